"""seqify.distributed reads its per-rank order from the shared schedules (no processes needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import seqify
import seqify.distributed as sd
from seqify.errors import ScheduleError
from seqify.pipeline.schedule import Action, Schedule, make

pytestmark = pytest.mark.timeout(60)


def stages(schedule: str | Schedule, n: int = 3) -> list[sd.DistributedStage]:
    seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])
    return [sd.DistributedStage(seq, [1] * n, index=i, device=torch.device("cpu"), schedule=schedule) for i in range(n)]


def by_hand(order: list[list[tuple[str, int]]], m: int) -> Schedule:
    """A schedule from per-rank lists: issue each rank's next action once what it needs has run."""
    from seqify.pipeline.schedule import needs

    todo = [list(work) for work in order]
    done: set[tuple[int, int, str]] = set()
    actions: list[Action] = []
    while any(todo):
        progress = False
        for d, work in enumerate(todo):
            if work and all(n in done for n in needs(d, work[0][1], work[0][0], len(order))):
                kind, i = work.pop(0)
                actions.append(Action(d, d, i, kind))  # type: ignore[arg-type]
                done.add((d, i, kind))
                progress = True
        if not progress:  # an order that cannot run: issue the rest as given, for check() to refuse
            rest = [Action(d, d, i, kind) for d, work in enumerate(todo) for kind, i in work]  # type: ignore[arg-type]
            actions += rest
            break
    return Schedule("by-hand", tuple(range(len(order))), m, tuple(actions))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_each_rank_runs_its_devices_list_of_the_shared_schedule(name: str) -> None:
    plan = make(name, (0, 1, 2), 4)
    for s in stages(name):
        assert s.order(4) == [(a.kind, a.microbatch) for a in plan.per_device()[s.index] if a.kind != "W"]
    # 1F1B keeps at most (ranks - rank) micro-batches in flight: the schedule's bound, not GPipe's
    if name == "1f1b":
        first = stages(name)[0].order(4)
        assert first[:4] == [("F", 0), ("F", 1), ("F", 2), ("B", 0)]


def test_a_schedule_object_sets_the_order() -> None:
    # GPipe with backwards in reverse micro-batch order on every rank: a valid schedule the names do not give.
    order = [[("F", i) for i in range(3)] + [("B", i) for i in reversed(range(3))] for _ in range(2)]
    plan = by_hand(order, 3)
    plan.check()
    assert [s.order(3) for s in stages(plan, 2)] == order


def test_ranks_meeting_micro_batches_in_different_orders_are_refused() -> None:
    order = [[("F", 0), ("F", 1), ("B", 0), ("B", 1)], [("F", 0), ("F", 1), ("B", 1), ("B", 0)]]
    plan = by_hand(order, 2)
    with pytest.raises(ScheduleError, match="same order"):
        stages(plan, 2)[0].order(2)


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ScheduleError, match="zb-h1"):
        stages("pipedream")


def test_graphs_with_checkpointing_is_refused() -> None:
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(seqify.BalanceError, match="checkpoint='never'"):
        sd.DistributedStage(seq, [1, 1], index=0, device=torch.device("cpu"), graphs=True, checkpoint="always")
