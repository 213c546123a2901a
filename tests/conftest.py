"""Test-session setup: share the CPU fairly between pytest-xdist workers and give memory back after each test."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Iterator

import pytest
import torch

workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_cmdline_main(config) -> None:  # type: ignore[no-untyped-def]
    """With -n N, schedule by xdist_group: the largest torchvision models share one worker, one at a time."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") in ("no", "load"):
        config.option.dist = "loadgroup"


_libc = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


@pytest.fixture(autouse=True)
def _give_memory_back() -> Iterator[None]:
    """A worker that has held a 13 GB model keeps those pages unless malloc is asked to return them; trim
    after each test so the next test on that worker (or the other worker) starts from what it needs."""
    yield
    gc.collect()
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)
