"""Inputs that want a gradient (adversarial training): a replayed pipe.step copies its inputs into fixed buffers, so
such a step runs eagerly and the input's ``.grad`` equals the eager step's (it was left None); under
seqify.distributed, whose ranks take their micro-batches as tensors of their own, the step refuses such inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from seqify.errors import ScheduleError


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def run(replay: bool, schedule: str, device: str = "cpu") -> tuple[list[torch.Tensor], object]:
    """Two steps on an input that requires grad (its gradient after each), then one on a plain input."""
    cuda = device.startswith("cuda")
    pipe = seqify.pipeline(seqify.convert(net().to(device)), devices=[device, device], balance=[2, 3], chunks=2,
                           checkpoint="never", schedule=schedule, graphs=cuda and replay)
    pipe._replay_eager = replay and not cuda
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


def test_a_distributed_step_refuses_an_input_that_wants_a_gradient() -> None:
    from helpers import dist_worker as worker

    import seqify.distributed as sd

    model = worker.build("skippy").float().train()
    stage = sd.DistributedStage(seqify.convert(model), [3, 3, 4, 4], index=0, device=torch.device("cpu"), chunks=4,
                                schedule="interleaved", loops=4, checkpoint="never")
    x, y = (t.float() if t.is_floating_point() else t for t in worker.data("skippy", 8, 0))
    with pytest.raises(ScheduleError, match="does not give the inputs a gradient.*x.detach"):
        stage.step(x.requires_grad_(), y, loss_fn=worker.loss_fn("skippy"))
    assert stage.step(x.detach(), y, loss_fn=worker.loss_fn("skippy")) is not None
