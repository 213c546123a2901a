"""A layer put in another mode between replayed steps (a BatchNorm frozen with ``.eval()`` while the rest trains, as
detection fine-tuning does): the programs are built again in the new mode, so running statistics stop updating
and the step normalises with them, as the eager step does. Captured CUDA graphs keep the mode they were captured
in, so without a rebuild they went on training the frozen layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(),
                         nn.Linear(8, 3))


def run(replay: bool, device: str = "cpu") -> tuple[list[torch.Tensor], list[list[torch.Tensor]], object]:
    """Four SGD steps of a 2-partition 1F1B pipeline; both BatchNorms in eval mode for the third and fourth.
    Returns the losses, each step's gradients and running statistics, and the pipeline."""
    seq = seqify.convert(net().to(device))
    cuda = device.startswith("cuda")
    pipe = seqify.pipeline(seq, devices=[device, device], balance=[3, 4], chunks=2, checkpoint="never",
                           schedule="1f1b", graphs=cuda and replay)
    pipe._replay_eager = replay and not cuda
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    norms = [m for m in seq.modules() if isinstance(m, nn.BatchNorm1d)]
    assert len(norms) == 2
    torch.manual_seed(1)
    x, target = torch.randn(8, 6, device=device), torch.randn(8, 3, device=device)
    losses, states = [], []
    for step in range(4):
        for m in norms:
            m.train(step < 2)
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.step(x, target, lambda y, t: F.mse_loss(y, t)).detach())
        states.append([p.grad.clone() for p in pipe.parameters()] + [b.clone() for b in pipe.buffers()])
        opt.step()
    assert not replay or (pipe.graph_error is None and (not cuda or pipe.graphs))
    return losses, states, pipe


def test_a_layer_frozen_between_replayed_steps_runs_in_its_new_mode() -> None:
    losses, states, pipe = run(True)
    want, want_states, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    for got, exp in zip(states, want_states):
        assert all(torch.equal(a, b) for a, b in zip(got, exp))
    assert torch.equal(states[2][-1], states[3][-1])  # frozen: the statistics stopped moving


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graphs_are_captured_again_for_a_frozen_layer() -> None:
    losses, states, _ = run(True, "cuda:0")
    want, want_states, _ = run(False, "cuda:0")
    for a, b in zip(losses, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for got, exp in zip(states, want_states):
        for a, b in zip(got, exp):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(states[2][-1], states[3][-1])
