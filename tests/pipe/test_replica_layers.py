"""The other replicas of a replicated pipeline follow what a user changes on ``pipe.model`` (the first replica's
layers) between steps: a BatchNorm put in eval mode, a setting changed (its momentum), a weight frozen. Without
that the other replicas' copies went on training the frozen BatchNorm with the old momentum: a different loss,
gradients and running statistics from the one model the pipeline stands for."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                         nn.ReLU(), nn.Linear(8, 3)).double()


def change(model: nn.Module) -> None:
    """Momentum 0.9 for every BatchNorm, the first one frozen in eval mode, the first weight frozen."""
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    for m in norms:
        m.momentum = 0.9
    norms[0].eval()
    next(m for m in model.modules() if isinstance(m, nn.Linear)).weight.requires_grad_(False)


def follows(replay: bool, stepping: str, device: str = "cpu", tol: float = 1e-12) -> None:
    """Four SGD steps of the source and of two replicas of a 2-partition 1F1B pipeline, :func:`change` made to
    both before the third; every step's loss, parameters and buffers compared."""
    source = net().to(device)
    cuda = device == "cuda"
    pipe = seqify.pipeline(seqify.convert(copy.deepcopy(source).cpu()), devices=None if cuda else ["cpu"] * 4,
                           gpus=4 if cuda else None, replicas=2, chunks=2, checkpoint="never", balance=[3, 4],
                           schedule="1f1b", graphs=cuda and replay)
    for r in pipe.replicas:
        r._replay_eager = replay and not cuda
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    opt_s = sgd(source.parameters())
    opt_p = pipe.optimizer(sgd) if stepping == "replicas" else sgd(pipe.parameters())
    torch.manual_seed(1)
    x, target = (torch.randn(8, n, dtype=torch.float64).to(pipe.input_device) for n in (6, 3))
    for step in range(4):
        if step == 2:
            change(source)
            change(pipe.model)
        opt_s.zero_grad(set_to_none=True)
        opt_p.zero_grad(set_to_none=True)
        want = F.mse_loss(torch.cat([source(c) for c in x.tensor_split(4)]), target)
        want.backward()
        got = pipe.step(x, target, F.mse_loss)
        torch.testing.assert_close(got.cpu(), want.detach().cpu(), rtol=tol, atol=tol)
        opt_s.step()
        opt_p.step()
        for a, b in zip(source.parameters(), pipe.model.parameters()):
            torch.testing.assert_close(b.cpu(), a.cpu(), rtol=tol, atol=tol)
        for a, b in zip(source.buffers(), pipe.model.buffers()):
            torch.testing.assert_close(b.cpu(), a.cpu(), rtol=tol, atol=tol)
    for other in pipe.replicas[1:]:  # each copy follows the model
        norms = [m for m in other.modules() if isinstance(m, nn.BatchNorm1d)]
        assert [m.training for m in norms] == [False, True] and all(m.momentum == 0.9 for m in norms)
    assert not (cuda and replay) or all(r.graphs and r.graph_error is None for r in pipe.replicas)


@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("stepping", ["first", "replicas"])
def test_the_other_replicas_follow_modes_settings_and_freezing_of_the_model(replay: bool, stepping: str) -> None:
    follows(replay, stepping)


@pytest.mark.gpu
@pytest.mark.parametrize("stepping", ["first", "replicas"])
def test_graphed_replicas_on_four_gpus_follow_the_model(stepping: str) -> None:
    if torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs")
    follows(True, stepping, "cuda", tol=1e-9)


def test_a_hook_on_the_model_alone_is_said_to_see_the_first_replicas_share() -> None:
    pipe = seqify.pipeline(seqify.convert(net()), devices=["cpu"] * 2, replicas=2, chunks=1, checkpoint="never",
                           balance=[7])
    x, target = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    seen: list[int] = []
    layer = next(m for m in pipe.model.modules() if isinstance(m, nn.Linear))
    layer.register_forward_hook(lambda m, args, out: seen.append(len(out)))
    with pytest.warns(UserWarning, match="only the first replica runs.*every replica's copy"):
        pipe.step(x, target, F.mse_loss)
    assert seen == [4]  # the first replica's share
    for other in pipe.replicas[1:]:
        copy_of = next(m for m in other.modules() if isinstance(m, nn.Linear))
        copy_of.register_forward_hook(lambda m, args, out: seen.append(len(out)))
    seen.clear()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.step(x, target, F.mse_loss)
    assert sorted(seen) == [4, 4]
