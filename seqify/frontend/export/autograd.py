"""Autograd context torch.export cannot hold: watched while it captures, refused with the reason and the fix."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from seqify.errors import AutogradContextError
from seqify.frontend.grad_watch import CHECKPOINT, FLAG, FUNCTION, GRAD, HOOK, LEAK, REGION, Use, Watcher, owner

__all__ = ["Watch", "refuse_autograd"]


class _Dropped(Exception):
    """Autograd context torch.export would drop: the capture stops there."""


class Watch(Watcher):
    """The autograd context of the model's code that an export graph cannot hold: tensor hooks, autograd run
    in the forward, requires_grad_/detach_, custom autograd.Functions (export keeps their forward, not their
    backward), inference_mode regions, grad mode left changed. Grad-mode regions are kept
    (``wrap_with_set_grad_enabled``)."""

    def __init__(self) -> None:
        self.dropped: list[Use] = []
        self.regions: list[tuple[object, Use]] = []

    def enter(self, ctx: object, use: Use) -> None:
        if isinstance(ctx, torch.autograd.grad_mode.inference_mode):
            self.use(use)
        self.regions.append((ctx, use))

    def exit(self, ctx: object) -> None:
        self.regions = [(c, u) for c, u in self.regions if c is not ctx]

    def use(self, use: Use) -> None:
        self.dropped.append(use)
        raise _Dropped(str(use))

    def function(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], site: Use) -> Any:
        self.use(site)


_DROPS = {
    HOOK: "torch.export drops a tensor hook registered in forward, so the converted model would compute other "
          "gradients",
    GRAD: "torch.export cannot keep autograd run inside the forward",
    FLAG: "torch.export does not record requires_grad_() or detach_() on the values it traces",
    FUNCTION: "torch.export keeps the Function's forward ops but not its backward, so the gradient through it "
              "would differ",
    CHECKPOINT: "torch.export captures reentrant checkpointing wrongly (the rest of the forward without gradients)",
    REGION: "torch.export drops inference_mode regions, so the converted model would track gradients where the "
            "source does not",
    LEAK: "grad mode stays changed after the forward returns, which an export graph cannot repeat",
}
_KEEPS = {
    FUNCTION: "applies the Function itself, forward and backward",
    CHECKPOINT: "records the checkpointed ops; or pass use_reentrant=False, which torch.export captures",
    FLAG: "records it on the values it traces (and keeps a submodule doing it to parameters whole)",
    REGION: "runs the region's ops in inference mode as the source does; or use torch.no_grad() instead, which "
            "torch.export keeps",
}


def _fix(kind: str, path: str | None) -> str:
    keep = _KEEPS.get(kind) or ("keeps a submodule doing this whole as one layer that runs the source's code"
                                + ("" if path else " (move that code into a submodule first)"))
    return f"convert with frontend='fx' (or 'auto'), which {keep}"


def refuse_autograd(model: nn.Module, watch: Watch) -> None:
    """Raise AutogradContextError for the first autograd context the capture would have dropped."""
    if watch.regions and not watch.dropped:
        first = watch.regions[0][1]
        watch.dropped.append(Use(LEAK, f"{first.what} outside a with block", first.site, first.frame))
    if not watch.dropped:
        return
    use = watch.dropped[0]
    name = type(model).__name__
    path = owner(use.frame, model)
    where = (f"submodule {path!r} ({type(model.get_submodule(path)).__name__}) of {name}: its forward" if path
             else f"{name}.forward")
    raise AutogradContextError(f"{where} {use}; {_DROPS[use.kind]}. What to do: {_fix(use.kind, path)}")
