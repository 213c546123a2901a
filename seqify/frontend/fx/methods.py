"""Methods the model's own forward calls that fx cannot trace through (torchvision's box selection and
``transform.postprocess``): each call becomes one opaque op at the place it runs."""

from __future__ import annotations

import copy
import sys
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from torch import nn

from seqify.frontend.fx.root_values import called_from, forward_site

__all__ = ["run_method", "detached", "MethodCalls", "methods_watched"]


def run_method(owner: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
    """What ``owner.name(*args, **kwargs)`` returns: an opaque method call of a converted model."""
    return getattr(owner, name)(*args, **kwargs)


def detached(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` without its own parameters and buffers: what a layer holds, unregistered,
    to call one of its methods. Its children are the source's own submodules (``self.head.compute_loss(...)``
    works; the layers that compute them hold the same objects, so nothing is copied or registered twice); a
    method that reads the module's own tensors fails the conversion's self-check."""
    clone = copy.copy(module)
    clone.__dict__["_parameters"] = OrderedDict()
    clone.__dict__["_buffers"] = OrderedDict()
    clone.__dict__["_modules"] = OrderedDict(module._modules)
    return clone


class MethodCalls(Protocol):
    """The tracer's side: plain runs call through; traced calls try, then fall back to one opaque op."""

    plain: int

    def method_call(self, owner: nn.Module, path: str, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any: ...

    def method_ran(self, path: str, name: str, out: Any) -> None: ...


def _methods(cls: type, names: frozenset[str]) -> Iterator[tuple[type, str, types.FunctionType]]:
    """The plain methods named in ``names`` that ``cls`` and its bases define outside torch.nn (forward and
    dunders excepted)."""
    for base in cls.__mro__:
        if base is nn.Module or base.__module__.startswith("torch.nn"):
            break
        own = vars(base)
        for name in names:
            fn = own.get(name)
            if isinstance(fn, types.FunctionType) and name != "forward" and not name.startswith("__"):
                yield base, name, fn


def _names_read(code: types.CodeType) -> frozenset[str]:
    """The attribute and global names ``code`` reads, its nested functions and comprehensions included."""
    nested = (_names_read(c) for c in code.co_consts if isinstance(c, types.CodeType))
    return frozenset(code.co_names).union(*nested)


@contextmanager
def methods_watched(root: nn.Module, calls: MethodCalls) -> Iterator[None]:
    """While tracing ``root``: a method of ``root`` or a submodule called directly from ``root``'s forward
    goes through ``calls`` (traced calls, and plain runs that record its value). Only the names that forward's
    code reads are patched: patching a class attribute invalidates the type caches of its subclasses (every
    model class, for a library's shared base class), so a wider net slows every trace."""
    where = forward_site(root)
    if where is None:
        yield
        return
    names = _names_read(type(root).forward.__code__)
    paths = {id(m): p for p, m in root.named_modules()}
    patched: dict[tuple[type, str], types.FunctionType] = {}
    for cls in {type(m) for m in root.modules()}:
        for base, name, fn in _methods(cls, names):
            patched.setdefault((base, name), fn)

    def wrap(name: str, fn: types.FunctionType) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            path = paths.get(id(self))
            if path is None or not called_from(where, sys._getframe(1)):
                return fn(self, *args, **kwargs)
            if calls.plain:
                out = fn(self, *args, **kwargs)
                calls.method_ran(path, name, out)
                return out
            return calls.method_call(self, path, name, fn, args, kwargs)

        method.__wrapped__ = fn  # type: ignore[attr-defined]
        return method

    try:
        for (base, name), fn in patched.items():
            setattr(base, name, wrap(name, fn))
        yield
    finally:
        for (base, name), fn in patched.items():
            setattr(base, name, fn)
