"""Boundary buffers sized to what a schedule keeps in flight: the places, and a replayed step sharing them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from seqify.pipe.executors.buffers import Buffers, in_flight, places
from seqify.pipe.executors.buffers import partition_order as _partition_order
from seqify.schedule.actions import gpipe, interleaved, one_f_one_b, zb_h1, zb_h2

from test_step import compare, setup


def test_fill_drain_keeps_every_micro_batch_and_1f1b_only_what_is_in_flight() -> None:
    m, p = 8, 4
    fill = gpipe(tuple(range(p)), m)
    assert [in_flight(_partition_order(fill, j)) for j in range(p)] == [m] * p
    # 1F1B: partition j has at most p - j micro-batches between forward and backward
    ofob = one_f_one_b(tuple(range(p)), m)
    assert [in_flight(_partition_order(ofob, j)) for j in range(p)] == [p - j for j in range(p)]


def test_a_split_backward_frees_at_w_not_at_b() -> None:
    order = [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("W", 0), ("F", 3), ("B", 1), ("W", 1)]
    # micro-batch 0 is freed only by its W, after micro-batch 2's forward took a third set
    assert places(order) == [0, 1, 2, 0]
    assert in_flight(order) == 3
    assert places([("F", 0), ("B", 0), ("F", 1), ("B", 1)]) == [0, 0]
    assert places([("F", 0), ("F", 1)]) == [0, 1]  # inference: nothing is ever given back


@pytest.mark.parametrize("make", [one_f_one_b, interleaved, zb_h1, zb_h2])
def test_places_never_give_a_set_to_two_micro_batches_at_once(make) -> None:  # type: ignore[no-untyped-def]
    placement = (0, 1, 0, 1) if make is interleaved else (0, 1, 1, 0) if make is zb_h1 else (0, 1, 2)
    schedule = make(placement, 8)
    for j in range(len(placement)):
        order = _partition_order(schedule, j)
        place = places(order)
        live: dict[int, int] = {}  # place -> micro-batch using it
        last = {i: n for n, (_, i) in enumerate(order)}
        for n, (kind, i) in enumerate(order):
            if kind == "F":
                assert place[i] not in live, (make.__name__, j, order)
                live[place[i]] = i
            if last[i] == n:
                live.pop(place[i])
        assert in_flight(order) < 8  # fewer sets than micro-batches


def test_buffers_are_shared_only_between_equal_shapes() -> None:
    b = Buffers(torch.device("cpu"))
    x = torch.randn(3, 2, requires_grad=True)
    first = b.take(0, [x])
    assert first[0].requires_grad and first[0] is not x and torch.equal(first[0], x)
    again = b.take(0, [x * 2])
    assert again[0] is first[0] and torch.equal(first[0], x * 2) and id(first[0]) in b.shared
    assert b.take(0, [torch.randn(2, 2)])[0] is not first[0]  # an uneven micro-batch: its own
    assert b.take(1, [x])[0] is not first[0]
    grads = b.take(0, [x], copy=False)
    assert not grads[0].requires_grad and not grads[0].any()


@pytest.mark.parametrize("schedule,parts,loops", [("1f1b", 3, 1), ("zb-h1", 4, 2), ("interleaved", 4, 2), ("zb-h2", 3, 1)])
def test_replayed_step_shares_boundary_buffers_and_trains_like_one_device(schedule: str, parts: int,
                                                                         loops: int) -> None:
    """pipe.step through Replay with micro-batches of one partition writing the same input and
    output-gradient buffers in turn: losses, gradients and BatchNorm statistics as on one device, step
    after step; fewer distinct buffers than micro-batches on the later partitions."""
    source, pipe = setup(schedule, parts, loops, chunks=8)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss(), steps=3)
    replay = pipe._graphed[1]
    assert replay.schedule.name == schedule and replay.shared
    for j, row in enumerate(replay.programs[1:], 1):
        distinct = {id(t) for p in row for t in p.inputs}
        per = len({id(t) for t in row[0].inputs})
        assert len(distinct) < per * len(row), (j, len(distinct))
