"""Options of the replaying executors: what tests and benchmarks switch, passed to the objects that use them.

Defaults are the executors' normal behaviour; the other settings exist to measure or check what a default
buys (each computes the same values).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplayOptions"]


@dataclass(frozen=True)
class ReplayOptions:
    """``share_buffers``: micro-batches share boundary buffers where the schedule lets them
    (:mod:`.buffers`); False gives every micro-batch its own (for measuring what sharing saves).
    ``cast_once``: under autocast, a partition's weights read only through autocast's cast are cast once
    per step (:mod:`.casts`); False lets every program cast its own (for comparing the two).
    ``fuse_grads``: the backward writes those cast linear weights' gradients into their float32 sums itself
    (:mod:`.fused_grads`: on CUDA a float32 product, not a rounded low-precision one widened after); False
    returns them for the sums as other gradients are (for comparing the two).
    ``expandable_pools``: CUDA graphs are captured into expandable segments, so their memory pools hold
    little more than their most bytes alive at once (:mod:`.pool_segments`); False keeps the allocator's
    fixed-size segments (for measuring what the pools' fragmentation costs)."""

    share_buffers: bool = True
    cast_once: bool = True
    fuse_grads: bool = True
    expandable_pools: bool = True
