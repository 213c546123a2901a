"""Signatures: how a converted model's arguments become flat tensors, and flat tensors its outputs."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from seqify.errors import ExampleInputError, InputError

__all__ = ["Param", "InputSpec", "OutputSpec", "EMPTY", "bind_examples"]


class _Empty:
    def __repr__(self) -> str:
        return "<no default>"

    def __reduce__(self) -> str:
        return "EMPTY"


EMPTY = _Empty()


def bind_examples(forward: Any, name: str, example_inputs: Any) -> dict[str, Any]:
    """The arguments ``example_inputs`` give ``forward``, by parameter name: a tensor is the one positional
    argument, a tuple or list the positional arguments, a dict the arguments by name. Both frontends bind
    their examples here; :class:`ExampleInputError` names ``name.forward(signature)`` when they do not fit."""
    sig = inspect.signature(forward)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    try:
        if isinstance(example_inputs, dict):
            return dict(sig.bind_partial(**example_inputs).arguments)
        if isinstance(example_inputs, (tuple, list)):
            return dict(sig.bind_partial(*example_inputs).arguments)
        raise TypeError(
            f"example_inputs must be a tensor, a tuple of arguments or a dict, not {type(example_inputs).__name__}"
        )
    except TypeError as e:
        keyword_only = [p.name for p in sig.parameters.values() if p.kind == inspect.Parameter.KEYWORD_ONLY]
        hint = (
            f"; {', '.join(keyword_only)} {'is' if len(keyword_only) == 1 else 'are'} keyword-only: pass "
            f"example_inputs as a dict by parameter name, e.g. {{{keyword_only[0]!r}: x}}"
            if keyword_only and not isinstance(example_inputs, dict) else
            "; pass a tensor, a tuple of positional arguments, or a dict by parameter name (e.g. {'input_ids': ids})"
        )
        raise ExampleInputError(f"example_inputs do not fit {name}.forward{sig}: {e}{hint}") from None


@dataclass(frozen=True)
class Param:
    """One parameter of the source forward: dynamic (carries tensors) or baked into the conversion."""

    name: str
    kind: int
    default: Any
    dynamic: bool
    spec: pytree.TreeSpec | None = None
    baked: tuple[Any, ...] = ()
    tensor_leaves: tuple[bool, ...] = ()

    def describe(self) -> str:
        if not self.dynamic:
            return f"{self.name}={self.baked[0]!r} (fixed)"
        if self.spec is None:
            return f"{self.name}: tensor"
        return f"{self.name}: structure of {sum(self.tensor_leaves)} tensors"


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


class InputSpec:
    """Binds ``(*args, **kwargs)`` like the source forward and returns its tensors in trace order."""

    def __init__(self, model_name: str, params: list[Param]) -> None:
        self.model_name = model_name
        self.params = params
        self._simple = all(p.dynamic and p.spec is None for p in params) and all(
            p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params
        )

    def __repr__(self) -> str:
        return f"InputSpec({', '.join(p.describe() for p in self.params)})"

    def flatten(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        if self._simple and not kwargs and len(args) == len(self.params):
            for p, a in zip(self.params, args):
                if not isinstance(a, torch.Tensor):
                    raise InputError(
                        f"{self.model_name}: argument {p.name!r} was a tensor when the model was converted, "
                        f"got {type(a).__name__}; pass a tensor (a non-tensor argument is baked into the "
                        "conversion: convert with example_inputs holding the value you will pass)"
                    )
            return list(args)
        values = self._bind(args, kwargs)
        out: list[torch.Tensor] = []
        for p in self.params:
            value = values[p.name]
            if not p.dynamic:
                if not _same(value, p.baked[0]):
                    raise InputError(
                        f"{self.model_name}: argument {p.name!r} was {p.baked[0]!r} when the model was converted "
                        f"and is baked into the layers; got {value!r}. Convert again with "
                        f"example_inputs that pass {p.name}={value!r} (as a tensor if it is one)."
                    )
                continue
            if p.spec is None:
                if not isinstance(value, torch.Tensor):
                    raise InputError(
                        f"{self.model_name}: argument {p.name!r} was a tensor when the model was converted, "
                        f"got {type(value).__name__}; pass a tensor (a non-tensor argument is baked into the "
                        "conversion: convert with example_inputs holding the value you will pass)"
                    )
                out.append(value)
                continue
            leaves, spec = pytree.tree_flatten(value)
            if spec != p.spec or any(isinstance(x, torch.Tensor) != t for x, t in zip(leaves, p.tensor_leaves)):
                raise InputError(
                    f"{self.model_name}: argument {p.name!r} has a different structure than at conversion "
                    f"({spec} vs {p.spec}); convert with example_inputs of this structure"
                )
            for x, is_tensor, baked in zip(leaves, p.tensor_leaves, p.baked):
                if is_tensor:
                    out.append(x)
                elif not _same(x, baked):
                    raise InputError(
                        f"{self.model_name}: argument {p.name!r} holds {x!r} where the conversion saw "
                        f"{baked!r}; convert with example_inputs holding this value"
                    )
        return out

    def tensor_names(self) -> list[str]:
        """The name of each tensor :meth:`flatten` returns (``img_ids``, ``added_cond_kwargs['time_ids']``)."""
        names: list[str] = []
        for p in self.params:
            if not p.dynamic:
                continue
            if p.spec is None:
                names.append(p.name)
                continue
            paths = key_paths(p.spec, len(p.tensor_leaves)) or [f"[{i}]" for i in range(len(p.tensor_leaves))]
            names += [f"{p.name}{path}" for path, is_tensor in zip(paths, p.tensor_leaves) if is_tensor]
        return names

    def _names(self) -> str:
        return ", ".join(p.name for p in self.params)

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = {}
        positional = [
            p for p in self.params
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        if len(args) > len(positional):
            keyword_only = [p.name for p in self.params if p.kind == inspect.Parameter.KEYWORD_ONLY]
            hint = f"; pass {', '.join(f'{n}=...' for n in keyword_only)} by keyword" if keyword_only else ""
            raise InputError(
                f"{self.model_name}: takes {len(positional)} positional arguments "
                f"({', '.join(p.name for p in positional)}), got {len(args)}{hint}"
            )
        for p, a in zip(positional, args):
            values[p.name] = a
        for name, a in kwargs.items():
            param = next((p for p in self.params if p.name == name), None)
            if param is None or param.kind == inspect.Parameter.POSITIONAL_ONLY:
                raise InputError(
                    f"{self.model_name}: unexpected keyword argument {name!r}; the converted forward takes "
                    f"({self._names()})"
                )
            if name in values:
                raise InputError(f"{self.model_name}: got multiple values for argument {name!r}; pass it once")
            values[name] = a
        for p in self.params:
            if p.name not in values:
                if p.default is EMPTY:
                    raise InputError(
                        f"{self.model_name}: missing argument {p.name!r}; the converted forward takes ({self._names()})"
                    )
                values[p.name] = p.default
        return values


def key_paths(spec: pytree.TreeSpec, leaves: int) -> list[str] | None:
    """Each leaf's place in a structure of ``spec`` (``['time_ids']``, ``.loss``, ``[0]``); None where the
    structure cannot be rebuilt with stand-in leaves (a node type whose unflatten checks its values)."""
    try:
        tree = pytree.tree_unflatten(list(range(leaves)), spec)
        return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(tree)[0]]
    except Exception:
        return None


class OutputSpec:
    """Rebuilds the source's output structure from the flat tuple the last layer returns."""

    def __init__(self, spec: pytree.TreeSpec, leaves: list[tuple[bool, Any]]) -> None:
        self.spec = spec
        self.leaves = leaves  # (True, slot index) or (False, constant)
        self.slots = sum(1 for is_slot, _ in leaves if is_slot)
        self._plain = spec.num_leaves == 1 and leaves[0] == (True, 0) and pytree.tree_unflatten([0], spec) == 0

    def __repr__(self) -> str:
        return f"OutputSpec({self.spec})"

    def unflatten(self, carried: Any) -> Any:
        if self._plain:
            return carried
        flat = carried if isinstance(carried, tuple) else (carried,)
        values = [flat[v] if is_slot else v for is_slot, v in self.leaves]
        return pytree.tree_unflatten(values, self.spec)

    def names(self) -> list[str] | None:
        """Each slot's place in the source's output (``.loss``, ``[0]``), for messages; None where unknown."""
        paths = key_paths(self.spec, len(self.leaves))
        if paths is None:
            return None
        names = [""] * self.slots
        for (is_slot, v), path in zip(self.leaves, paths):
            if is_slot:
                names[v] = path
        return names

    def flatten(self, output: Any) -> tuple[torch.Tensor, ...]:
        """The inverse of :meth:`unflatten` for an output of this structure (used to merge micro-batches)."""
        leaves, _ = pytree.tree_flatten(output)
        flat: list[Any] = [None] * self.slots
        for (is_slot, v), x in zip(self.leaves, leaves):
            if is_slot:
                flat[v] = x
        return tuple(flat)
