"""Binding example inputs to forward's parameters: which carry tensors (placeholders) and which are baked in."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx._symbolic_trace import PH

from seqify.errors import ExampleInputError, KeywordArgumentsError
from seqify.frontend.traced import UNKNOWN
from seqify.model.signature import EMPTY, Param, bind_examples

__all__ = ["bind_forward"]


def _has_tensor(x: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(x))


def bind_forward(
    model: nn.Module, example_inputs: Any
) -> tuple[list[Param], dict[str, Any], list[tuple[str, Any]]]:
    """Decide which forward parameters carry tensors; return params, fx concrete_args and the placeholder plan."""
    name = type(model).__name__
    sig = inspect.signature(model.forward)
    given = bind_examples(model.forward, name, example_inputs) if example_inputs is not None else {}
    params: list[Param] = []
    concrete: dict[str, Any] = {}
    plan: list[tuple[str, Any]] = []
    for p in sig.parameters.values():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if p.name in given and given[p.name]:
                star = "*" if p.kind == inspect.Parameter.VAR_POSITIONAL else "**"
                error = KeywordArgumentsError if star == "**" else ExampleInputError
                raise error(
                    f"{name}.forward takes {star}{p.name}; the fx frontend converts forwards with named "
                    "parameters: wrap the model in a module whose forward names its inputs"
                    + (", or convert with frontend='export' (or 'auto'), which bakes non-tensor values passed "
                       f"through **{p.name} (output_hidden_states=True)" if star == "**" else "")
                )
            continue
        default = EMPTY if p.default is inspect.Parameter.empty else p.default
        if p.name in given:
            value = given[p.name]
        elif default is EMPTY:
            if example_inputs is not None:
                raise ExampleInputError(f"example_inputs miss the required argument {p.name!r} of {name}.forward")
            params.append(Param(p.name, int(p.kind), default, dynamic=True))
            plan.append(("value", UNKNOWN))
            continue
        else:
            value = default
        if isinstance(value, torch.Tensor):
            params.append(Param(p.name, int(p.kind), default, dynamic=True))
            plan.append(("value", value))
        elif _has_tensor(value):
            leaves, spec = pytree.tree_flatten(value)
            if not all(isinstance(x, torch.Tensor) for x in leaves):
                raise ExampleInputError(
                    f"argument {p.name!r} of {name}.forward mixes tensors with other values; pass "
                    "the non-tensor values as separate arguments"
                )
            params.append(
                Param(p.name, int(p.kind), default, dynamic=True, spec=spec,
                      baked=tuple(None for _ in leaves), tensor_leaves=tuple(True for _ in leaves))
            )
            concrete[p.name] = pytree.tree_unflatten([PH] * len(leaves), spec)
            plan.extend(("value", x) for x in leaves)
        else:
            params.append(Param(p.name, int(p.kind), default, dynamic=False, baked=(value,)))
            concrete[p.name] = value
            plan.append(("baked", None))
    return params, concrete, plan
