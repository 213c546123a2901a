"""Schedules as data: every builder's dependencies, placement and in-flight activation bound, without a model."""

from __future__ import annotations

import itertools

import pytest

from seqify.errors import ScheduleError
from seqify.schedule.actions import (Action, Schedule, ahead, gpipe, interleaved, make, merge, one_f_one_b,
    round_robin, v_shape, zb_h1, zb_h2)

SHAPES = [(2, 1), (2, 4), (3, 5), (4, 8), (4, 3)]  # (devices, micro-batches)


def check_by_hand(s: Schedule) -> None:
    """The rules, restated independently of Schedule.check: each (p, m, kind) once, on its device, after
    its dependencies; each device's list is the schedule's order restricted to it."""
    kinds = ("F", "B", "W") if s.split else ("F", "B")
    position = {}
    for k, a in enumerate(s.actions):
        assert (a.partition, a.microbatch, a.kind) not in position
        position[(a.partition, a.microbatch, a.kind)] = k
        assert a.device == s.placement[a.partition]
    assert set(position) == set(itertools.product(range(s.partitions), range(s.microbatches), kinds))
    for (p, m, kind), k in position.items():
        if kind == "F" and p > 0:
            assert position[(p - 1, m, "F")] < k
        if kind == "B":
            assert position[(p, m, "F")] < k
            if p + 1 < s.partitions:
                assert position[(p + 1, m, "B")] < k
        if kind == "W":
            assert position[(p, m, "B")] < k
    for d, actions in enumerate(s.per_device()):
        assert actions == [a for a in s.actions if a.device == d]


def held(s: Schedule) -> list[int]:
    """Peak micro-batch activations per device, counted by hand (F holds, B or W frees)."""
    free = "W" if s.split else "B"
    out = []
    for actions in s.per_device():
        now = peak = 0
        for a in actions:
            now += (a.kind == "F") - (a.kind == free)
            peak = max(peak, now)
        out.append(peak)
    return out


@pytest.mark.parametrize("d,m", SHAPES)
def test_gpipe_keeps_every_micro_batch_in_flight(d: int, m: int) -> None:
    for loops in (1, 2):
        s = gpipe(round_robin(d, loops), m)
        check_by_hand(s)
        assert held(s) == [loops * m] * d
        assert s.peak_activations() == [loops * m] * d
        for actions in s.per_device():  # fill-drain: every F before any B
            kinds = [a.kind for a in actions]
            assert kinds == ["F"] * (loops * m) + ["B"] * (loops * m)


@pytest.mark.parametrize("d,m", SHAPES)
def test_1f1b_keeps_at_most_partitions_minus_stage_in_flight(d: int, m: int) -> None:
    s = one_f_one_b(tuple(range(d)), m)
    check_by_hand(s)
    assert held(s) == [min(d - stage, m) for stage in range(d)]
    assert s.peak_activations() == [float(h) for h in held(s)]
    last = [a.kind for a in s.per_device()[-1]]
    assert last == ["F", "B"] * m  # the last stage alternates from the start


@pytest.mark.parametrize("d,m", SHAPES)
@pytest.mark.parametrize("loops", [2, 3])
def test_interleaved_is_valid_and_holds_less_than_gpipe(d: int, m: int, loops: int) -> None:
    s = interleaved(round_robin(d, loops), m)
    check_by_hand(s)
    bound = [min(2 * (d - r - 1) + (loops - 1) * d + 1, loops * m) for r in range(d)]
    assert all(h <= b for h, b in zip(held(s), bound))
    assert held(s) == s.peak_activations()
    if m > 2 * d:
        assert max(held(s)) < loops * m


@pytest.mark.parametrize("d,m", SHAPES)
def test_zb_h1_splits_backward_and_keeps_1f1b_peak(d: int, m: int) -> None:
    s = zb_h1(tuple(range(d)), m)
    assert s.split
    check_by_hand(s)
    assert max(held(s)) <= max(held(one_f_one_b(tuple(range(d)), m)))
    # F and B keep 1F1B's order on every device; W only adds steps
    fb = [[(a.partition, a.microbatch, a.kind) for a in acts if a.kind != "W"] for acts in s.per_device()]
    ref = [[(a.partition, a.microbatch, a.kind) for a in acts] for acts in one_f_one_b(tuple(range(d)), m).per_device()]
    assert [[x[:2] for x in row if x[2] == "F"] for row in fb] == [[x[:2] for x in row if x[2] == "F"] for row in ref]


@pytest.mark.parametrize("d,m", SHAPES + [(2, 8), (4, 16)])
def test_zb_h2_runs_further_ahead_within_its_bound(d: int, m: int) -> None:
    """Device s keeps at most max(2 (d - s) - 1, d) micro-batches awaiting W (the first: 2 d - 1) and
    reaches that bound once enough micro-batches exist; where ZB-H1 waits, ZB-H2 has started more forwards."""
    s = zb_h2(tuple(range(d)), m)
    assert s.split and s.name == "zb-h2"
    check_by_hand(s)
    bound = [max(2 * (d - p) - 1, d) for p in range(d)]
    assert all(h <= b for h, b in zip(held(s), bound))
    if m >= 2 * d - 1:
        assert held(s)[0] == 2 * d - 1
    h1 = zb_h1(tuple(range(d)), m)
    first = [a.kind for a in s.per_device()[0]]
    assert first.index("B") == min(m, 2 * d - 1)  # forwards before its first B: ZB-H1's d
    assert [a.kind for a in h1.per_device()[0]].index("B") == min(m, d)
    assert s.ticks <= h1.ticks


@pytest.mark.parametrize("d,m", [(2, 4), (3, 6), (4, 8)])
def test_zb_v_two_partitions_per_device_valid_and_bounded(d: int, m: int) -> None:
    s = zb_h1(v_shape(d), m)
    check_by_hand(s)
    assert s.placement[0] == s.placement[-1] == 0
    assert max(held(s)) <= 2 * d  # half-size partitions: 1F1B's first-device memory


def test_check_catches_each_broken_rule() -> None:
    good = one_f_one_b((0, 1), 2)
    acts = list(good.actions)
    swapped = [acts[1], acts[0]] + acts[2:] if acts[0].partition == acts[1].partition == 0 else None
    cases = {
        "repeats": acts + [acts[0]],
        "missing": acts[:-1],
        "lives on": [Action(1 - a.device, a.partition, a.microbatch, a.kind) if k == 0 else a for k, a in enumerate(acts)],
        "depends on": list(reversed(acts)),
    }
    for phrase, actions in cases.items():
        with pytest.raises(ScheduleError, match=phrase):
            Schedule("broken", (0, 1), 2, tuple(actions)).check()
    assert swapped is None or Schedule("ok", (0, 1), 2, tuple(swapped)).check() is None  # two Fs of p0 commute
    with pytest.raises(ScheduleError, match="uses"):
        Schedule("w", (0, 1), 2, tuple(acts) + (Action(0, 0, 0, "W"),)).check()


def test_make_names_and_refusals() -> None:
    assert make("1f1b", (0, 1), 3) == one_f_one_b((0, 1), 3)
    own = gpipe((0, 1), 3)
    assert make(own, (0, 1), 3) is own
    with pytest.raises(ScheduleError, match="choose one of"):
        make("pipedream", (0, 1), 3)
    with pytest.raises(ScheduleError, match="placement"):
        make(own, (0, 1), 4)
    with pytest.raises(ScheduleError, match="interleaved"):
        one_f_one_b((0, 1, 0, 1), 2)
    with pytest.raises(ScheduleError, match="round-robin"):
        interleaved((0, 0, 1, 1), 2)
    with pytest.raises(ScheduleError, match="V"):
        zb_h1((0, 1, 0, 1), 2)
    with pytest.raises(ScheduleError, match="one per device"):
        zb_h2((0, 1, 1, 0), 2)
    assert make("zb-h2", (0, 1), 4) == zb_h2((0, 1), 4)


@pytest.mark.parametrize("d,m", [(2, 4), (3, 5), (4, 8), (4, 16)])
def test_simulated_lengths_show_each_schedule_shrinking_the_bubble(d: int, m: int) -> None:
    """In forward times (B = 2 unsplit, B = W = 1 split; half-size partitions with two per device):
    1F1B keeps GPipe's bubble, zero bubble fills part of it with W, interleaving and the V shrink it."""
    line = tuple(range(d))
    work = 3 * m  # one device's F + B + W for its micro-batches, with no idle time
    bubble = {name: s.ticks - work for name, s in [("gpipe", gpipe(line, m)), ("1f1b", one_f_one_b(line, m)),
                                                   ("zb-h1", zb_h1(line, m))]}
    assert bubble["gpipe"] == bubble["1f1b"] == 3 * (d - 1)  # (d - 1) slots of F + B
    assert 0 < bubble["zb-h1"] < bubble["1f1b"]
    assert interleaved(round_robin(d, 2), m).ticks / 2 < one_f_one_b(line, m).ticks
    assert zb_h1(v_shape(d), m).ticks / 2 < zb_h1(line, m).ticks


@pytest.mark.parametrize("d,m", SHAPES)
def test_ahead_issues_each_forward_one_run_earlier_for_one_more_in_flight(d: int, m: int) -> None:
    """ahead() (two streams per GPU): on each device the backwards issued between two forwards move
    behind the second; each kind keeps its own order, the result is valid, and a device holds at most one
    more micro-batch than before."""
    built = [gpipe(round_robin(d, 1), m), one_f_one_b(round_robin(d, 1), m), zb_h1(round_robin(d, 1), m),
             zb_h1(v_shape(d), m), zb_h2(round_robin(d, 1), m)]
    if m % d == 0:
        built.append(interleaved(round_robin(d, 2), m))
    for s in built:
        a = ahead(s)
        check_by_hand(a)
        assert (a.name, a.placement, a.split) == (s.name, s.placement, s.split)
        for old, new in zip(s.per_device(), a.per_device()):
            for keep in (lambda x: x.kind == "F", lambda x: x.kind != "F"):
                assert [x for x in new if keep(x)] == [x for x in old if keep(x)]
            forwards = [k for k, x in enumerate(old) if x.kind == "F"]
            where = {x: k for k, x in enumerate(new)}
            for k, (here, there) in enumerate(zip(forwards, forwards[1:])):
                # the run between forward k and forward k + 1 now runs after k + 1 (and before k + 2)
                for x in old[here + 1:there]:
                    assert where[x] > where[old[there]]
                    if k + 2 < len(forwards):
                        assert where[x] < where[old[forwards[k + 2]]]
        assert all(h <= o + 1 for h, o in zip(held(a), held(s)))
        assert a.peak_activations() == [float(h) for h in held(a)]


def test_merge_finds_no_order_for_orders_that_wait_on_each_other() -> None:
    """A device whose backward comes before its own forward can never go on: merge says None."""
    assert merge([[Action(0, 0, 0, "B"), Action(0, 0, 0, "F")]], 1) is None
    f, b = Action(0, 0, 0, "F"), Action(0, 0, 0, "B")
    assert merge([[f, b]], 1) == [f, b]
