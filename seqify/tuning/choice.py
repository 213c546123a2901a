"""The tuner's choice among candidates: which to time, the memory bounds a timed one is held to, and ties."""

from __future__ import annotations

from typing import Any

from seqify.pipe.config import Trial
from seqify.schedule.actions import SCHEDULES

__all__ = ["BAND", "TIE", "RUNOFF", "RUNOFF_MOST", "RESERVED_TIE", "to_time", "lighter", "steady", "lean",
           "reserved_with_state", "bound_to_ddp", "like_ddp", "contenders"]


#: How far over the best prediction each other schedule's best candidate is still timed (with ``top >= 2``):
#: on GPUs the predictions err by more than schedules differ (docs/design/cost-model.md, "What is timed").
BAND = 0.05


def to_time(fits: list[Trial], top: int, gpus: int = 0) -> list[Trial]:
    """The candidates to time: the ``top`` best predicted (``fits`` is sorted), and with ``top >= 2`` also the
    best of the other kind (eager or replayed) when none of them is: the two kinds are predicted from different
    costs (the host's issue time against the GPU's work), and an error in one must not keep the other untimed.
    Then the best of each layout (stages x replicas) not yet among them; over ``gpus`` GPUs, data parallelism as
    DDP runs it (:func:`like_ddp`; else the best eager one): what DDP holds, the memory bound of every layout,
    see :func:`bound_to_ddp`; and the best of each schedule not yet among them predicted within :data:`BAND` of the
    best."""
    best = fits[:top]
    if top < 2:
        return best
    if len({t.graphs for t in best}) == 1:
        other = next((t for t in fits[top:] if t.graphs != best[0].graphs), None)
        best += [other] if other is not None else []
    for r in dict.fromkeys(t.replicas for t in fits):  # the best of each layout (stages x replicas)
        first = next(t for t in fits if t.replicas == r)
        if not any(first is u for u in best):
            best.append(first)
    ddp = next((t for t in fits if like_ddp(t, gpus)), None) or next(
        (t for t in fits if t.replicas == gpus > 1 and not t.graphs), None)
    if ddp is not None and not any(ddp is u for u in best):
        best.append(ddp)
    schedules = {t.schedule for t in best}
    for t in fits[top:]:
        if t.predicted_s > fits[0].predicted_s * (1 + BAND):
            break
        if t.schedule not in schedules and not any(t is u for u in best):
            best.append(t)
            schedules.add(t.schedule)
    return best


def lighter(fits: list[Trial], timed: list[Trial], than: Trial) -> list[Trial]:
    """The candidates not yet timed that are predicted to hold less on their fullest device than ``than`` (fewer
    micro-batches in flight: 1F1B where GPipe keeps every one): the best predicted of each kind first (options
    but the balance: another cut of one layout holds about as much), then the rest, best predicted first."""
    def fullest(t: Trial) -> int:
        return max(t.memory_per_device, default=t.memory_bytes)

    found = [t for t in fits if not any(t is u for u in timed) and fullest(t) < fullest(than)]
    kinds: dict[tuple[Any, ...], Trial] = {}
    for t in found:
        kinds.setdefault(_kind(t), t)
    first = list(kinds.values())
    return first + [t for t in found if not any(t is u for u in first)]


def _kind(t: Trial) -> tuple[Any, ...]:
    """``t``'s options but its balance."""
    return (t.replicas, t.schedule or "gpipe", t.chunks, t.loops, t.checkpoint, t.graphs, t.overlap)


#: Timed GPU candidates within this fraction of the fastest are timed once more before one is chosen: a step
#: timed twice moves by a few percent, and an eager step, whose host issues every kernel, by more than a replay
#: (on two H200s an eager ResNet-101 data-parallel step timed 5% under a replayed 1F1B one and trained 8% over).
RUNOFF = 0.08


#: The most candidates timed again before the choice (see :data:`RUNOFF`).
RUNOFF_MOST = 3


def contenders(pool: list[Trial]) -> list[Trial]:
    """The timed candidates of ``pool`` within :data:`RUNOFF` of its fastest, fastest first, at most
    :data:`RUNOFF_MOST`."""
    timed = sorted((t for t in pool if t.measured_s is not None), key=lambda t: t.measured_s or 0.0)
    if not timed:
        return []
    fastest = timed[0].measured_s or 0.0
    return [t for t in timed if (t.measured_s or 0.0) <= fastest * (1 + RUNOFF)][:RUNOFF_MOST]


#: Timed candidates within this fraction of the fastest measured step are taken as equally fast: timing one
#: configuration again moves it by about as much (GPU clocks, the host).
TIE = 0.02


def steady(confirmed: list[Trial]) -> Trial:
    """The fastest timed candidate, or, among those within :data:`TIE` of it, the first in a fixed order of
    their options (:func:`_preference`): a choice between ties that timing noise would make differently run
    after run is made the same way every time."""
    fastest = min(t.measured_s or 0.0 for t in confirmed)
    ties = [t for t in confirmed if (t.measured_s or 0.0) <= fastest * (1 + TIE)]
    return min(ties, key=_preference)


def _preference(t: Trial) -> tuple[Any, ...]:
    """Simpler first: more replicas (fewer stages), graphs, no checkpointing, fewer micro-batches and loops, the
    schedule's place in SCHEDULES, one lane; then the balance, so that no two distinct options tie."""
    schedules, recomputed = list(SCHEDULES), ["never", "except_last", "always"]
    schedule = t.schedule or "gpipe"
    return (-t.replicas, not t.graphs,
            recomputed.index(t.checkpoint) if t.checkpoint in recomputed else len(recomputed), t.chunks, t.loops,
            schedules.index(schedule) if schedule in schedules else len(schedules), t.overlap, t.by, t.balance)


def lean(confirmed: list[Trial], allocated: int | None, reserved: int | None) -> list[Trial]:
    """The confirmed candidates whose timed steps allocated at most ``allocated`` and reserved at most
    ``reserved`` bytes on every device (the model training on one device; the allocated bound also the
    user's memory cap), each with the optimizer state the candidate will hold (:meth:`Trial.held`): a pipeline
    that holds more on some GPU than one GPU training the whole model is no gain (people pipeline because a
    model does not fit). A bound that is ``None``, or a candidate not measured (the CPU), passes."""
    def within(peaks: tuple[int, ...], bound: int | None) -> bool:
        return bound is None or not peaks or max(peaks) <= bound

    return [t for t in confirmed if within(t.held(), allocated) and within(reserved_with_state(t), reserved)]


def reserved_with_state(t: Trial) -> tuple[int, ...]:
    """The timed step's reserved peak per CUDA device plus the optimizer state it will hold there."""
    extra = t.optimizer_bytes or (0,) * len(t.measured_reserved)
    return tuple(r + o for r, o in zip(t.measured_reserved, extra))


#: A layout reserving up to this fraction more than data parallelism reserved is taken as reserving as much: the
#: caching allocator's fragmentation moves a step's reserved peak from run to run (two H200 runs of DenseNet-121's
#: eager replicas reserved 9.4 and 11.0 GiB per GPU; its graphed replicas were then left out for 0.03 GiB).
#: Allocated peaks are held to data parallelism's exactly.
RESERVED_TIE = 0.02


def bound_to_ddp(confirmed: list[Trial], bound: tuple[int | None, int | None], gpus: int
                 ) -> tuple[int | None, int | None]:
    """``bound`` lowered to what plain data parallelism held per GPU where it was timed: a layout is chosen over
    it only at no more memory per GPU (a user's other choice, at that memory; its reserved peak within
    :data:`RESERVED_TIE`). The reference is data parallelism as DDP runs it (:func:`like_ddp`), which holds
    what DDP holds; failing that, other eager data parallelism;
    replayed graphs keep a step's activations in pools of their own, so a graphed one holds more and is the
    reference only where no eager one was timed."""
    plain = [t for t in confirmed if t.replicas == gpus > 1 and t.measured_peak]
    if not plain:
        return bound
    held = min([t for t in plain if like_ddp(t, gpus)] or [t for t in plain if not t.graphs] or plain,
               key=lambda t: t.measured_s or 0.0)

    def lower(a: int | None, b: int) -> int:
        return b if a is None else min(a, b)

    return lower(bound[0], max(held.held())), lower(bound[1], int(max(reserved_with_state(held)) * (1 + RESERVED_TIE)))


def like_ddp(t: Trial, gpus: int) -> bool:
    """Whether ``t`` runs as DDP does: one whole replica per GPU, each step eager, nothing recomputed, the share
    in one micro-batch (the memory every layout is held to)."""
    return t.replicas == gpus > 1 and not t.graphs and t.checkpoint == "never" and t.chunks == 1
