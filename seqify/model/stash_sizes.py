"""Size skips: skip values computed from tensor shapes alone (a batch size carried to a reshape), fixed per input
shape."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from seqify.skip.namespace import SkipKey

__all__ = ["size_skips"]

# Ops whose result is a size of their tensor argument, whatever its values.
_SIZES: set[Any] = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
                    torch.ops.aten.sym_storage_offset.default}
_SIZE_METHODS = {"size", "dim", "numel", "stride"}
# Arithmetic that keeps a size a size when every value it reads is one (or a constant).
_ARITHMETIC: set[Any] = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod,
                         operator.neg, operator.pow, operator.getitem, math.ceil, math.floor, math.sqrt, max, min,
                         torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_sqrt}


def _refs(value: Any) -> list[str]:
    """The names of the layer values ``value`` (an op argument, maybe nested) reads."""
    from seqify.model.layer import Ref

    if isinstance(value, Ref):
        return [value.name]
    if isinstance(value, (tuple, list)):
        return [n for v in value for n in _refs(v)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _refs(v)]
    return []


def size_skips(layers: Iterable[nn.Module]) -> set[SkipKey]:
    """The skips, among ``layers`` (a converted model's, in order), whose values are sizes: made by a
    size op (``aten.sym_size``, ``Tensor.size``, ...) or by arithmetic on sizes and constants only. Such a
    value is the same on every call with the same input shapes, so a replayed program may keep it."""
    from seqify.model.layer import Layer

    sized: set[SkipKey] = set()
    for layer in layers:
        if isinstance(layer, Layer):  # a size in every program the layer runs (a program per mode)
            sized |= set.intersection(*(_sized(program, sized) for program in layer.programs()))
    return sized


def _sized(program: Any, sized: set[SkipKey]) -> set[SkipKey]:
    """The skips ``program`` stashes whose values are sizes, given the ``sized`` skips it may pop."""
    known = {name for key, name in program.pops if key in sized}
    for op in program.ops:
        if op.target in _SIZES or (op.kind == "call_method" and op.target in _SIZE_METHODS):
            extra = [*op.args[1:], *op.kwargs.values()]
            if all(n in known for n in _refs(extra)):
                known.add(op.out)
        elif op.target in _ARITHMETIC or (op.kind == "call_function" and op.target is getattr and
                                           len(op.args) == 2 and op.args[1] == "shape"):
            reads = _refs([*op.args, *op.kwargs.values()])
            if op.target is getattr or (reads and all(n in known for n in reads)):
                known.add(op.out)
    return {key for key, name in program.stashes if name in known}
