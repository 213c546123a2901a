"""torch calls fx cannot record: factories and methods of real tensors called with proxy sizes, torch.is_tensor, and
``isinstance(x, torch.Tensor)`` in the model's own code."""

from __future__ import annotations

import builtins
import functools
import os
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from seqify.frontend.fx.root_values import INTERNAL
from seqify.frontend.torch_tables import settle_torch_tables

__all__ = ["recording_shape_ops", "FACTORIES", "TENSOR_METHODS"]

#: torch functions that take sizes (``torch.ones(n, n)``) or make a tensor of a value (``torch.tensor(channels)``,
#: RAFT's correlation scale): with a proxy there, torch's argument parser fails before fx's ``__torch_function__``
#: can record the call.
FACTORIES = (
    "ones", "zeros", "empty", "full", "rand", "randn", "randint", "arange", "eye", "tril_indices",
    "triu_indices", "tensor", "as_tensor", "scalar_tensor",
)
#: Methods of a real tensor (a buffer, a constant) called with proxy sizes or indices
#: (``self.position_ids.expand(b, n)``, ``self.table[:, :n]``).
TENSOR_METHODS = (
    "expand", "view", "reshape", "repeat", "permute", "tile", "narrow", "unflatten", "new_ones",
    "new_zeros", "new_empty", "new_full", "__getitem__",
)


def _proxy_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Proxy | None:
    leaves = pytree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, slice))
    for leaf in leaves:
        if isinstance(leaf, slice):
            leaf = next((p for p in (leaf.start, leaf.stop, leaf.step) if isinstance(p, fx.Proxy)), None)
        if isinstance(leaf, fx.Proxy):
            return leaf
    return None


def _recording_function(original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxy = _proxy_in(args, kwargs)
        if proxy is None:
            return original(*args, **kwargs)
        return proxy.tracer.create_proxy("call_function", original, args, kwargs)

    return wrapper


def _recording_method(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        proxy = _proxy_in(args, kwargs)
        if proxy is None:
            return original(self, *args, **kwargs)
        if name == "__getitem__":
            import operator

            return proxy.tracer.create_proxy("call_function", operator.getitem, (self, *args), kwargs)
        return proxy.tracer.create_proxy("call_method", name, (self, *args), kwargs)

    return wrapper


def _isinstance(original: Any) -> Any:
    """``isinstance`` for Python code: in the model's own code a proxy standing for a tensor is a
    ``torch.Tensor`` (``isinstance(target["boxes"], torch.Tensor)`` checks an input, and the source's path
    follows); torch's and seqify's code, and C++ (which never calls this), see the proxy."""

    @functools.wraps(original)
    def isinstance_(obj: Any, cls: Any) -> bool:
        if (type(obj).__name__ == "ValueProxy" and (cls is torch.Tensor or type(cls) is tuple and torch.Tensor in cls)
                and original(obj.node.meta.get("val"), torch.Tensor)):
            return True
        return bool(original(obj, cls))

    return isinstance_


def _is_tensor(original: Any) -> Any:
    @functools.wraps(original)
    def is_tensor(obj: Any) -> bool:
        if not isinstance(obj, fx.Proxy):
            return bool(original(obj))
        node = obj.node
        if "val" in node.meta:
            return isinstance(node.meta["val"], torch.Tensor)
        if node.op == "placeholder":  # an input without an example value is declared a tensor
            return True
        raise fx.proxy.TraceError(
            f"torch.is_tensor(`{node.name}`) needs the traced value's example value (code that branches on "
            "whether a value is a tensor); pass example_inputs to seqify.convert"
        )

    return is_tensor


def _model_modules(model: nn.Module) -> list[types.ModuleType]:
    """The Python modules that define ``model``'s classes and their bases, outside torch and seqify."""
    names = {base.__module__ for m in model.modules() for base in type(m).__mro__}
    files = {n: getattr(sys.modules.get(n), "__file__", None) for n in sorted(names)}
    return [sys.modules[n] for n, f in files.items() if f and not os.path.abspath(f).startswith(INTERNAL)]


@contextmanager
def _isinstance_in(modules: list[types.ModuleType]) -> Iterator[None]:
    """``isinstance`` answered by :func:`_isinstance` in the code of ``modules`` (a global there shadows the
    builtin), so torch's own code, fake-tensor dispatch included, keeps the builtin's speed."""
    missing = object()
    saved = [(m, vars(m).get("isinstance", missing)) for m in modules]
    answer = _isinstance(builtins.isinstance)
    try:
        for m, _ in saved:
            setattr(m, "isinstance", answer)  # noqa: B010 (a module global, not an attribute mypy knows)
        yield
    finally:
        for m, before in saved:
            if before is missing:
                delattr(m, "isinstance")  # noqa: B043
            else:
                setattr(m, "isinstance", before)  # noqa: B010


@contextmanager
def recording_shape_ops(model: nn.Module) -> Iterator[None]:
    """While tracing ``model``, record size-taking torch calls whose sizes are proxies as graph nodes (so they
    stay dynamic: ``torch.ones(x.shape[1], x.shape[1])`` follows the input's shape at run time)."""
    settle_torch_tables()
    saved: list[tuple[Any, str, Any]] = [(torch, "is_tensor", torch.is_tensor)]
    try:
        torch.is_tensor = _is_tensor(torch.is_tensor)
        for name in FACTORIES:
            original = getattr(torch, name)
            saved.append((torch, name, original))
            setattr(torch, name, _recording_function(original))
        for name in TENSOR_METHODS:
            original = torch.Tensor.__dict__.get(name, getattr(torch.Tensor, name))
            saved.append((torch.Tensor, name, torch.Tensor.__dict__.get(name)))
            setattr(torch.Tensor, name, _recording_method(name, original))
        with _isinstance_in(_model_modules(model)):
            yield
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
