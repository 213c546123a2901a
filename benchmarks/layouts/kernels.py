"""Where a step's GPU time goes on one GPU, by kind of kernel: the 0.89 B Llama (bf16 autocast, SGD) trained plainly
and as each seqify layout ``--layouts`` names (``1x1:schedule:chunks[:graphs][:loopsK]``), a few steps profiled
back to back. Per layout and per step: wall time, the GPU's busy time, and kernel time by kind (matrix
multiplies, attention, elementwise, reductions, copies, other), each with its kernel count, so two layouts that
differ in speed show what differs; beside them the peak allocated, reserved and in-use GiB of the profiled steps.

    python benchmarks/layouts/kernels.py --layouts 1x1:gpipe:1:graphs 1x1:interleaved:2:graphs:loops4
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from main import cast, llama, peaks, plain_step, reset, workload
from torch.profiler import ProfilerActivity, profile

import seqify

RANGES = ("PP:",)  # seqify's profiler ranges, which the profiler also draws on the GPU's timeline: not kernels
KINDS = [
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|xmma|cutlass|cublas|Kernel2|sm\d+_|nvjet|matmul", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|cat|fill", re.I)),
    ("reduction", re.compile(r"reduce|softmax|norm|sum|mean|nll|cross_entropy|log_softmax", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|mul|add|silu", re.I)),
]


def kind(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def profiled(step: Callable[[], None], sync: Callable[[], None], steps: int, top_n: int) -> dict[str, Any]:
    """``steps`` of ``step`` back to back under the profiler: ms per step of wall time, busy time and each kind."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - start
    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                   for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA and not e.name().startswith(RANGES))
    by = collections.Counter[str]()
    count = collections.Counter[str]()
    top = collections.Counter[str]()
    busy, end = 0, spans[0][0] if spans else 0
    for s, e, name in spans:
        by[kind(name)] += e - s
        count[kind(name)] += 1
        top[name[:90]] += e - s
        busy += max(0, e - max(s, end))
        end = max(end, e)
    ms = 1e-6 / steps
    return dict(wall_ms=round(wall * 1e3 / steps, 2), busy_ms=round(busy * ms, 2),
                kinds={k: dict(ms=round(v * ms, 2), kernels=count[k] // steps) for k, v in by.most_common()},
                top=[dict(ms=round(v * ms, 2), kernel=n) for n, v in top.most_common(top_n)])


def plain(args: argparse.Namespace, work: Any, dev: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    return plain_step(work, dev, args.per_gpu), torch.cuda.synchronize


def layout(args: argparse.Namespace, work: Any, dev: torch.device, spec: str) -> tuple[Callable[[], None], Any]:
    _, schedule, chunks, *rest = spec.split(":")
    loops = next((int(r[len("loops"):]) for r in rest if r.startswith("loops")), 1)
    x, y = work.data(args.per_gpu)
    seq = seqify.convert(work.build(), (x[:2],), verify=False)
    x, y = x.to(dev), y.to(dev)
    with cast(work, dev):
        pipe = seqify.pipeline(seq, devices=[dev], replicas=1, chunks=int(chunks), schedule=schedule, loops=loops,
                               graphs="graphs" in rest, checkpoint="never", balance="time", sample=x)
    opt = pipe.optimizer(work.optimizer)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with cast(work, dev):
            pipe.step(x, y, work.loss)
        opt.step()

    return step, torch.cuda.synchronize


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama"], default="llama")
    p.add_argument("--per-gpu", type=int, default=4)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--top", type=int, default=40, help="the kernels with the most time to list")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None, help="a JSON lines file to append the rows to")
    args = p.parse_args(argv)
    work = llama(args.tiny) if args.model == "llama" else workload(args.model, args.tiny)
    dev = torch.device("cuda:0")
    for spec in ["one GPU", *args.layouts]:
        step, sync = plain(args, work, dev) if spec == "one GPU" else layout(args, work, dev, spec)
        for _ in range(args.warm):
            step()
        sync()
        torch.cuda.reset_peak_memory_stats(dev)
        timing = profiled(step, sync, args.steps, args.top)
        allocated, reserved, held = peaks([dev])
        row = dict(row=spec, device=torch.cuda.get_device_name(0), torch=torch.__version__, per_gpu=args.per_gpu,
                   peak_gib=allocated, reserved_gib=reserved, in_use_gib=held, **timing)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        del step, sync
        reset([dev])


if __name__ == "__main__":
    sys.exit(main())
