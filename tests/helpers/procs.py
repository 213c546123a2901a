"""What the processes tests launch need: a free port for their process group, the caller's environment with
tests/ importable, and ranks started from a server that has imported torch and seqify once."""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

#: What the fork server imports once, so that no rank it forks imports them again (2-4 s a rank each): torch,
#: seqify, torch._dynamo (the first optimizer a process builds imports it) and the transformers models the workers
#: build (skipped where transformers is not installed)
PRELOAD = ["torch", "torch._dynamo", "seqify", "helpers.dist_worker", "transformers.models.gpt2.modeling_gpt2",
           "transformers.models.llama.modeling_llama"]


def spawn(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, join: bool = True) -> Any:
    """``torch.multiprocessing.spawn`` with each rank forked from a fork server that has imported :data:`PRELOAD`
    and run no torch operation (no thread pool or process group to inherit), instead of a new interpreter that
    imports them again."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with tests/ first on PYTHONPATH (the workers import helpers from it) and the caller's
    PYTHONPATH kept (an environment that imports seqify from it, such as a GPU image's, still does)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, **extra, PYTHONPATH=path)
