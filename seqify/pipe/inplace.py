"""In place: which received values a run of layers may modify in place, following their aliases.

A layer may modify a value it never receives directly: a view of it (``x[:, :2].mul_(2)``), the result
of an in-place op on it, or the same tensor passed on by the layers before it. Checkpointing must copy
such values before a stage runs (it recomputes from them), and micro-batches of an input that the model
modifies must not be views of one tensor (views share autograd's version counter). The analysis is
conservative: code it cannot see into (a custom module kept whole, a hand-written skippable layer) is
assumed to modify what it receives and to return aliases of it.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from torch import nn

__all__ = ["INPUT", "mutated_roots"]

#: The value a run of layers receives first (a stage's carried input, or the model's input).
INPUT = "<input>"

# Tensor methods and torch functions whose result may share memory with (or be) their first argument.
_ALIASING = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute", "narrow",
    "select", "squeeze", "unsqueeze", "expand", "expand_as", "broadcast_to", "broadcast_tensors", "chunk",
    "split", "tensor_split", "split_with_sizes", "unbind", "hsplit", "vsplit", "dsplit", "t", "T", "mT", "H",
    "mH", "adjoint", "contiguous", "as_strided", "detach", "diagonal", "movedim", "moveaxis", "swapaxes",
    "swapdims", "real", "imag", "to", "type", "type_as", "float", "double", "half", "bfloat16", "int",
    "long", "short", "bool", "byte", "char", "cpu", "cuda", "data", "unfold", "view_as_real",
    "view_as_complex", "align_to", "align_as", "rename", "refine_names", "conj", "resolve_conj",
    "resolve_neg", "sum_to_size", "as_tensor", "atleast_1d", "atleast_2d", "atleast_3d", "getitem",
    "__getitem__", "getattr", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
    "feature_alpha_dropout", "identity", "as_subclass", "coalesce", "to_dense", "squeeze_copy",
}
_INPLACE_FUNCTIONS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.imatmul, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift, operator.setitem,
}
_ALIAS_MODULES: tuple[type[nn.Module], ...] = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)

_NONE: frozenset[Hashable] = frozenset()


def _torch_module(m: nn.Module) -> bool:
    return type(m).__module__.startswith("torch.nn.") or isinstance(m, nn.modules.batchnorm._BatchNorm)


def _module_mutates(m: nn.Module) -> bool:
    """Whether calling ``m`` may modify its arguments in place."""
    if getattr(m, "inplace", False) is True:
        return True
    return not _torch_module(m)


def _module_aliases(m: nn.Module) -> bool:
    """Whether ``m``'s result may be (a view of) its argument."""
    return getattr(m, "inplace", False) is True or isinstance(m, _ALIAS_MODULES) or not _torch_module(m)


def _name(target: Any) -> str:
    """The op's name without its overload: an aten op of an export-made layer (``aten.add_.Tensor``) by its
    packet's name (``add_``), so its in-place and aliasing kinds read as those of the method."""
    if isinstance(target, str):
        return target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet if packet is not None else target, "__name__", "")


def _inplace(kind: str, target: Any, kwargs: Any) -> bool:
    if kind == "call_function" and target in _INPLACE_FUNCTIONS:
        return True
    name = _name(target)
    if name.endswith("_") and not name.startswith("_"):
        return True
    return isinstance(kwargs, dict) and kwargs.get("inplace") is True


def mutated_roots(
    modules: Iterable[nn.Module], pops: Sequence[Hashable] = ()
) -> set[Hashable]:
    """Which of :data:`INPUT` and the skip keys ``pops`` (values received from earlier partitions) the
    layers ``modules``, run in order, may modify in place, directly or through an alias."""
    mutated: set[Hashable] = set()
    skips: dict[Hashable, frozenset[Hashable]] = {key: frozenset([key]) for key in pops}
    _walk(list(modules), frozenset([INPUT]), skips, mutated)
    return mutated


def _walk(
    modules: list[nn.Module],
    carry: frozenset[Hashable],
    skips: dict[Hashable, frozenset[Hashable]],
    mutated: set[Hashable],
) -> frozenset[Hashable]:
    from seqify.model.layer import Layer
    from seqify.skip.skippable import Skippable, pop_keys, stash_keys

    for m in modules:
        if isinstance(m, Layer):
            # a layer that holds a program per mode may modify in place what either program does
            stashed: dict[Hashable, frozenset[Hashable]] = {}
            outs = [_walk_program(m, program, carry, skips, mutated, stashed) for program in m.programs()]
            skips.update(stashed)
            carry = frozenset().union(*outs)
        elif isinstance(m, Skippable):
            received = carry.union(*(skips.get(key, _NONE) for key in pop_keys(m)))
            mutated |= received
            for key in stash_keys(m):
                skips[key] = received
            carry = received
        elif type(m) is nn.Sequential:
            carry = _walk(list(m), carry, skips, mutated)
        else:
            if _module_mutates(m):
                mutated |= carry
            carry = carry if _module_aliases(m) else _NONE
    return carry


def written_tensors(layer: nn.Module) -> list[Any]:
    """Parameters and buffers a generated layer modifies in place through its ops (``self.count += 1``), in
    either mode's program."""
    from seqify.model.layer import Attr, Layer

    if not isinstance(layer, Layer):
        return []
    found = []
    for op in (op for program in layer.programs() for op in program.ops):
        first = op.args[0] if op.args else None
        if isinstance(first, Attr) and op.kind != "call_module" and _inplace(op.kind, op.target, op.kwargs):
            owner, _, name = first.name.rpartition(".")
            module = layer.get_submodule(owner) if owner else layer
            t = module._parameters.get(name)
            found.append(module._buffers.get(name) if t is None else t)
    return [t for t in found if t is not None]


def _walk_program(layer: nn.Module, program: Any, carry: frozenset[Hashable],
                  skips: dict[Hashable, frozenset[Hashable]], mutated: set[Hashable],
                  stashed: dict[Hashable, frozenset[Hashable]]) -> frozenset[Hashable]:
    """One program of a generated layer: what it modifies in place (added to ``mutated``), the roots of what it
    stashes (joined into ``stashed``) and of what it returns."""
    from seqify.model.layer import Ref

    env: dict[str, frozenset[Hashable]] = {name: carry for name in program.inputs}
    for key, name in program.pops:
        env[name] = skips.get(key, _NONE)

    # called only within this layer's iteration: env is this layer's
    def roots(a: Any, env: dict[str, frozenset[Hashable]] = env) -> frozenset[Hashable]:
        if isinstance(a, Ref):
            return env.get(a.name, _NONE)
        if isinstance(a, (tuple, list)):
            return frozenset().union(*(roots(x) for x in a)) if a else _NONE
        if isinstance(a, dict):
            return frozenset().union(*(roots(x) for x in a.values())) if a else _NONE
        if isinstance(a, slice):
            return roots((a.start, a.stop, a.step))
        return _NONE

    for op in program.ops:
        first = roots(op.args[0]) if op.args else _NONE
        every = roots((op.args, op.kwargs))
        if op.kind == "call_module":
            module = layer.get_submodule(op.target)
            if _module_mutates(module):
                mutated |= every if not getattr(module, "inplace", False) else first
            env[op.out] = every if _module_aliases(module) else _NONE
            continue
        target = op.target
        if _inplace(op.kind, target, op.kwargs):
            mutated |= first
            out = op.kwargs.get("out") if isinstance(op.kwargs, dict) else None
            mutated |= roots(out)
            env[op.out] = first
        elif isinstance(op.kwargs, dict) and "out" in op.kwargs:
            mutated |= roots(op.kwargs["out"])
            env[op.out] = roots(op.kwargs["out"])
        elif _name(target) in _ALIASING:
            env[op.out] = first
        else:
            env[op.out] = _NONE
    for key, name in program.stashes:
        stashed[key] = stashed.get(key, _NONE) | env.get(name, _NONE)
    return frozenset().union(*(env.get(o, _NONE) for o in program.outputs)) if program.outputs else _NONE
