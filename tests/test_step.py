"""pipe.step(x, target, loss_fn): every schedule trains like one device (float64: gradients, loss, BatchNorm)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from seqify.errors import BoundaryError, ScheduleError

pytestmark = pytest.mark.timeout(120)


class UNet(nn.Module):
    """Skips that cross partitions (encoder features reused by the decoder), BatchNorm, an in-place ReLU."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.inc = nn.Conv2d(2, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * c)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = nn.Conv2d(2 * c, c, 3, padding=1)
        self.out = nn.Conv2d(c, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn1(self.inc(x)), inplace=True)
        b = torch.tanh(self.bn2(self.down(a)))
        m = self.mid(b) + b
        u = self.up(m)
        d = F.relu(self.dec(torch.cat([u, a], 1)))
        return self.out(d).mean((2, 3))


def even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def setup(schedule: str, parts: int, loops: int = 1, chunks: int = 4, checkpoint: str = "never",
          deferred: bool = False) -> tuple[nn.Module, seqify.Pipeline]:
    torch.manual_seed(0)
    source = UNet().double()
    model = copy.deepcopy(source)  # the pipeline moves and shares the converted model's modules
    seq = seqify.convert(model)
    pipe = seqify.pipeline(seq, devices=["cpu"] * (parts // loops), loops=loops, balance=even(len(seq), parts),
                           chunks=chunks, checkpoint=checkpoint, schedule=schedule, deferred_batch_norm=deferred)
    assert len(pipe.partitions) == parts
    assert any(a != b for a, b in pipe.skip_partitions.values())  # a skip does cross partitions
    return source, pipe


def data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def compare(source: nn.Module, pipe: seqify.Pipeline, loss_fn: nn.Module, steps: int = 2,
            buffers: bool = True) -> None:
    """One device, the source model over the same micro-batches (training BatchNorm normalises each
    micro-batch by its own statistics, in a pipeline as on one device fed those micro-batches)."""
    x, y = data()
    for _ in range(steps):  # twice: gradients accumulate into .grad as autograd's do
        expected = loss_fn(torch.cat([source(c) for c in x.tensor_split(pipe.chunks)]), y)
        expected.backward()
        got = pipe.step(x, y, loss_fn)
        assert got.requires_grad is False
        torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)
    theirs = dict(source.named_parameters())
    mine = dict(pipe.model.named_parameters()) if hasattr(pipe.model, "named_parameters") else {}
    assert len(theirs) == len(mine)
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    if buffers:
        for a, b in zip(source.buffers(), pipe.model.buffers()):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


CASES = [("gpipe", 2, 1), ("gpipe", 4, 2), ("1f1b", 2, 1), ("1f1b", 3, 1), ("1f1b", 4, 1),
         ("interleaved", 4, 2), ("zb-h1", 2, 1), ("zb-h1", 3, 1), ("zb-h1", 4, 1), ("zb-h1", 4, 2)]


@pytest.mark.parametrize("schedule,parts,loops", CASES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_step_trains_like_one_device(schedule: str, parts: int, loops: int, checkpoint: str) -> None:
    source, pipe = setup(schedule, parts, loops, checkpoint=checkpoint)
    compare(source, pipe, nn.CrossEntropyLoss())


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_sum_reduction_and_uneven_micro_batches(schedule: str) -> None:
    source, pipe = setup(schedule, 3, chunks=3)  # 10 samples: 4, 3, 3
    compare(source, pipe, nn.CrossEntropyLoss(reduction="sum"), steps=1)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_deferred_batch_norm_statistics_equal_gpipe(checkpoint: str) -> None:
    """Deferred BatchNorm folds every micro-batch into one update per step, under every schedule."""
    x, y = data()
    stats = []
    for schedule, parts, loops in [("1f1b", 3, 1), ("zb-h1", 3, 1), ("interleaved", 4, 2), ("zb-h1", 4, 2)]:
        _, pipe = setup(schedule, parts, loops, deferred=True, checkpoint=checkpoint)
        pipe.step(x, y, nn.CrossEntropyLoss())
        stats.append([b.clone() for b in pipe.model.buffers()])
    _, pipe = setup("gpipe", 3, deferred=True, checkpoint=checkpoint)
    out = pipe(x)  # today's path: pipe(x) + loss.backward()
    nn.CrossEntropyLoss()(out, y).backward()
    reference = list(pipe.model.buffers())
    for got in stats:
        for a, b in zip(got, reference):
            assert torch.equal(a, b)


def test_step_refuses_inference_and_a_bad_target() -> None:
    _, pipe = setup("1f1b", 2)
    x, y = data()
    with pytest.raises(BoundaryError, match="target"):
        pipe.step(x, y[:3], nn.CrossEntropyLoss())
    with pytest.raises(ScheduleError, match="scalar"):
        pipe.step(x, y, nn.CrossEntropyLoss(reduction="none"), reduction="sum")
    pipe.eval()
    with pytest.raises(ScheduleError, match="train"):
        pipe.step(x, y, nn.CrossEntropyLoss())
    with pytest.raises(ScheduleError, match="choose one of"):
        seqify.pipeline(seqify.convert(UNet()), devices=["cpu"] * 2, balance=[4, 4] if False else None, schedule="2f2b")


def test_replay_issues_programs_in_the_gpipe_schedule_order_and_step_trains_through_it() -> None:
    """Replay (CUDA graphs' driver, here with eager programs on the CPU) reads its order from the
    pipeline's gpipe Schedule, looped over two partitions per device; pipe.step through it is exact."""
    from seqify.pipeline.schedule import gpipe

    source, pipe = setup("gpipe", 4, loops=2)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss(), steps=1)
    replay = pipe._graphed[1] if pipe._graphed is not None else None
    assert replay is not None, pipe.graph_error
    schedule = gpipe(pipe.placement, pipe.chunks)
    assert pipe.placement == (0, 1, 0, 1)
    assert replay.forward_order == schedule.forwards()
    assert replay.backward_order == schedule.backwards()
    on_zero = [ij for ij in replay.forward_order if ij[1] in (0, 2)]
    assert on_zero == [(i, 0) for i in range(4)] + [(i, 2) for i in range(4)]  # looped: breadth-first


@pytest.mark.parametrize("schedule,parts,loops", [c for c in CASES if c[0] != "gpipe"])
def test_replayed_step_runs_every_schedule_in_its_own_order(schedule: str, parts: int, loops: int) -> None:
    """pipe.step through Replay (the CUDA-graph driver, here with eager programs on the CPU) issues the
    schedule's own actions: 1F1B, interleaved and zero-bubble train like one device, and pipe(x)
    afterwards gets fill-drain programs of its own (programs captured for one order never run in another)."""
    source, pipe = setup(schedule, parts, loops)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss())
    key, replay = pipe._graphed
    assert replay.schedule.name == schedule and not replay.drains, pipe.graph_error
    last = [a.kind == "B" for a in replay.schedule.actions if a.partition == parts - 1 and a.kind != "W"]
    assert last != sorted(last)  # forwards and backwards interleave: the programs ran in that order
    x, y = data()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), torch.cat([source(c) for c in x.tensor_split(pipe.chunks)]))
    pipe(x).sum().backward()
    assert pipe._graphed[1].drains and pipe._graphed[1] is not replay


@pytest.mark.parametrize("schedule,parts,loops", [("gpipe", 2, 1), ("1f1b", 3, 1), ("zb-h1", 4, 2)])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_replayed_checkpointed_step_trains_like_one_device(schedule: str, parts: int, loops: int,
                                                          checkpoint: str) -> None:
    """Checkpointed programs (what graphs=True captures: the forward keeps only its inputs, the backward
    recomputes it) train like one device, BatchNorm statistics updated once per micro-batch."""
    source, pipe = setup(schedule, parts, loops, checkpoint=checkpoint)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss())
    key, replay = pipe._graphed
    checkpointed = [p.flat.checkpoint is not None for p in replay.programs[0]]
    assert checkpointed == [i < (4 if checkpoint == "always" else 3) for i in range(4)]
