"""Schedule: GPipe's fill-drain clock cycles over micro-batches and partitions."""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["clock_cycles"]


def clock_cycles(micro_batches: int, partitions: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, per clock cycle, the (micro-batch, partition) pairs that can run at once.

    Cycle ``k`` runs micro-batch ``i`` on partition ``j`` for every ``i + j == k``: partition ``j``
    receives micro-batch ``i`` one cycle after partition ``j - 1`` produced it.
    """
    for k in range(micro_batches + partitions - 1):
        yield [(k - j, j) for j in range(max(0, k - micro_batches + 1), min(k + 1, partitions))]
