"""seqify.distributed reads its per-rank order from the shared schedules (no processes needed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import seqify
import seqify.distributed as sd
from seqify.errors import ScheduleError
from seqify.schedule.actions import Action, Schedule, make

pytestmark = pytest.mark.timeout(60)


def stages(schedule: str | Schedule, n: int = 3) -> list[sd.DistributedStage]:
    seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])
    return [sd.DistributedStage(seq, [1] * n, index=i, device=torch.device("cpu"), schedule=schedule) for i in range(n)]


def by_hand(order: list[list[tuple[str, int]]], m: int) -> Schedule:
    """A schedule from per-rank lists: issue each rank's next action once what it needs has run."""
    from seqify.schedule.actions import needs

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


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
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


def test_each_rank_keeps_its_own_order_of_micro_batches() -> None:
    # Messages are keyed by (partition or skip, micro-batch), so ranks may differ (run: test_dist_loops.py).
    order = [[("F", 0), ("F", 1), ("B", 0), ("B", 1)], [("F", 0), ("F", 1), ("B", 1), ("B", 0)]]
    plan = by_hand(order, 2)
    assert [s.order(2) for s in stages(plan, 2)] == order


def one_rank_v() -> tuple[nn.Module, sd.DistributedStage]:
    """zb-h1 with loops=2 on a one-rank pipeline: both partitions of the V on rank 0, values handed over
    directly, no process group needed."""
    from helpers import dist_worker as worker

    model = worker.build("skippy").train()
    return model, sd.DistributedStage(seqify.convert(model), [7, 7], index=0, device=torch.device("cpu"),
                                      chunks=4, schedule="zb-h1", loops=2)


def test_zb_h1_b_sends_input_gradients_before_w_computes_weight_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import dist_worker as worker
    from seqify.distributed.eager import RankRun

    model, stage = one_rank_v()
    assert stage.owned == [0, 1] and stage.placement == (0, 0)
    seen: list[tuple[str, int, int, bool, bool]] = []
    backward, weights = RankRun.backward, RankRun.weights

    def spy(kind: str, real: Any) -> Any:
        def run(self: RankRun, p: int, i: int) -> None:
            real(self, p, i)
            sent = p > 0 and (2, p - 1, i) in self.local  # the input gradient, ready for partition p - 1
            has = any(w.grad is not None for w in stage.params[p])
            seen.append((kind, p, i, sent, has))
        return run

    monkeypatch.setattr(RankRun, "backward", spy("B", backward))
    monkeypatch.setattr(RankRun, "weights", spy("W", weights))
    import seqify.distributed.eager as ds

    from_boundary: list[bool] = []
    real_w = ds.weight_grads

    def boundary(outs: Any, grads: Any, params: Any, later: Any) -> None:
        from_boundary.append(later is not None and later.groups is not None)
        real_w(outs, grads, params, later)

    monkeypatch.setattr(ds, "weight_grads", boundary)
    x, y = worker.data("skippy", 8)
    loss = stage.step(x, y, loss_fn=worker.loss_fn("skippy"))
    plan = stage.plan(4)
    assert plan.split and [k for k, *_ in seen] == [a.kind for a in plan.actions if a.kind != "F"]
    first_w = {p: next(k for k, e in enumerate(seen) if e[0] == "W" and e[1] == p) for p in (0, 1)}
    for k, (kind, p, i, sent, has) in enumerate(seen):
        if kind == "B" and p == 1:
            assert sent  # B of the second partition hands its input gradient on at once
        if k < first_w[p]:
            assert not has, f"{kind}{p}.{i} wrote weight gradients before any W of partition {p}"
    assert all(has for kind, _, _, _, has in seen if kind == "W")
    # the second partition's W starts from what B kept at its boundary (the first has no input gradients
    # to compute, so its W is its whole backward)
    ws = [p for kind, p, *_ in seen if kind == "W"]
    assert [b for b, p in zip(from_boundary, ws) if p == 1] == [True] * 4
    assert [b for b, p in zip(from_boundary, ws) if p == 0] == [False] * 4
    # and the sum is exact: one process, the same micro-batches
    total = sum(worker.loss_fn("skippy")(model(a), b) * (len(a) / len(x))
                for a, b in zip(x.tensor_split(4), y.tensor_split(4)))
    grads = {n: g for n, g in zip([n for n, _ in model.named_parameters()],
                                  torch.autograd.grad(total, list(model.parameters())))}
    assert loss is not None and float(loss) == pytest.approx(float(total.detach()), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize(("schedule", "loops", "balance", "match"), [
    ("1f1b", 2, [1, 1, 1, 1], "interleaved"),
    ("zb-h1", 3, [1] * 6, "V"),
    ("interleaved", 2, [1, 1, 1], "multiple of loops"),
])
def test_placements_seqify_distributed_cannot_run_say_what_to_use(schedule: str, loops: int, balance: list[int],
                                                                   match: str) -> None:
    seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(len(balance))])
    with pytest.raises(seqify.SeqifyError, match=match):
        sd.DistributedStage(seq, balance, index=0, device=torch.device("cpu"), schedule=schedule, loops=loops)


def test_fixed_programs_hold_one_set_of_programs_per_partition_of_the_rank() -> None:
    seq = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    s = sd.DistributedStage(seq, [1] * 4, index=0, device=torch.device("cpu"), schedule="interleaved", loops=2,
                            graphs=True, checkpoint="always")
    assert sorted(s._programs) == s.owned == [0, 2]
    assert [s._programs[p].runner is s.runners[p] for p in s.owned] == [True, True]


def test_a_checkpointed_partition_drawing_random_numbers_is_not_captured() -> None:
    # a captured recomputation cannot replay dropout's draws: that partition's programs stay eager (warned)
    from seqify.distributed.replay import RankPrograms
    from seqify.pipe.executors.replayed import GraphWarning

    seq = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.Linear(2, 2), nn.Linear(2, 2))
    s = sd.DistributedStage(seq, [2, 2], index=0, device=torch.device("cpu"), graphs=True, checkpoint="always")
    programs = RankPrograms(s.runners[0], torch.device("cpu"), True)
    programs.graphs = True  # as on CUDA
    programs.begin([1, 1], stop=1)
    with pytest.warns(GraphWarning, match="draws random numbers"):
        assert programs._recompute(0) is not None
    assert not programs.graphs and programs._recompute(1) is None


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ScheduleError, match="zb-h1"):
        stages("pipedream")


def test_a_message_left_unread_at_the_end_of_a_step_says_the_ranks_disagree() -> None:
    # what a rank built with another schedule leaves behind: a message no action of this rank reads
    from seqify.distributed.link import GRAD, Link

    link = Link(torch.device("cpu"), "rank 1")
    link.inbox[(0, (GRAD, 2, 3))] = torch.zeros(2)
    with pytest.raises(seqify.PeerError, match=r"gradients for partition 2, micro-batch 3 from rank 0.*same schedule"):
        link.flush()


def test_each_direction_travels_on_its_own_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL orders a group's sends and receives between two ranks on one stream, so activations going up and
    # gradients coming down on one group can each wait behind the other; the link keeps the two apart.
    import torch.distributed as dist

    from seqify.distributed.link import ACTIVATION, GRAD, Link

    used: list[tuple[str, int, str]] = []

    class Done:
        def wait(self) -> None:
            pass

    def isend(t: torch.Tensor, dst: int, group: Any = None) -> Done:
        used.append(("send", dst, group))
        return Done()

    def irecv(t: torch.Tensor, src: int, group: Any = None) -> Done:
        used.append(("recv", src, group))
        t.zero_()
        t[3] = 2  # a header (key (0, 0, 0)) of a message carrying None: no tensors follow
        return Done()

    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    link = Link(torch.device("cpu"), "rank 1", ("up", "down"))
    link.send((ACTIVATION, 1, 0), torch.ones(2), dst=2)  # to a higher rank
    link.send((GRAD, 1, 0), torch.ones(2), dst=0)  # to a lower rank
    assert [g for _, _, g in used] == ["up", "up", "down", "down"]  # header and tensor each
    used.clear()
    link._next(0, (ACTIVATION, 0, 0))  # from a lower rank: it sends upward
    link._next(2, (GRAD, 2, 0))  # from a higher rank: downward
    assert {(src, g) for _, src, g in used} == {(0, "up"), (2, "down")}
