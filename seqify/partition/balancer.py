"""balance: cost a model's layers, then split them into the pipeline stages that minimise the bottleneck."""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from seqify.partition.cost import BY, LayerCosts, costs, default_transfer_cost
from seqify.partition.errors import BalanceError
from seqify.partition.graph import clean_cuts, crossing, dataflow, live_bytes
from seqify.partition.plan import PartitionPlan, Stage
from seqify.partition.profile import device_of
from seqify.partition.solve import solve
from seqify.partition.walk import layers
from seqify.skip.layout import SkipRoute

__all__ = ["balance", "split"]


def balance(
    model: nn.Module,
    partitions: int,
    sample: Any = None,
    by: str = "time",
    device: str | torch.device | None = None,
    memory_cap: float | None = None,
    transfer_cost: float | None = None,
    progress: bool = True,
    *,
    prefer_clean: bool = True,
) -> PartitionPlan:
    """Split ``model``'s layers into ``partitions`` contiguous, non-empty stages with the smallest bottleneck.

    Args:
        model: a :class:`seqify.Sequential` (``sample`` is what you pass to it: a tensor, a tuple of
            positional arguments or a dict of keyword arguments) or a plain ``nn.Sequential``, e.g. of
            ``@skippable`` layers (``sample`` is the input of layer 0).
        partitions: number of stages, ``1 <= partitions <= len(model)``.
        sample: an input batch. Needed by ``time``, ``memory`` and ``flops``; optional for ``params``,
            where it fills in the byte columns.
        by: the cost model: ``'time'`` (measured forward+backward seconds on ``device``), ``'memory'``
            (measured bytes), ``'flops'`` (forward+backward FLOPs from shapes on fake tensors: no compute,
            no device) or ``'params'`` (parameter count).
        device: where ``time`` and ``memory`` are measured; default the one device the model's parameters
            and buffers are on (a model on a GPU is measured there), else the CPU.
        memory_cap: bytes each stage may hold (parameters and buffers plus activations for ``sample``);
            :class:`NoPlanFitsError` says the smallest cap that works when none does.
        transfer_cost: cost (in the unit of ``by``) per byte crossing a stage's incoming cut; defaults
            to :func:`~seqify.partition.cost.default_transfer_cost`.
        progress: show a progress bar on stderr while profiling (only on a terminal, or with
            ``SEQIFY_PROGRESS=1``).
        prefer_clean: among optimal plans, prefer cuts that no skip crosses.

    Returns:
        A :class:`PartitionPlan`; ``print(plan)`` shows it as a table, ``plan.balance`` feeds a pipeline.
    """
    lays = layers(model)
    if by not in BY:
        raise BalanceError(f"by={by!r} is not a cost model; use one of {', '.join(repr(b) for b in BY)}")
    if isinstance(partitions, bool) or not isinstance(partitions, numbers.Integral) or partitions < 1:
        raise BalanceError(f"partitions={partitions!r}: ask for a whole number of stages, at least 1")
    partitions = int(partitions)
    if partitions > len(lays):
        raise BalanceError(
            f"cannot split {len(lays)} layers into {partitions} partitions: every stage needs at least one "
            f"layer; use partitions <= {len(lays)}, or convert into finer layers (no leaf_types/depth in "
            "seqify.convert)"
        )
    if transfer_cost is not None and not transfer_cost >= 0:
        raise BalanceError(f"transfer_cost={transfer_cost}: give a cost per byte >= 0 (0 ignores transfers)")
    if memory_cap is not None and not memory_cap >= 0:
        raise BalanceError(f"memory_cap={memory_cap}: give the bytes a stage may hold (>= 0), or None for no cap")
    if by != "params":
        from seqify.errors import MetaDeviceError
        from seqify.model.sequential import meta_tensor

        meta = meta_tensor(model)
        if meta is not None:
            raise MetaDeviceError(
                f"{meta} is on the meta device (shapes, no data), and balance by={by!r} runs the layers on the "
                "sample; balance by='params' (no data needed), or materialise the weights first "
                "(model.to_empty(device='cpu'), then initialise them or load a checkpoint)"
            )
    if device is None and by in ("time", "memory"):
        device = home(model)
    measured = costs(model, by, sample, device, progress=progress)
    where = str(device_of(device)) if by in ("time", "memory") else None
    return split(
        measured,
        partitions,
        lays.names,
        lays.routes,
        memory_cap=memory_cap,
        transfer_cost=default_transfer_cost(by) if transfer_cost is None else float(transfer_cost),
        prefer_clean=prefer_clean,
        device=where,
    )


def split(
    measured: LayerCosts,
    partitions: int,
    names: Sequence[str],
    routes: Sequence[SkipRoute],
    *,
    memory_cap: float | None = None,
    transfer_cost: float = 0.0,
    prefer_clean: bool = True,
    device: str | None = None,
    cuts: Collection[int] | None = None,
    slack: float = 0.0,
) -> PartitionPlan:
    """The optimal plan for per-layer costs already measured (``balance`` without the measuring); with
    ``cuts``, stages start only at those layer indices (and 0); ``slack``: see
    :func:`~seqify.partition.solve.solve` (a plan within ``slack`` of the best, chosen by what noise does not
    move)."""
    n = len(measured)
    graph = dataflow(n, routes, measured.output_bytes, measured.skip_bytes)
    live = live_bytes(graph)
    clean = set(clean_cuts(graph))
    solution = solve(
        measured.cost,
        partitions,
        cut_cost=[live[a] * transfer_cost if a > 0 else 0.0 for a in range(n)],
        memory=measured.memory,
        cap=memory_cap,
        clean=[prefer_clean and a in clean for a in range(n)],
        cut_bytes=live[:n],
        names=names,
        cuts=cuts,
        slack=slack,
    )
    stages = []
    start = 0
    for index, (size, stage_cost) in enumerate(zip(solution.balance, solution.costs)):
        stop = start + size
        transfer = live[start] * transfer_cost if start > 0 else 0.0
        stages.append(
            Stage(
                index=index,
                start=start,
                stop=stop,
                names=tuple(names[start:stop]),
                cost=stage_cost,
                compute=math.fsum(measured.cost[start:stop]),
                transfer=transfer,
                param_bytes=sum(measured.state_bytes[start:stop]),
                activation_bytes=sum(measured.activation_bytes[start:stop]),
                in_bytes=live[start] if start > 0 else 0,
                in_skips=tuple(crossing(graph, start)) if start > 0 else (),
                clean=start == 0 or start in clean,
            )
        )
        start = stop
    return PartitionPlan(
        by=measured.by,
        balance=list(solution.balance),
        stages=tuple(stages),
        bottleneck=solution.bottleneck,
        cut_bytes=tuple(s.in_bytes for s in stages[1:]),
        clean_cuts=tuple(sorted(clean)),
        transfer_cost=transfer_cost,
        memory_cap=memory_cap,
        device=device,
        measured=measured.measured,
    )


def home(model: nn.Module) -> torch.device | None:
    """The one device all of ``model``'s parameters and buffers are on; None when they are spread or absent."""
    found = {t.device for t in [*model.parameters(), *model.buffers()]}
    return found.pop() if len(found) == 1 else None
