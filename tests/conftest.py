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


_HELD = 2 << 30  # bytes of resident memory above which a test's leftovers are collected and trimmed


def _resident() -> int:
    """This process's resident bytes (Linux); where unknown, as if above ``_HELD``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _HELD + 1


@pytest.fixture(autouse=True)
def _give_memory_back() -> Iterator[None]:
    """A worker that has held a 13 GB model keeps those pages unless malloc is asked to return them; after a
    test that leaves the worker holding more than 2 GiB, collect and trim so the next test on that worker (or
    the other worker) starts from what it needs. (Not after every test: a full collection takes 0.2 s once
    transformers and diffusers are imported, minutes over the suite.)"""
    yield
    if _resident() > _HELD:
        gc.collect()
        if _libc is not None and hasattr(_libc, "malloc_trim"):
            _libc.malloc_trim(0)


#: Files whose tests take the longest, longest-running kinds first. With two workers the run ends when the
#: last long test does: started early, long tests overlap the many short ones instead of leaving one worker
#: with a tail of minutes. (xdist runs the largest xdist_group, the torchvision giants, first on its own.)
#: Processes-launching tests come before torchvision's other models, so the worker not holding a giant spends
#: that time on tests that need little memory in the worker itself.
_LONG_FIRST = (
    "test_sweep.py", "test_distributed.py", "test_dist_nodes.py", "test_dist_loops.py", "test_dist_sizes.py", "test_examples.py",
    "test_first_hour.py", "test_timm.py", "test_hf.py", "test_zoo.py", "test_torchvision.py", "test_tune.py",
    "test_fuzz.py", "test_fuzz_autograd.py",
)


def pytest_collection_modifyitems(config, items) -> None:  # type: ignore[no-untyped-def]
    """Long-running files first (a stable sort: within a file, the written order)."""
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(_LONG_FIRST)))
