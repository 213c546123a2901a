"""Casts: the weights autocast lowers at their one use, cast once per step instead of once per micro-batch.

Under ``torch.autocast`` a partition's programs cast every float32 weight a matmul or convolution reads to
the lower precision (bfloat16, float16), inside each micro-batch's forward: with ``m`` micro-batches a step
casts every weight ``m`` times, keeps ``m`` cast copies alive for the backward and, per micro-batch, widens
each weight's gradient to float32 in a tensor of its own before adding it up. One device training the whole
batch casts once (autocast's cache). This unit finds, by watching one forward, the weights whose only use is
such a cast, casts them once per step into fixed buffers, and lets every program read those buffers
instead: the same values reach the same kernels (autocast leaves a tensor already in its precision alone,
and a cast commutes with views), each program's gradient for the buffer is the gradient autocast's cast
would have widened, and adding a low-precision gradient into a float32 sum widens it exactly as that cast's
backward would. A weight with any other use (a norm's scale read in float32, a weight read twice, a tied
weight), or with a gradient hook, keeps autocast's own cast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from seqify.pipe.executors.user_hooks import hooked

__all__ = ["Casts", "find", "lowered"]

aten = torch.ops.aten
# Ops that return a view of their first argument: a cast of a view of a weight is a view of its cast.
_VIEWS = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
    aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default,
    aten._reshape_alias.default, aten.reshape.default, aten.as_strided.default,
}


class _Uses(TorchDispatchMode):
    """Counts, per watched tensor (and the views of it), casts to ``dtype`` and every other use."""

    def __init__(self, watched: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.owner: dict[int, int] = {id(t): k for k, t in enumerate(watched)}  # tensor (or view) -> weight
        self.views: list[torch.Tensor] = []  # kept alive so their ids stay theirs
        self.casts = [0] * len(watched)
        self.other = [0] * len(watched)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        hits = [self.owner[id(t)] for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and id(t) in self.owner]
        if not hits:
            return out
        first = args[0] if args else None
        if len(hits) == 1 and isinstance(first, torch.Tensor) and id(first) in self.owner:
            k = hits[0]
            if func is aten._to_copy.default and kwargs.get("dtype") == self.dtype and len(args) == 1:
                self.casts[k] += 1
                return out
            if func in _VIEWS and isinstance(out, torch.Tensor):
                self.owner[id(out)] = k
                self.views.append(out)
                return out
        for k in hits:
            self.other[k] += 1
        return out


def lowered(device: torch.device) -> torch.dtype | None:
    """The precision autocast lowers to on ``device``'s type now, or None where it is off. (Whether to
    cast once at all is the executors' option, :class:`~.options.ReplayOptions` ``cast_once``.)"""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


class Casts:
    """A partition's weights that are read only through autocast's cast, with their once-per-step casts."""

    def __init__(self, slots: list[list[tuple[nn.Module, str]]], params: list[torch.Tensor],
                 dtype: torch.dtype) -> None:
        self.slots = slots  # per weight: every (module, name) that holds it
        self.params = params
        self.low = [torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format) for p in params]
        # what programs read: the casts as leaves of their autograd graphs (gradients for them, not the weights)
        self.leaves = [t.detach().requires_grad_(p.requires_grad) for t, p in zip(self.low, params)]
        self.by_param = {id(p): leaf for p, leaf in zip(params, self.leaves)}
        self.refresh()

    def __len__(self) -> int:
        return len(self.params)

    def refresh(self) -> None:
        """Cast the weights as they are now (once per step: an optimizer changed them in between)."""
        with torch.no_grad():
            torch._foreach_copy_(self.low, self.params)

    def wrt(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What to differentiate by for ``params``: a weight's cast where it has one, else the weight."""
        return [self.by_param.get(id(p), p) for p in params]

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Every slot holds the weight's cast while a program runs (or is captured)."""
        for slots, leaf in zip(self.slots, self.leaves):
            for m, name in slots:
                m._parameters[name] = leaf  # type: ignore[assignment]
        try:
            yield
        finally:
            for slots, p in zip(self.slots, self.params):
                for m, name in slots:
                    m._parameters[name] = p  # type: ignore[assignment]


def find(layers: nn.Module, run: Callable[[], Any], dtype: torch.dtype) -> Casts | None:
    """Watch ``run()`` (one forward of ``layers`` under autocast to ``dtype``) and return the float32
    weights whose only use is one cast to ``dtype`` (None: there are none). The forward runs once more
    than the step does: buffers (BatchNorm statistics) are put back; random draws are the caller's. A
    forward that fails while watched (an op a dispatch mode cannot see through) casts nothing here: the
    programs then cast as autocast does, and the real run reports any real error."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for m in layers.modules():
        for name, p in m._parameters.items():
            # a weight with a gradient hook keeps autocast's cast: the hook runs on its float32 gradient
            if p is not None and p.dtype == torch.float32 and not any(hooked(p)):
                slots.setdefault(id(p), []).append((m, name))
                params[id(p)] = p
    if not params:
        return None
    watched = list(params.values())
    uses = _Uses(watched, dtype)
    saved = [(b, b.clone()) for b in layers.buffers()]
    try:
        with uses:  # in the caller's grad mode: a forward may choose its ops by it
            run()
    except Exception:
        return None
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
    keep = [k for k in range(len(watched)) if uses.casts[k] == 1 and uses.other[k] == 0]
    if not keep:
        return None
    return Casts([slots[id(watched[k])] for k in keep], [watched[k] for k in keep], dtype)
