"""Boundary buffers sized to what a schedule keeps in flight, not one set per micro-batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from seqify.schedule.actions import Schedule

__all__ = ["Buffers", "in_flight", "partition_order", "places"]


def places(order: Sequence[tuple[str, int]]) -> list[int]:
    """The buffer set each micro-batch of one partition uses, given the partition's actions in issue
    order (("F" | "B" | "W", micro-batch), as :func:`partition_order` lists them): a set is
    taken at a micro-batch's forward and given back after its last backward action (its W when the
    backward is split, else its B), and a later forward takes the lowest set given back. A micro-batch
    with no backward action (inference, or a fill-drain order) never gives its set back, so fill-drain
    gets one set per micro-batch and 1F1B as many as it keeps in flight."""
    last = {i: n for n, (_, i) in enumerate(order)}
    free: list[int] = []
    made = 0
    place: dict[int, int] = {}
    for n, (kind, i) in enumerate(order):
        if kind == "F" and i not in place:
            if free:
                free.sort()
                place[i] = free.pop(0)
            else:
                place[i], made = made, made + 1
        if kind != "F" and last[i] == n:
            free.append(place[i])
    return [place[i] for i in sorted(place)]


def in_flight(order: Sequence[tuple[str, int]]) -> int:
    """How many buffer sets ``order`` needs: the most micro-batches it keeps between forward and last
    backward at once."""
    return max(places(order), default=-1) + 1


class Buffers:
    """One partition's input or output-gradient buffers, shared by micro-batches whose use never
    overlaps (same place, see :func:`places`, and the same shapes, dtypes, strides and gradient
    requirements: an uneven last micro-batch gets buffers of its own)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._sets: dict[tuple[object, ...], list[torch.Tensor]] = {}
        self.shared: set[int] = set()  # ids of buffers more than one micro-batch writes

    def take(self, place: int, like: Sequence[torch.Tensor], copy: bool = True,
             grads: Sequence[bool] | None = None) -> list[torch.Tensor]:
        """Buffers for values like ``like`` at ``place``, holding copies of them (``copy``; the buffers
        need a gradient where ``grads`` says, by default where those values do) or, new, zeros needing
        none (gradients to come)."""
        need = [t.requires_grad for t in like] if grads is None else list(grads)
        key = (place, copy, *[(tuple(t.shape), tuple(t.stride()), t.dtype, g) for t, g in zip(like, need)])
        got = self._sets.get(key)
        if got is None:
            with torch.no_grad():
                if copy:
                    got = [t.detach().to(self.device, copy=True).requires_grad_(g) for t, g in zip(like, need)]
                else:
                    got = [torch.zeros_like(t, device=self.device, memory_format=torch.preserve_format) for t in like]
            self._sets[key] = got
            return got
        self.shared.update(id(t) for t in got)
        if copy:
            with torch.no_grad():
                for dst, src in zip(got, like):
                    dst.copy_(src)
        return got


def partition_order(schedule: Schedule, j: int) -> list[tuple[str, int]]:
    """Partition ``j``'s forwards, backwards and (split schedules) weight-gradient steps in the order
    ``schedule`` issues them."""
    return [(a.kind, a.microbatch) for a in schedule.actions if a.partition == j]
