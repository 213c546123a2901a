"""Autograd context under fx: grad-mode regions recorded on the nodes they hold; other uses keep their module whole."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.autograd import grad_mode

from seqify.errors import AutogradContextError
from seqify.frontend.grad_watch import (
    CHECKPOINT,
    FLAG,
    FUNCTION,
    GRAD,
    HOOK,
    LEAK,
    RUN,
    Use,
    Watcher,
    applied,
    holds_proxy,
)

__all__ = ["GRAD_MODE", "FxAutograd", "Refused", "refusal", "keep_reason", "AUTOGRAD_CALLS", "PROXY_USES"]

#: ``node.meta[GRAD_MODE]``: ``(grad enabled, inference mode or None)`` the op ran under in the source, on the
#: nodes made inside a grad-mode region of the model's code (None: the region did not set inference mode).
GRAD_MODE = "seqify_grad_mode"

#: Functions that run autograd inside a forward: traced, they would need the autograd graph of that very call.
AUTOGRAD_CALLS = {
    torch.autograd.grad: "calls torch.autograd.grad()",
    torch.autograd.backward: "calls torch.autograd.backward()",
}

#: Tensor methods on traced values a graph cannot hold (their argument is a Python function, or they run autograd).
PROXY_USES = {
    "register_hook": (HOOK, "registers a tensor hook (Tensor.register_hook)"),
    "register_post_accumulate_grad_hook": (HOOK, "registers a tensor hook (Tensor.register_post_accumulate_grad_hook)"),
    "backward": (GRAD, "calls Tensor.backward()"),
}


def _requires_grad(value: Any) -> bool:
    """Whether ``value`` (a tensor, or a traced value with an example) requires grad."""
    if isinstance(value, fx.Proxy):
        value = value.node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.requires_grad


class Refused(fx.proxy.TraceError):
    """A use a graph cannot hold: tracing that forward stops, and its module is kept whole."""

    def __init__(self, use: Use) -> None:
        super().__init__(str(use))
        self.use = use


class _Tracer(Protocol):
    plain: int
    module_stack: Any

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Proxy: ...


class FxAutograd(Watcher):
    """What an fx trace does with the autograd context the model's code sets or uses (ignored while the tracer
    runs code plainly: a leaf's example value, the real run)."""

    def __init__(self, tracer: _Tracer) -> None:
        self.tracer = tracer
        self.regions: list[tuple[object, Use]] = []
        self.uses: dict[str, Use] = {}  # the first use, by the path of the module whose forward made it

    def path(self) -> str:
        stack = self.tracer.module_stack
        return next(reversed(stack.values()))[0] if stack else ""

    def enter(self, ctx: object, use: Use) -> None:
        if not self.tracer.plain:
            self.regions.append((ctx, use))

    def exit(self, ctx: object) -> None:
        for i in range(len(self.regions) - 1, -1, -1):
            if self.regions[i][0] is ctx:
                del self.regions[i]
                return

    def mode(self) -> tuple[bool, bool | None] | None:
        """The mode an op made now runs under, where a region of the model's code is open; else None (the
        caller's mode)."""
        if not self.regions:
            return None
        inference = any(isinstance(ctx, grad_mode.inference_mode) for ctx, _ in self.regions)
        return torch.is_grad_enabled(), torch.is_inference_mode_enabled() if inference else None

    def note(self, use: Use) -> None:
        self.uses.setdefault(self.path(), use)

    def use(self, use: Use) -> None:
        if self.tracer.plain:
            return
        self.note(use)
        raise Refused(use)

    def function(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], site: Use) -> Any:
        if self.tracer.plain:
            return RUN
        if site.kind == CHECKPOINT:
            # its ops are traced through: the same gradients, unless no input requires grad (then the source's
            # checkpoint gives its parameters none)
            if not any(_requires_grad(a) for a in pytree.tree_leaves((args, kwargs))):
                self.use(Use(CHECKPOINT, f"{site.what} on inputs that do not require grad", site.site, site.frame))
            return RUN
        if holds_proxy((args, kwargs)):
            # recorded as the Function itself, so the converted layer runs its forward and its backward
            return self.tracer.create_proxy("call_function", applied(cls), args, kwargs)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves((args, kwargs))):
            self.use(Use(FUNCTION, f"{site.what} to tensors fx does not trace", site.site, site.frame))
        return RUN

    def left_open(self, depth: int) -> None:
        """A forward returned with regions opened since ``depth`` still open: grad mode stays changed."""
        if len(self.regions) > depth:
            first = self.regions[depth][1]
            self.note(Use(LEAK, f"{first.what} outside a with block", first.site, first.frame))
            del self.regions[depth:]


_WHY = {
    HOOK: ("a hook registered while the forward runs is not a graph op (torch.export drops it)",
           "registers its hooks on every call"),
    GRAD: ("autograd run inside the forward needs the autograd graph of that very call, which layers split",
           "runs autograd inside its own call"),
    FLAG: ("it changes a tensor fx does not trace (a parameter reached through .parameters(), a tensor attribute), "
           "so the converted model would not repeat it", "changes that tensor on every call"),
    FUNCTION: ("fx would bake the result in as a constant, and the gradient through it would be lost",
               "applies it on every call"),
    CHECKPOINT: ("reentrant checkpointing then gives the parameters inside no gradient, where its traced ops would "
                 "(pass use_reentrant=False, or an input that requires grad)", "checkpoints as the source does"),
    LEAK: ("grad mode stays changed after the forward returns, which layers cannot repeat (use a with block)",
           "leaves grad mode as the source does"),
}


def keep_reason(use: Use) -> str:
    """Why a submodule whose forward made ``use`` is kept whole."""
    why, kept = _WHY.get(use.kind, _WHY[GRAD])
    return f"its forward {use}: {why}; kept whole so it {kept}"


def refusal(name: str, use: Use) -> AutogradContextError:
    """The error for ``use`` in the model's own forward (``name``: its class)."""
    why, _ = _WHY.get(use.kind, _WHY[GRAD])
    return AutogradContextError(
        f"{name}.forward {use}: {why}. What to do: move that code into a submodule (seqify keeps a submodule "
        "whose forward does this whole, as one layer that runs the source's code on every call)"
        + (", or call torch.set_grad_enabled(...) in a with block" if use.kind == LEAK else "")
        + "; inside a submodule this is not an error."
    )


