"""Expandable pool segments: a device's graphs capture into one growing mapping, whose freed blocks merge."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

__all__ = ["expandable_segments", "is_expandable"]

_KEY = "expandable_segments"


def is_expandable(settings: str) -> bool:
    """Whether an allocator settings string (``PYTORCH_CUDA_ALLOC_CONF``'s syntax) turns expandable segments on
    (its last ``expandable_segments`` entry wins)."""
    on = False
    for item in settings.split(","):
        key, _, value = item.partition(":")
        if key.strip() == _KEY:
            on = value.strip() == "True"
    return on


def _settings() -> str:
    """The caching allocator's settings as last given (the environment's, or the last runtime change)."""
    get: Callable[[], str] | None = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        return get()
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))


@contextlib.contextmanager
def expandable_segments(enabled: bool = True) -> Iterator[None]:
    """Within the block, segments the caching allocator creates are expandable; after it, its settings are what
    they were.

    A graph pool keeps what its captures reserved for as long as the graphs live. Blocks a capture frees merge
    only with neighbours in their own segment, so in fixed-size segments (the allocator's default) a pool
    reserves well beyond its most bytes alive at once; one growing mapping merges them all (measured in
    docs/design/replay.md, "Memory pools"). Segments created outside the block (the weights', the gradient
    sums', the buffers') stay as the user configured them. Nothing changes where the settings cannot be changed
    at runtime (an older torch, or an allocator other than the native one), or where expandable segments are
    already on."""
    change: Callable[[str], None] | None = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if not enabled or change is None or torch.cuda.get_allocator_backend() != "native":
        yield
        return
    before = _settings()
    if is_expandable(before):
        yield
        return
    # a change resets the settings it does not name (max_split_size_mb, ...): the user's go first each time
    kept = f"{before}," if before else ""
    change(f"{kept}{_KEY}:True")
    try:
        yield
    finally:
        change(f"{kept}{_KEY}:False")
