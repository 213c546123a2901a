"""Gradient views: ``.grad`` as views of a replayed step's gradient sums, given memory of their own when still held.

A replayed step adds every parameter's gradient into fixed sums (:func:`~.programs.accumulators`: a captured
backward can only write fixed memory). Autograd would leave a tensor of its own in ``.grad`` each step; a copy
of the sums would be that, at the price of a second copy of every gradient alive from the backward's end to the
optimizer's step (3.3 GiB per GPU for a 0.89 B model in float32, 14 GiB for a pipeline stage of 3.75 B). A view
is no copy: ``.grad`` is a tensor over the sums' memory. What the caller sees is still a tensor of its own:
before the sums are zeroed or written again, every view something still refers to (``.grad`` kept to
accumulate into, a list of gradients kept for logging) is given memory of its own holding its values, so no
held gradient changes under its holder. After the usual ``optimizer.zero_grad()`` (``.grad`` set to None)
nothing holds one, and nothing is copied.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["GradViews"]


class GradViews:
    """The tensors over one set of gradient sums handed out as ``.grad`` since the sums were last released."""

    def __init__(self) -> None:
        self._out: list[weakref.ref[torch.Tensor]] = []

    def hand(self, params: Sequence[nn.Parameter], sums: Sequence[torch.Tensor], divisor: int = 1) -> None:
        """What autograd leaves in ``.grad`` after a backward: where it is None, a view of the parameter's sum
        (no copy); else the sum added into it. The sums are divided by ``divisor`` first where it is not 1
        (data-parallel replicas' summed sums, to their mean)."""
        if divisor != 1 and sums:
            torch._foreach_div_(list(sums), float(divisor))
        added = [(p, s) for p, s in zip(params, sums) if p.grad is not None]
        for p, s in zip(params, sums):
            if p.grad is None:
                view = s.detach()  # a tensor object of its own over the sum's memory, with the parameter's strides
                p.grad = view
                self._out.append(weakref.ref(view))
        if added:
            torch._foreach_add_([p.grad for p, _ in added], [s for _, s in added])  # type: ignore[misc]

    def release(self) -> None:
        """Before the sums are written again: every view handed out and still referred to anywhere gets memory
        of its own, holding the values it had."""
        out, self._out = self._out, []
        with torch.no_grad():
            for ref in out:
                view = ref()
                if view is not None:
                    view.data = view.clone(memory_format=torch.preserve_format)

    def __len__(self) -> int:
        """How many views handed out are still referred to."""
        return sum(ref() is not None for ref in self._out)
