"""A layer put in another mode between replayed steps (a BatchNorm frozen with ``.eval()`` while the rest trains, as
detection fine-tuning does): the programs are built again in the new mode, so running statistics stop updating
and the step normalises with them, as the eager step does. Captured CUDA graphs keep the mode they were captured
in, so without a rebuild they went on training the frozen layer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import replay_steps


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(),
                         nn.Linear(8, 3))


def run(replay: bool, device: str = "cpu") -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[object]]:
    """Four SGD steps of a 2-partition 1F1B pipeline; both BatchNorms in eval mode for the third and fourth.
    Returns the losses, each step's gradients and running statistics, and the programs each step ran."""
    return replay_steps.norm_steps(net(), [3, 4], replay, device, lambda m, step: m.train(step < 2))


def test_a_layer_frozen_between_replayed_steps_runs_in_its_new_mode() -> None:
    got = run(True)
    replay_steps.assert_like(got, run(False))
    states = got[1]
    assert torch.equal(states[2][-1], states[3][-1])  # frozen: the statistics stopped moving


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graphs_are_captured_again_for_a_frozen_layer() -> None:
    got = run(True, "cuda:0")
    replay_steps.assert_like(got, run(False, "cuda:0"), tol=1e-5)
    states = got[1]
    assert torch.equal(states[2][-1], states[3][-1])
