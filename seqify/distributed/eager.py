"""A rank's share of a shared schedule: its partitions' F, B and W actions, with values crossing by key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from seqify.distributed.link import ACTIVATION, GRAD, SKIP, SKIP_GRAD, Key, Link, grads_for, leaves, like_grads
from seqify.distributed.rank import RankStage
from seqify.distributed.sizes import is_size
from seqify.errors import ScheduleError
from seqify.pipe.recompute import checkpointed
from seqify.pipe.split_backward import Later, accumulate, input_grads, weight_grads
from seqify.schedule.actions import Action
from seqify.schedule.interpreter import interpret

__all__ = ["RankRun", "hand_back"]

#: micro-batch i's output -> its loss, already weighed (seqify.pipe.losses.Weigher)
Loss = Callable[[Any, int], torch.Tensor]


def _as_leaves(value: Any) -> tuple[Any, list[torch.Tensor]]:
    """Received tensors as leaves that collect gradients, and clones of them for the partition to use (a
    first layer may work in place, which autograd forbids on a leaf); a size (an int made from shapes) as
    it is, with no leaves."""
    if value is None or is_size(value):
        return value, []
    tensors = leaves(value)
    made = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    used = [t.clone() if t.requires_grad else t for t in made]
    return (used[0] if isinstance(value, torch.Tensor) else tuple(used)), made


def hand_back(given: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """The first partition's input gradients into the caller's inputs (each micro-batch a slice of them): through
    autograd, so ``.grad`` adds up over micro-batches and steps as an eager backward's does."""
    pairs = [(t, g) for t, g in zip(given, grads) if t.requires_grad and g is not None]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


@dataclass
class _Work:
    """One (partition, micro-batch) between its F and its last backward action."""

    x: list[torch.Tensor] = field(default_factory=list)  # leaves of the carried input
    given: list[torch.Tensor] = field(default_factory=list)  # first partition: the caller's inputs behind x
    popped: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # route -> leaves of the popped skip
    y: Any = None  # the carried output, or the micro-batch's weighted loss on the last partition
    stashed: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # route -> tensors of the stashed skip
    outs: list[torch.Tensor] = field(default_factory=list)  # what W differentiates (split schedules)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    boundary: Later | None = None  # what B left for W (see dist_backward)


class RankRun:
    """One training step (or inference pass) of ``stage``'s partitions over ``micro`` micro-batches.

    Each (partition, micro-batch) forward runs on *leaves*, detached copies of what it reads (the
    previous partition's output, popped skips), so its backward runs on its own whenever the schedule
    says. A value for a partition on another rank is sent (:class:`~seqify.distributed.link.Link`); one for a
    partition on this rank is handed over directly; a skip that holds a size (an int made from shapes, as
    export-converted transformers models carry the batch size) crosses as that value and gets no gradient
    message back (nor does any skip without tensors). B of a split schedule (zero bubble) computes only
    the gradients of its leaves and sends them on at once; W later adds the weights' gradients
    (:mod:`seqify.pipe.split_backward`). Unsplit, B does both in one ``torch.autograd.backward``."""

    def __init__(self, stage: RankStage, link: Link, micro: list[Any], sizes: list[int], loss: Loss | None,
                 stop: int, split: bool) -> None:
        self.s = stage
        self.link = link
        self.micro = micro
        self.sizes = sizes
        self.loss = loss
        self.stop = stop
        self.split = split
        self.grad = torch.is_grad_enabled()
        # the caller's inputs want their gradient: the first partition takes them as leaves and hands theirs back
        self.input_grads = self.grad and any(t.requires_grad for v in micro for t in leaves(v))
        self.work: dict[tuple[int, int], _Work] = {}
        self.local: dict[Key, Any] = {}  # values between two partitions of this rank
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, Any] = {}  # inference: the last partition's output per micro-batch
        self.last = stage.partitions - 1

    # -- moving values ------------------------------------------------------------------------------
    def _put(self, key: Key, value: Any, partition: int) -> None:
        rank = self.s.rank_of_partition(partition)
        if rank == self.s.global_rank:
            self.local[key] = value
        else:
            self.link.send(key, value, rank)

    def _send(self, p: int, i: int, y: Any, stashed: dict[Any, Any], leaves_of: dict[int, list[torch.Tensor]]) -> None:
        """Hand partition ``p``'s outputs for micro-batch ``i`` on: the carried value to ``p + 1``, each
        stashed skip to the partition that pops it (noting their leaves by route in ``leaves_of``, the
        ``stashed`` of the micro-batch's work, for the backward)."""
        if p < self.last:
            self._put((ACTIVATION, p, i), y, p + 1)
        for r in self.s.routes:
            if r.src == p:
                value = stashed[self.s.skip_key(r)]
                self._put((SKIP, r.index, i), value, r.dst)
                leaves_of[r.index] = leaves(value)

    def _get(self, key: Key, partition: int) -> Any:
        rank = self.s.rank_of_partition(partition)
        if rank == self.s.global_rank:
            if key not in self.local:
                raise ScheduleError(f"{self.s.me}: an action of partition {partition} reads a value this rank has "
                                    "not made yet: the schedule runs a step before what it depends on")
            return self.local.pop(key)
        return self.link.recv(key, rank)

    def _take(self, value: Any) -> tuple[Any, list[torch.Tensor]]:
        return _as_leaves(value) if self.grad else (value, [])

    # -- the three kinds of work --------------------------------------------------------------------
    def run(self, actions: list[Action]) -> None:
        """This rank's ``actions`` in order, each through its handler (:meth:`forward`, :meth:`backward`,
        :meth:`weights`; :func:`~seqify.schedule.interpreter.interpret`)."""
        interpret(actions, self, f"{type(self).__name__} ({self.s.me})")

    def forward(self, p: int, i: int) -> None:
        s, w = self.s, _Work()
        if p == 0:
            x = self.micro[i]
            if self.input_grads:
                w.given = leaves(x)
                x, w.x = _as_leaves(x)
        else:
            x, w.x = self._take(self._get((ACTIVATION, p - 1, i), p - 1))
        skips: dict[Any, Any] = {}
        for r in s.routes:
            if r.dst == p:
                skips[s.skip_key(r)], w.popped[r.index] = self._take(self._get((SKIP, r.index, i), r.src))
        runner = s.runners[p]
        if self.grad and i < self.stop:
            y, stashed = checkpointed(runner.fresh, x, skips, norms=s.norms[p])
        else:
            y, stashed = runner(x, skips)
        self._send(p, i, y, stashed, w.stashed)
        if p == self.last:
            if self.loss is None:
                self.outputs[i] = y
                return
            y = self.loss(y, i)
            self.losses.append(y.detach())
        w.y = y
        if self.grad:
            self.work[(p, i)] = w

    def _seed(self, p: int, i: int, w: _Work) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The outputs of (p, i) with the gradients their readers sent back (the loss: the root)."""
        outs: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if p == self.last:
            outs.append(w.y)
            grads.append(None)
        else:
            ys = leaves(w.y)
            outs += ys
            grads += grads_for(ys, self._get((GRAD, p, i), p + 1))
        for r in self.s.routes:
            if r.src == p and w.stashed[r.index]:  # a skip without tensors (a size) gets no gradient back
                outs += w.stashed[r.index]
                grads += grads_for(w.stashed[r.index], self._get((SKIP_GRAD, r.index, i), r.dst))
        keep = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and (g is not None or p == self.last)]
        return [o for o, _ in keep], [g for _, g in keep]

    def backward(self, p: int, i: int) -> None:
        w = self.work[(p, i)]
        outs, grads = self._seed(p, i, w)
        inputs = w.x + [t for r in self.s.routes if r.dst == p for t in w.popped[r.index]]
        wanted = [t for t in inputs if t.requires_grad]
        got: dict[int, torch.Tensor | None] = {}
        if not self.split:
            if outs:
                torch.autograd.backward(outs, grads)
            got = {id(t): t.grad for t in wanted}
            del self.work[(p, i)]
        else:
            if outs and wanted:
                found, now, w.boundary = input_grads(outs, grads, wanted, self.s.params[p])
                accumulate(self.s.params[p], now)  # the normalisations' weights: B yields their gradients
                got = {id(t): g for t, g in zip(wanted, found)}
            w.outs, w.grads = outs, grads
        if p > 0:
            self._put((GRAD, p - 1, i), like_grads(w.x, [got.get(id(t)) for t in w.x]), p - 1)
        elif w.given:
            hand_back(w.given, [got.get(id(t)) for t in w.x])
        for r in self.s.routes:
            if r.dst == p and w.popped[r.index]:
                popped = w.popped[r.index]
                self._put((SKIP_GRAD, r.index, i), like_grads(popped, [got.get(id(t)) for t in popped]), r.src)

    def _split_only(self) -> None:
        if not self.split:
            raise ScheduleError(f"{self.s.me}: a W action in a schedule whose backward is not split; build the "
                                "Schedule with split=True or drop its W actions")

    def weights(self, p: int, i: int) -> None:
        """W of a split schedule: the weights' gradients of (p, i), from the gradients B kept."""
        self._split_only()
        w = self.work.pop((p, i))
        if w.outs:
            weight_grads(w.outs, w.grads, self.s.params[p], w.boundary)
