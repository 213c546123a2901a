"""What the seqify commands share on the console: exit codes, section headings with a clock, the GPU count."""

from __future__ import annotations

import time

import torch

__all__ = ["OK", "NOT_EXACT", "section", "restart_clock", "gpu_count"]

OK, NOT_EXACT = 0, 1

_started = time.perf_counter()


def restart_clock() -> float:
    """Start the clock that section headings show from now; returns now (``time.perf_counter()``)."""
    global _started
    _started = time.perf_counter()
    return _started


def section(title: str, clock: bool = False) -> None:
    """A heading: ``== title``, with the seconds since the clock started when ``clock``."""
    when = f"  [{time.perf_counter() - _started:.1f} s]" if clock else ""
    print(f"\n== {title}{when}", flush=True)


def gpu_count() -> int:
    """How many CUDA GPUs this process sees (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
