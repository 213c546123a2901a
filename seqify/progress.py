"""progress: a dependency-free progress bar on stderr, shown only where someone is watching."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress", "shown"]

T = TypeVar("T")

_WIDTH = 28


def shown(enabled: bool = True) -> bool:
    """Whether a bar would be drawn: ``enabled``, and stderr is a terminal or ``SEQIFY_PROGRESS=1``."""
    if not enabled:
        return False
    if os.environ.get("SEQIFY_PROGRESS") == "1":
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress(iterable: Iterable[T], total: int, desc: str = "", enabled: bool = True) -> Iterator[T]:
    """Yield from ``iterable`` and draw ``desc [####    ] i/total`` on stderr as it goes.

    Silent unless ``enabled`` and stderr is a TTY (or the environment sets ``SEQIFY_PROGRESS=1``).
    """
    if not shown(enabled):
        yield from iterable
        return
    start = time.perf_counter()
    done = 0
    _draw(desc, done, total, 0.0)
    try:
        for item in iterable:
            yield item
            done += 1
            _draw(desc, done, total, time.perf_counter() - start)
    finally:
        sys.stderr.write("\n")
        sys.stderr.flush()


def _draw(desc: str, done: int, total: int, elapsed: float) -> None:
    frac = min(done / total, 1.0) if total > 0 else 1.0
    filled = int(round(frac * _WIDTH))
    bar = "#" * filled + " " * (_WIDTH - filled)
    sys.stderr.write(f"\r{desc} [{bar}] {done}/{total} {elapsed:5.1f}s")
    sys.stderr.flush()
