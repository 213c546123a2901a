"""What the torchrun benchmarks (benchmarks/distributed/main.py, benchmarks/two_gpus/torchpp.py) share: timing a step on every
rank, one JSON row per configuration, and rank 0 writing the rows."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def measure(step: Callable[[], None], warm: int, steps: int, device: torch.device) -> tuple[float, list[float]]:
    """Seconds per step after ``warm`` untimed steps (ranks in step), and every rank's peak allocated GiB."""
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    sec = (time.perf_counter() - start) / steps
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    return sec, [round(float(v), 2) for v in peaks]


def reserved(device: torch.device) -> list[float]:
    """Every rank's peak reserved GiB (the caching allocator's pool) since the last reset."""
    peak = torch.tensor([torch.cuda.max_memory_reserved(device) / 2**30], device=device)
    peaks = [torch.zeros_like(peak) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, peak)
    return [round(float(v), 2) for v in peaks]


def row(name: str, batch: int, sec: float, peaks: list[float], **extra: Any) -> dict[str, Any]:
    return dict(name=name, batch=batch, sec_per_step=round(sec, 4), samples_per_s=round(batch / sec, 1),
                peak_gib=peaks, **extra)


def error_row(name: str, e: BaseException) -> dict[str, Any]:
    return dict(name=name, error=f"{type(e).__name__}: {str(e)[:300]}")


def report(rows: list[dict[str, Any]], r: dict[str, Any]) -> None:
    """Keep a row; rank 0 prints it as it comes."""
    rows.append(r)
    if dist.get_rank() == 0:
        print(json.dumps(r), flush=True)
    torch.cuda.empty_cache()


def finish(rows: list[dict[str, Any]], path: str) -> None:
    """Rank 0 writes the rows to ``path``; every rank leaves the process group."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()
