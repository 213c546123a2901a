"""How evenly seqify.balance splits deep nets: by-FLOPs and by-params plans, and measured stage times on GPUs.

    python benchmarks/balance/main.py [--device cuda] [--batch 64] [--repeats 5]

CPU part (always; fake tensors, no real compute): converted torchvision ResNet-101 at 2, 4 and 8 stages
and ResNet-152 at 8 stages, sample 1x3x224x224. For each it prints the imbalance (largest stage cost
over mean stage cost, transfers included) of the by-FLOPs plan, of the by-params plan in parameters,
and of the by-params plan measured in FLOPs (what balancing by parameters does to compute).

GPU part (``--device cuda`` with at least 2 GPUs; skipped otherwise): ResNet-101 over 2 stages, the
by-time plan (profiled on cuda:0 with a batch of ``--batch``) next to the by-FLOPs plan, with the
measured forward+backward time of each stage of both plans, each stage run on cuda:0.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torchvision
from torch import nn

import seqify
from seqify.partition import FLOPS_PER_BYTE, LayerCosts, PartitionPlan, balance, flop_costs, param_costs, split
from seqify.partition.graph import dataflow, live_bytes
from seqify.partition.walk import fresh, roots
from seqify.skip.tracker import SkipTracker, use_tracker

warnings.filterwarnings("ignore", category=UserWarning)

CPU_CASES: list[tuple[str, int]] = [("resnet101", 2), ("resnet101", 4), ("resnet101", 8), ("resnet152", 8)]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(device: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    where = f"CPU: {cpu_name()} ({torch.get_num_threads()} threads)"
    if device.startswith("cuda") and torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        where += f"; GPUs: {len(names)} x {names[0]}"
    print(f"date:    {now}")
    print(f"device:  {where}; torch {torch.__version__}, torchvision {torchvision.__version__}, Python {platform.python_version()}")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print()


def imbalance(stage_costs: Sequence[float]) -> float:
    mean = sum(stage_costs) / len(stage_costs)
    return max(stage_costs) / mean if mean > 0 else 1.0


def evaluate(plan: PartitionPlan, costs: LayerCosts, live: Sequence[int], per_byte: float) -> list[float]:
    """Stage costs of ``plan`` under another cost model (its layers' costs plus incoming-cut transfers)."""
    return [
        math.fsum(costs.cost[r.start : r.stop]) + (live[r.start] * per_byte if r.start > 0 else 0.0)
        for r in plan.ranges
    ]


def cpu_part() -> None:
    print("By-FLOPs vs by-params plans (fake tensors, sample 1x3x224x224, transfer cost "
          f"{FLOPS_PER_BYTE:g} FLOP/byte for FLOPs, 0 for params)")
    rows: list[tuple[str, ...]] = [("model", "stages", "layers", "flops plan", "params plan", "params plan", "flops plan", "time")]
    rows.append(("", "", "", "imb. (FLOPs)", "imb. (params)", "imb. (FLOPs)", "balance", "s"))
    models: dict[str, tuple[seqify.Sequential, LayerCosts, LayerCosts, list[int]]] = {}
    x = torch.zeros(1, 3, 224, 224)
    for name, parts in CPU_CASES:
        start = time.perf_counter()
        if name not in models:
            torch.manual_seed(0)
            seq = seqify.convert(torchvision.models.get_model(name, weights=None))
            flops = flop_costs(seq, x)
            params = dataclasses.replace(flops, by="params", cost=param_costs(seq).cost)
            lays = list(seq._modules.values())
            graph = dataflow(len(lays), seqify.skip.routes(seq), flops.output_bytes, flops.skip_bytes)
            models[name] = (seq, flops, params, live_bytes(graph))
        seq, flops, params, live = models[name]
        names = tuple(seq._modules.keys())
        routes = tuple(seqify.skip.routes(seq))
        by_flops = split(flops, parts, names, routes, transfer_cost=FLOPS_PER_BYTE)
        by_params = split(params, parts, names, routes, transfer_cost=0.0)
        elapsed = time.perf_counter() - start
        rows.append(
            (
                name,
                str(parts),
                str(len(seq)),
                f"{by_flops.imbalance:.3f}",
                f"{by_params.imbalance:.3f}",
                f"{imbalance(evaluate(by_params, flops, live, FLOPS_PER_BYTE)):.3f}",
                str(list(by_flops.balance)),
                f"{elapsed:.1f}",
            )
        )
    table(rows)
    print()
    name = "resnet101"
    seq, flops, _, _ = models[name]
    print(f"{name}, 4 stages by FLOPs:")
    print(split(flops, 4, tuple(seq._modules.keys()), tuple(seqify.skip.routes(seq)), transfer_cost=FLOPS_PER_BYTE))
    print()


def table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stage_times(seq: nn.Sequential, plan: PartitionPlan, sample: Any, device: torch.device, repeats: int) -> list[float]:
    """Median forward+backward seconds of each stage of ``plan``, run alone on ``device``."""
    layers = list(seq._modules.values())
    entries: list[tuple[Any, dict[Any, Any]]] = []
    with torch.no_grad(), use_tracker(SkipTracker()) as tracker:
        x = seq.flatten_inputs(sample) if isinstance(seq, seqify.Sequential) else sample
        for i, layer in enumerate(layers):
            if i in plan.cuts or i == 0:
                entries.append((x, dict(tracker.values)))
            x = layer(x)
    times = []
    for stage, (x, skips) in zip(plan.stages, entries):
        runs = []
        for r in range(repeats + 1):
            inputs, leaves = fresh(x)
            inner = SkipTracker()
            for key, value in skips.items():
                copy, more = fresh(value)
                inner.stash(key, copy)
                leaves += more
            params: list[torch.Tensor] = [p for i in stage.layers for p in layers[i].parameters() if p.requires_grad]
            sync(device)
            start = time.perf_counter()
            with use_tracker(inner):
                h = inputs
                for i in stage.layers:
                    h = layers[i](h)
                outs = roots(h, inner)
                torch.autograd.grad(outs, leaves + params, [torch.ones_like(t) for t in outs], allow_unused=True)
            sync(device)
            if r:
                runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs))
    return times


def gpu_part(batch: int, repeats: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"GPU part skipped: it needs 2 CUDA GPUs, this machine has {count}")
        return
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.get_model("resnet101", weights=None)).to(device).train()
    sample = torch.randn(batch, 3, 224, 224, device=device)
    start = time.perf_counter()
    by_time = balance(seq, 2, sample, by="time", device=device, progress=False)
    profiled = time.perf_counter() - start
    by_flops = balance(seq, 2, sample, by="flops", progress=False)
    print(f"ResNet-101 over 2 stages, batch {batch}x3x224x224 (by-time profile took {profiled:.1f} s on {device}):")
    print(by_time)
    print(by_flops)
    print()
    rows: list[tuple[str, ...]] = [("plan", "balance", "stage 0 ms", "stage 1 ms", "bottleneck ms", "imbalance (measured)")]
    for label, plan in (("by time", by_time), ("by flops", by_flops)):
        measured = stage_times(seq, plan, sample, device, repeats)
        rows.append(
            (
                label,
                str(list(plan.balance)),
                *(f"{t * 1e3:.2f}" for t in measured),
                f"{max(measured) * 1e3:.2f}",
                f"{imbalance(measured):.3f}",
            )
        )
    print(f"Measured forward+backward time per stage on {device} (median of {repeats}):")
    table(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU part too")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    header(args.device)
    cpu_part()
    if args.device.startswith("cuda"):
        gpu_part(args.batch, args.repeats)


if __name__ == "__main__":
    main()
