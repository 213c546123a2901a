"""The random generators training draws from (dropout, data order): captured with a checkpoint, restored with it."""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["capture", "restore"]


def capture() -> dict[str, Any]:
    """The state of torch's CPU generator, each CUDA device's (where CUDA has been initialised), Python's
    ``random`` and numpy's global generator (where numpy is imported), as plain values and tensors."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the generators :func:`capture` saw (CUDA: the devices present, up to as many as were saved)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)
    if "numpy" in state:
        _restore_numpy(state["numpy"])


def _restore_numpy(saved: tuple[Any, ...]) -> None:
    try:
        import numpy as np
    except ImportError:  # saved where numpy was imported, loaded where it is not installed: nothing draws from it
        return
    name, keys, pos, has_gauss, cached = saved
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
