"""Kinds: what each graph node produces (tensor, container of tensors, other Python value, constant)."""

from __future__ import annotations

import builtins
import math
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from seqify.frontend.traced import UNKNOWN, value_of
from seqify.model.guard import check_bool, check_equal

__all__ = ["TENSOR", "CONTAINER", "AUX", "CONST", "classify", "is_projection", "module_path"]

TENSOR = "tensor"  # a tensor: may be carried between layers
CONTAINER = "container"  # a tuple/list/dict holding tensors
AUX = "aux"  # any other Python value (sizes, dtypes, None, ...): computed where needed or skipped
CONST = "const"  # get_attr: a parameter, buffer or constant the layer holds



def module_path(node: fx.Node) -> str:
    """The submodule path a ``call_module`` node calls (fx types targets as callables or strings; a
    ``call_module`` target is always the string)."""
    assert node.op == "call_module" and isinstance(node.target, str), node.format_node()
    return node.target


_AUX_METHODS = {
    "size", "dim", "ndimension", "numel", "nelement", "element_size", "item", "tolist", "stride",
    "storage_offset", "is_contiguous", "get_device", "data_ptr", "is_floating_point", "is_complex",
    "type", "__len__", "keys", "values", "items", "index", "count",
}
_CONTAINER_METHODS = {
    "split", "chunk", "unbind", "tensor_split", "split_with_sizes", "sort", "topk", "kthvalue",
    "mode", "cummax", "cummin", "aminmax", "unique_consecutive", "hsplit", "vsplit", "dsplit",
}
_DIM_CONTAINER = {"max", "min", "median", "nanmedian"}
_TENSOR_ATTRS = {"T", "mT", "H", "mH", "real", "imag", "data", "grad"}
_CONTAINER_FUNCS = {
    torch.split, torch.chunk, torch.unbind, torch.tensor_split, torch.meshgrid, torch.broadcast_tensors,
    torch.sort, torch.topk, torch.kthvalue, torch.mode, torch.cummax, torch.cummin, torch.aminmax,
    torch.hsplit, torch.vsplit, torch.dsplit, F.multi_head_attention_forward,
}
_DIM_CONTAINER_FUNCS = {torch.max, torch.min, torch.median, torch.nanmedian}
_AUX_FUNCS = {len, torch._assert, check_bool, check_equal, isinstance, getattr, hasattr}
_CONTAINER_MODULES: tuple[type[nn.Module], ...] = (nn.RNNBase, nn.MultiheadAttention, nn.AdaptiveLogSoftmaxWithLoss)


def _python_level(target: Any) -> bool:
    return getattr(target, "__module__", None) in ("_operator", "operator", "builtins", "math") or target in (
        operator.getitem, builtins.getattr, math.ceil, math.floor
    )


def _from_value(v: Any) -> str | None:
    if v is UNKNOWN:
        return None
    if isinstance(v, torch.Tensor):
        return TENSOR
    if isinstance(v, (tuple, list, dict)):
        leaves = torch.utils._pytree.tree_leaves(v)
        return CONTAINER if any(isinstance(x, torch.Tensor) for x in leaves) else AUX
    return AUX


def is_projection(node: fx.Node, kinds: dict[fx.Node, str]) -> bool:
    """A constant-index ``getitem``/``getattr`` on a container: it picks an element, computing nothing."""
    return (
        node.op == "call_function"
        and node.target in (operator.getitem, builtins.getattr)
        and len(node.args) == 2
        and isinstance(node.args[0], fx.Node)
        and kinds.get(node.args[0]) == CONTAINER
        and not isinstance(node.args[1], fx.Node)
    )


def _has_dim(node: fx.Node, kinds: dict[fx.Node, str]) -> bool:
    if "dim" in node.kwargs:
        return True
    if len(node.args) < 2:
        return False
    second = node.args[1]
    return kinds.get(second) == AUX if isinstance(second, fx.Node) else isinstance(second, int)


def _rule(node: fx.Node, kinds: dict[fx.Node, str], root: nn.Module) -> str:
    def arg_kinds() -> set[str]:
        found: set[str] = set()

        def note(n: fx.Node) -> fx.Node:
            found.add(kinds[n])
            return n

        fx.node.map_arg((node.args, node.kwargs), note)
        return found

    if node.op == "placeholder":
        return TENSOR
    if node.op == "get_attr":
        return CONST
    if node.op == "call_module":
        module = root.get_submodule(module_path(node))
        if isinstance(module, _CONTAINER_MODULES) or getattr(module, "return_indices", False):
            return CONTAINER
        return TENSOR
    if node.op == "call_method":
        receiver = kinds.get(node.args[0]) if isinstance(node.args[0], fx.Node) else AUX
        if node.target in _AUX_METHODS or receiver == AUX:
            return AUX
        if node.target in _CONTAINER_METHODS or (node.target in _DIM_CONTAINER and _has_dim(node, kinds)):
            return CONTAINER
        return TENSOR
    if node.op == "call_function":
        target = node.target
        if target in _AUX_FUNCS and target is not builtins.getattr:
            return AUX
        if target is builtins.getattr:
            receiver = kinds.get(node.args[0]) if isinstance(node.args[0], fx.Node) else AUX
            if receiver == CONTAINER:
                return TENSOR
            return TENSOR if receiver == TENSOR and node.args[1] in _TENSOR_ATTRS else AUX
        if target is operator.getitem:
            receiver = kinds.get(node.args[0]) if isinstance(node.args[0], fx.Node) else AUX
            return AUX if receiver == AUX else TENSOR
        if target in _CONTAINER_FUNCS or (target in _DIM_CONTAINER_FUNCS and _has_dim(node, kinds)):
            return CONTAINER
        if _python_level(target):
            return TENSOR if TENSOR in arg_kinds() else AUX
        return TENSOR
    return AUX


def _writes_tensor(node: fx.Node, kinds: dict[fx.Node, str]) -> bool:
    """Whether ``operator.setitem`` assigns into a tensor (not into a Python list or dict)."""
    receiver = node.args[0] if node.args else None
    if not isinstance(receiver, fx.Node):
        return False
    value = value_of(receiver)
    return isinstance(value, torch.Tensor) if value is not UNKNOWN else kinds.get(receiver) == TENSOR


def classify(graph: fx.Graph, root: nn.Module) -> dict[fx.Node, str]:
    """The kind of every node but the output: from its example value where known, else from rules."""
    kinds: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "get_attr":
            kinds[node] = CONST
            continue
        if node.op == "call_function" and node.target is operator.setitem and _writes_tensor(node, kinds):
            kinds[node] = TENSOR  # in place on a tensor: it heads a step, in the source's order
            continue
        kind = _from_value(value_of(node))
        kinds[node] = kind if kind is not None else _rule(node, kinds, root)
    # Without example values, a module or function returning a tuple shows itself by being indexed.
    for node in graph.nodes:
        if node.op == "output" or value_of(node) is not UNKNOWN or kinds[node] != TENSOR:
            continue
        if node.users and all(
            u.op == "call_function" and u.target is operator.getitem and u.args[0] is node
            and isinstance(u.args[1], int) for u in node.users
        ) and (node.op == "call_module" or node.op == "call_function" and node.target is operator.getitem):
            if node.op == "call_module" or kinds.get(node.args[0]) == CONTAINER:
                kinds[node] = CONTAINER
    return kinds
