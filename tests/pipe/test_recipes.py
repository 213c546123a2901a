"""The training recipes of docs/guide/recipes.md, each run on a 2-partition CPU pipeline in float64 and compared with
the same recipe on the unpipelined source fed the pipeline's micro-batches."""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from helpers.exactness import by_micro_batch

pytestmark = pytest.mark.timeout(120)
CHUNKS = 3  # 10 samples: micro-batches of 4, 3 and 3


class Net(nn.Module):
    """A skip that crosses the cut and a BatchNorm (eval mode matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.a(x)))
        return self.c(torch.relu(self.b(h)) + h)


def setup(schedule: str = "1f1b", loops: int = 1) -> tuple[nn.Module, seqify.Pipeline]:
    """The source and a pipeline of a copy of it (two CPU devices, ``loops`` partitions each)."""
    torch.manual_seed(0)
    source = Net().double()
    seq = seqify.convert(copy.deepcopy(source))
    parts = 2 * loops
    balance = [len(seq) // parts + (i < len(seq) % parts) for i in range(parts)]
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], loops=loops, chunks=CHUNKS, schedule=schedule,
                           balance=balance)
    assert len(pipe.partitions) == parts and any(a != b for a, b in pipe.skip_partitions.values())
    return source, pipe


def batch(step: int, n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def source_loss(source: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The source's loss on the whole batch, its outputs computed micro-batch by micro-batch as the pipeline's."""
    return F.cross_entropy(by_micro_batch(source, (x,), CHUNKS), y)


def assert_same(source: nn.Module, pipe: seqify.Pipeline, grads: bool = False) -> None:
    """Parameters (and gradients) and BatchNorm statistics of the pipeline's model equal the source's."""
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)
        if grads:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    for a, b in zip(source.buffers(), pipe.model.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", [2.0, math.inf])
def test_clipping_gives_torchs_global_norm_bit_for_bit(norm: float) -> None:
    """On the same gradients, seqify.clip_grad_norm_ of the pipeline (four partitions, two per device) returns
    the total torch's clip_grad_norm_ returns on the source and leaves the same clipped gradients."""
    source, pipe = setup("gpipe", loops=2)
    x, y = batch(0)
    pipe.step(x, y, F.cross_entropy)
    for a, b in zip(source.parameters(), pipe.model.parameters(), strict=True):
        a.grad = b.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(source.parameters(), 1e-3, norm_type=norm)
    got = seqify.clip_grad_norm_(pipe, 1e-3, norm_type=norm)
    assert expected > 1e-3 and torch.equal(got, expected)
    for a, b in zip(source.parameters(), pipe.model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_scheduler_and_clipping_train_like_the_source() -> None:
    """SGD with momentum, a OneCycle LR schedule stepped after each optimizer step, global-norm clipping."""
    source, pipe = setup()
    runs = []
    for model in (source, pipe):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=4)
        runs.append((model, opt, sched))
    clipped = []
    for step in range(4):
        x, y = batch(step)
        totals = []
        for model, opt, sched in runs:
            opt.zero_grad()
            if model is pipe:
                loss = pipe.step(x, y, F.cross_entropy)
                totals.append((loss, seqify.clip_grad_norm_(pipe, 1e-2)))
            else:
                loss = source_loss(source, x, y)
                loss.backward()
                totals.append((loss.detach(), torch.nn.utils.clip_grad_norm_(source.parameters(), 1e-2)))
            opt.step()
            sched.step()
        (ref_loss, ref_norm), (loss, norm) = totals
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-12, atol=1e-12)
        clipped.append(bool(norm > 1e-2))
        assert runs[0][2].get_last_lr() == runs[1][2].get_last_lr()
    assert any(clipped)
    assert_same(source, pipe)


@pytest.mark.parametrize("schedule,replay", [("zb-h1", False), ("zb-h1", True), ("gpipe", True)])
def test_gradient_accumulation_over_steps(schedule: str, replay: bool) -> None:
    """Two mini-batches per optimizer step, each step's loss scaled by 1/2 (loss_scale=0.5), as
    ``(loss / 2).backward()`` twice on the source; pipe.step returns the unscaled loss. Also through the
    replay executor (what graphs=True runs; eager programs on the CPU), whose gpipe step is pipe(x) and one
    backward. (SGD: Adam would turn the rounding noise of a gradient that is zero in exact arithmetic, the
    bias before BatchNorm's, into a whole step of either sign.)"""
    source, pipe = setup(schedule)
    pipe._replay_eager = replay
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (source, pipe)]
    for step in range(2):
        for opt in opts:
            opt.zero_grad()
        for micro in range(2):
            x, y = batch(10 * step + micro)
            expected = source_loss(source, x, y)
            (expected / 2).backward()
            got = pipe.step(x, y, F.cross_entropy, loss_scale=0.5)
            torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)
        assert_same(source, pipe, grads=True)
        for opt in opts:
            opt.step()
    assert_same(source, pipe)
    assert (pipe._graphed is not None) is replay, pipe.graph_error


def test_grad_scaler_with_pipe_step() -> None:
    """torch.amp.GradScaler on the CPU (float64 gradients, no autocast): loss_scale=scaler scales the backward
    as scaler.scale(loss).backward() does; unscale_, clipping, step and update as usual. The second step's
    loss is inf (its gradients overflow): both skip that step and back the scale off, then train on."""
    source, pipe = setup()
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (source, pipe)]
    for step in range(3):
        x, y = batch(step)
        k = math.inf if step == 1 else 1.0
        for model, opt, scaler in zip((source, pipe), opts, scalers):
            opt.zero_grad()
            if model is pipe:
                loss = pipe.step(x, y, lambda out, t: F.cross_entropy(out, t) * k, reduction="mean",
                                 loss_scale=scaler)
                scaler.unscale_(opt)
                seqify.clip_grad_norm_(pipe, 1.0)
            else:
                scaler.scale(source_loss(source, x, y) * k).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(source.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        assert_same(source, pipe)
        assert scalers[0].get_scale() == scalers[1].get_scale() == 2.0 ** (9 if step else 10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_under_autocast_on_the_cpu(dtype: torch.dtype) -> None:
    """GradScaler("cpu") with float16 or bfloat16 autocast (a float32 model): the same loss, and gradients that
    agree to the low precision's rounding (each micro-batch runs as the source's does, but the loss's gradient
    reaches it through other float32 roundings than the whole batch's)."""
    torch.manual_seed(0)
    source = Net()
    pipe = seqify.pipeline(seqify.convert(copy.deepcopy(source)), devices=["cpu", "cpu"], chunks=CHUNKS,
                           schedule="1f1b", balance=[4, 3])
    scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]
    x, y = batch(0)
    with torch.autocast("cpu", dtype=dtype):
        got = pipe.step(x.float(), y, F.cross_entropy, loss_scale=scalers[1])
        expected = F.cross_entropy(by_micro_batch(source, (x.float(),), CHUNKS), y)
    scalers[0].scale(expected).backward()
    torch.testing.assert_close(got, expected.detach())
    for a, b in zip(source.parameters(), pipe.model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=2e-2 * float(a.grad.abs().max()))


def test_evaluation_under_no_grad() -> None:
    """After a training step, pipe.eval() under torch.no_grad(): the source's eval outputs, bit for bit
    (BatchNorm reads its running statistics), and no autograd graph."""
    source, pipe = setup()
    x, y = batch(0)
    pipe.step(x, y, F.cross_entropy)
    source_loss(source, x, y).backward()
    source.eval()
    pipe.eval()
    x, _ = batch(1)
    with torch.no_grad():
        out = pipe(x)
        expected = by_micro_batch(source, (x,), CHUNKS)
    assert not out.requires_grad and torch.equal(out, expected)
    pipe.train()


def _example() -> Any:
    path = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"
    spec = importlib.util.spec_from_file_location("hf_trainer_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_hf_trainer_example_trains_like_the_plain_trainer() -> None:
    """examples/hf_trainer.py: transformers' Trainer over a 2-partition pipeline of a tiny GPT-2 logs the losses
    and gradient norms of the stock Trainer on the plain model (float32), here accumulating gradients over two
    batches (the example's quick run, in tests/tools/test_examples.py, takes one)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    example = _example()
    source = example.build()
    trainer, pipe = example.train_pipeline(source, steps=3, accumulation=2)
    mine, theirs = example.logged(trainer), example.logged(example.train_plain(source, 3, 2))
    assert len(mine) == len(theirs) == 3
    torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), rtol=1e-5, atol=1e-6)
    assert mine[0] != mine[-1]  # it trained
