"""What the layout benchmark's torchrun workers share: their arguments, main.py's workloads, and each rank's
timing and peak memory."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

GIB = 2**30


def load(name: str, path: Path) -> Any:
    """The benchmark script at ``path`` imported as module ``name``, once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def layouts() -> Any:
    """benchmarks/layouts/main.py (its workloads: model, data, loss, precision and optimizer)."""
    return load("layouts_main", Path(__file__).with_name("main.py"))


def arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options every worker takes: the workload, its samples per process, the configuration file, timing."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet101", "llama", "llama8b"], default="resnet101")
    p.add_argument("--per-gpu", type=int, default=128)
    p.add_argument("--config", required=True, help="the PipeConfig file (its devices = the processes)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="the CPU smoke run's small models (gloo)")
    return p


def timed(step: Any, device: torch.device, steps: int, warm: int) -> float:
    """Mean seconds of ``step()`` over ``steps`` run back to back after ``warm``, every rank synchronized at the
    ends only (as main.py times its rows); peaks counted from the first timed step."""
    for _ in range(warm):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def peaks(device: torch.device) -> tuple[list[float], list[float]]:
    """Every rank's peak allocated and reserved GiB, in rank order (empty on the CPU)."""
    if device.type != "cuda":
        return [], []
    mine = (round(torch.cuda.max_memory_allocated(device) / GIB, 2),
            round(torch.cuda.max_memory_reserved(device) / GIB, 2))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [a for a, _ in every], [r for _, r in every]
