"""Freezing and unfreezing parameters between replayed steps: the programs are built again for the parameters
that now want a gradient, so a frozen weight's ``.grad`` stays None as in an eager step (fixed programs used to
crash without autocast and, under it, kept differentiating the frozen weight); under seqify.distributed's
programs the change is refused with the parameter's name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from helpers import replay_steps
from seqify.errors import GraphError


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def grads(replay: bool, autocast: bool, device: str = "cpu") -> list[list[torch.Tensor | None]]:
    """Four SGD steps of a 2-partition 1F1B pipeline (on a GPU replayed from CUDA graphs); the middle weight
    frozen for the second and third."""
    seq = seqify.convert(net().to(device))
    cuda = device.startswith("cuda")
    pipe = replay_steps.pipeline(seq, [2, 3], replay, device)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    weight = next(p for p in seq.parameters() if p.shape == (8, 8))
    torch.manual_seed(1)
    x, target = torch.randn(4, 6, device=device), torch.randn(4, 3, device=device)
    found = []
    for step in range(4):
        weight.requires_grad_(step not in (1, 2))
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            pipe.step(x, target, lambda y, t: F.mse_loss(y.float(), t))
        found.append([None if p.grad is None else p.grad.clone() for p in pipe.parameters()])
        opt.step()
    assert not replay or (pipe.graph_error is None and (not cuda or pipe.graphs))
    return found


@pytest.mark.parametrize("autocast", [False, True])
def test_a_frozen_weight_gets_no_gradient_in_replayed_steps(autocast: bool) -> None:
    replayed, eager = grads(True, autocast), grads(False, autocast)
    assert [sum(g is None for g in step) for step in replayed] == [0, 1, 1, 0]
    for got, want in zip(replayed, eager):
        for a, b in zip(got, want):
            assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_frozen_weight_gets_no_gradient_from_captured_graphs() -> None:
    """Captured again for the parameters that want a gradient; gradients as the eager step's, within bfloat16's
    rounding (captured steps multiply linear weights' gradients into float32 sums)."""
    replayed, eager = grads(True, True, "cuda:0"), grads(False, True, "cuda:0")
    assert [sum(g is None for g in step) for step in replayed] == [0, 1, 1, 0]
    for got, want in zip(replayed, eager):
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_distributed_programs_refuse_a_parameter_frozen_after_the_first_step() -> None:
    from helpers import dist_worker as worker

    import seqify.distributed as sd

    model = worker.build("skippy").float().train()
    stage = sd.DistributedStage(seqify.convert(model), [3, 3, 4, 4], index=0, device=torch.device("cpu"), chunks=4,
                                schedule="interleaved", loops=4, checkpoint="never", graphs=True)
    x, y = (t.float() if t.is_floating_point() else t for t in worker.data("skippy", 8, 0))
    stage.step(x, y, loss_fn=worker.loss_fn("skippy"))
    next(p for p in model.parameters() if p.dim() == 2).requires_grad_(False)
    with pytest.raises(GraphError, match="no longer wants a gradient.*graphs=False"):
        stage.step(x, y, loss_fn=worker.loss_fn("skippy"))
