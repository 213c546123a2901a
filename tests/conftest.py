"""Test-session setup: share the CPU fairly between pytest-xdist workers."""

from __future__ import annotations

import os

import torch

workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if workers > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_cmdline_main(config) -> None:  # type: ignore[no-untyped-def]
    """With -n N, schedule by xdist_group: the largest torchvision models share one worker, one at a time."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") in ("no", "load"):
        config.option.dist = "loadgroup"
