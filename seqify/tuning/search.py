"""The tuner's search: predict every candidate, time the best few, keep the fastest within the memory bounds
(which, and how, in :mod:`~seqify.tuning.choice`)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import MemoryCapError, MicroBatchError, ScheduleError, SeqifyError, TuneError
from seqify.partition.cost import LayerCosts
from seqify.pipe import tied
from seqify.pipe.assemble import build
from seqify.pipe.config import PipeConfig, Trial
from seqify.pipe.pipeline import CHECKPOINT, resolve_devices
from seqify.pipe.replicated import replicated
from seqify.progress import progress
from seqify.schedule.actions import SCHEDULES, SPLIT
from seqify.tuning import cache as tune_cache
from seqify.tuning import measure, memory_bounds, profile, space
from seqify.tuning.choice import bound_to_ddp, contenders, lean, lighter, steady, to_time
from seqify.tuning.memory_bounds import OptimizerSpec
from seqify.tuning.predict import Calibration, Candidate, LayerModel, Prediction, predict, schedule_of

__all__ = ["tune", "options", "build_trial"]

log = logging.getLogger("seqify.tuning")


@dataclass(frozen=True)
class _Costs:
    """What the tuner measured of the model: the executor's overheads, the layer model, the full batch's layer
    costs, and the bounds a timed candidate's peak bytes are held to (allocated, reserved; ``None``: none)."""

    cal: Calibration
    layers: LayerModel
    hi: LayerCosts
    bound: tuple[int | None, int | None]
    #: the optimizer's bytes at its step's peak (state and temporaries) per parameter byte, and each layer's
    #: trainable parameter bytes
    optimizer_ratio: float = 0.0
    trainable: tuple[int, ...] = ()


def tune(
    model: nn.Module,
    sample: Any,
    *,
    gpus: int | None = None,
    devices: Sequence[Any] | None = None,
    memory_cap: float | None = None,
    chunks: int | None = None,
    loops: int | None = None,
    balance: Sequence[int] | str | None = None,
    checkpoint: str | None = None,
    graphs: bool | None = None,
    schedule: str | None = None,
    overlap: bool | None = None,
    replicas: int | None = None,
    optimizer: OptimizerSpec = None,
    top: int = 3,
    steps: int = 2,
    warm: int = 1,
    cache: bool = True,
    show: bool = True,
    example_inputs: Any = None,
    **convert_options: Any,
) -> PipeConfig:
    """The fastest pipeline configuration of ``model`` for mini-batches like ``sample`` on these devices.

    Args:
        model: a seqify.Sequential or nn.Sequential, or any module (converted first, with
            ``example_inputs`` and ``convert_options``). It is left as it was (devices, values, gradients).
        sample: a training mini-batch, as you pass it to the model.
        gpus / devices: as for :func:`seqify.pipeline`: ``gpus=N`` or one device per pipeline stage
            (``devices=['cpu', 'cpu']`` pipelines on the CPU).
        memory_cap: bytes a device may hold (parameters, gradients and the activations the schedule
            keeps in flight, predicted; optimizer state not counted): candidates predicted over it are
            rejected, and :class:`MemoryCapError` names the smallest cap that works when none fits.
            On GPUs the timed candidates' allocated peaks are read too: one that held more than the cap
            on some device, or (cap or not) more than the model training on one device (allocated against
            allocated, reserved against reserved; a batch one device cannot take whole counts as the fewest
            accumulated micro-batches that fit), is chosen only when none of the timed ones stays under
            (the next best predicted are timed first).
        chunks, loops, balance, checkpoint, graphs, schedule: fix that choice (``balance``: a strategy
            or a list of layer counts; ``schedule``: one of 'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-h2');
            ``None`` searches it. Schedules other than GPipe are timed, and later run, by ``pipe.step``.
        overlap: two streams per GPU for ``pipe.step``'s graphs (see :func:`seqify.pipeline`). ``None``:
            the fastest timed candidate with graphs and a schedule other than GPipe is timed once more with
            it, and kept that way where it ran faster within the same memory bounds (its time is not
            predicted; its memory is, one micro-batch more in flight); ``True``: every candidate has it
            (graphs only); ``False``: none.
        replicas: data-parallel copies of the pipeline (see :func:`seqify.pipeline`); ``None``: each number
            that divides the GPUs is a layout (``stages x replicas``: every GPU one pipeline, plain data
            parallelism, and those between), predicted with the reduction of its gradients, and the best of
            each layout is timed (with ``top >= 2``). On CPU devices, one pipeline unless fixed. A
            layout whose timed steps held more on some GPU than data parallelism as DDP runs it (one eager
            replica per GPU, one micro-batch, nothing recomputed; timed beside the others as the reference,
            :func:`~seqify.tuning.choice.like_ddp`) is chosen only where no other stays under it; where the
            fastest does, the best predicted to hold less are timed too (a replica's share as several
            micro-batches in 1F1B order holds fewer activations).
        optimizer: the optimizer training will use: its class (``torch.optim.AdamW``), a function that builds
            it from parameters (``functools.partial(torch.optim.AdamW, lr=3e-4)``), or the bytes of state it
            keeps per parameter byte (``2.0`` for Adam). Its state (probed on one small parameter: Adam's two
            moments) is added to each candidate's predicted and timed peaks on the GPUs that will hold it
            (with replicas, the first replica's: the optimizer steps ``pipe.parameters()``), so the bounds
            above compare what training will hold; a timed candidate whose peak plus that state fills more
            than :data:`~seqify.tuning.ROOM` (95%) of a GPU is never chosen, and :class:`MemoryCapError` says so
            when none is left. ``None``: no state counted (SGD without momentum keeps none).
        top: how many of the best predicted candidates to confirm with timed steps (0: trust the
            prediction; from 2, the best eager or replayed candidate is timed too where the ``top`` are
            all of the other kind, and the best of each other schedule predicted within ``BAND`` (5%) of
            the best);
            ``steps`` timed steps each after ``warm`` untimed ones. On GPUs, with ``top >= 2``, the timed
            candidates within the memory bounds and within :data:`~seqify.tuning.RUNOFF` (8%) of the fastest are
            built and timed once more with twice the steps before one is chosen (their times the mean of both).
        cache: read and write the on-disk cache (:func:`cache_path`).
        show: progress bars on stderr (on a terminal, or with ``SEQIFY_PROGRESS=1``).

    Returns:
        A :class:`PipeConfig`: ``seqify.pipeline(model, config=cfg)`` builds it; ``print(cfg)`` shows the
        candidates with predicted and measured milliseconds per step.
    """
    if sample is None:
        raise TuneError("seqify.tune needs sample=... (a training mini-batch) to measure the model; or pass "
                        "chunks=N and balance= to seqify.pipeline to choose by hand")
    if not isinstance(model, nn.Sequential):
        from seqify.convert import convert

        model = convert(model, example_inputs, **convert_options)
    placed = resolve_devices(gpus, devices, None if gpus is not None or devices is not None else 1)
    _check(schedule=schedule, checkpoint=checkpoint, memory_cap=memory_cap, overlap=overlap, graphs=graphs)
    ratio = memory_bounds.optimizer_ratio(optimizer)
    fixed = dict(chunks=chunks, loops=loops, balance=list(balance) if isinstance(balance, (list, tuple)) else balance,
                 checkpoint=checkpoint, graphs=True if overlap else graphs, schedule=schedule, memory_cap=memory_cap,
                 top=top, overlap=overlap, replicas=replicas)
    if ratio:  # a choice for training with this much optimizer state (no key change for the stateless)
        fixed["optimizer"] = ratio
    key = tune_cache.key(model, sample, placed, fixed)
    hit = _cached(key, len(model)) if cache else None
    if hit is not None:
        log.info("tune: cache hit (key %s in %s): %s", key, tune_cache.cache_path(), hit.without_trials())
        return hit
    if cache:
        log.info("tune: cache miss (key %s in %s): measuring", key, tune_cache.cache_path())
    batch = measure.batch_size(sample)
    # every candidate, and the one-device anchor, is timed from the batch on the first device: a batch left
    # elsewhere would add its copy to the candidates' times and to no prediction
    sample = pytree.tree_map(lambda t: t.to(placed[0]) if isinstance(t, torch.Tensor) else t, sample)
    with measure.kept(model):
        costs = _measured(model, sample, placed, fixed, batch, steps=steps, warm=warm, show=show)
        fits = _predicted(model, sample, placed, fixed, costs, batch)
        confirmed, timed = _time_best(model, sample, placed, fits, costs.bound, top=top, steps=steps, warm=warm,
                                      show=show)
        if ratio:
            confirmed = memory_bounds.with_room(confirmed, placed)
        plain = bound_to_ddp(confirmed, costs.bound, len(placed))
        lightest = lean(confirmed, *plain) or lean(confirmed, *costs.bound) or confirmed
        if top >= 2:
            lightest = _runoff(model, sample, placed, lightest, confirmed, steps=steps, warm=warm, show=show)
        best = steady(lightest) if confirmed else fits[0]
        if overlap is None and best.measured_s is not None and best.graphs and (best.schedule or "gpipe") != "gpipe":
            best = _with_overlap(model, sample, placed, best, costs, batch, confirmed, timed, memory_cap=memory_cap,
                                 steps=steps, warm=warm, show=show)
    measure.release(placed)  # the timed candidates' graphs and pools, before the chosen pipeline is built
    cfg = _config(best, confirmed, fits, timed, placed, batch, key)
    log.info("tune: chose %s (of %d candidates that fit, %d timed)", cfg.without_trials(), len(fits), len(confirmed))
    if cache:
        tune_cache.write(key, cfg)
        log.debug("tune: cached under key %s in %s", key, tune_cache.cache_path())
    return cfg


def _check(*, schedule: str | None, checkpoint: str | None, memory_cap: float | None, overlap: bool | None,
           graphs: bool | None) -> None:
    """Refuse fixed options that name no choice, before anything is measured."""
    if schedule is not None and schedule not in SCHEDULES:
        raise TuneError(f"schedule={schedule!r}: choose one of {SCHEDULES}, or None to let the tuner choose")
    if checkpoint is not None and checkpoint not in CHECKPOINT:
        raise TuneError(f"checkpoint={checkpoint!r}: choose one of {CHECKPOINT}, or None to let the tuner choose")
    if memory_cap is not None and not memory_cap > 0:
        raise TuneError(f"memory_cap={memory_cap!r}: give the bytes one device may hold (> 0), or None for no cap")
    if overlap and graphs is False:
        raise TuneError("overlap=True runs captured graphs on two streams per GPU: it needs graphs (pass graphs=None "
                        "or True)")


def _cached(key: str, layers: int) -> PipeConfig | None:
    """The cached choice for ``key``, if it is one this version reads and balances ``layers`` layers."""
    hit = tune_cache.read().get(key)
    if hit is None:
        return None
    try:
        cfg = PipeConfig.from_dict(hit)
        return cfg if sum(cfg.balance) == layers else None
    except (SeqifyError, TypeError, KeyError):
        log.info("tune: the cached entry under key %s is one this version cannot read; measuring again", key)
        return None


def _measured(model: nn.Sequential, sample: Any, placed: list[torch.device], fixed: dict[str, Any], batch: int, *,
              steps: int, warm: int, show: bool) -> _Costs:
    """Calibrate the executor, profile every layer at each micro-batch size a candidate runs, anchor the layer
    times to the model's measured step on one device (whose peak bytes bound the timed candidates, with the
    memory cap), and on a GPU measure how a replayed backward splits on the model itself."""
    schedule, memory_cap = fixed["schedule"], fixed["memory_cap"]
    splits = schedule is None or schedule in SPLIT  # some candidate splits its backward (zero bubble)
    own_split = splits and placed[0].type == "cuda"  # the captured split, measured on the model below
    cal = measure.calibrate(placed, split=splits and not isinstance(sample, dict), replayed=not own_split)
    counts = [fixed["chunks"]] if fixed["chunks"] else [c for c in space.CHUNKS if c <= batch]
    lo = max(2 if batch >= 2 else 1, batch // max(counts))
    shares = [-(-batch // r) for r in space.replica_counts(placed, batch, fixed)]  # each layout's replica batch
    micro = sorted({b // c for b in shares for c in counts if b // c >= lo})  # the candidates' micro-batch sizes
    layers, hi = profile.layer_model(model, sample, placed[0], lo=lo, sizes=micro, show=show)
    layers, alone = profile.anchor(model, sample, placed[0], layers, cal, batch, steps=steps, warm=warm)
    # no timed candidate may hold more on some GPU than the model training on one (or than the cap)
    ratio = fixed.get("optimizer", 0.0)
    trainable = tuple(memory_bounds.trainable_bytes(model)) if ratio else ()
    state = int(ratio * sum(trainable))  # what one device training the whole model adds for the optimizer
    limits = [b for b in (alone[0] + state if alone else None, memory_cap) if b is not None]
    bound = (int(min(limits)) if limits else None, alone[1] + state if alone else None)
    if own_split:  # a replayed split, as this model splits; where it cannot be measured, as a chain does
        own = measure.model_split(model, sample, placed[0])
        if own is None and not isinstance(sample, dict):
            own = measure.chain_split(placed[0])
        cal = replace(cal, split_replayed=own) if own is not None else cal
    return _Costs(cal, layers, hi, bound, ratio, trainable)


def _predicted(model: nn.Sequential, sample: Any, placed: list[torch.device], fixed: dict[str, Any], costs: _Costs,
               batch: int) -> list[Trial]:
    """Every candidate of every layout predicted once per distinct run, those within the memory cap, best
    predicted first."""
    found = [(c, s, v, r) for r in space.replica_counts(placed, batch, fixed)
             for c, s, v in space.candidates(model, measure.head(sample, -(-batch // r)), costs.hi,
                                             placed[:len(placed) // r], fixed, costs.cal.copy_bytes_per_s,
                                             costs.layers, replicas=r)]
    if not found:
        raise _no_candidate(model, placed, fixed)
    trials = []
    same: set[tuple[Any, ...]] = set()  # one trial per distinct run: zb-h2 with few micro-batches is zb-h1
    for c, s, v, r in found:
        try:
            run = schedule_of(c.schedule, c.slots(), max(1, min(c.chunks, -(-batch // r)))).actions
            key_of = (c.balance, c.devices, c.checkpoint, c.graphs, c.chunks, run, c.schedule == "gpipe", r)
            if key_of in same:
                continue
            same.add(key_of)
            trial = _trial(c, s, v, predict(c, costs.layers, costs.cal, batch, replicas=r), r)
            if costs.optimizer_ratio:
                trial = memory_bounds.with_state(trial, c, costs.optimizer_ratio, costs.trainable, placed)
            trials.append(trial)
        except ScheduleError:
            continue  # a schedule that does not apply to this layout
    if not trials:
        raise TuneError(f"no schedule applies with the fixed options "
                        f"{({k: v for k, v in fixed.items() if v is not None})}; let the tuner choose schedule "
                        "or loops (schedule=None, loops=None)")
    memory_cap = fixed["memory_cap"]
    fits = [t for t in trials if memory_cap is None or t.memory_bytes <= memory_cap]
    if not fits:
        least = min(trials, key=lambda t: (t.memory_bytes, t.predicted_s))
        raise MemoryCapError(
            f"no configuration fits memory_cap={memory_cap:.0f} bytes ({memory_cap / 2**20:.2f} MiB) per device: "
            f"the smallest cap that works is {least.memory_bytes} bytes ({least.memory_bytes / 2**20:.2f} MiB, "
            f"{least.label()}); raise memory_cap to at least that, use more devices, or a smaller mini-batch"
        )
    fits.sort(key=lambda t: t.predicted_s)
    return memory_bounds.predicted_to_fit(fits, placed)


def _no_candidate(model: nn.Sequential, placed: list[torch.device], fixed: dict[str, Any]) -> TuneError:
    """Why the fixed options leave no candidate, and what to do."""
    given = {k: v for k, v in fixed.items() if v is not None}
    schedule = fixed["schedule"]
    if schedule is not None and schedule != "gpipe":
        return TuneError(f"no candidate configuration with the fixed options {given}: schedule={schedule!r} "
                         "applies to loops=1 ('1f1b', 'zb-h2'), loops > 1 ('interleaved') or loops 1 and 2 "
                         "('zb-h1'), "
                         "with positional inputs; fix loops to match, or let the tuner choose (schedule=None)")
    ties = tied.across(model, [1] * len(model)) if fixed.get("graphs") else []
    if ties:
        return TuneError(f"graphs=True: parameter {ties[0].name} is used by layers that land on different "
                         "devices under every balance and layout tried, and captured graphs cannot replay a "
                         "weight copied to another device per call; let the tuner choose (graphs=None), use "
                         "graphs=False, or allow schedule='zb-h1' with loops=2 (its V puts the first and last "
                         "partitions on one device)")
    return TuneError(f"no candidate configuration: {len(model)} layers cannot make {len(placed)} partitions "
                     f"with the fixed options {given}")


def _time_best(model: nn.Sequential, sample: Any, placed: list[torch.device], fits: list[Trial],
               bound: tuple[int | None, int | None], *, top: int, steps: int, warm: int,
               show: bool) -> tuple[list[Trial], list[Trial]]:
    """Time the candidates :func:`to_time` picks, and where each held more than ``bound`` the next best too;
    the confirmed ones (with their measurements) and every one timed."""
    timed = to_time(fits, top, gpus=len(placed))
    refused: list[MicroBatchError] = []
    confirmed = _confirm(model, sample, placed, timed, steps=steps, warm=warm, show=show, refused=refused)
    if refused:  # the model refuses micro-batches of one sample: none of those, and the next best where none ran
        batch = measure.batch_size(sample)
        fits = [t for t in fits if -(-batch // t.replicas) // t.chunks >= 2]
        if not confirmed:
            more = _untimed(fits, timed)[:max(top, 1)]
            confirmed += _confirm(model, sample, placed, more, steps=steps, warm=warm, show=show)
            timed += more
    if confirmed and not lean(confirmed, *bound):  # each held more than the bound: time the next best too
        more = _untimed(fits, timed)[:max(top, 1)]
        confirmed += _confirm(model, sample, placed, more, steps=steps, warm=warm, show=show)
        timed += more
    plain = bound_to_ddp(confirmed, bound, len(placed))
    fastest = steady(confirmed) if confirmed else None
    if fastest is not None and plain != bound and not lean([fastest], *plain):
        # the fastest holds more than data parallelism would: time the best predicted to hold less
        more = lighter(fits, timed, fastest)[:max(top, 1)]
        confirmed += _confirm(model, sample, placed, more, steps=steps, warm=warm, show=show)
        timed += more
    if top > 0 and not confirmed and refused:
        raise refused[0]  # the model cannot run micro-batches that small: the refusal says how to fix it
    if top > 0 and not confirmed:
        raise MemoryCapError(f"each of the {len(timed)} best candidates ran out of memory in a timed "
                             "step; pass a memory_cap below the devices' memory, use more devices, or a smaller "
                             "mini-batch")
    return confirmed, timed


def _untimed(fits: list[Trial], timed: list[Trial]) -> list[Trial]:
    """``fits`` not among ``timed``, in their order."""
    return [t for t in fits if not any(t is u for u in timed)]


def _with_overlap(model: nn.Sequential, sample: Any, placed: list[torch.device], best: Trial, costs: _Costs, batch: int,
                  confirmed: list[Trial], timed: list[Trial], *, memory_cap: float | None, steps: int, warm: int,
                  show: bool) -> Trial:
    """``best`` timed once more with two streams per GPU (its twin joins ``confirmed`` and ``timed``); the twin
    where it ran faster within the same memory bounds, else ``best``."""
    twin = _twin(best, placed, costs, batch)
    if memory_cap is not None and twin.memory_bytes > memory_cap:
        return best
    more = _confirm(model, sample, placed, [twin], steps=steps, warm=warm, show=show)
    if costs.optimizer_ratio:  # two lanes hold more: the twin too must leave room for the optimizer's state
        more = [t for t in more if memory_bounds.fullness(t, placed) <= memory_bounds.ROOM]
    confirmed += more
    timed.append(twin)
    bound = bound_to_ddp(confirmed, costs.bound, len(placed))  # two lanes hold more: still no more than DDP
    ran, before = (more[0].measured_s if more else None), best.measured_s
    if ran is not None and before is not None and ran < before and (lean(more, *bound) or not lean([best], *bound)):
        return more[0]
    return best


def _config(best: Trial, confirmed: list[Trial], fits: list[Trial], timed: list[Trial],
            placed: list[torch.device], batch: int, key: str) -> PipeConfig:
    """The choice, with the timed candidates and the next best predicted ones beside it."""
    shown = confirmed + _untimed(fits, timed)[:8]
    return PipeConfig(chunks=best.chunks, loops=best.loops, balance=best.balance, by=best.by,
                      checkpoint=best.checkpoint, graphs=best.graphs, devices=tuple(str(d) for d in placed),
                      batch=batch, predicted_s=best.predicted_s, measured_s=best.measured_s,
                      schedule=best.schedule, memory_per_device=best.memory_per_device, overlap=best.overlap,
                      trials=tuple(shown), key=key, replicas=best.replicas)


def _confirm(model: nn.Sequential, sample: Any, placed: list[torch.device], timed: list[Trial], *, steps: int,
             warm: int, show: bool, refused: list[MicroBatchError] | None = None) -> list[Trial]:
    """``timed`` with measured step seconds and, on GPUs, the peak bytes each device allocated while the
    pipeline was built, captured and ran its steps (from an emptied cache); a candidate that runs out of
    memory is left out, and so is one whose micro-batches the model refuses (a BatchNorm left one value per
    channel), its refusal added to ``refused``."""
    confirmed = []
    for t in progress(timed, len(timed), "seqify tune: timing the best candidates", show):
        pipe = None
        try:
            with measure.peaks(placed) as got:
                pipe = build_trial(model, t, placed, sample).train()
                seconds = measure.step_seconds(pipe, sample, placed, steps=steps, warm=warm + (1 if t.graphs else 0),
                                               update=True)
        except MicroBatchError as e:  # a shape the profile at two samples or more could not show
            if refused is not None:
                refused.append(e)
            continue
        except Exception as e:  # predicted to fit but did not: the next candidate
            if not measure.out_of_memory(e):
                raise
            gc.collect()  # what the failed step held, before the next candidate measures its peaks
            continue
        finally:
            del pipe
        allocated, reserved = got()
        confirmed.append(replace(t, measured_s=seconds, measured_peak=allocated, measured_reserved=reserved))
    return confirmed


def _runoff(model: nn.Sequential, sample: Any, placed: list[torch.device], pool: list[Trial], confirmed: list[Trial],
            *, steps: int, warm: int, show: bool) -> list[Trial]:
    """``pool`` (timed candidates within the memory bounds) where the best of them on GPUs are within ``RUNOFF``
    of its fastest (:func:`~seqify.tuning.choice.contenders`): those built again and timed with twice the steps,
    their measured seconds the mean of both timings (their peaks those of the first, which the bounds passed; the
    same replaced in ``confirmed``, which ``print(cfg)`` shows); one whose second build runs out of memory keeps
    its first timing. On the CPU, ``pool``."""
    if not any(d.type == "cuda" for d in placed):
        return pool
    close = contenders(pool)
    if len(close) < 2:
        return pool
    again = {}
    for first in close:
        second = _confirm(model, sample, placed, [first], steps=2 * steps, warm=warm, show=show)
        if second:
            mean = ((first.measured_s or 0.0) + (second[0].measured_s or 0.0)) / 2
            again[id(first)] = replace(first, measured_s=mean)
    confirmed[:] = [again.get(id(t), t) for t in confirmed]
    return [again.get(id(t), t) for t in pool]


def _trial(c: Candidate, by: str, loops: int, p: Prediction, replicas: int = 1) -> Trial:
    return Trial(chunks=c.chunks, loops=loops, by=by, checkpoint=c.checkpoint, graphs=c.graphs,
                 schedule=c.schedule, balance=c.balance, predicted_s=p.seconds, memory_bytes=p.memory_bytes,
                 memory_per_device=p.per_device, overlap=c.overlap, replicas=replicas)


def build_trial(model: nn.Sequential, t: Trial, devices: Sequence[torch.device], sample: Any) -> nn.Module:
    """The pipeline trial ``t`` describes: one, or its replicas over the devices."""
    if t.replicas == 1:
        return build(model, **options(t, devices))
    return replicated(model, t.replicas, sample=sample, **options(t, devices))


def _twin(t: Trial, devices: Sequence[torch.device], costs: _Costs, batch: int) -> Trial:
    """Trial ``t`` with two lanes per GPU, not yet timed: its memory predicted as they hold it."""
    names, slots = space.layout(t.schedule or "gpipe", devices[:len(devices) // t.replicas], t.loops)
    c = Candidate(t.balance, names, t.chunks, t.checkpoint, t.graphs, t.schedule or "gpipe", slots, overlap=True)
    twin = _trial(c, t.by, t.loops, predict(c, costs.layers, costs.cal, batch, replicas=t.replicas), t.replicas)
    if not costs.optimizer_ratio:
        return twin
    return memory_bounds.with_state(twin, c, costs.optimizer_ratio, costs.trainable, list(devices))


def options(t: Trial, devices: Sequence[torch.device]) -> dict[str, Any]:
    """Keyword arguments of :func:`seqify.pipeline` that build trial ``t`` on ``devices`` (without ``replicas``:
    pass ``replicas=t.replicas`` beside them where it is over 1)."""
    return dict(devices=list(devices), loops=t.loops, balance=list(t.balance), chunks=t.chunks,
                checkpoint=t.checkpoint, graphs=t.graphs, schedule=t.schedule or "gpipe", overlap=t.overlap)
