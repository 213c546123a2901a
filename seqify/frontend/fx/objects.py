"""Plain Python objects that hold traced values (torchvision's ``ImageList``): recorded as a call that
rebuilds them from their fields, so a graph can pass them to the calls that take them."""

from __future__ import annotations

import copy
import functools
import importlib
import types
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["class_name", "holds_proxies", "map_tensors", "rebuilt"]


def class_name(cls: type) -> str:
    """``cls`` as ``module:qualname``, the form :func:`rebuilt` takes (a graph argument cannot be a class)."""
    return f"{cls.__module__}:{cls.__qualname__}"


@functools.cache
def _class(name: str) -> Any:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for atom in qualname.split("."):
        obj = getattr(obj, atom)
    return obj


def rebuilt(name: str, fields: dict[str, Any]) -> Any:
    """An instance of class ``name`` whose attributes are ``fields``, made without calling its ``__init__``
    (as pickle does)."""
    cls = _class(name)
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def holds_proxies(a: Any) -> bool:
    """Whether ``a`` is a plain object (attributes in ``__dict__``, no tensor, module or callable) whose
    attributes hold traced values."""
    if isinstance(a, (nn.Module, torch.Tensor, fx.Proxy, type, types.FunctionType, types.MethodType)):
        return False
    if type(a).__module__ == "builtins" or callable(a) or not isinstance(getattr(a, "__dict__", None), dict):
        return False
    if type(a).__reduce_ex__ is not object.__reduce_ex__ or "<locals>" in type(a).__qualname__:
        return False
    leaves = pytree.tree_leaves(list(a.__dict__.values()))
    return any(isinstance(v, fx.Proxy) or holds_proxies(v) for v in leaves)


def _plain(a: Any) -> bool:
    return (not isinstance(a, (nn.Module, torch.Tensor, type)) and type(a).__module__ != "builtins"
            and not callable(a) and isinstance(getattr(a, "__dict__", None), dict))


def map_tensors(fn: Any, value: Any) -> Any:
    """``value`` with ``fn`` applied to every tensor, inside containers and plain objects (an ``ImageList``
    a submodule returned), which are copied; the rest is shared."""
    if _plain(value):
        clone = copy.copy(value)
        clone.__dict__.update({k: map_tensors(fn, v) for k, v in value.__dict__.items()})
        return clone
    if isinstance(value, torch.Tensor):
        return fn(value)
    leaves, spec = pytree.tree_flatten(value)
    if spec.num_leaves == 1 and leaves and leaves[0] is value:
        return value
    return pytree.tree_unflatten([map_tensors(fn, leaf) for leaf in leaves], spec)
