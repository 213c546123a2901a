"""The one action interpreter (seqify/schedule/interpreter.py): order, hooks, and a missing handler named."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import pytest

from seqify.errors import ScheduleError
from seqify.schedule.actions import Action, one_f_one_b, zb_h1
from seqify.schedule.interpreter import HANDLERS, Hooks, interpret


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
