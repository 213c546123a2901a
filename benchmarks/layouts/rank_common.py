"""What the layout benchmark's torchrun workers share: their arguments, main.py's workloads, and each rank's
timing and peak memory."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


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
    """main.py's timing of a row (:func:`timed` there) on this rank's device, every rank starting and ending
    together."""
    return float(layouts().timed(step, [device], steps, warm, barrier=dist.barrier))


def peaks(device: torch.device) -> tuple[list[float], list[float], list[float]]:
    """Every rank's peak allocated, reserved and in-use GiB (main.py's :func:`peaks` of its device), in rank
    order (empty on the CPU)."""
    allocated, reserved, held = layouts().peaks([device])
    if not allocated:
        return [], [], []
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (allocated[0], reserved[0], held[0]))
    return [a for a, _, _ in every], [r for _, r, _ in every], [h for _, _, h in every]
