"""Probe: where a pipelined Llama bf16 step's time goes on two GPUs: GPU busy time per device (summed kernel
time from torch.profiler, CUDA graph kernels included) against the step's wall time, beside one GPU training
the same batch whole and in micro-batches (gradient accumulation: what smaller kernels alone cost).

    python benchmarks/probe/llama_pipe_busy.py --chunks 4 8 --schedules zb-h1 1f1b
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llama_bench  # noqa: E402

import seqify  # noqa: E402


def busy(step, devs, steps: int = 2) -> tuple[float, dict[int, float]]:
    for d in devs:
        torch.cuda.synchronize(d)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        for d in devs:
            torch.cuda.synchronize(d)
        wall = (time.perf_counter() - start) / steps
    per: dict[int, float] = collections.defaultdict(float)
    spans: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per[e.device_index] += e.time_range.elapsed_us() / 1e6 / steps
            spans[e.device_index].append((e.time_range.start / 1e3, e.time_range.end / 1e3, e.name[:40]))
    if GAPS:
        origin = min(s[0][0] for s in map(sorted, spans.values()))
        for d, ks in sorted(spans.items()):
            ks.sort()
            gaps, end, last = [], ks[0][1], ks[0][2]
            for a, b, name in ks[1:]:
                if a - end > 0.3:
                    gaps.append((a - end, end - origin, last, name))
                end, last = max(end, b), name
            total = sum(g[0] for g in gaps)
            print(f"  cuda:{d}: {len(gaps)} gaps > 0.3 ms, {total / steps:.1f} ms per step; first at "
                  f"{ks[0][0] - origin:.1f} ms, last end {end - origin:.1f} ms; largest:", flush=True)
            for g in sorted(gaps, reverse=True)[:8]:
                print(f"    {g[0]:6.2f} ms at {g[1]:7.1f} ms after {g[2]!r} before {g[3]!r}", flush=True)
    return wall, dict(per)


GAPS = False


def host(step, devs, steps: int = 3) -> float:
    """Seconds per step the host takes to issue a step (no synchronisation inside)."""
    for d in devs:
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    issued = (time.perf_counter() - start) / steps
    for d in devs:
        torch.cuda.synchronize(d)
    return issued


def show(name: str, wall: float, per: dict[int, float]) -> None:
    cells = "  ".join(f"cuda:{i} busy {t * 1e3:7.1f} ms ({t / wall:4.0%})" for i, t in sorted(per.items()))
    print(f"{name:<48} wall {wall * 1e3:7.1f} ms  {cells}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--schedules", nargs="+", default=["zb-h1"])
    parser.add_argument("--accumulate", action="store_true", help="also one GPU with gradient accumulation")
    args = parser.parse_args()
    bench = llama_bench.main.__globals__
    bench["PRECISION"] = "bf16"
    ns = argparse.Namespace(tiny=False, size="default", hidden=2048, layers=16, heads=16, kv_heads=8, vocab=32000,
                            batch=8, seq=2048)
    devs = [torch.device("cuda:0"), torch.device("cuda:1")]
    lm, ids = llama_bench.build(ns, devs[0])
    step = llama_bench.trainer(lm, ids, devs[:1], False)
    step(); step()
    show("source, one GPU, batch 8", *busy(step, devs[:1]))
    for m in args.chunks if args.accumulate else []:
        def accumulate(m: int = m) -> torch.Tensor:
            for part in ids.chunk(m):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = lm(input_ids=part).logits
                (llama_bench.loss_of(logits, part) / m).backward()
            return logits
        accumulate()
        show(f"source, one GPU, {m} micro-batches accumulated", *busy(accumulate, devs[:1]))
    seq = seqify.convert(lm, example_inputs={"input_ids": ids[:2]}, frontend="export", verify=False)
    plan = seqify.balance(seq, 2, {"input_ids": ids[:1]}, by="time").balance
    print("# balance", plan, flush=True)
    for m in args.chunks:
        for schedule in args.schedules:
            pipe = seqify.pipeline(seq, devices=devs, balance=plan, chunks=m, graphs=True, schedule=schedule,
                                   example_inputs={"input_ids": ids}, checkpoint="never")
            step = llama_bench.trainer(pipe, ids, devs, False)
            step(); step()
            print(f"# host issues a step in {host(step, devs) * 1e3:.1f} ms", flush=True)
            global GAPS
            GAPS = True
            show(f"pipeline {schedule} chunks={m} graphs", *busy(step, devs))
            GAPS = False
            pipe = step = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
