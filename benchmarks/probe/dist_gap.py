"""Probe: where seqify.distributed loses to the in-process pipeline at many chunks (ResNet-101, 1F1B, graphs).

    torchrun --nproc-per-node 2 benchmarks/probe/dist_gap.py --chunks 8 --out OUT   # seqify.distributed, per rank
    python benchmarks/probe/dist_gap.py --inprocess --chunks 8 --out OUT             # the in-process pipeline

Profiles two training steps after warm-up with torch.profiler and prints, per GPU: the step's wall time, the
GPU's busy time (the union of its kernels' intervals, captured graphs' kernels included), the part of it in
NCCL kernels, how much of the NCCL time overlaps other kernels (NCCL's p2p kernels take SMs from them; the
in-process pipeline copies with copy engines instead), and the idle time with its longest gaps. A probe: it
prints no memory; the speed figures are the side-by-side benchmark's (benchmarks/gpu_session.sh side-by-side).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch.profiler import ProfilerActivity, profile

import seqify

Span = tuple[float, float]


def union(spans: list[Span]) -> list[Span]:
    """Sorted, merged intervals."""
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(spans: list[Span]) -> float:
    return sum(b - a for a, b in spans)


def intersect(x: list[Span], y: list[Span]) -> float:
    """Total length of the overlap of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def summary(prof: profile, steps: int, wall: float) -> dict[int, dict[str, object]]:
    """Per CUDA device: busy, NCCL, overlap and idle milliseconds per step, and the five longest gaps."""
    kernels: dict[int, list[tuple[float, float, str]]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels.setdefault(e.device_index, []).append((e.time_range.start / 1e3, e.time_range.end / 1e3, e.name))
    out: dict[int, dict[str, object]] = {}
    for d, ks in sorted(kernels.items()):
        busy = union([(a, b) for a, b, _ in ks])
        nccl = union([(a, b) for a, b, n in ks if "nccl" in n.lower()])
        other = union([(a, b) for a, b, n in ks if "nccl" not in n.lower()])
        gaps = sorted(((busy[k + 1][0] - busy[k][1]) for k in range(len(busy) - 1)), reverse=True)
        out[d] = {
            "wall_ms": round(wall * 1e3, 2),
            "busy_ms": round(length(busy) / steps, 2),
            "compute_ms": round(length(other) / steps, 2),
            "nccl_ms": round(length(nccl) / steps, 2),
            "nccl_overlapping_compute_ms": round(intersect(nccl, other) / steps, 2),
            "idle_in_span_ms": round((busy[-1][1] - busy[0][0] - length(busy)) / steps, 2) if busy else 0.0,
            "longest_gaps_ms": [round(g, 3) for g in gaps[:5]],
        }
    return out


def timeline(step: Callable[[], None], device: torch.device) -> list[dict[str, object]]:
    """One step with each action of this rank timed: when the host began and finished issuing it (a
    receive waits there for the message's header) and when the GPU began and ended it, in ms from the
    step's start (host and GPU clocks joined at a synchronize just before)."""
    from seqify.distributed import replay as dist_replay

    from seqify.pipe.executors import programs as replay

    marks: list[tuple[str, int, int, float, float, torch.cuda.Event, torch.cuda.Event]] = []
    saved = {k: getattr(dist_replay.ProgramRun, k) for k in ("forward", "backward", "weights")}
    programs = {k: getattr(replay.Program, k) for k in ("forward", "backward", "weights")}
    starts: list[torch.cuda.Event] = []

    def begin(fn: Callable[..., object]) -> Callable[..., object]:
        def run(self: object, *a: object, **k: object) -> object:
            e = torch.cuda.Event(enable_timing=True)
            e.record()  # the GPU reaches it once the receives it waits for have landed
            starts.append(e)
            return fn(self, *a, **k)
        return run

    def wrap(kind: str, fn: Callable[..., None]) -> Callable[..., None]:
        def run(self: object, p: int, i: int) -> None:
            t0 = time.perf_counter()
            starts.clear()
            fn(self, p, i)  # receives happen inside, before the program is queued
            b = torch.cuda.Event(enable_timing=True)
            b.record()
            a = starts[0] if starts else b
            t1 = time.perf_counter()
            marks.append((kind, p, i, t0, t1, a, b))
        return run

    for k, fn in saved.items():
        setattr(dist_replay.ProgramRun, k, wrap(k[0].upper(), fn))
    for k, fn in programs.items():
        setattr(replay.Program, k, begin(fn))
    try:
        torch.cuda.synchronize(device)
        base = torch.cuda.Event(enable_timing=True)
        base.record()
        torch.cuda.synchronize(device)
        h0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
    finally:
        for k, fn in saved.items():
            setattr(dist_replay.ProgramRun, k, fn)
        for k, fn in programs.items():
            setattr(replay.Program, k, fn)
    rows = []
    for kind, p, i, t0, t1, a, b in marks:
        rows.append({"a": f"{kind}{p}.{i}", "host_in": round((t0 - h0) * 1e3, 3), "host_out": round((t1 - h0) * 1e3, 3),
                     "gpu_start": round(base.elapsed_time(a), 3), "gpu_end": round(base.elapsed_time(b), 3)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--inprocess", action="store_true", help="seqify.pipeline over two GPUs in this process")
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=".")
    p.add_argument("--balance", type=int, nargs=2, default=None, help="layers per GPU (default: balanced by time)")
    p.add_argument("--timeline", action="store_true",
                   help="seqify.distributed: also one more step's per-action GPU start/end and host issue times")
    args = p.parse_args()
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet101())
    micro = torch.randn(max(1, args.batch // args.chunks), 3, 224, 224)
    if args.inprocess:
        devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
        parts = args.balance or seqify.balance(seq, 2, micro, by="time", device=devices[0]).balance
        model = seqify.pipeline(seq, devices=devices, balance=list(parts), chunks=args.chunks, schedule="1f1b",
                                graphs=True, checkpoint="never")
        x = torch.randn(args.batch, 3, 224, 224, device=devices[0])
        y = torch.randint(0, 1000, (args.batch,), device=devices[-1])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model.step(x, y, F.cross_entropy)
            opt.step()

        label, sync, parts = "in-process", devices, list(parts)
    else:
        import seqify.distributed as sd

        sd.init()
        stage = sd.stage(seq, balance=args.balance or "time", chunks=args.chunks, schedule="1f1b", graphs=True, sample=micro)
        x = torch.randn(args.batch, 3, 224, 224, device=stage.device)
        y = torch.randint(0, 1000, (args.batch,), device=stage.device)
        opt = torch.optim.SGD(stage.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            stage.step(x if stage.is_first else None, y if stage.is_last else None, loss_fn=F.cross_entropy)
            opt.step()

        label, sync, parts = f"seqify.distributed rank {torch.distributed.get_rank()}", [stage.device], stage.balance
    for _ in range(args.warm):
        step()
    for d in sync:
        torch.cuda.synchronize(d)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        for d in sync:
            torch.cuda.synchronize(d)
        wall = (time.perf_counter() - start) / args.steps
    rows: dict[str, object] = {"probe": label, "chunks": args.chunks, "batch": args.batch, "balance": list(parts),
                               "per_gpu": summary(prof, args.steps, wall)}
    if args.timeline and not args.inprocess:
        rows["timeline"] = timeline(step, sync[0])
    print(json.dumps(rows), flush=True)
    rank = os.environ.get("RANK", "inprocess")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(os.path.join(args.out, f"dist-gap-{rank}-c{args.chunks}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    if not args.inprocess:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
