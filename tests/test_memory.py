"""Memory planning: predicted per-device peaks against hand computation, and memory_cap's choice or refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import seqify
from seqify.errors import MemoryCapError
from seqify.pipeline.memory import parse_bytes

pytestmark = pytest.mark.timeout(60)

F64 = 8
MB = 4 * 8 * F64  # one micro-batch (4 samples x 8 features) of float64: 256 bytes
P0 = (8 * 8 + 8) * F64  # partition 0: Linear(8, 8) + ReLU
P1 = 2 * (8 * 8 + 8) * F64  # partition 1: two Linear(8, 8)
# What autograd keeps per micro-batch: partition 0 the Linear's input and the ReLU's output; partition 1
# the inputs of its two Linears. A checkpointed micro-batch keeps only the partition's input.
A0, A1 = 2 * MB, 2 * MB


def make(schedule: str = "gpipe", **options: object) -> seqify.Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8)).double()
    return seqify.pipeline(model, devices=["cpu", "cpu"], balance=[2, 2], chunks=4, schedule=schedule,
                           checkpoint="never", **options)


X = torch.randn(16, 8, dtype=torch.float64)


@pytest.mark.parametrize("schedule,checkpoint,expected", [
    ("gpipe", "never", (2 * P0 + 4 * A0, 2 * P1 + 4 * A1)),  # every micro-batch in flight
    ("1f1b", "never", (2 * P0 + 2 * A0, 2 * P1 + 1 * A1)),  # stage s holds partitions - s
    ("zb-h1", "never", (2 * P0 + 2 * A0, 2 * P1 + 2 * A1)),  # W deferred: up to partitions on each
    ("gpipe", "always", (2 * P0 + 4 * MB + A0, 2 * P1 + 4 * MB + A1)),  # inputs kept, one recompute
    ("gpipe", "except_last", (2 * P0 + 3 * MB + A0 + A0, 2 * P1 + 3 * MB + A1 + A1)),
])
def test_predicted_peak_matches_hand_computation(schedule: str, checkpoint: str, expected: tuple[int, int]) -> None:
    pipe = make()
    plan = pipe.plan_memory(X, schedule=schedule, checkpoint=checkpoint)
    assert plan.per_device == expected
    assert plan.peak == max(expected)


def test_measuring_leaves_statistics_and_parameters_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)).double()
    pipe = seqify.pipeline(model, devices=["cpu", "cpu"], balance=[2, 1], chunks=2)
    before = [t.clone() for t in list(model.buffers()) + list(model.parameters())]
    pipe.plan_memory(X)
    assert all(torch.equal(a, b) for a, b in zip(before, list(model.buffers()) + list(model.parameters())))
    assert all(p.grad is None for p in model.parameters())


def test_memory_cap_picks_the_first_schedule_that_fits() -> None:
    cap = 2 * P1 + 1 * A1  # 1F1B without checkpointing fits exactly; zero bubble does not
    pipe = make("gpipe", memory_cap=cap, sample=X)
    assert (pipe.schedule, pipe.checkpoint) == ("1f1b", "never")
    assert make("gpipe", memory_cap=str(cap + 10 * 2**20) + "", sample=X).schedule == "gpipe"  # the caller's first


def test_memory_cap_too_small_names_the_smallest_cap_that_works() -> None:
    pipe = make()
    smallest = min(pipe.plan_memory(X, schedule=s, checkpoint=c).peak
                   for s in ("gpipe", "1f1b", "zb-h1") for c in ("never", "except_last", "always"))
    with pytest.raises(MemoryCapError, match=f"smallest cap that works is {smallest} bytes"):
        make(memory_cap=smallest - 1, sample=X)
    fitted = make(memory_cap=smallest, sample=X)
    assert fitted.plan_memory(X).peak == smallest
    with pytest.raises(MemoryCapError, match="sample"):
        make(memory_cap="1GiB")


def test_parse_bytes() -> None:
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes(512) == 512
    for bad in ("lots", "-1GiB", 0, True, "4 parsecs"):
        with pytest.raises(MemoryCapError):
            parse_bytes(bad)  # type: ignore[arg-type]
