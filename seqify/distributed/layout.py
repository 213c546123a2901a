"""Which rank of a pipeline holds each of its partitions: the schedule's placement, checked against the balance."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from seqify.errors import BalanceError, ScheduleError
from seqify.pipe.placement import _check_balance
from seqify.schedule.actions import SCHEDULES, Schedule, round_robin, v_shape

__all__ = ["placement_for", "layout_of"]


def placement_for(schedule: str | Schedule, ranks: int, loops: int) -> tuple[int, ...]:
    """Which rank (of one pipeline) holds each partition: a ``Schedule``'s own placement; one partition
    per rank for ``loops=1``; a V (``v_shape``) for 'zb-h1' with ``loops=2``; else round-robin."""
    if isinstance(schedule, Schedule):
        return tuple(schedule.placement)
    if loops == 1:
        return tuple(range(ranks))
    if schedule == "zb-h1":
        if loops != 2:
            raise ScheduleError(f"zb-h1 with loops={loops}: it runs one partition per rank, or two placed in a V "
                                "(loops=2); use schedule='interleaved' for more")
        return v_shape(ranks)
    if schedule in ("1f1b", "zb-h2"):
        raise ScheduleError(f"{schedule} runs one partition per rank; with loops > 1 use schedule='interleaved' (or "
                            "'gpipe', or 'zb-h1' with loops=2)")
    return round_robin(ranks, loops)


def layout_of(balance: Sequence[int], layers: int, schedule: str | Schedule,
            loops: Any) -> tuple[list[int], tuple[int, ...]]:
    """The checked balance and the rank of each partition: the schedule's own placement, or ``loops``
    partitions per rank as the named schedule places them."""
    if not isinstance(schedule, Schedule) and schedule not in SCHEDULES:
        raise ScheduleError(f"schedule={schedule!r}: choose one of {SCHEDULES} or pass a "
                            "seqify.schedule.actions.Schedule")
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise BalanceError(f"loops={loops!r}: give the number of partitions per rank, a whole number >= 1")
    balance = _check_balance(balance, layers)
    if isinstance(schedule, Schedule):
        placement = placement_for(schedule, 0, 0)
    else:
        if len(balance) % loops:
            raise BalanceError(f"balance has {len(balance)} partitions, not a multiple of loops={loops}: give "
                               "loops entries per rank")
        placement = placement_for(schedule, len(balance) // loops, loops)
    if len(placement) != len(balance):
        raise ScheduleError(f"schedule {getattr(schedule, 'name', schedule)!r} places {len(placement)} "
                            f"partitions, but balance has {len(balance)}: build it for this balance")
    ranks = max(placement) + 1
    if sorted(set(placement)) != list(range(ranks)):
        raise ScheduleError(f"placement {placement} leaves a rank without partitions; number ranks 0..n-1")
    return list(balance), tuple(placement)
