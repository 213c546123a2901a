"""A placed pipeline refuses moves to other devices, whole, and casts in place to the source's bits."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.exactness import by_micro_batch
from helpers.nets import Shares
from torch import nn

import seqify
from seqify.model.sequential import tied_slots

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    """A skip that crosses partitions, BatchNorm (running statistics), an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.inc = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.mid = nn.Conv2d(3, 3, 3, padding=1)
        self.out = nn.Conv2d(6, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn(self.inc(x)), inplace=True)
        m = torch.tanh(self.mid(a))
        return self.out(torch.cat([m, a], 1)).mean((2, 3))


def built(chunks: int = 2, schedule: str = "gpipe") -> tuple[nn.Module, seqify.Pipeline]:
    torch.manual_seed(0)
    source = Net()
    seq = seqify.convert(copy.deepcopy(source))
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[4, 4], chunks=chunks, schedule=schedule)
    assert any(a != b for a, b in pipe.skip_partitions.values())
    return source, pipe


def state(pipe: nn.Module) -> list[tuple[torch.device, torch.dtype, torch.Tensor]]:
    return [(t.device, t.dtype, t.detach().clone()) for t in [*pipe.parameters(), *pipe.buffers()]]


MOVES: dict[str, Callable[[seqify.Pipeline], object]] = {
    "to-meta": lambda p: p.to("meta"),
    "to-device-keyword": lambda p: p.to(device=torch.device("meta")),
    "to-meta-and-float64": lambda p: p.to("meta", torch.float64),
    "to-a-tensor's-device-and-dtype": lambda p: p.to(torch.empty(0, device="meta", dtype=torch.float16)),
    "to-cuda": lambda p: p.to("cuda:0"),
    "cuda": lambda p: p.cuda(),
    "cuda-index": lambda p: p.cuda(1),
    "to-empty-on-meta": lambda p: p.to_empty(device="meta"),
}


@pytest.mark.parametrize("move", list(MOVES))
def test_a_move_to_another_device_is_refused_and_nothing_moves(move: str) -> None:
    source, pipe = built()
    before = state(pipe)
    with pytest.raises(seqify.DeviceError) as info:
        MOVES[move](pipe)
    text = str(info.value)
    for phrase in ("placed on [cpu, cpu]", "nothing was moved", "Build the pipeline again",
                   "seqify.pipeline(model, devices=[...])"):
        assert phrase in text, text
    after = state(pipe)
    assert [(d, t) for d, t, _ in after] == [(d, t) for d, t, _ in before]  # not half moved, not half cast
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(after, before))
    assert pipe.devices == [torch.device("cpu")] * 2
    x = torch.randn(4, 2, 6, 6)
    assert torch.equal(pipe(x), by_micro_batch(source, (x,), 2))


@pytest.mark.parametrize("move", ["cpu", "to-cpu", "to-cpu-device", "to-cpu-index"])
def test_a_move_to_the_devices_it_has_does_nothing(move: str) -> None:
    source, pipe = built()
    before = state(pipe)
    calls = {"cpu": lambda p: p.cpu(), "to-cpu": lambda p: p.to("cpu"),
             "to-cpu-device": lambda p: p.to(torch.device("cpu")), "to-cpu-index": lambda p: p.to("cpu:0")}
    assert calls[move](pipe) is pipe
    assert all(a is b or torch.equal(a, b) for (_, _, a), (_, _, b) in zip(state(pipe), before))
    x = torch.randn(4, 2, 6, 6)
    assert torch.equal(pipe(x), by_micro_batch(source, (x,), 2))


CASTS: dict[str, tuple[Callable[[nn.Module], object], torch.dtype]] = {
    "double": (lambda m: m.double(), torch.float64),
    "to-dtype": (lambda m: m.to(torch.float64), torch.float64),
    "to-cpu-and-dtype": (lambda m: m.to("cpu", torch.float64), torch.float64),
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_cast_trains_like_the_source_cast_the_same_way(cast: str, schedule: str) -> None:
    """Forward and ``pipe.step`` after the cast equal the source cast the same way, run on the same
    micro-batches, bit for bit: outputs, loss, gradients and BatchNorm statistics."""
    apply, dtype = CASTS[cast]
    source, pipe = built(schedule=schedule)
    x, y = torch.randn(6, 2, 6, 6), torch.randint(0, 4, (6,))
    pipe.step(x, y, nn.CrossEntropyLoss())  # a step before the cast: what it kept must not outlive the cast
    source(x[:3]), source(x[3:])  # the same BatchNorm updates on the source
    pipe.zero_grad(), source.zero_grad()
    assert apply(pipe) is pipe
    apply(source)
    assert {t.dtype for t in pipe.parameters()} == {dtype}
    assert pipe.devices == [torch.device("cpu")] * 2
    x = x.to(dtype)
    assert torch.equal(pipe(x), by_micro_batch(source, (x,), 2))
    summed = nn.CrossEntropyLoss(reduction="sum")  # each micro-batch's loss as is: no weights rounded in
    loss = pipe.step(x, y, summed)
    losses = [summed(source(xc), yc) for xc, yc in zip(x.tensor_split(2), y.tensor_split(2))]
    for part in losses:
        part.backward()
    assert torch.equal(loss, losses[0].detach() + losses[1].detach())
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
        assert b.dtype == dtype and torch.equal(b.grad, a.grad), name
    for a, b in zip(source.buffers(), pipe.model.buffers()):
        assert torch.equal(a, b)


def test_a_failed_step_after_a_cast_restores_statistics_in_the_new_dtype() -> None:
    """The statistics a failed step puts back are copies taken in the pipeline's current dtype."""
    _, pipe = built(schedule="1f1b")
    x, y = torch.randn(6, 2, 6, 6), torch.randint(0, 4, (6,))
    pipe.step(x, y, nn.CrossEntropyLoss())
    pipe.double()
    pipe.step(x.double(), y, nn.CrossEntropyLoss())  # statistics that float32 cannot hold
    before = [b.clone() for b in pipe.buffers()]
    calls = []

    def fails_second(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("second micro-batch")
        return F.cross_entropy(out, target, reduction="sum")

    with pytest.raises(RuntimeError, match="second micro-batch"):
        pipe.step(x.double() + 0.5, y, fails_second, reduction="sum")
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(pipe.buffers(), before))


def test_a_cast_keeps_tensors_that_layers_share_shared() -> None:
    torch.manual_seed(0)
    source = Shares().train()
    seq = seqify.convert(copy.deepcopy(source))
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[len(seq) - 1, 1], chunks=2)
    ties = len(tied_slots(pipe))
    assert ties >= 2
    pipe.double()
    source.double()
    assert len(tied_slots(pipe)) == ties
    x = torch.randn(6, 4, dtype=torch.float64)
    for _ in range(2):  # train mode: BatchNorm updates the running mean a later layer reads
        assert torch.equal(pipe(x), by_micro_batch(source, (x,), 2))
