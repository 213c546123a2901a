"""User hooks on a partition's parameters and layers: the ones replayed programs cannot run as an eager step does.

A replayed backward adds each micro-batch's gradients into sums of its own and fills ``.grad`` at the end of the
step, so autograd never accumulates into ``.grad`` and a post-accumulate-grad hook would never run. A gradient
hook runs in an eager program (its weight is then read through autocast's own cast, so the hook sees the float32
gradient, see :mod:`.casts`), but a captured CUDA graph replays only the kernels a hook launched while it was
captured: its Python would run once. A layer's hooks (forward, backward), and torch's global module hooks, are
called by every forward that building the programs runs besides the step's own, and a captured graph would run
them once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from seqify.model.hooks import user_hooks
from seqify.pipe.executors.layer_settings import Settings, values

__all__ = ["built_for", "global_hooks", "hooked", "refusal", "suspended"]

#: Hooks run on a parameter's gradient as autograd computes it (``Tensor.register_hook``).
GRADIENT = "_backward_hooks"
#: Hooks run after autograd accumulated a gradient into ``.grad`` (``Tensor.register_post_accumulate_grad_hook``).
ACCUMULATED = "_post_accumulate_grad_hooks"


def hooked(t: torch.Tensor) -> tuple[bool, bool]:
    """Whether ``t`` has gradient hooks, and post-accumulate-grad hooks."""
    return bool(getattr(t, GRADIENT, None)), bool(getattr(t, ACCUMULATED, None))


#: torch's hooks run around every module's call (``torch.nn.modules.module.register_module_forward_hook`` and
#: the like), by the name of their dict in ``torch.nn.modules.module``.
GLOBAL = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")


def global_hooks() -> list[str]:
    """The kinds of global module hook registered now (``forward-pre``, ``forward``, ...)."""
    from torch.nn.modules import module

    return [name.removeprefix("_global_").removesuffix("_hooks").replace("_", "-")
            for name in GLOBAL if getattr(module, name, None)]


def built_for(params: Iterable[torch.Tensor], layers: Iterable[nn.Module], settings: Settings = ()
              ) -> tuple[object, ...]:
    """What a user may change between steps that programs are built for, in one pass: each parameter's
    ``requires_grad`` and hooks, each layer's mode and hooks, torch's global module hooks, and the layers' plain
    ``settings`` (:mod:`.layer_settings`). Programs are built again (or refused, :func:`refusal`) when it
    changes: captured graphs keep what they were captured with."""
    return (tuple((p.requires_grad, *hooked(p)) for p in params),
            tuple((m.training, *user_hooks(m)) for m in layers), tuple(global_hooks()), values(settings))


def refusal(layers: nn.Module, partition: int, capturing: bool, training: bool = True) -> tuple[str, bool] | None:
    """Why partition ``partition``'s programs would not run a hook of its layers (or, ``training``, of its
    trainable parameters) as an eager step does, and whether eager programs would (a gradient hook that only
    capturing misses); None where they would."""
    kinds_all = global_hooks()
    if kinds_all:
        return (f"global module {', '.join(kinds_all)} hooks are registered (torch.nn.modules.module."
                "register_module_forward_hook and the like), which replayed programs would not call once per layer "
                f"and micro-batch in partition {partition}: building them runs more forwards, and a captured graph "
                "runs their Python once", False)
    for name, m in layers.named_modules():
        kinds = user_hooks(m)
        if kinds:
            what = ", ".join(k.strip("_").removesuffix("_hooks").replace("_", "-") for k in kinds)
            return (f"layer {name or type(m).__name__!r} of partition {partition} has {what} hooks, which "
                    "replayed programs would not call once per micro-batch: building them runs more forwards, and "
                    "a captured graph runs their Python once", False)
    for name, p in layers.named_parameters() if training else ():
        if not p.requires_grad:
            continue
        gradient, accumulated = hooked(p)
        if accumulated:
            return (f"parameter {name!r} of partition {partition} has a post-accumulate-grad hook "
                    "(Tensor.register_post_accumulate_grad_hook), which a replayed step never runs: it sums "
                    "gradients apart from .grad", False)
        if gradient and capturing:
            return (f"parameter {name!r} of partition {partition} has a gradient hook (Tensor.register_hook), "
                    "whose Python a captured CUDA graph would run only once, at capture", True)
    return None


@contextmanager
def suspended(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Hold back ``params``' gradient hooks while a backward whose gradients are thrown away runs (the pass that
    learns where gradients reach before a step's programs are fixed): they run on the step's own backwards only.
    The hook dicts are emptied and refilled in place, since autograd calls the dict a hook was registered in."""
    saved = [(d, dict(d)) for d in (getattr(p, GRADIENT, None) for p in params) if d]
    for d, _ in saved:
        d.clear()
    try:
        yield
    finally:
        for d, items in saved:
            d.update(items)
