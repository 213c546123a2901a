"""Scheduled step: one training step (forward, loss, backward) run action by action from a Schedule, with autograd.

Each (partition, micro-batch) forward runs on *leaves*: detached copies of what it receives (carried
values and popped skips), so its backward can run on its own, whenever the schedule says::

    partition p-1            partition p                         partition p+1
    F: x -> y  --(detach)--> leaf -> F: ... -> y'  --(detach)--> leaf -> ...
    B: y.backward(g)  <--  leaf.grad  <--  B: y'.backward(g')  <--  leaf.grad  <--  ...

B of (p, m) differentiates p's outputs with the gradients its consumers' leaves received. Unsplit, B
is one ``torch.autograd.backward`` (inputs and weights). Split (zero-bubble), B computes only the
inputs' gradients (``torch.autograd.grad(..., retain_graph=True)``) and W then adds the weights'
gradients (``torch.autograd.backward(..., inputs=weights)``), both exact. The last partition's forward
also computes the micro-batch's loss, weighed so the micro-batch losses add up to one device's loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from seqify.errors import BoundaryError, ScheduleError
from seqify.pipe.batchnorm import DeferredBatchNorm
from seqify.pipe.microbatch import is_tensors
from seqify.pipe.recompute import checkpointed
from seqify.pipe.stage import Stage
from seqify.pipe.transfer import Transfer
from seqify.schedule.actions import Schedule
from seqify.schedule.interpreter import interpret
from seqify.skip.namespace import SkipKey

__all__ = ["ScheduledStep"]

#: micro-batch i's output -> its loss, already weighed (seqify.pipe.losses.Weigher)
Loss = Callable[[Any, int], torch.Tensor]


@dataclass
class _Work:
    """One (partition, micro-batch): the leaves it read, the outputs it made, and for each output
    tensor the gradient its consumers sent back (summed)."""

    leaves: list[tuple[torch.Tensor, tuple[int, int, int]]] = field(default_factory=list)  # (leaf, source)
    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # id(output) -> gradient
    loss: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None  # on CUDA: when the forward's outputs are made, to copy them from


class _Run:
    """One step's state, and its handlers of F, B and W actions (:func:`~seqify.schedule.interpreter.interpret`)."""

    def __init__(self, step: ScheduledStep, split: bool, batches: list[Any], loss_of: Loss, stop: int) -> None:
        n, m = len(step.stages), len(batches)
        self.step, self.split, self.loss_of, self.stop, self.last = step, split, loss_of, stop, n - 1
        self.work = [[_Work() for _ in range(m)] for _ in range(n)]
        self.carried: list[Any] = list(batches)  # micro-batch i's value entering its next partition
        self.pending: list[dict[SkipKey, tuple[int, Any]]] = [{} for _ in range(m)]  # skip -> (partition, value)
        self.total: torch.Tensor | None = None

    def forward(self, j: int, i: int) -> None:
        self.carried[i] = self.step._forward(j, i, self.carried[i], self.pending[i], self.work, i < self.stop)
        if j == self.last:
            w = self.work[j][i]
            w.loss = self.loss_of(self.carried[i], i)
            w.outputs = [w.loss]
            loss = w.loss.detach()
            self.total = loss if self.total is None else self.total + loss.to(self.total.device)

    def backward(self, j: int, i: int) -> None:
        self.step._backward(j, self.work[j][i], self.work, self.split)

    def weights(self, j: int, i: int) -> None:
        self.step._weights(j, self.work[j][i])


class ScheduledStep:
    """Runs one training step of ``stages`` in the order of a :class:`Schedule`."""

    def __init__(self, stages: Sequence[Stage], transfer: Transfer,
                 norms: Sequence[Sequence[nn.modules.batchnorm._NormBase]],
                 deferred: Sequence[DeferredBatchNorm]) -> None:
        self.stages = stages
        self.transfer = transfer
        self.norms = norms
        self.deferred = deferred
        # A value is copied to its consumer once the forward that made it is done (not once everything queued
        # on its device so far is: in 1F1B or interleaved order that holds later micro-batches' forwards, and
        # the devices took turns). Where a stage changes an input or a popped skip in place, a skip may still
        # be changed after its maker is done, so skips then wait for everything queued, as in the source order.
        self.skips_ready = not any(st.mutates_input or st.mutated_skips for st in stages)

    def __call__(self, schedule: Schedule, batches: list[Any], loss_of: Loss, stop: int) -> torch.Tensor:
        """Every action of ``schedule`` on these micro-batches, ``loss_of(output, i)`` on each last output;
        returns the detached loss. Micro-batches below ``stop`` are checkpointed (recomputed in their backward)."""
        n, m = len(self.stages), len(batches)
        if schedule.partitions != n or schedule.microbatches != m:
            raise ScheduleError(
                f"schedule {schedule.name!r} is for {schedule.partitions} partitions and {schedule.microbatches} "
                f"micro-batches, but this step has {n} and {m}; build it for this pipeline"
            )
        for bn in self.deferred:
            bn.chunks = m
            bn._reset_tracking()
        run = _Run(self, schedule.split, batches, loss_of, stop)
        try:
            interpret(schedule.actions, run, "ScheduledStep")
        except BaseException:
            for bn in self.deferred:
                bn._reset_tracking()
            raise
        assert run.total is not None
        return run.total

    # -- the three kinds of work --------------------------------------------------------------------
    def _leaf(self, t: Any, device: torch.device, source: tuple[int, int, int], w: _Work,
              made: dict[int, torch.Tensor], ready: torch.cuda.Event | None) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        leaf = made.get(id(t))
        if leaf is None:
            leaf = self.transfer(t.detach(), device, ready).requires_grad_(t.requires_grad)
            made[id(t)] = leaf
            if t.requires_grad:
                w.leaves.append((leaf, source))
        return leaf

    def _forward(self, j: int, i: int, x: Any, pending: dict[SkipKey, tuple[int, Any]], work: list[list[_Work]],
                 checkpoint: bool) -> Any:
        stage = self.stages[j]
        w = work[j][i]
        made: dict[int, torch.Tensor] = {}
        if j > 0:
            if not is_tensors(x):
                raise BoundaryError(
                    f"layer {self.stages[j - 1].names[-1]!r}, the last of partition {j - 1}, returns "
                    f"{type(x).__name__}; only a tensor or a tuple of tensors can cross to partition {j}. Move the "
                    "cut (balance) so this value stays inside one partition."
                )
            ready = work[j - 1][i].ready
            x = (self._leaf(x, stage.device, (j - 1, i, id(x)), w, made, ready) if isinstance(x, torch.Tensor)
                 else tuple(self._leaf(t, stage.device, (j - 1, i, id(t)), w, made, ready) for t in x))
        skips = {}
        for key in stage.pops:
            src, value = pending.pop(key)
            ready = work[src][i].ready if self.skips_ready else None
            skips[key] = self._leaf(value, stage.device, (src, i, id(value)), w, made, ready)
        if checkpoint:
            y, out = checkpointed(stage.fresh, x, skips, norms=self.norms[j])
        else:
            y, out = stage.fresh(x, skips) if j > 0 else stage(x, skips)
        w.ready = self.transfer.mark(stage.device)
        for key, value in out.items():
            pending[key] = (j, value)
        outs = [y] if isinstance(y, torch.Tensor) else [t for t in y if isinstance(t, torch.Tensor)]
        outs += [v for v in out.values() if isinstance(v, torch.Tensor)]
        distinct = {id(t): t for t in outs}  # one entry per tensor, however many slots carry it
        w.outputs = [t for t in distinct.values() if t.requires_grad]
        return y

    def _seed(self, w: _Work) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The outputs a gradient reached, with their gradients (the loss: none, it is the root)."""
        if w.loss is not None:
            return [w.loss], [None]
        pairs = [(o, w.grads[id(o)]) for o in w.outputs if id(o) in w.grads]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _send(self, w: _Work, grads: Sequence[torch.Tensor | None], work: list[list[_Work]]) -> None:
        """Hand each leaf's gradient to the output it was made from (summed over consumers)."""
        for (_leaf, (p, i, tid)), g in zip(w.leaves, grads):
            if g is None:
                continue
            source = work[p][i]
            device = self.stages[p].device
            g = self.transfer(g, device)
            source.grads[tid] = source.grads[tid] + g if tid in source.grads else g

    def _backward(self, j: int, w: _Work, work: list[list[_Work]], split: bool) -> None:
        outs, grads = self._seed(w)
        if not outs:
            return
        if not split:
            torch.autograd.backward(outs, grads)
            self._send(w, [leaf.grad for leaf, _ in w.leaves], work)
            self._release(w)
            return
        if w.leaves:
            got = torch.autograd.grad(outs, [leaf for leaf, _ in w.leaves], grads, retain_graph=True,
                                      allow_unused=True)
            self._send(w, got, work)

    def _weights(self, j: int, w: _Work) -> None:
        outs, grads = self._seed(w)
        if outs:
            params = [p for p in self.stages[j].layers.parameters() if p.requires_grad]
            if j == 0:  # the pipeline's own inputs may want gradients too, as on one device
                torch.autograd.backward(outs, grads)
            elif params:
                torch.autograd.backward(outs, grads, inputs=params)
        self._release(w)

    @staticmethod
    def _release(w: _Work) -> None:
        w.outputs, w.grads, w.leaves, w.loss = [], {}, [], None
