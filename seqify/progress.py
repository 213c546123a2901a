"""progress: a dependency-free progress bar on stderr on a terminal, a line now and then in a log; rank 0 only."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["progress", "rank", "shown"]

T = TypeVar("T")

_WIDTH = 28
_LINE_AFTER = 3.0  # seconds: without a terminal, waits shorter than this print nothing
_LINE_EVERY = 10.0  # seconds between lines without a terminal


def rank() -> int:
    """This process's rank under torchrun: torch.distributed's once a process group is up, else ``RANK`` (0
    outside torchrun). torch is not imported here: a process that never imported torch.distributed has no group."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def shown(enabled: bool = True) -> bool:
    """Whether a bar would be drawn: ``enabled`` on rank 0, and stderr is a terminal or ``SEQIFY_PROGRESS=1``."""
    if not enabled or rank() != 0:
        return False
    if os.environ.get("SEQIFY_PROGRESS") == "1":
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress(iterable: Iterable[T], total: int, desc: str = "", enabled: bool = True) -> Iterator[T]:
    """Yield from ``iterable`` and draw ``desc [####    ] i/total`` on stderr as it goes.

    The bar needs ``enabled`` and stderr a TTY (or ``SEQIFY_PROGRESS=1``); otherwise, if ``enabled``, waits
    over a few seconds print a plain line every ten seconds (``SEQIFY_PROGRESS=0`` silences both). Under
    torchrun only rank 0 draws either: the other ranks would repeat its lines, interleaved.
    """
    enabled = enabled and rank() == 0
    if not shown(enabled):
        if enabled and os.environ.get("SEQIFY_PROGRESS") != "0":
            yield from _lines(iterable, total, desc)
        else:
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


def _lines(iterable: Iterable[T], total: int, desc: str) -> Iterator[T]:
    """Without a terminal (a log, CI): one line ``desc: i/total, N s`` once a wait passes a few seconds, then
    every ten seconds and at the end, so long waits are never silent and short ones add nothing."""
    start = time.perf_counter()
    last, done, printed = start - _LINE_EVERY + _LINE_AFTER, 0, False
    for item in iterable:
        yield item
        done += 1
        now = time.perf_counter()
        if now - last >= _LINE_EVERY and done < total:
            sys.stderr.write(f"{desc or 'working'}: {done}/{total}, {now - start:.0f} s\n")
            sys.stderr.flush()
            last, printed = now, True
    if printed:
        sys.stderr.write(f"{desc or 'working'}: {done}/{total} done in {time.perf_counter() - start:.0f} s\n")
        sys.stderr.flush()


def _draw(desc: str, done: int, total: int, elapsed: float) -> None:
    frac = min(done / total, 1.0) if total > 0 else 1.0
    filled = int(round(frac * _WIDTH))
    bar = "#" * filled + " " * (_WIDTH - filled)
    sys.stderr.write(f"\r{desc} [{bar}] {done}/{total} {elapsed:5.1f}s")
    sys.stderr.flush()
