"""Eager executor: runs partitions on micro-batches with autograd, in a schedule's order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import BoundaryError
from seqify.pipe.batchnorm import DeferredBatchNorm
from seqify.pipe.microbatch import is_tensors
from seqify.pipe.recompute import checkpointed
from seqify.pipe.stage import Stage
from seqify.pipe.transfer import Transfer
from seqify.schedule.actions import clock_cycles
from seqify.skip.namespace import SkipKey

__all__ = ["Eager", "checkpoint_stop"]

Observer = Callable[[str, str, int, int, int], None]


class Eager:
    """Runs each (partition, micro-batch) forward as autograd ops: values cross devices through
    ``transfer``, skips go from the partition that stashes them to the one that pops them, and the
    first ``stop`` micro-batches are checkpointed (recomputed in backward)."""

    def __init__(self, stages: Sequence[Stage], transfer: Transfer, skip_partitions: dict[SkipKey, tuple[int, int]],
                 norms: Sequence[Sequence[nn.modules.batchnorm._NormBase]],
                 deferred: Sequence[DeferredBatchNorm]) -> None:
        self.stages = stages
        self.transfer = transfer
        self.skip_partitions = skip_partitions
        self.norms = norms
        self.deferred = deferred

    def forward(self, values: list[Any], stop: int, observe: Observer | None = None) -> list[Any]:
        """Every micro-batch through every partition (GPipe's clock cycles); returns the last
        partition's outputs, one per micro-batch."""
        m, n = len(values), len(self.stages)
        for bn in self.deferred:
            bn.chunks = m
            bn._reset_tracking()
        pending: list[dict[SkipKey, tuple[Any, Any]]] = [{} for _ in range(m)]  # skip -> (value, ready)
        ready: list[Any] = [None] * m  # when micro-batch i's carried value is ready to copy
        try:
            for cycle in clock_cycles(m, n):
                for i, j in cycle:
                    values[i], ready[i] = self.run(j, i, values[i], ready[i], pending[i], i < stop, observe)
        except BaseException:
            for bn in self.deferred:
                bn._reset_tracking()
            raise
        left = [k[1] for p in pending for k in p]
        if left:
            raise BoundaryError(f"skips {sorted(set(left))} were stashed but no later partition popped them")
        return values

    def run(self, j: int, i: int, x: Any, ready: Any, pending: dict[SkipKey, tuple[Any, Any]], checkpoint: bool,
            observe: Observer | None = None) -> tuple[Any, Any]:
        """Partition ``j`` on micro-batch ``i``: its input ``x`` (made ready at event ``ready``) and the
        skips it pops from ``pending``; returns its output and when that output is ready, and leaves the
        skips it stashes in ``pending``."""
        stage = self.stages[j]
        transfer = self.transfer
        memo: dict[int, Any] | None = {} if stage.pops or type(x) is tuple else None
        if j > 0:
            if not is_tensors(x):
                prev = self.stages[j - 1]
                raise BoundaryError(
                    f"layer {prev.names[-1]!r}, the last of partition {j - 1}, returns "
                    f"{type(x).__name__}; only a tensor or a tuple of tensors can cross to partition {j}. "
                    "Move the cut (balance) so this value stays inside one partition, or convert with "
                    "example_inputs so seqify knows which values are tensors."
                )
            x = transfer(x, stage.device, ready, memo)
            if observe is not None:
                observe("carry", "", j - 1, j, i)
        skips = {}
        for key in stage.pops:
            value, when = pending.pop(key)
            skips[key] = transfer(value, stage.device, when, memo)
            if observe is not None:
                observe("skip", key[1], self.skip_partitions[key][0], j, i)
        if checkpoint and _changes_held_value(stage, x, skips, pending):
            checkpoint = False  # exactness over memory: recomputing would need a copy the later reader misses
        if checkpoint:
            y, out = checkpointed(stage.fresh, x, skips, norms=self.norms[j])
        else:
            y, out = stage(x, skips)
        done = transfer.mark(stage.device)
        for key, value in out.items():
            pending[key] = (value, done)
        return y, done


def _storages(values: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)}


def _changes_held_value(
    stage: Stage, x: Any, skips: dict[SkipKey, Any], pending: dict[SkipKey, tuple[Any, Any]]
) -> bool:
    """Whether ``stage`` changes in place an input that a skip still waiting for a later partition holds
    too. A checkpointed stage runs on copies of the inputs it changes (recomputation needs the originals),
    so that later reader would not see the change the source makes: such a step runs uncheckpointed."""
    if not (stage.mutates_input or stage.mutated_skips) or not pending:
        return False
    changed = _storages(x) if stage.mutates_input else set()
    changed |= _storages([skips[k] for k in stage.mutated_skips if k in skips])
    return bool(changed & _storages([value for value, _ in pending.values()]))


def checkpoint_stop(checkpoint: str, micro_batches: int) -> int:
    """How many leading micro-batches ``checkpoint`` recomputes (none without gradients)."""
    if not torch.is_grad_enabled():
        return 0
    return {"always": micro_batches, "except_last": micro_batches - 1, "never": 0}[checkpoint]
