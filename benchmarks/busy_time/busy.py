"""GPU busy time per device (summed kernel time from torch.profiler, CUDA graph kernels included) against a
step's wall time, the host's issue time, and the largest idle gaps: what benchmarks/busy_time/main.py reads."""

from __future__ import annotations

import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile


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

