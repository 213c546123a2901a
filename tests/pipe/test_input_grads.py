"""Inputs that want a gradient (adversarial training): a replayed pipe.step copies its inputs into fixed buffers, so
such a step runs eagerly and the input's ``.grad`` equals the eager step's (it was left None); under
seqify.distributed each micro-batch's input gradient is handed back to the caller's input, by an eager step and by
a step of fixed programs (``graphs=True``), whose first partition then differentiates its input buffers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from helpers import replay_steps


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def run(replay: bool, schedule: str, device: str = "cpu") -> tuple[list[torch.Tensor], object]:
    """Two steps on an input that requires grad (its gradient after each), then one on a plain input."""
    pipe = replay_steps.pipeline(seqify.convert(net().to(device)), [2, 3], replay, device, schedule)
    torch.manual_seed(1)
    x = torch.randn(4, 6, device=device, requires_grad=True)
    target = torch.randn(4, 3, device=device)
    found = []
    for _ in range(2):
        x.grad = None
        pipe.step(x, target, lambda y, t: F.mse_loss(y, t))
        found.append(x.grad)
    pipe.step(x.detach(), target, lambda y, t: F.mse_loss(y, t))  # plain inputs replay as before
    return found, pipe


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_replayed_step_gives_the_input_its_gradient(schedule: str) -> None:
    replayed, pipe = run(True, schedule)
    eager, _ = run(False, schedule)
    assert all(g is not None for g in replayed)
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))
    assert pipe.graph_error is None and pipe._replayer.built is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graphed_pipeline_gives_the_input_its_gradient() -> None:
    replayed, pipe = run(True, "1f1b", "cuda:0")
    eager, _ = run(False, "1f1b", "cuda:0")
    assert all(g is not None for g in replayed)
    for a, b in zip(replayed, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert pipe.graphs and pipe.graph_error is None and pipe._replayer.built is not None


def _stage(schedule: str, loops: int, checkpoint: str, graphs: bool = False, device: str = "cpu"
           ) -> tuple[nn.Module, object]:
    import seqify.distributed as sd

    source = net()
    model = seqify.convert(net())
    balance = {1: [5], 2: [2, 3], 4: [1, 1, 1, 2]}[loops]
    return source, sd.DistributedStage(model, balance, index=0, device=torch.device(device), chunks=3,
                                       schedule=schedule, loops=loops, checkpoint=checkpoint, graphs=graphs)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("schedule,loops,checkpoint", [("gpipe", 1, "never"), ("gpipe", 2, "except_last"),
                                                       ("interleaved", 4, "never"), ("zb-h1", 2, "never"),
                                                       ("zb-h1", 2, "always")])
def test_a_distributed_step_gives_the_input_its_gradient(schedule: str, loops: int, checkpoint: str,
                                                         graphs: bool) -> None:
    """Each rank's first partition hands its micro-batches' gradients back through autograd (eagerly, or from
    fixed programs differentiating their input buffers): ``x.grad`` is the source's on the same micro-batches,
    and adds up over steps."""
    source, stage = _stage(schedule, loops, checkpoint, graphs)
    torch.manual_seed(1)
    x = torch.randn(6, 6, requires_grad=True)
    target = torch.randn(6, 3)
    want = x.detach().clone().requires_grad_()
    F.mse_loss(torch.cat([source(c) for c in want.tensor_split(3)]), target).backward()
    stage.step(x, target, loss_fn=F.mse_loss)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, want.grad, rtol=1e-6, atol=1e-7)
    once = x.grad.clone()
    stage.step(x, target, loss_fn=F.mse_loss)  # accumulated, as an eager backward accumulates
    torch.testing.assert_close(x.grad, 2 * once, rtol=1e-6, atol=1e-7)
    for p, q in zip(source.parameters(), stage.parameters()):
        assert q.grad is not None and p.grad is not None


def test_distributed_programs_are_built_again_when_the_inputs_stop_or_start_wanting_a_gradient() -> None:
    """Programs built for plain inputs, then for inputs wanting a gradient, then plain again: each step's ``x.grad``
    and parameter gradients are the eager stage's, and a plain step leaves ``x.grad`` as it was."""
    replayed, eager = _switching_steps(True, "cpu"), _switching_steps(False, "cpu")
    assert [g is None for g in replayed] == [g is None for g in eager]
    assert replayed[0] is None and replayed[len(replayed) // 5] is not None
    for a, b in zip(replayed, eager, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_rank_gives_the_input_its_gradient() -> None:
    """The same on a GPU, where the rank's programs are captured as CUDA graphs and replayed."""
    replayed, eager = _switching_steps(True, "cuda:0"), _switching_steps(False, "cuda:0")
    assert [g is None for g in replayed] == [g is None for g in eager]
    for a, b in zip(replayed, eager, strict=True):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _switching_steps(graphs: bool, device: str) -> list[torch.Tensor | None]:
    """Five steps of a single-rank stage whose inputs want a gradient, or not, in turn: after each, the input's
    gradient and the parameters'."""
    _, stage = _stage("interleaved", 4, "never", graphs=graphs, device=device)
    torch.manual_seed(1)
    x, target = torch.randn(6, 6, device=device), torch.randn(6, 3, device=device)
    found: list[torch.Tensor | None] = []
    for wants in (False, True, True, False, True):
        given = x.clone().requires_grad_(wants)
        stage.step(given, target, loss_fn=F.mse_loss)
        found += [given.grad] + [p.grad.clone() for p in stage.parameters()]
        stage.zero_grad(set_to_none=True)
    if graphs:  # the last step ran the first partition's programs built for inputs wanting a gradient
        first = stage._programs[0]
        assert first.input_grads and all(p is not None for p in first.programs)
    return found
