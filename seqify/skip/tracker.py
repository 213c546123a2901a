"""SkipTracker: where stashed skip values wait until they are popped, one per thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from seqify.errors import SkipError
from seqify.skip.namespace import SkipKey

__all__ = ["SkipTracker", "current_tracker", "use_tracker"]


class SkipTracker:
    """Holds stashed values by (namespace, name) until their pop takes them."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[SkipKey, Any] = {}

    def stash(self, key: SkipKey, value: Any) -> None:
        if key in self.values:
            raise SkipError(
                f"skip {key[1]!r} is stashed twice before it is popped; each skip name must be "
                "stashed once and popped once (isolate repeated layers with a Namespace)"
            )
        self.values[key] = value

    def pop(self, key: SkipKey) -> Any:
        try:
            return self.values.pop(key)
        except KeyError:
            raise SkipError(
                f"skip {key[1]!r} is popped but nothing stashed it; a layer before this one must "
                "stash it (check the layer order and the Namespace of both layers)"
            ) from None

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        return f"SkipTracker({sorted(name for _, name in self.values)})"


_local = threading.local()


def current_tracker() -> SkipTracker:
    """The tracker of this thread: the one a pipeline or a converted model installed, else a default."""
    tracker: SkipTracker | None = getattr(_local, "tracker", None)
    if tracker is None:
        tracker = _local.tracker = SkipTracker()
    return tracker


@contextmanager
def use_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Install ``tracker`` for this thread while the block runs."""
    previous = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = previous

