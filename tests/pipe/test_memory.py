"""Memory planning: predicted per-device peaks against hand computation, and memory_cap's choice or refusal."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import seqify
from seqify.errors import MemoryCapError
from seqify.pipe import memory
from seqify.pipe.memory import parse_bytes

pytestmark = pytest.mark.timeout(60)

F64 = 8
MB = 4 * 8 * F64  # one micro-batch (4 samples x 8 features) of float64: 256 bytes
P0 = (8 * 8 + 8) * F64  # partition 0: Linear(8, 8) + ReLU
P1 = 2 * (8 * 8 + 8) * F64  # partition 1: two Linear(8, 8)
# What autograd keeps per micro-batch: partition 0 the Linear's input and the ReLU's output; partition 1
# the inputs of its two Linears. A checkpointed micro-batch keeps only the partition's input.
A0, A1 = 2 * MB, 2 * MB
# What a split backward's B keeps for W per micro-batch: the gradient at each weighted layer's output
# (partition 1: its two Linears'); partition 0's B has no input gradient to compute and keeps nothing.
K1 = 2 * MB


def make(schedule: str = "gpipe", **options: object) -> seqify.Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 8)).double()
    return seqify.pipeline(model, devices=["cpu", "cpu"], balance=[2, 2], chunks=4, schedule=schedule,
                           checkpoint="never", **options)


X = torch.randn(16, 8, dtype=torch.float64)


@pytest.mark.parametrize("schedule,checkpoint,expected", [
    ("gpipe", "never", (2 * P0 + 4 * A0, 2 * P1 + 4 * A1)),  # every micro-batch in flight
    ("1f1b", "never", (2 * P0 + 2 * A0, 2 * P1 + 1 * A1)),  # stage s holds partitions - s
    ("zb-h1", "never", (2 * P0 + 2 * A0, 2 * P1 + 2 * A1 + 2 * K1)),  # W deferred: F0 B0 F1 B1 before W0 on 1
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


def test_what_b_keeps_for_w_is_what_the_split_backward_keeps() -> None:
    """The plan's ``kept`` bytes per partition against the gradients the library's own B
    (dist_backward.input_grads) keeps for W on the same micro-batch, for a net with a skip."""
    from seqify.pipe.split_backward import input_grads

    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
            self.bn = nn.BatchNorm1d(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(x))
            return self.d(self.bn(self.c(torch.tanh(self.b(h))) + h))

    seq = seqify.convert(Net().double())
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu", "cpu"], balance=[2, 3, len(seq) - 5], chunks=4)
    parts = memory.measure(pipe.stages, X[:4])
    assert parts[0].kept == 0 and all(p.kept > 0 for p in parts[1:])
    pending: dict = {}
    x = X[:4]
    for stage, part in zip(pipe.stages, parts):
        skips = {k: pending.pop(k).detach().requires_grad_(True) for k in stage.pops}
        x = x.detach().requires_grad_(stage.index > 0)
        with torch.enable_grad():
            y, made = stage(x, skips)
        outs = [y] + [v for v in made.values() if isinstance(v, torch.Tensor)]
        wrt = [t for t in [x, *skips.values()] if t.requires_grad]
        if wrt:
            _, _, later = input_grads(outs, [torch.ones_like(o) for o in outs], wrt, list(stage.layers.parameters()))
            groups = later.groups
            assert groups is not None
            grads = {id(g): g for group in groups for gs in group["grads"] for g in gs if isinstance(g, torch.Tensor)}
            assert part.kept == sum(g.numel() * g.element_size() for g in grads.values())
        pending.update(made)
        x = y


def test_a_replayed_step_is_predicted_to_hold_its_gradients_once() -> None:
    """Replayed programs (CUDA graphs, or their eager stand-in on the CPU) add into sums of their own, which .grad
    views at the step's end: no more gradient bytes than an eager step."""
    torch.manual_seed(0)
    seq = seqify.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    x = torch.randn(8, 8)
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[2, 1], chunks=2, checkpoint="never")
    eager = pipe.plan_memory(x).per_device
    pipe._replay_eager = True
    replayed = pipe.plan_memory(x).per_device
    assert replayed == eager and eager[0] > (8 * 16 + 16) * 4 * 2  # the parameters and their gradients, at least
