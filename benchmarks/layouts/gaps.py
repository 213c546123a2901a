"""Where each GPU waits during replicated steps run back to back: a profile of ResNet-101 (fp32) steps, each
GPU's busy time per step and its longest idle gaps, with what ran before and after each and whether the host
was late (the kernel after the gap started within ``--host-us`` of its launch: the GPU waited for the host) or
the GPU waited on another stream or GPU (the kernel was launched well before it could start).

    python benchmarks/layouts/gaps.py --gpus 4 --layout 1x4:gpipe:1:graphs
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from replicated_resnet import arguments, build


def extra(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gap-ms", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--host-us", type=float, default=50.0)


def phase_at(ranges: list[tuple[int, int, str]], t: int) -> str:
    """The innermost benchmark range (zero_grad, pipe.step, opt.step) running on the host at ``t``."""
    inside = [r for r in ranges if r[0] <= t <= r[1]]
    return min(inside, key=lambda r: r[1] - r[0])[2] if inside else "between steps"


def main() -> None:
    args = arguments(__doc__, extra)
    run = build(args)

    def step() -> None:
        with record_function("zero_grad"):
            run.opt.zero_grad(set_to_none=True)
        with record_function("pipe.step"):
            run.pipe.step(run.x, run.y, torch.nn.functional.cross_entropy)
        with record_function("opt.step"):
            run.opt.step()

    for _ in range(4):
        step()
    run.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        run.sync()
        wall = (time.perf_counter() - t0) / args.steps
    print(f"{args.layout} on {args.gpus} GPUs: {wall * 1e3:.1f} ms a step ({args.steps} back to back)")
    events: list[Any] = list(prof.profiler.kineto_results.events())
    ranges = [(e.start_ns(), e.start_ns() + e.duration_ns(), e.name()) for e in events
              if e.name() in ("zero_grad", "pipe.step", "opt.step")]
    launches = {e.correlation_id(): e.start_ns() for e in events
                if e.device_type() == torch.autograd.DeviceType.CPU and e.name().startswith("cuda")}
    per: dict[int, list[tuple[int, int, str, int]]] = {}
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            per.setdefault(e.device_index(), []).append(
                (e.start_ns(), e.start_ns() + e.duration_ns(), e.name(), e.correlation_id()))
    for dev, spans in sorted(per.items()):
        spans.sort()
        busy, gaps, end, prev = 0, [], spans[0][0], spans[0][2]
        for s, e, name, corr in spans:
            if s > end and (s - end) / 1e6 >= args.gap_ms:
                launched = launches.get(corr)
                late = launched is not None and (s - launched) / 1e3 < args.host_us
                why = (f"host late, in {phase_at(ranges, launched)}" if late else
                       f"waited {(s - launched) / 1e6:.2f} ms after launch" if launched else "launch unknown")
                gaps.append(((s - end) / 1e6, prev[:50], name[:50], why))
            busy += max(0, e - max(s, end))
            if e > end:
                end, prev = e, name
        span = (end - spans[0][0]) / 1e6
        idle = sum(g[0] for g in gaps)
        print(f"cuda:{dev}: busy {busy / 1e6 / args.steps:.1f} ms a step; over {args.steps} steps ({span:.1f} ms) "
              f"idle {idle:.1f} ms in {len(gaps)} gaps of >= {args.gap_ms} ms")
        for gap, before, after, why in sorted(gaps, reverse=True)[:8]:
            print(f"   idle {gap:6.2f} ms  after {before!r}  before {after!r}  ({why})")


if __name__ == "__main__":
    main()
