"""The search space: every configuration the tuner predicts (micro-batches, loops, balance, checkpointing,
graphs, schedule) and each partition's placement."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from seqify.errors import SeqifyError, TuneError
from seqify.partition.balancer import split
from seqify.partition.cost import LayerCosts, default_transfer_cost, flop_costs, param_costs
from seqify.partition.walk import layers as walk_layers
from seqify.pipe import tied
from seqify.pipe.pipeline import CHECKPOINT
from seqify.schedule.actions import round_robin, v_shape
from seqify.tuning import measure
from seqify.tuning.predict import Candidate, LayerModel

__all__ = ["CHUNKS", "LOOPS", "STRATEGIES", "TIME_SLACK", "schedules", "layout", "balances", "candidates",
           "replica_counts"]


CHUNKS = (1, 2, 4, 8, 16, 32, 64)


LOOPS = (1, 2, 4)


STRATEGIES = ("time", "flops", "memory")
#: How far over the best bottleneck by measured layer times a plan may be, when it has more cuts no skip crosses
#: or fewer bytes crossing them: profiling again moves the exact optimum, where a choice by the model's shapes
#: within the slack stays put (the 2% by which timing one configuration again moves it).
TIME_SLACK = 0.02


def replica_counts(devices: Sequence[torch.device], batch: int, fixed: dict[str, Any]) -> list[int]:
    """The layouts to consider, as data-parallel replica counts: the fixed one, or every divisor of the device
    count that leaves each replica a sample (1: one pipeline over every device; the count itself: plain data
    parallelism). One pipeline on CPU devices or on a GPU named twice: replicas there share the hardware."""
    if fixed.get("replicas"):
        return [fixed["replicas"]]
    n = len(devices)
    if len(set(devices)) < n or any(d.type != "cuda" for d in devices):
        return [1]
    return [r for r in range(1, n + 1) if n % r == 0 and r <= batch]


def schedules(loops: int, sample: Any) -> tuple[str, ...]:
    """The schedules that apply with ``loops`` partitions per device: GPipe always; 1F1B, ZB-H1 and ZB-H2
    with one partition per device; interleaved 1F1B with several; ZB-H1 also with two in a V. Only GPipe
    for a sample of keyword arguments (``pipe.step``, which runs the others, takes positional inputs)."""
    if isinstance(sample, dict):
        return ("gpipe",)
    if loops == 1:
        return ("gpipe", "1f1b", "zb-h1", "zb-h2")
    return ("gpipe", "interleaved", "zb-h1") if loops == 2 else ("gpipe", "interleaved")


def layout(schedule: str, devices: Sequence[torch.device], loops: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Each partition's device and pipeline device number, as :func:`seqify.pipeline` places them: ZB-H1
    with two partitions per device in a V, everything else round-robin."""
    names = [str(d) for d in devices]
    if schedule == "zb-h1" and loops == 2:
        order, placement = tuple(names + names[::-1]), v_shape(len(names))
    else:
        order, placement = tuple(names * loops), round_robin(len(names), loops)
    # One number per GPU: a GPU listed twice (devices=["cuda:0", "cuda:0"]) runs its partitions one after
    # another, and predicting it as two devices halved the step. (CPU partitions share the host anyway:
    # the model runs them in turn whatever their numbers.)
    first: dict[str, int] = {}
    merged = tuple(first.setdefault(n, len(first)) for n in order)
    gpus = all(torch.device(n).type == "cuda" for n in names)
    return order, merged if gpus and len(first) < len(names) else placement


def balances(model: nn.Sequential, sample: Any, hi: LayerCosts, parts: int, by: Sequence[str],
           bandwidth: float) -> dict[str, tuple[int, ...]]:
    """The optimal balance of each strategy for ``parts`` partitions."""
    lays = walk_layers(model)
    out: dict[str, tuple[int, ...]] = {}
    for strategy in by:
        if strategy not in ("time", "memory", "flops", "params"):
            raise TuneError(f"balance={strategy!r}: give a list of layer counts, one of ('time', 'memory', 'flops', "
                            "'params'), or None to let the tuner choose")
        if strategy == "time":
            costs = hi
        elif strategy == "params":
            costs = param_costs(model, sample)
        elif strategy == "memory":
            costs = replace(hi, by="memory", cost=tuple(float(c) for c in hi.memory))
        else:
            try:
                costs = flop_costs(model, sample)
            except SeqifyError:
                continue  # a model fake tensors cannot run: the other strategies stand
        if strategy == "time" and bandwidth < float("inf"):
            transfer = default_transfer_cost(strategy, bandwidth=bandwidth)
        else:
            transfer = default_transfer_cost(strategy) if strategy == "flops" else 0.0
        plan = split(costs, parts, lays.names, lays.routes, transfer_cost=transfer,
                     slack=TIME_SLACK if strategy == "time" else 0.0)
        out[strategy] = tuple(plan.balance)
    return out


def _at(hi: LayerCosts, layers: LayerModel, batch: int, m: int) -> LayerCosts:
    """``hi`` with each layer's time where the step runs ``m`` micro-batches: its seconds at ``batch / m``
    samples, ``m`` times (the bytes stay those of the whole batch, so a cut's transfer weighs as before)."""
    b = batch / m
    return replace(hi, cost=tuple(m * layers.seconds(i, i + 1, b) for i in range(len(hi))))


def candidates(model: nn.Sequential, sample: Any, hi: LayerCosts, devices: list[torch.device], fixed: dict[str, Any],
                bandwidth: float, layers: LayerModel | None = None, replicas: int = 1
                ) -> list[tuple[Candidate, str, int]]:
    """Every configuration to predict: per loops and micro-batch count, each balance strategy's plan (by
    time at that micro-batch size where ``layers`` has it: ResNet-101's batch-256 times cut it at [92, 253],
    its micro-batches of 64 at [101, 244], 1.62x and 1.64x one GPU under ZB-H2 on two H200s) with every
    checkpointing, graphs and schedule choice that applies. ``devices`` are one pipeline's; with ``replicas``
    of a pipeline on one GPU, ``loops`` cut it into partitions that are DDP's buckets: each partition's gradient
    sum starts as its last backward ends (replayed graphs only, GPipe or interleaved order,
    :mod:`seqify.pipe.partition_sums`)."""
    batch = measure.batch_size(sample)
    n = len(hi)
    cuda = all(d.type == "cuda" for d in devices)
    chunk_set = [fixed["chunks"]] if fixed.get("chunks") else [c for c in CHUNKS if c <= batch]
    buckets = replicas > 1 and len(devices) == 1 and cuda  # a replica on one GPU: its loops are buckets
    loop_set = [fixed["loops"]] if fixed.get("loops") else [v for v in LOOPS if v == 1 or len(devices) > 1 or buckets]
    ckpt_set = [fixed["checkpoint"]] if fixed.get("checkpoint") else list(CHECKPOINT)
    graph_set = [fixed["graphs"]] if fixed.get("graphs") is not None else ([False, True] if cuda else [False])
    balance = fixed.get("balance")
    given = isinstance(balance, (list, tuple))
    strategies = [] if given else [balance] if balance else list(STRATEGIES)
    # each micro-batch count's layer times, for the time strategy's cuts (the same for every loops)
    timed = {m: _at(hi, layers, batch, m) for m in chunk_set} if "time" in strategies and layers is not None else {}
    out: list[tuple[Candidate, str, int]] = []
    for loops in loop_set:
        parts = len(devices) * loops
        if parts > n:
            continue
        # a replica's partitions on one GPU: all forwards then all backwards (GPipe), or one micro-batch through
        # them at a time (interleaved: one micro-batch's activations, each partition's sum after its last backward)
        valid = ("gpipe", "interleaved") if buckets and loops > 1 else schedules(loops, sample)
        if fixed.get("schedule"):
            sched_set = [fixed["schedule"]] if fixed["schedule"] in valid else []
        else:
            sched_set = list(valid)
        if given:
            assert balance is not None  # given: the caller fixed a balance
            if len(balance) != parts:
                continue
            fixed_plans: dict[str, tuple[int, ...]] = {"given": tuple(balance)}
        else:  # the strategies whose costs do not depend on the micro-batch size, once per loops
            fixed_plans = balances(model, sample, hi, parts, [s for s in strategies if s != "time" or layers is None],
                                 bandwidth)
        layouts = {sched: layout(sched, devices, loops) for sched in sched_set}
        apart_of: dict[tuple[int, ...], dict[str, bool]] = {}  # per balance: schedules whose layout splits a tie
        for m in chunk_set:
            plans = dict(fixed_plans)
            if m in timed:
                plans.update(balances(model, sample, timed[m], parts, ["time"], bandwidth))
            seen: dict[tuple[int, ...], str] = {}
            for strategy in [s for s in (*strategies, "given") if s in plans]:
                seen.setdefault(plans[strategy], strategy)  # two strategies that agree are one candidate
            for bal, strategy in seen.items():
                if bal not in apart_of:  # weights several partitions use (GPT-2's embedding and head)
                    ties = tied.across(model, bal)
                    apart_of[bal] = {sched: bool(tied.crossing(ties, names)) for sched, (names, _) in layouts.items()}
                apart = apart_of[bal]
                for ckpt, graphs, sched in itertools.product(ckpt_set, graph_set, sched_set):
                    if buckets and loops > 1 and not graphs:
                        continue  # eager replicas sum after the step: partitions on one GPU would only cost
                    if m == 1 and ckpt == "except_last" and not fixed.get("checkpoint"):
                        continue  # one micro-batch, the last: the same run as checkpoint='never'
                    if m == 1 and sched != "gpipe" and not fixed.get("schedule"):
                        continue  # one micro-batch has no bubble to fill: every schedule is GPipe's order
                    names, slots = layouts[sched]
                    if graphs and apart[sched]:
                        continue  # captured graphs cannot replay a weight copied to another device per call
                    out.append((Candidate(bal, names, m, ckpt, graphs, sched, slots, bool(fixed.get("overlap"))),
                                strategy, loops))
    return out
