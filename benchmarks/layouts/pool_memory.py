"""Where a seqify step's memory goes on one GPU: the 0.89 B Llama, the 7.2 B one cut to ``--layers``, or
ResNet-101 (or ``--tiny``) as one replica on one GPU, one micro-batch by default (main.py's ``1x1:gpipe:1``
layout), eager or with CUDA graphs (their pools in expandable segments unless ``--no-expandable-pools``), built
and stepped under the caching allocator's history. Prints the peaks as main.py counts them (allocated, reserved,
in use with graphs' pools) and, from the history, the live bytes at the peak of the default pool and of the
graphs' private pools, by the Python lines that allocated them (an allocation with no Python line is the autograd
engine's: a backward).

    python benchmarks/layouts/pool_memory.py --graphs --out graphs.json
    python benchmarks/layouts/pool_memory.py --model resnet101 --per-gpu 128 --graphs --no-expandable-pools
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/layouts/pool_memory.py --graphs
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import sys
from typing import Any

import torch
from main import GIB, cast, llama, peaks, reset, resnet

import seqify
from seqify.pipe.executors.options import ReplayOptions

OURS = ("seqify/", "transformers/", "benchmarks/")


def site(frames: list[dict[str, Any]]) -> str:
    """The first three lines of ours (seqify, transformers, this benchmark) that led to an allocation."""
    mine = [f for f in frames if any(o in f["filename"] for o in OURS)]
    if not mine:
        return "no line of ours: " + (frames[0]["name"] if frames else "autograd engine")
    return " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in mine[:3])


def pools(snapshot: dict[str, Any], device: int) -> list[tuple[int, int, bool]]:
    """(start, end, private) of each segment on ``device`` when the snapshot was taken, by start."""
    return sorted((s["address"], s["address"] + s["total_size"], tuple(s["segment_pool_id"]) != (0, 0))
                  for s in snapshot["segments"] if s["device"] == device)


def private(ranges: list[tuple[int, int, bool]], addr: int) -> bool:
    """Whether ``addr`` lies in a private pool's segment (False: the default pool's, or one since freed)."""
    k = bisect.bisect_right(ranges, (addr, float("inf"), True)) - 1
    return k >= 0 and ranges[k][0] <= addr < ranges[k][1] and ranges[k][2]


def at_peaks(snapshot: dict[str, Any], device: int, top: int) -> dict[str, Any]:
    """Replay the allocation history: for the default pool and the private pools, the most bytes live at once and
    the sites holding them then."""
    ranges = pools(snapshot, device)
    trace = snapshot["device_traces"][device]
    made: dict[int, tuple[int, str, str]] = {}  # event index of each allocation -> (bytes, pool, site)
    live: dict[int, int] = {}  # address -> the event index that allocated it
    totals = collections.Counter[str]()
    best: dict[str, tuple[int, int]] = {}
    for k, e in enumerate(trace):
        if e["action"] == "alloc":
            kind = "private" if private(ranges, e["addr"]) else "default"
            made[k] = (e["size"], kind, site(e.get("frames", [])))
            live[e["addr"]] = k
            totals[kind] += e["size"]
            if totals[kind] > best.get(kind, (0, -1))[0]:
                best[kind] = (totals[kind], k)
        elif e["action"] == "free_completed" and e["addr"] in live:
            size, was, _ = made[live.pop(e["addr"])]
            totals[was] -= size
    out: dict[str, Any] = {}
    for kind, (peak, index) in best.items():
        alive: dict[int, int] = {}  # the allocations alive just after event ``index``, by address
        for k, e in enumerate(trace[: index + 1]):
            if e["action"] == "alloc":
                alive[e["addr"]] = k
            elif e["action"] == "free_completed":
                alive.pop(e["addr"], None)
        by = collections.Counter[str]()
        count = collections.Counter[str]()
        for size, was, where in (made[k] for k in alive.values()):
            if was == kind:
                by[where] += size
                count[where] += 1
        out[kind] = dict(peak_gib=round(peak / GIB, 3), event=index, events=len(trace),
                         sites=[dict(gib=round(b / GIB, 3), n=count[w], site=w) for w, b in by.most_common(top)])
    segs = [s for s in snapshot["segments"] if s["device"] == device]
    for kind, want in (("private", True), ("default", False)):
        mine = [s for s in segs if (tuple(s["segment_pool_id"]) != (0, 0)) == want]
        out.setdefault(kind, {}).update(
            segments=len(mine), reserved_gib=round(sum(s["total_size"] for s in mine) / GIB, 3),
            allocated_gib_now=round(sum(s["allocated_size"] for s in mine) / GIB, 3))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama", "llama8b", "resnet101"], default="llama")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    p.add_argument("--schedule", default="gpipe")
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--loops", type=int, default=1, help="parts on the GPU (cut evenly by layer count)")
    p.add_argument("--graphs", action="store_true")
    p.add_argument("--no-cast-once", action="store_true", help="autocast casts each weight in each program")
    p.add_argument("--no-expandable-pools", action="store_true", help="graphs' pools in fixed-size segments")
    p.add_argument("--per-gpu", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="a JSON file for the summary")
    p.add_argument("--snapshot", default=None, help="a pickle file for the allocator's whole history")
    args = p.parse_args(argv)
    work = (resnet(args.tiny) if args.model == "resnet101" else
            llama(args.tiny, "8b" if args.model == "llama8b" else "0.89b", args.layers))
    dev = torch.device("cuda:0")
    torch.empty(0, device=dev)  # the allocator exists before its peaks are reset
    reset([dev])
    x, y = work.data(args.per_gpu)
    seq = seqify.convert(work.build(), (x[:2],), verify=False)
    x, y = x.to(dev), y.to(dev)
    torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    even = [len(seq) // args.loops + (k < len(seq) % args.loops) for k in range(args.loops)]
    with cast(work, dev):
        pipe = seqify.pipeline(seq, devices=[dev], replicas=1, chunks=args.chunks, schedule=args.schedule,
                               loops=args.loops, graphs=args.graphs, checkpoint="never", balance=even,
                               replay_options=ReplayOptions(cast_once=not args.no_cast_once,
                                                            expandable_pools=not args.no_expandable_pools))
    opt = work.optimizer(pipe.parameters())
    for k in range(args.steps):
        if k == args.steps - 1:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        opt.zero_grad(set_to_none=True)
        with cast(work, dev):
            pipe.step(x, y, work.loss)
        opt.step()
    torch.cuda.synchronize(dev)
    allocated, reserved, held = peaks([dev])
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if args.snapshot:
        import pickle

        with open(args.snapshot, "wb") as f:
            pickle.dump(snapshot, f)
    summary = dict(model=args.model, layers=args.layers, schedule=args.schedule, chunks=args.chunks,
                   loops=args.loops, graphs=args.graphs, cast_once=not args.no_cast_once,
                   expandable_pools=not args.no_expandable_pools, per_gpu=args.per_gpu,
                   alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), torch=torch.__version__,
                   device=torch.cuda.get_device_name(0), last_step_peak_gib=allocated, last_step_reserved_gib=reserved,
                   last_step_in_use_gib=held, history=at_peaks(snapshot, 0, args.top))
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
