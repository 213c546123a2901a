"""NoPlanFitsError, and BalanceError re-exported: why a model cannot be partitioned as asked, and what to change."""

from __future__ import annotations

from seqify.errors import BalanceError

__all__ = ["BalanceError", "NoPlanFitsError"]


class NoPlanFitsError(BalanceError):
    """No contiguous plan with the asked number of stages keeps every stage under ``memory_cap``.

    ``cap`` is the cap that was asked for, ``smallest_cap`` the smallest cap that some plan with that
    many stages meets (bytes), and ``partitions_needed`` the fewest stages that meet ``cap`` (``None``
    when a single layer alone exceeds it).
    """

    def __init__(self, message: str, *, cap: float, smallest_cap: float, partitions_needed: int | None) -> None:
        super().__init__(message)
        self.cap = cap
        self.smallest_cap = smallest_cap
        self.partitions_needed = partitions_needed
