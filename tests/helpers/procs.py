"""What the processes tests launch need: a free port for their process group, and the caller's environment
with tests/ importable."""

from __future__ import annotations

import os
import socket
from pathlib import Path


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
