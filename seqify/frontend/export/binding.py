"""Binding example inputs for torch.export: the InputSpec's params, export's keyword arguments and dynamic shapes."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import ExampleInputError
from seqify.model.signature import EMPTY, Param, bind_examples

__all__ = ["bind_inputs"]


def bind_inputs(model: nn.Module, example_inputs: Any) -> tuple[list[Param], dict[str, Any], dict[str, Any]]:
    """Bind example inputs to ``model.forward``: params for the InputSpec, export kwargs in signature order,
    and dynamic shapes (dim 0 of every tensor is one shared batch dimension)."""
    name = type(model).__name__
    sig = inspect.signature(model.forward)
    given = bind_examples(model.forward, name, example_inputs)
    batch = torch.export.Dim.AUTO  # export infers the batch range; a batch it cannot free stays fixed (guarded)
    params: list[Param] = []
    kwargs: dict[str, Any] = {}
    dynamic: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind == inspect.Parameter.VAR_KEYWORD and isinstance(given.get(p.name), dict):
            extra = given[p.name]  # transformers 5 takes output_hidden_states=... through **kwargs
            dynamic[p.name] = {key: None for key in extra}  # export matches dynamic shapes to the signature
            continue
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if given.get(p.name):
                passed = sorted(given[p.name]) if isinstance(given[p.name], dict) else "extra values"
                raise ExampleInputError(
                    f"example_inputs pass {passed} "
                    f"through {name}.forward's *{'*' if p.kind == inspect.Parameter.VAR_KEYWORD else ''}{p.name}; "
                    "seqify converts named parameters: pass only the forward's named parameters, or wrap the model "
                    "in a module whose forward names them"
                )
            continue
        if p.kind == inspect.Parameter.POSITIONAL_ONLY:
            raise ExampleInputError(f"{name}.forward has the positional-only parameter {p.name!r}; wrap the model in "
                                    "a module whose forward takes it by name")
        default = EMPTY if p.default is inspect.Parameter.empty else p.default
        if p.name not in given:
            if default is EMPTY:
                raise ExampleInputError(f"example_inputs miss the required argument {p.name!r} of {name}.forward")
            params.append(Param(p.name, int(p.kind), default, dynamic=False, baked=(default,)))
            continue
        value = given[p.name]
        leaves, spec = pytree.tree_flatten(value)
        if isinstance(value, torch.Tensor):
            params.append(Param(p.name, int(p.kind), default, dynamic=True))
        elif any(isinstance(x, torch.Tensor) for x in leaves):
            if not all(isinstance(x, torch.Tensor) for x in leaves):
                raise ExampleInputError(
                    f"argument {p.name!r} of {name}.forward mixes tensors with other values; pass the non-tensor "
                    "values as separate arguments"
                )
            params.append(Param(p.name, int(p.kind), default, dynamic=True, spec=spec,
                                baked=tuple(None for _ in leaves), tensor_leaves=tuple(True for _ in leaves)))
        else:
            params.append(Param(p.name, int(p.kind), default, dynamic=False, baked=(value,)))
        kwargs[p.name] = value
        dynamic[p.name] = pytree.tree_map(
            lambda x: {0: batch} if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] > 1 else None, value
        ) if isinstance(value, (torch.Tensor, tuple, list, dict)) else None
    for key, value in extra.items():
        # A keyword the forward takes through **kwargs: a value baked into the conversion, which every call
        # must pass again (its default is the forward's own, unknown here); tensors there are refused.
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value)):
            raise ExampleInputError(
                f"example_inputs pass the tensor {key!r} through {name}.forward's **kwargs; seqify converts tensors "
                "of named parameters: wrap the model in a module whose forward names it"
            )
        params.append(Param(key, int(inspect.Parameter.KEYWORD_ONLY), EMPTY, dynamic=False, baked=(value,)))
        kwargs[key] = value
    return params, kwargs, dynamic
