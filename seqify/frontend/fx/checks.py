"""Checks around an fx trace: forwards wrapped by (*args, **kwargs) decorators, and state a forward writes."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from torch import nn

from seqify.errors import DecoratedForwardError

__all__ = ["attributes", "writes_since", "check_decorated", "passthrough"]

_TABLES = ("_parameters", "_buffers", "_modules")


def attributes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each module's plain Python attributes, parameters and buffers (not its children), by path."""
    return {
        path: {**{k: v for k, v in m.__dict__.items() if k not in _TABLES}, **m._parameters, **m._buffers}
        for path, m in model.named_modules()
    }


def writes_since(model: nn.Module, before: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The attributes, by module path, that differ from ``before`` (set, replaced or deleted)."""
    after = attributes(model)
    changed: dict[str, list[str]] = {}
    for path, attrs in before.items():
        now = after.get(path, {})
        names = [k for k in attrs.keys() | now.keys() if k not in attrs or k not in now or attrs[k] is not now[k]]
        if names:
            changed[path] = sorted(names)
    return changed


def _renames(wrapper: Any) -> str | None:
    """The deprecated keyword a transformers ``deprecate_kwarg`` wrapper renames, or None if ``wrapper``
    is not one. That decorator only renames (or warns about) one keyword: with that keyword absent it
    calls the function it wraps with the same arguments."""
    code = getattr(wrapper, "__code__", None)
    if code is None or not code.co_filename.replace(os.sep, "/").endswith("transformers/utils/deprecation.py"):
        return None
    if not getattr(code, "co_qualname", "").startswith("deprecate_kwarg."):
        return None
    old = inspect.getclosurevars(wrapper).nonlocals.get("old_name")
    return old if isinstance(old, str) else None


def passthrough(model: nn.Module, example_inputs: Any) -> Callable[..., Any] | None:
    """The forward under ``model``'s decorators when each of them passes these inputs through unchanged
    (transformers' ``deprecate_kwarg``, for inputs without the deprecated name), else None: fx may trace
    that forward itself (LED's forward gained such a decorator in transformers 5.24)."""
    forward = type(model).forward
    inner = inspect.unwrap(forward)
    if inner is forward:
        return None
    names = set(example_inputs) if isinstance(example_inputs, dict) else set()
    f = forward
    while f is not inner:
        old = _renames(f)
        if old is None or old in names:
            return None
        f = f.__wrapped__  # type: ignore[attr-defined]
    return inner


def check_decorated(model: nn.Module, cause: BaseException) -> None:
    """Raise DecoratedForwardError (from ``cause``, the failed trace) if the forward is wrapped by a
    ``(self, *args, **kwargs)`` decorator: fx reads the parameter names of the wrapped function but calls
    the wrapper, so the inputs land in the wrong place."""
    forward = type(model).forward
    inner = inspect.unwrap(forward)
    if inner is forward:
        return
    spec = inspect.getfullargspec(forward)
    if not (spec.varargs or spec.varkw) or spec == inspect.getfullargspec(inner):
        return
    name = type(model).__name__
    chain, f = [], forward
    while f is not inner:
        code = getattr(f, "__code__", None)  # functools.wraps copies the wrapped names: the code has its own
        name = getattr(code, "co_qualname", getattr(f, "__qualname__", repr(f)))
        chain.append(f"{name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})" if code else repr(f))
        f = f.__wrapped__  # type: ignore[attr-defined]
    raise DecoratedForwardError(
        f"{name}.forward is wrapped by a decorator ({' -> '.join(chain)}) that takes (self, *args, **kwargs) "
        f"around {getattr(inner, '__qualname__', 'forward')}{inspect.signature(inner)}; torch.fx cannot trace "
        "through it (transformers 5 wraps its forwards this way). What to do: use the torch.export frontend "
        "(seqify.convert(model, example_inputs, frontend='export'), or frontend='auto'), or convert a "
        "module whose forward calls this model with named arguments (def forward(self, input_ids): return "
        "model(input_ids=input_ids, use_cache=False).logits)."
    ) from cause
