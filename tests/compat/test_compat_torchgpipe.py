"""seqify.compat.torchgpipe against torchgpipe 0.0.7 itself (skipped where it is not installed) and the source."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import seqify
from helpers.exactness import by_micro_batch
from seqify.compat.torchgpipe import GPipe, balance_by_size, balance_by_time, verify_skippables
from seqify.skip import pop, skippable, stash

torchgpipe = pytest.importorskip("torchgpipe")
import torchgpipe.balance  # noqa: E402
import torchgpipe.skip  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CPU2 = ["cpu", "cpu"]


def flat(width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, width), nn.ReLU(), nn.BatchNorm1d(width), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3)
    ).double()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gpipe_matches_torchgpipe_and_the_source(checkpoint: str) -> None:
    source = flat()
    ours, theirs, one = copy.deepcopy(source), copy.deepcopy(source), copy.deepcopy(source)
    x = torch.randn(9, 4, dtype=torch.float64)
    g = GPipe(ours, [2, 4], devices=CPU2, chunks=3, checkpoint=checkpoint)
    t = torchgpipe.GPipe(theirs, [2, 4], devices=CPU2, chunks=3, checkpoint=checkpoint)
    # against the source on one device, micro-batch by micro-batch: outputs exact in eval mode
    g.eval(), one.eval()
    with torch.no_grad():
        assert torch.equal(g(x), by_micro_batch(one, (x,), 3))
    g.train()
    y, y_t = g(x), t(x)
    assert torch.equal(y, y_t)
    (y * torch.arange(3.0, dtype=torch.float64)).sum().backward()
    (y_t * torch.arange(3.0, dtype=torch.float64)).sum().backward()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    # BatchNorm statistics as one device updates them, micro-batch by micro-batch (torchgpipe updates them
    # a second time when it recomputes a checkpointed micro-batch, so it matches only without checkpoints)
    for chunk in x.chunk(3):
        one.train()(chunk)
    for p, q, r in zip(ours.buffers(), theirs.buffers(), one.buffers()):
        assert torch.equal(p, r)
        assert torch.equal(q, r) or checkpoint != "never"


def test_gpipe_attributes_as_torchgpipe() -> None:
    source = flat()
    g = GPipe(copy.deepcopy(source), [2, 4], devices=CPU2, chunks=2, checkpoint="never")
    t = torchgpipe.GPipe(copy.deepcopy(source), [2, 4], devices=CPU2, chunks=2, checkpoint="never")
    assert (g.balance, g.devices, g.chunks, g.checkpoint) == (t.balance, t.devices, t.chunks, t.checkpoint)
    assert len(g) == len(t) == 6
    assert [type(m) for m in g] == [type(m) for m in t]
    assert type(g[-1]) is type(t[-1]) and g[-1] is list(g)[5]
    assert [[type(m) for m in p] for p in g.partitions] == [[type(m) for m in p] for p in t.partitions]
    with pytest.raises(IndexError):
        g[6]
    with pytest.raises(IndexError):
        t[6]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(balance=[2, 3], devices=CPU2),  # sums to 5, not 6
        dict(balance=[0, 6], devices=CPU2),
        dict(balance=[2, 4], devices=["cpu"]),
        dict(balance=[2, 4], devices=CPU2, chunks=0),
        dict(balance=[2, 4], devices=CPU2, checkpoint="sometimes"),
        dict(balance=None, devices=CPU2),
    ],
)
def test_gpipe_bad_arguments_raise_what_torchgpipe_raises(kwargs: dict) -> None:
    with pytest.raises(Exception) as theirs:
        torchgpipe.GPipe(flat(), **kwargs)
    with pytest.raises(seqify.SeqifyError) as ours:
        GPipe(flat(), **kwargs)
    assert isinstance(ours.value, type(theirs.value)), (ours.value, theirs.value)


def test_gpipe_takes_any_module_by_converting_it() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)) + x)

    torch.manual_seed(0)
    source = Net().double()
    x = torch.randn(5, 4, dtype=torch.float64)
    g = GPipe(copy.deepcopy(source), [1, len(seqify.convert(copy.deepcopy(source))) - 1], devices=CPU2, chunks=2)
    assert torch.equal(g(x), by_micro_batch(source, (x,), 2))


def slow_last() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 1024), nn.Linear(1024, 1024))


def test_balance_by_time_same_type_and_answer_as_torchgpipe() -> None:
    model = slow_last()
    x = torch.randn(256, 8)
    ours = balance_by_time(2, model, x, timeout=0.3, device="cpu")
    theirs = torchgpipe.balance.balance_by_time(2, model, x, timeout=0.3, device="cpu")
    assert type(ours) is type(theirs) is list and all(type(b) is int for b in ours + theirs)
    assert sum(ours) == sum(theirs) == 5 and len(ours) == len(theirs) == 2
    # the last layer dominates: the optimal split puts it alone (torchgpipe's block partition does not
    # always find the optimum: it splits costs [1, 1, 1, 1, 100] as [2, 3])
    assert ours == [4, 1]
    assert all(p.grad is None for p in model.parameters())  # the module is left as it was


def test_balance_by_time_refuses_existing_gradients_like_torchgpipe() -> None:
    model = slow_last()
    model(torch.randn(2, 8)).sum().backward()
    with pytest.raises(ValueError):
        torchgpipe.balance.balance_by_time(2, model, torch.randn(2, 8), device="cpu")
    with pytest.raises(seqify.CompatError, match="zero_grad"):
        balance_by_time(2, model, torch.randn(2, 8), device="cpu")


def test_balance_by_size_weighs_parameters_by_param_scale_and_activations_by_chunks() -> None:
    # four layers: parameters mostly in the first, activations mostly in the last (a wide ReLU)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4), nn.Linear(4, 4), nn.Linear(4, 4096), nn.ReLU())
    x = torch.randn(512, 256)
    by_params = balance_by_size(2, model, x, chunks=512, param_scale=1000.0, device="cpu")
    by_activations = balance_by_size(2, model, x, chunks=1, param_scale=0.0, device="cpu")
    assert type(by_params) is list and all(type(b) is int for b in by_params)
    assert by_params == [1, 4]  # the 256x256 weights alone
    assert by_activations == [4, 1]  # the wide activations apart
    with pytest.raises(ValueError, match="CUDA"):  # torchgpipe cannot size on the CPU; seqify can
        torchgpipe.balance.balance_by_size(2, model, x, device="cpu")


@skippable(stash=["h"])
class Keep(nn.Module):
    def forward(self, x):  # type: ignore[no-untyped-def]
        yield stash("h", x)
        return x * 2


@skippable(pop=["h"])
class Add(nn.Module):
    def forward(self, x):  # type: ignore[no-untyped-def]
        h = yield pop("h")
        return x + h


def test_verify_skippables_like_torchgpipe() -> None:
    verify_skippables(nn.Sequential(Keep(), nn.ReLU(), Add()))
    with pytest.raises(TypeError) as info:
        verify_skippables(nn.Sequential(Add(), Keep()))
    assert isinstance(info.value, seqify.SkipError) and "'h'" in str(info.value)

    from torchgpipe.skip import pop as tpop, skippable as tskippable, stash as tstash

    @tskippable(pop=["h"])
    class TAdd(nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            h = yield tpop("h")
            return x + h

    @tskippable(stash=["h"])
    class TKeep(nn.Module):
        def forward(self, x):  # type: ignore[no-untyped-def]
            yield tstash("h", x)
            return x

    with pytest.raises(TypeError):
        torchgpipe.skip.verify_skippables(nn.Sequential(TAdd(), TKeep()))


def test_gpipe_runs_skippables_as_torchgpipe_does() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Keep(), nn.Linear(4, 4), Add()).double()
    x = torch.randn(4, 4, dtype=torch.float64)
    expected = by_micro_batch(model, (x,), 2)
    g = GPipe(model, [1, 2], devices=CPU2, chunks=2)
    assert torch.equal(g(x), expected)
