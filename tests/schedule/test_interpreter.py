"""The one action interpreter (seqify/schedule/interpreter.py): order, hooks, a missing handler named, and a
profiler range per action."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import seqify
from seqify.errors import ScheduleError
from seqify.schedule.actions import Action, one_f_one_b, zb_h1
from seqify.schedule.interpreter import HANDLERS, Hooks, interpret, range_name


class Recorder(Hooks):
    def __init__(self) -> None:
        self.seen: list[str] = []

    def begin(self) -> None:
        self.seen.append("begin")

    @contextmanager
    def around(self, action: Action) -> Any:
        self.seen.append(f"<{action!r}")
        yield
        self.seen.append(">")

    def after(self, action: Action) -> None:
        self.seen.append("after")

    def end(self) -> None:
        self.seen.append("end")

    def forward(self, p: int, i: int) -> None:
        self.seen.append(f"F{p}.{i}")

    def backward(self, p: int, i: int) -> None:
        self.seen.append(f"B{p}.{i}")

    def weights(self, p: int, i: int) -> None:
        self.seen.append(f"W{p}.{i}")


def test_actions_run_in_order_each_inside_its_hooks() -> None:
    schedule = zb_h1((0, 1), 3)
    r = Recorder()
    interpret(schedule.actions, r)
    want = ["begin"]
    for a in schedule.actions:
        want += [f"<{a!r}", f"{a.kind}{a.partition}.{a.microbatch}", "after", ">"]
    assert r.seen == want + ["end"]


def test_a_missing_handler_names_the_executor_and_the_kind_before_anything_runs() -> None:
    class OnlyForward:
        def __init__(self) -> None:
            self.ran = 0

        def forward(self, p: int, i: int) -> None:
            self.ran += 1

    run = OnlyForward()
    with pytest.raises(ScheduleError, match=r"my executor has no handler for B actions.*backward"):
        interpret(one_f_one_b((0, 1), 2).actions, run, "my executor")
    assert run.ran == 0
    interpret([a for a in one_f_one_b((0, 1), 2).actions if a.kind == "F"], run)  # forwards alone: enough
    assert run.ran == 4


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ScheduleError, match="'X'"):
        interpret([Action(0, 0, 0, "X")], Recorder())  # type: ignore[arg-type]
    assert set(HANDLERS) == {"F", "B", "W"}


def test_an_error_propagates_without_end() -> None:
    class Failing(Recorder):
        def backward(self, p: int, i: int) -> None:
            raise RuntimeError("boom")

    r = Failing()
    with pytest.raises(RuntimeError, match="boom"):
        interpret(one_f_one_b((0,), 1).actions, r)
    assert "end" not in r.seen and r.seen[-1] == "<B0.0@0"


def ranges(prof: Any) -> Counter[str]:
    return Counter(e.name for e in prof.events() if e.name.startswith("PP:"))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("replayed", [False, True], ids=["scheduled", "replayed"])
def test_a_profiled_step_has_one_range_per_action(schedule: str, replayed: bool) -> None:
    torch.manual_seed(0)
    pipe = seqify.pipeline(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), devices=["cpu", "cpu"],
                           balance=[2, 1], chunks=3, schedule=schedule, checkpoint="never")
    pipe._replay_eager = replayed  # the replay executor's step, with eager programs (graphs=True on GPUs)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    for _ in range(2):  # the first step (which builds the programs) and a later one
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pipe.step(x, y, F.mse_loss)
        actions = pipe.schedule_for(3).actions
        assert {a.kind for a in actions} == ({"F", "B", "W"} if schedule == "zb-h1" else {"F", "B"})
        assert ranges(prof) == Counter(range_name(a) for a in actions)
        assert all(n == 1 for n in ranges(prof).values())


def test_range_names_follow_torch_pipelining() -> None:
    assert [range_name(a) for a in zb_h1((0, 1), 2).actions[:3]] == ["PP:0F0", "PP:0F1", "PP:1F0"]
    assert range_name(Action(device=1, partition=3, microbatch=12, kind="W")) == "PP:3W12"


def test_no_range_is_made_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str) -> None:
        raise AssertionError(f"a range {name!r} was made with no profiler running")

    monkeypatch.setattr(torch.profiler, "record_function", refuse)
    r = Recorder()
    interpret(zb_h1((0, 1), 2).actions, r)
    assert r.seen[-1] == "end"


def test_a_range_holds_its_handler_and_after() -> None:
    class Timed(Recorder):
        def forward(self, p: int, i: int) -> None:
            torch.ones(3).add_(1)  # an op the profiler records inside the range

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        interpret(one_f_one_b((0,), 1).actions, Timed())
    events = {e.name: e for e in prof.events()}
    f, add = events["PP:0F0"], events["aten::add_"]
    assert f.time_range.start <= add.time_range.start and add.time_range.end <= f.time_range.end
    assert "PP:0B0" in events
