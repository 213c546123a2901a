"""A layer's plain setting changed between replayed steps (a BatchNorm's momentum, a dropout's p): the programs are
built again with the new value, as the eager step reads it. A captured CUDA graph replays the kernels its layers
launched at capture, with the values they read then, so without a rebuild the old momentum went on updating the
running statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from helpers import replay_steps
from seqify.pipe.executors.layer_settings import named, values


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def run(replay: bool, device: str = "cpu") -> tuple[list[torch.Tensor], list[list[torch.Tensor]], list[object]]:
    """Four SGD steps of a 2-partition 1F1B pipeline; the BatchNorms' momentum 0.1, then 0.9 from the third step.
    Returns the losses, each step's gradients and running statistics, and the programs each step ran."""
    def momentum(m: nn.BatchNorm1d, step: int) -> None:
        m.momentum = 0.1 if step < 2 else 0.9

    return replay_steps.norm_steps(net(), [4, 4], replay, device, momentum)


def test_a_setting_changed_between_replayed_steps_builds_the_programs_again() -> None:
    got = run(True)
    replay_steps.assert_like(got, run(False))
    built = got[2]
    assert built[0] is not None and built[0] is built[1] and built[2] is not built[1] and built[2] is built[3]


def test_settings_are_a_layers_plain_public_attributes() -> None:
    drop, norm = nn.Dropout(0.25), nn.BatchNorm1d(4, momentum=None)
    norm.note = "kept"  # an attribute a user set is a setting too
    container = nn.Sequential()
    found = dict(named([drop, norm, nn.ReLU(inplace=False), container]))
    assert found[drop] == ("p", "inplace")
    assert set(found[norm]) == {"num_features", "eps", "momentum", "affine", "track_running_stats", "note"}
    assert container not in found  # a container has no settings
    before = values(list(found.items()))
    drop.p = 0.5
    assert values(list(found.items())) != before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_graphs_are_captured_again_for_a_new_momentum() -> None:
    got = run(True, "cuda:0")
    replay_steps.assert_like(got, run(False, "cuda:0"), tol=1e-5)
    assert got[2][2] is not got[2][1]


def test_distributed_programs_are_built_again_for_a_new_setting() -> None:
    import seqify.distributed as sd

    def steps(graphs: bool) -> tuple[list[torch.Tensor], list[object]]:
        model = net()
        stage = sd.DistributedStage(seqify.convert(model), [4, 4], index=0, device=torch.device("cpu"), chunks=2,
                                    schedule="interleaved", loops=2, checkpoint="never", graphs=graphs)
        norms = [m for m in stage.modules() if isinstance(m, nn.BatchNorm1d)]
        torch.manual_seed(1)
        x, target = torch.randn(8, 6), torch.randn(8, 3)
        built = []
        for step in range(3):
            for m in norms:
                m.momentum = 0.1 if step < 2 else 0.9
            stage.step(x, target, loss_fn=F.mse_loss)
            built.append([prog.programs[0] for prog in stage._programs.values()] if graphs else None)
        return [b.clone() for b in stage.buffers()], built

    stats, built = steps(True)
    want, _ = steps(False)
    assert all(torch.equal(a, b) for a, b in zip(stats, want))
    assert built[0] == built[1] and all(a is not b for a, b in zip(built[1], built[2]))
