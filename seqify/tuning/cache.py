"""tune_cache: where seqify.tune keeps its choices, keyed by model fingerprint, input, devices and options."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.pipe.config import PipeConfig

__all__ = ["cache_path", "fingerprint", "key", "read", "write", "SPACE"]

#: The version of the search space, in the cache key: what the candidates range over and how they are weighed.
#: Raise it whenever either changes, so that no choice cached by an earlier search is reused (CHANGELOG.md).
SPACE = "7"


def cache_path() -> str:
    """Where choices are cached: ``$SEQIFY_CACHE_DIR/tune.json``, default ``~/.cache/seqify/tune.json``."""
    folder = os.environ.get("SEQIFY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "seqify")
    return os.path.join(folder, "tune.json")


def fingerprint(model: nn.Module) -> str:
    """A hash of the layers' names and types and every parameter's and buffer's name, shape and dtype
    (not their values: training does not change the best configuration)."""
    h = hashlib.sha256()
    for name, child in model.named_children():
        h.update(f"{name}:{type(child).__qualname__};".encode())
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()[:16]


def _describe(sample: Any) -> list[Any]:
    leaves = pytree.tree_leaves(sample)
    return [[list(t.shape), str(t.dtype)] if isinstance(t, torch.Tensor) else repr(t) for t in leaves]


def _device_names(devices: Sequence[torch.device]) -> list[str]:
    return [f"{d}:{torch.cuda.get_device_name(d)}" if d.type == "cuda" else str(d) for d in devices]


def key(model: nn.Module, sample: Any, devices: Sequence[torch.device], options: dict[str, Any]) -> str:
    """The cache key of a tuning: model, input shapes and dtypes, devices, options, versions and search space."""
    from seqify._version import __version__

    text = json.dumps([fingerprint(model), _describe(sample), _device_names(devices), options, __version__,
                       torch.__version__, SPACE, _precision(devices)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _precision(devices: Sequence[torch.device]) -> dict[str, str]:
    """The autocast dtype per device type where autocast is on: a bf16 step is tuned apart from float32's."""
    kinds = sorted({d.type for d in devices})
    return {k: str(torch.get_autocast_dtype(k)) for k in kinds if torch.is_autocast_enabled(k)}


def read() -> dict[str, Any]:
    """Every cached choice by key (empty when the file is missing or unreadable)."""
    try:
        with open(cache_path()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write(name: str, cfg: PipeConfig) -> None:
    """Add ``cfg`` under ``name``, replacing the file whole so readers never see half of it."""
    path = cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    data = read()
    data[name] = cfg.to_dict()
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
