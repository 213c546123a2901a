"""Building a Pipeline from seqify.pipeline's options: layer counts or a balance strategy, a memory cap, a
configuration the tuner chose or a file holds."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from seqify.errors import BalanceError, ConfigError, MemoryCapError, ScheduleError
from seqify.pipe.config import PipeConfig
from seqify.pipe.executors.options import ReplayOptions
from seqify.pipe.memory import parse_bytes
from seqify.pipe.pipeline import Pipeline
from seqify.pipe.placement import STRATEGIES, _check_chunks, _counts, resolve_devices
from seqify.schedule.actions import SCHEDULES, Schedule, round_robin, v_shape

__all__ = ["build", "capped", "from_config"]


def build(
    model: nn.Sequential,
    *,
    gpus: int | None = None,
    devices: Sequence[Any] | None = None,
    chunks: int | str = 1,
    balance: Sequence[int] | str | None = None,
    checkpoint: str = "except_last",
    deferred_batch_norm: bool = False,
    graphs: bool = False,
    loops: int = 1,
    sample: Any = None,
    schedule: str | Schedule | None = None,
    memory_cap: int | float | str | None = None,
    overlap: bool | None = None,
    replay_options: ReplayOptions | None = None,
) -> Pipeline:
    """A pipeline of ``model`` with a fixed number of ``chunks``: what :func:`seqify.pipeline` builds when it
    tunes nothing (the arguments mean what they mean there; ``sample`` measures a 'time', 'memory' or
    'flops' balance and a ``memory_cap``)."""
    schedule = "gpipe" if schedule is None else schedule
    layers = len(model)
    probe = sample
    chunks = _check_chunks(chunks)
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise BalanceError(f"loops={loops!r}: give the number of partitions per device, a whole number >= 1")
    if not isinstance(schedule, Schedule) and schedule not in SCHEDULES:
        raise ScheduleError(f"schedule={schedule!r}: choose one of {SCHEDULES} or pass a "
                            "seqify.schedule.actions.Schedule")
    v = schedule == "zb-h1" and loops == 2

    def lay(devs: list[torch.device]) -> tuple[list[torch.device], tuple[int, ...]]:
        if v:
            return devs + devs[::-1], v_shape(len(devs))
        return devs * loops, round_robin(len(devs), loops)
    if isinstance(balance, str) or balance is None:
        strategy = balance or "params"
        if strategy not in STRATEGIES:
            raise BalanceError(f"balance={strategy!r}: use a list of layer counts or one of {STRATEGIES}")
        placed, slots = lay(resolve_devices(gpus, devices, None))
        if len(placed) > layers:
            raise BalanceError(f"{len(placed)} partitions but the model has only {layers} layers; use fewer devices")
        from seqify.partition import balance as make_plan

        plan = make_plan(model, len(placed), sample=probe, by=strategy, device=placed[0])
        pipe = Pipeline(model, plan.balance, placed, chunks=chunks, checkpoint=checkpoint,
                        deferred_batch_norm=deferred_batch_norm, graphs=graphs, plan=plan, schedule=schedule,
                        placement=slots, overlap=bool(overlap), replay_options=replay_options)
        return capped(pipe, memory_cap, probe)
    counts = _counts(balance, layers)
    if len(counts) > layers:
        raise BalanceError(f"balance has {len(counts)} partitions but the model has only {layers} layers")
    if len(counts) % loops:
        raise BalanceError(
            f"balance has {len(counts)} partitions, not a multiple of loops={loops}: give loops partitions per device"
        )
    placed, slots = lay(resolve_devices(gpus, devices, len(counts) // loops))
    pipe = Pipeline(model, counts, placed, chunks=chunks, checkpoint=checkpoint,
                    deferred_batch_norm=deferred_batch_norm, graphs=graphs, schedule=schedule, placement=slots,
                    overlap=bool(overlap), replay_options=replay_options)
    return capped(pipe, memory_cap, sample)




def capped(pipe: Pipeline, cap: int | float | str | None, sample: Any) -> Pipeline:
    """``pipe`` switched to a schedule and checkpointing that fit ``cap`` (unchanged without a cap)."""
    if cap is None:
        return pipe
    parse_bytes(cap)
    if sample is None:
        raise MemoryCapError("memory_cap needs a sample mini-batch to measure activations: pass sample=x (or "
                             "example_inputs=x) shaped like a training batch")
    pipe.fit_memory(cap, sample)
    return pipe


def from_config(model: nn.Sequential, config: PipeConfig | str | os.PathLike[str], gpus: int | None,
                 devices: Sequence[Any] | None, deferred_batch_norm: bool,
                 schedule: str | Schedule | None = None, overlap: bool | None = None) -> Pipeline:
    """The pipeline a tuned configuration describes, checked against the model and the devices: its
    schedule (``pipe.step`` runs it), or ``schedule`` when given (a :class:`Schedule` built for the same
    placement, or a name that applies to it); two lanes per GPU as it says, or as ``overlap`` when given."""
    from seqify.errors import TuneError

    cfg = config if isinstance(config, PipeConfig) else PipeConfig.load(config)
    if not cfg.fixed:
        raise ConfigError(f"{cfg} leaves chunks, balance or devices open (or sets a memory cap): build it with "
                          "seqify.pipeline(model, config=cfg), which chooses them")
    if overlap is not None and overlap != cfg.overlap:
        cfg = replace(cfg, overlap=overlap)
    if sum(cfg.balance) != len(model):
        raise TuneError(
            f"the configuration's balance {list(cfg.balance)} covers {sum(cfg.balance)} layers but this model has "
            f"{len(model)}; it was tuned for another model (or another conversion): tune this one with "
            "seqify.tune(model, sample, ...)"
        )
    placed = cfg.partitions
    if len(placed) != len(cfg.balance):
        raise ConfigError(f"the configuration's balance {list(cfg.balance)} has {len(cfg.balance)} partitions but "
                          f"its {len(cfg.devices)} devices with loops = {cfg.loops} place {len(placed)}: give "
                          f"{len(placed)} layer counts, or other devices or loops")
    if gpus is not None or devices is not None:
        mine = resolve_devices(gpus, devices, None)
        if len(mine) != len(cfg.devices):
            raise TuneError(f"the configuration is for {len(cfg.devices)} devices ({', '.join(cfg.devices)}) but "
                            f"{len(mine)} were given; give {len(cfg.devices)}, or tune for these")
        placed = [str(mine[d]) for d in cfg.placement]
    pipe = Pipeline(model, list(cfg.balance), resolve_devices(None, placed, None), chunks=int(cfg.chunks),
                    checkpoint=cfg.checkpoint, deferred_batch_norm=deferred_batch_norm or cfg.deferred_batch_norm,
                    graphs=cfg.graphs,
                    schedule=schedule if schedule is not None else (cfg.schedule or "gpipe"), placement=cfg.placement,
                    overlap=cfg.overlap)
    pipe.config = cfg
    return pipe
