"""The environment of the processes tests launch (torchrun workers): the caller's, with tests/ importable."""

from __future__ import annotations

import os
from pathlib import Path


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with tests/ first on PYTHONPATH (the workers import helpers from it) and the caller's
    PYTHONPATH kept (an environment that imports seqify from it, such as a GPU image's, still does)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, **extra, PYTHONPATH=path)
