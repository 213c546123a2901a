"""Weights cast once per step under autocast (seqify/pipe/executors/casts.py): which weights, and the same step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import seqify
from seqify.pipe.executors import casts
from seqify.pipe.executors.options import ReplayOptions


class Block(nn.Module):
    """Linear and convolution weights (cast by autocast), a norm's scale and a weight read directly
    (float32 uses), and a linear called twice (two casts of one weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.twice = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.a(x)) * self.scale
        h = self.twice(h) + self.twice(h.flip(-1))
        return self.conv(h.unsqueeze(-1)).squeeze(-1)


def names(model: nn.Module, params: list[torch.Tensor]) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


def test_only_weights_autocast_casts_once_are_cast_once() -> None:
    model = Block()
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        found = casts.find(model, lambda: model(x), torch.bfloat16)
    assert found is not None
    assert names(model, found.params) == ["a.weight", "a.bias", "conv.weight", "conv.bias"]
    assert all(low.dtype == torch.bfloat16 and torch.equal(low, p.to(torch.bfloat16))
               for low, p in zip(found.low, found.params))
    with found.swapped():
        assert model.a.weight is found.leaves[0]
    assert model.a.weight is found.params[0]  # put back
    assert casts.find(model, lambda: model(x), torch.bfloat16) is None  # no autocast: nothing is cast


def test_watching_a_forward_leaves_batch_norm_statistics_alone() -> None:
    """The watched forward is one the step does not have: running statistics and counters are put back."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        found = casts.find(model, lambda: model(torch.randn(8, 4)), torch.bfloat16)
    assert found is not None and len(found) == 2  # the Linear's weight and bias; BatchNorm runs in float32
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n]), n


def test_a_forward_that_fails_while_watched_casts_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).train()
    before = model[1].running_mean.clone()

    def run() -> None:
        model(torch.randn(8, 4))
        raise RuntimeError("an op the watching mode cannot run")

    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        assert casts.find(model, run, torch.bfloat16) is None
    assert torch.equal(model[1].running_mean, before)


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Block(), nn.GELU(), Block(), nn.Linear(8, 3))


def step(schedule: str, enabled: bool, checkpoint: str, steps: int = 2, devices: tuple[str, str] = ("cpu", "cpu"),
         cut: int = 5, fuse: bool = True) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[list[str]]]:
    """``steps`` SGD steps of a 2-partition pipeline (the first ``cut`` layers, then the rest) under bfloat16
    autocast, driven as fixed programs (on the CPU eagerly, on GPUs as captured CUDA graphs); ``fuse``: cast
    linear weights' gradients written into their sums by the backward (:mod:`~seqify.pipe.executors.fused_grads`)."""
    model = net()
    seq = seqify.convert(model)
    cuda = devices[0].startswith("cuda")
    pipe = seqify.pipeline(seq, devices=list(devices), balance=[cut, len(seq) - cut], chunks=4, checkpoint=checkpoint,
                           schedule=schedule, graphs=cuda,
                           replay_options=ReplayOptions(cast_once=enabled, fuse_grads=fuse))
    pipe._replay_eager = not cuda
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, target = torch.randn(8, 6, device=devices[0]), torch.randn(8, 3, device=devices[-1])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast(devices[0].split(":")[0], dtype=torch.bfloat16, cache_enabled=False):
            if schedule == "gpipe":
                loss = nn.functional.mse_loss(pipe(x).float(), target)
                loss.backward()
            else:
                loss = pipe.step(x, target, lambda y, t: nn.functional.mse_loss(y.float(), t))
        losses.append(loss.detach())
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        opt.step()
    assert pipe._graphed is not None and pipe.graph_error is None, f"the step did not run as programs: {pipe.graph_error}"
    cast = [names(seq, c.params) if c is not None else [] for c in pipe._graphed[1].casts]
    return losses, grads, cast


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_step_with_weights_cast_once_equals_casting_per_micro_batch(schedule: str, checkpoint: str) -> None:
    """Losses and every gradient bit-equal over two SGD steps (the second reads the first step's update)."""
    losses, grads, cast = step(schedule, True, checkpoint)
    want, want_grads, none = step(schedule, False, checkpoint)
    # The cut falls between the first Block's two calls of `twice`: partition 0 casts its one call once;
    # the second Block's `twice` is called twice in partition 1 and keeps autocast's casts, as norms and scales.
    assert cast == [["0.weight", "0.bias", "1_a.weight", "1_a.bias", "1_twice.twice.weight", "1_twice.twice.bias"],
                    ["1_conv.weight", "1_conv.bias", "3_a.weight", "3_a.bias", "3_conv.weight", "3_conv.bias",
                     "4.weight", "4.bias"]]
    assert none == [[], []]
    for a, b in zip(losses, want):
        assert torch.equal(a, b)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_captured_graphs_cast_once_like_per_micro_batch(schedule: str) -> None:
    """The same on GPUs, replayed from captured CUDA graphs (cuda:0 and cuda:1, or cuda:0 twice). Over two GPUs
    the cut keeps the first Block whole: graphs refuse a module called on both sides of a cut between devices,
    and `twice`, called twice in one partition, keeps autocast's casts. Bit-equal with the sums filled the usual
    way; with fused sums (a float32 product on CUDA, not a bfloat16 one widened) equal within bfloat16's rounding."""
    two = torch.cuda.device_count() > 1
    devices = ("cuda:0", "cuda:1") if two else ("cuda:0", "cuda:0")
    cut = 11 if two else 5
    losses, grads, cast = step(schedule, True, "never", steps=3, devices=devices, cut=cut, fuse=False)
    want, want_grads, none = step(schedule, False, "never", steps=3, devices=devices, cut=cut)
    fused_losses, fused_grads, _ = step(schedule, True, "never", steps=3, devices=devices, cut=cut)
    assert sum(map(len, cast)) == (12 if two else 14) and none == [[], []]
    for a, b, c in zip(losses, want, fused_losses):
        assert torch.equal(a, b)
        torch.testing.assert_close(c, b, rtol=2e-2, atol=1e-3)
    for name, g in want_grads.items():
        assert torch.equal(grads[name], g), name
        torch.testing.assert_close(fused_grads[name], g, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("schedule", ["interleaved", "zero bubble"])
def test_distributed_programs_cast_once_like_per_micro_batch(schedule: str) -> None:
    """seqify.distributed's programs (one rank holding four partitions, graphs=True run eagerly on the CPU)
    under bfloat16 autocast: three SGD steps, losses, gradients and weights bit-equal with and without
    casting once (the first step's weights are cast when watched, the later ones' after each update)."""
    from helpers import dist_worker as worker
    import seqify.distributed as sd

    def run(enabled: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], int]:
        model = worker.build("skippy").float().train()  # autocast lowers float32, not the float64 skippy is
        plan = schedule if schedule == "interleaved" else worker.one_rank_zb(4, 4)
        stage = sd.DistributedStage(seqify.convert(model), [3, 3, 4, 4], index=0, device=torch.device("cpu"),
                                    chunks=4, schedule=plan, loops=4, checkpoint="never", graphs=True,
                                    replay_options=ReplayOptions(cast_once=enabled))
        opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for k in range(3):
            x, y = (t.float() if t.is_floating_point() else t for t in worker.data("skippy", 8, k))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                losses.append(stage.step(x, y, loss_fn=worker.loss_fn("skippy")).detach())
            opt.step()
        state = {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        state.update({f"{n}.grad": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        count = sum(len(p.casts) for p in stage._programs.values() if p.casts is not None)
        return losses, state, count

    losses, state, count = run(True)
    want, want_state, none = run(False)
    assert count > 0 and none == 0
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    for name, value in want_state.items():
        assert torch.equal(state[name], value), name
