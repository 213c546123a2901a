"""Autograd context a forward sets or uses while a frontend traces it: grad-mode regions, hooks, flags, autograd."""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd import grad_mode

from seqify._paths import PACKAGE_DIR
from seqify.frontend.torch_tables import settle_torch_tables

__all__ = ["Use", "Watcher", "watching", "REGION", "HOOK", "FLAG", "GRAD", "FUNCTION", "CHECKPOINT", "LEAK",
           "custom_function", "applied", "holds_proxy", "owner", "RUN"]

#: Kinds of use: a grad-mode region, a tensor hook, a requires_grad_/detach_ call, torch.autograd.grad or
#: backward, a custom autograd.Function, torch's reentrant checkpointing (its autograd.Function), and grad mode
#: left changed when a forward returns.
REGION, HOOK, FLAG, GRAD, FUNCTION, CHECKPOINT, LEAK = (
    "region", "hook", "flag", "grad", "function", "checkpoint", "leak")

_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
_SEQIFY = PACKAGE_DIR
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"])
_PACKAGES = tuple({os.path.abspath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")})
_GRAD_MODE = os.path.abspath(grad_mode.__file__)
_CONTEXTLIB = os.path.join(_TORCH, "utils", "_contextlib.py")


@dataclass(frozen=True)
class Use:
    """One use of autograd context in a forward: its kind, what it does and where (``file:line (code)``)."""

    kind: str
    what: str
    site: str
    frame: Any = None  # the user frame that made it (dropped once the watch ends)

    def __str__(self) -> str:
        return f"{self.what} at {self.site}"


class Watcher:
    """What a frontend does with the uses it sees; the defaults ignore them. Only uses made by the model's code
    reach it (torch's and seqify's own regions and hooks do not), on the thread that started the watch."""

    def enter(self, ctx: object, use: Use) -> None:
        """A grad-mode region ``ctx`` begins (its mode is set once this returns)."""

    def exit(self, ctx: object) -> None:
        """The region ``ctx`` ended (its mode is restored)."""

    def use(self, use: Use) -> None:
        """A tensor hook, requires_grad_/detach_, autograd.grad or backward call is about to run; raise to stop it."""

    def function(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], site: Use) -> Any:
        """A custom autograd.Function is applied: return its result, or :data:`RUN` to apply it plainly."""
        return RUN


#: Returned by :meth:`Watcher.function`: apply the Function as usual.
RUN: Any = object()

_WATCHERS: list[tuple[Watcher, int]] = []
_APPLY = torch.autograd.function.Function.__dict__["apply"]


def _stdlib(path: str) -> bool:
    return path.startswith(_STDLIB) and not path.startswith(_PACKAGES) and "-packages" not in path


def _user(file: str) -> bool:
    """Whether code in ``file`` is the model's (not torch's, seqify's, Python's or code fx or seqify generated)."""
    if file.startswith("<"):
        return not file.startswith(("<eval_with_key", "<seqify"))
    path = os.path.abspath(file)
    return not (path.startswith(_TORCH) or path.startswith(_SEQIFY) or _stdlib(path))


def _transparent(file: str) -> bool:
    """Frames that only pass a call on: torch's grad-mode classes and decorators, and Python's library."""
    path = os.path.abspath(file)
    return path in (_GRAD_MODE, _CONTEXTLIB) or _stdlib(path)


def _site(frame: FrameType | None) -> tuple[str, FrameType] | None:
    """Where the call that reached ``frame`` was made, when the model's code made it: ``file:line (code)`` and
    the frame. A grad-mode decorator's region is the decorated function's; anything else torch or seqify
    calls (their own regions, hooks on internal tensors) is not the model's and gives None."""
    while frame is not None and _transparent(frame.f_code.co_filename):
        func = frame.f_locals.get("func") if frame.f_code.co_name == "decorate_context" else None
        code = getattr(func, "__code__", None)
        if code is not None:
            if not _user(code.co_filename):
                return None
            name = getattr(func, "__qualname__", code.co_name)
            return f"{os.path.basename(code.co_filename)}:{code.co_firstlineno} (decorating {name})", frame
        frame = frame.f_back
    if frame is None or not _user(frame.f_code.co_filename):
        return None
    file, line = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(file, line).strip()
    return f"{os.path.basename(file)}:{line}" + (f" ({code})" if code else ""), frame


def _watcher() -> Watcher | None:
    if not _WATCHERS:
        return None
    watcher, thread = _WATCHERS[-1]
    return watcher if thread == threading.get_ident() else None


def _region(original: Callable[..., Any], what: Callable[..., str]) -> Callable[..., Any]:
    def enter(self: Any, *args: Any) -> Any:
        watcher = _watcher()
        found = _site(sys._getframe(1)) if watcher is not None else None
        if watcher is not None and found is not None:
            # before the mode changes: a watcher that refuses the region leaves grad mode as it was
            watcher.enter(self, Use(REGION, what(self, *args), found[0], found[1]))
        return original(self, *args)

    return enter


def _ended(original: Callable[..., Any]) -> Callable[..., Any]:
    def exit(self: Any, *args: Any) -> Any:
        result = original(self, *args)
        watcher = _watcher()
        if watcher is not None:
            watcher.exit(self)
        return result

    return exit


def _called(original: Callable[..., Any], kind: str, what: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        watcher = _watcher()
        found = _site(sys._getframe(1)) if watcher is not None else None
        if watcher is not None and found is not None:
            watcher.use(Use(kind, what, found[0], found[1]))
        return original(*args, **kwargs)

    return call


def custom_function(cls: type) -> bool:
    """Whether ``cls`` is the model's autograd.Function, with a backward of its own (torch's, such as reentrant
    checkpointing, compute the gradient the forward's ops give; seqify's run pipelines, not models)."""
    return not cls.__module__.startswith(("torch.", "seqify."))


def applied(cls: type) -> Callable[..., Any]:
    """``cls.apply`` as torch defines it (not as a watch patches it): what a converted layer calls to apply a
    custom autograd.Function, forward and backward, as the source did."""
    return _APPLY.__get__(None, cls)


def _beyond_torch(frame: FrameType | None) -> FrameType | None:
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_TORCH):
        frame = frame.f_back
    return frame


def _function_use(cls: type, frame: FrameType | None) -> Use | None:
    """The use of autograd.Function ``cls`` applied from ``frame``: any of the model's own, and torch's where
    the model's code reached it through torch's helpers (checkpoint); None for seqify's and torch's inner ones."""
    if custom_function(cls):
        found = _site(frame)
        where = found or (f"{cls.__module__}.{cls.__qualname__}", None)
        return Use(FUNCTION, f"applies the custom autograd.Function {cls.__qualname__}", where[0], where[1])
    if cls.__module__.startswith("seqify.") or cls.__module__.startswith("torch._library"):
        # torch.library makes these for a custom operator's registered autograd: the operator itself is the
        # graph op both frontends record, and it keeps its backward
        return None
    found = _site(_beyond_torch(frame))
    if found is None:
        return None
    if cls.__module__ == "torch.utils.checkpoint":
        return Use(CHECKPOINT, "runs torch.utils.checkpoint with use_reentrant=True", found[0], found[1])
    return Use(FUNCTION, f"applies torch's autograd.Function {cls.__qualname__}", found[0], found[1])


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    watcher = _watcher()
    use = _function_use(cls, sys._getframe(1)) if watcher is not None else None
    if watcher is not None and use is not None:
        result = watcher.function(cls, args, kwargs, use)
        if result is not RUN:
            return result
    return applied(cls)(*args, **kwargs)


def _patches() -> list[tuple[Any, str, Any]]:
    """(owner, attribute, replacement) for every entry point of autograd context a forward may call."""
    T = torch.Tensor
    return [
        (grad_mode.no_grad, "__enter__", _region(grad_mode.no_grad.__enter__, lambda c: "enters torch.no_grad()")),
        (grad_mode.no_grad, "__exit__", _ended(grad_mode.no_grad.__exit__)),
        (grad_mode.enable_grad, "__enter__",
         _region(grad_mode.enable_grad.__enter__, lambda c: "enters torch.enable_grad()")),
        (grad_mode.enable_grad, "__exit__", _ended(grad_mode.enable_grad.__exit__)),
        (grad_mode.set_grad_enabled, "__init__",
         _region(grad_mode.set_grad_enabled.__init__, lambda c, mode: f"calls torch.set_grad_enabled({mode})")),
        (grad_mode.set_grad_enabled, "__exit__", _ended(grad_mode.set_grad_enabled.__exit__)),
        (grad_mode.inference_mode, "__enter__",
         _region(grad_mode.inference_mode.__enter__, lambda c: f"enters torch.inference_mode({c.mode})")),
        (grad_mode.inference_mode, "__exit__", _ended(grad_mode.inference_mode.__exit__)),
        (T, "register_hook", _called(T.register_hook, HOOK, "registers a tensor hook (Tensor.register_hook)")),
        (T, "register_post_accumulate_grad_hook", _called(
            T.register_post_accumulate_grad_hook, HOOK,
            "registers a tensor hook (Tensor.register_post_accumulate_grad_hook)")),
        (T, "requires_grad_", _called(T.requires_grad_, FLAG, "calls Tensor.requires_grad_()")),
        (T, "detach_", _called(T.detach_, FLAG, "calls Tensor.detach_()")),
        (T, "backward", _called(T.backward, GRAD, "calls Tensor.backward()")),
        (torch.autograd, "backward", _called(torch.autograd.backward, GRAD, "calls torch.autograd.backward()")),
        (torch.autograd, "grad", _called(torch.autograd.grad, GRAD, "calls torch.autograd.grad()")),
        (torch.autograd.function.Function, "apply", classmethod(_apply)),
    ]


@contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Report to ``watcher`` the autograd context the model's code sets or uses on this thread until exit."""
    settle_torch_tables()
    saved: list[tuple[Any, str, bool, Any]] = []
    if not _WATCHERS:
        for owner, name, replacement in _patches():
            saved.append((owner, name, name in owner.__dict__, owner.__dict__.get(name)))
            setattr(owner, name, replacement)
    _WATCHERS.append((watcher, threading.get_ident()))
    try:
        yield
    finally:
        _WATCHERS.pop()
        for owner, name, had, value in reversed(saved):
            if had:
                setattr(owner, name, value)
            else:
                delattr(owner, name)


def holds_proxy(args: Any) -> bool:
    """Whether ``args`` hold an fx Proxy (a traced value) anywhere."""
    import torch.fx as fx

    return any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves(args))


def owner(frame: FrameType | None, model: nn.Module) -> str | None:
    """The path of the module of ``model`` whose code ``frame`` (or a caller of it) runs: '' for the model's own
    forward, None where no frame belongs to one."""
    paths = {id(m): p for p, m in model.named_modules()}
    while frame is not None:
        if frame.f_code.co_name == "decorate_context":
            args = frame.f_locals.get("args") or ()
            if args and id(args[0]) in paths:
                return paths[id(args[0])]
        me = frame.f_locals.get("self")
        if me is not None and id(me) in paths:
            return paths[id(me)]
        frame = frame.f_back
    return None
