"""pipe.step weighs each micro-batch's loss by what the loss divides by: equal to one device for every loss."""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from seqify.pipe.losses import Probes, reduction_of

pytestmark = pytest.mark.timeout(120)

#: (schedule, partitions, loops): every schedule pipe.step runs, one and two partitions per device
SCHEDULES = [("gpipe", 2, 1), ("1f1b", 2, 1), ("interleaved", 4, 2), ("zb-h1", 2, 1), ("zb-h1", 4, 2),
             ("zb-h2", 2, 1)]


class LM(nn.Module):
    """A tiny language model whose logits come out (batch, classes, positions), as cross entropy takes them."""

    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.e = nn.Embedding(vocab, d)
        self.h = nn.Linear(d, d)
        self.g = nn.Linear(d, d)
        self.o = nn.Linear(d, vocab)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.h(self.e(i)))
        return self.o(torch.relu(self.g(h)) + h).transpose(1, 2)


def lm(schedule: str = "1f1b", parts: int = 2, loops: int = 1, chunks: int = 2) -> tuple[nn.Module, seqify.Pipeline]:
    torch.manual_seed(0)
    source = LM().double()
    pipe = seqify.pipeline(copy.deepcopy(source), devices=["cpu"] * (parts // loops), loops=loops,
                           balance=[8 // parts] * parts, chunks=chunks, schedule=schedule)
    return source, pipe


def padded(lengths: list[int], width: int = 6, pad: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, each sample's targets past its length set to ``pad``."""
    g = torch.Generator().manual_seed(len(lengths))
    ids = torch.randint(0, 11, (len(lengths), width), generator=g)
    target = torch.randint(1, 11, (len(lengths), width), generator=g)
    for row, n in enumerate(lengths):
        target[row, n:] = pad
    return ids, target


def check(source: nn.Module, pipe: seqify.Pipeline, x: Any, target: Any, loss_fn: Any, **kw: Any) -> None:
    """pipe.step's loss and gradients equal ``loss_fn`` on the whole batch on one device (float64)."""
    expected = loss_fn(source(x), target)
    expected.backward()
    got = pipe.step(x, target, loss_fn, **kw)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)


# -- torch's own losses: they say what they divide by ------------------------------------------------------


def test_padded_targets_weigh_by_non_ignored_tokens() -> None:
    """Micro-batches with different numbers of padded positions: one device divides by the non-ignored
    tokens of the whole batch, so micro-batch weights by samples were wrong (2.404 against 2.439)."""
    source, pipe = lm(chunks=2)
    ids, target = padded([6, 6, 6, 6])
    target[2:, 2:] = -100
    check(source, pipe, ids, target, nn.CrossEntropyLoss())


@pytest.mark.parametrize("schedule,parts,loops", SCHEDULES)
@pytest.mark.parametrize("chunks", [2, 3])
def test_uneven_padding_under_every_schedule(schedule: str, parts: int, loops: int, chunks: int) -> None:
    source, pipe = lm(schedule, parts, loops, chunks)
    ids, target = padded([6, 1, 4, 6, 2, 3, 5])
    check(source, pipe, ids, target, nn.CrossEntropyLoss())


@pytest.mark.parametrize("loss_fn", [
    nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 11, dtype=torch.float64), ignore_index=0),
    nn.CrossEntropyLoss(label_smoothing=0.2),
    nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, 11, dtype=torch.float64), label_smoothing=0.1),
    functools.partial(F.cross_entropy, ignore_index=0, label_smoothing=0.1),
    F.cross_entropy,
], ids=["class-weights", "label-smoothing", "weights-and-smoothing", "partial", "functional"])
def test_class_weights_label_smoothing_and_functional_forms(loss_fn: Any) -> None:
    """Torch's mean with class weights divides by the weights of the kept targets; label smoothing's term is
    divided by the same (torch's cross_entropy_loss_label_smoothing)."""
    source, pipe = lm("zb-h1", chunks=3)
    ids, target = padded([6, 1, 4, 6, 2, 3, 5], pad=0 if getattr(loss_fn, "keywords", {}).get("ignore_index") == 0
                         or getattr(loss_fn, "ignore_index", None) == 0 else -100)
    check(source, pipe, ids, target, loss_fn)


def test_nll_loss_with_class_weights() -> None:
    torch.manual_seed(0)
    source = nn.Sequential(LM(), nn.LogSoftmax(1)).double()
    pipe = seqify.pipeline(copy.deepcopy(source), devices=["cpu"] * 2, chunks=3, schedule="1f1b")
    ids, target = padded([6, 1, 4, 6, 2, 3, 5])
    check(source, pipe, ids, target, nn.NLLLoss(weight=torch.rand(11, dtype=torch.float64)))


def test_a_micro_batch_with_every_target_ignored_adds_nothing() -> None:
    """Its own mean is 0/0; on one device its positions add nothing to the sum or the count."""
    source, pipe = lm(chunks=3)
    ids, target = padded([6, 4, 5, 0, 0])  # micro-batches 2, 2, 1: the last two hold no target
    check(source, pipe, ids, target, nn.CrossEntropyLoss())
    assert all(torch.isfinite(p.grad).all() for p in pipe.model.parameters())


def test_element_means_and_sums_of_torch_losses() -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    pipe = seqify.pipeline(copy.deepcopy(source), devices=["cpu"] * 2, chunks=3, schedule="1f1b")
    x, y = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    for loss_fn in (nn.MSELoss(), nn.SmoothL1Loss(reduction="sum"), nn.HuberLoss(), F.l1_loss,
                    functools.partial(F.mse_loss, reduction="sum")):
        source.zero_grad()
        pipe.zero_grad()
        check(source, pipe, x, y, loss_fn)


def test_the_replayed_step_weighs_as_the_eager_one() -> None:
    """Graph replay's driver (eager programs on the CPU) takes the same weights."""
    source, pipe = lm("zb-h1", chunks=3)
    pipe._replay_eager = True
    ids, target = padded([6, 1, 4, 6, 2, 3, 5])
    check(source, pipe, ids, target, nn.CrossEntropyLoss())
    assert pipe._graphed is not None


# -- undeclared losses: probed -----------------------------------------------------------------------------


def summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="sum")


def by_samples(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target, reduction="none").sum(1).mean()


def masked(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    keep = target != -100
    return (F.cross_entropy(out, target.clamp(min=0), reduction="none") * keep).sum() / keep.sum()


@pytest.mark.parametrize("schedule,parts,loops", SCHEDULES)
@pytest.mark.parametrize("loss_fn", [summed, by_samples], ids=["sum", "mean-by-samples"])
def test_an_undeclared_sum_or_mean_by_samples_is_found_by_its_probe(schedule: str, parts: int, loops: int,
                                                                    loss_fn: Any) -> None:
    source, pipe = lm(schedule, parts, loops, chunks=3)
    ids, target = padded([6, 1, 4, 6, 2, 3, 5])
    check(source, pipe, ids, target, loss_fn)


def test_a_sum_lambda_is_not_halved() -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    pipe = seqify.pipeline(copy.deepcopy(source), devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    check(source, pipe, x, y, lambda a, b: F.mse_loss(a, b, reduction="sum"))


def test_a_masked_mean_is_refused_and_its_denominator_makes_it_exact() -> None:
    source, pipe = lm(chunks=2)
    ids, target = padded([6, 6, 6, 6])
    target[2:, 2:] = -100  # the first micro-batch holds no padding: only the step's targets show the mask
    with pytest.raises(seqify.LossError, match="denominator=") as info:
        pipe.step(ids, target, masked)
    assert isinstance(info.value, seqify.ScheduleError) and "masked" in str(info.value)
    assert all(p.grad is None for p in pipe.model.parameters())  # refused before any backward
    check(source, pipe, ids, target, masked, denominator=lambda t: (t != -100).sum())


def test_a_masked_mean_over_one_micro_batch_needs_no_weights() -> None:
    source, pipe = lm(chunks=1)
    ids, target = padded([6, 1, 4])
    check(source, pipe, ids, target, masked)


def test_the_probe_runs_once_per_loss_and_layout() -> None:
    calls = []

    def counted(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(out.size(0))
        return summed(out, target)

    _, pipe = lm(chunks=3)
    ids, target = padded([6, 1, 4, 6, 2, 3, 5])
    pipe.step(ids, target, counted)
    first = len(calls)
    assert first > 3  # the three micro-batches' losses and the probe's pieces
    calls.clear()
    pipe.step(ids, target, counted)
    assert len(calls) == 3
    pipe.step(ids[:, :4], target[:, :4], counted)  # another layout: probed again
    assert len(calls) > 6


def test_the_probe_leaves_no_trace() -> None:
    """No gradient, no RNG draw, no buffer change (running statistics): the probe runs on detached values
    without gradients, the RNG forked and a loss module's buffers put back."""
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            self.seen.add_(1)
            return F.mse_loss(out + 0 * torch.rand(()), target, reduction="sum")

    loss_fn = Noisy()
    out = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    targets = list(torch.randn(6, 3, dtype=torch.float64).tensor_split(2))
    rng = torch.get_rng_state()
    stats = [b.clone() for b in loss_fn.buffers()]
    assert Probes().kind(loss_fn, out[:3], 3, targets, [3, 3], lambda y: y) == "sum"
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(a, b) for a, b in zip(stats, loss_fn.buffers()))
    assert out.grad is None


def test_what_is_declared_is_trusted_and_what_contradicts_is_refused() -> None:
    assert reduction_of(summed, "sum").kind == "sum"
    assert reduction_of(nn.MSELoss(reduction="sum")).kind == "sum"
    assert reduction_of(lambda a, b: a.sum()).kind == "probe"
    assert reduction_of(nn.CrossEntropyLoss(), "mean").count is not None  # the table's count, not samples
    with pytest.raises(seqify.LossError, match="reduction='sum' but CrossEntropyLoss"):
        reduction_of(nn.CrossEntropyLoss(), "sum")
    with pytest.raises(seqify.LossError, match="batch second"):
        reduction_of(nn.CTCLoss())
    with pytest.raises(seqify.LossError, match="pass one"):
        reduction_of(summed, "sum", lambda t: 1)


# -- inputs the pipeline cannot take -----------------------------------------------------------------------


def test_meta_inputs_and_targets_are_refused_before_any_work() -> None:
    _, pipe = lm(chunks=2)
    with pytest.raises(seqify.DeviceError, match="the pipeline's input 'i'.*meta device"):
        pipe(torch.zeros(4, 6, dtype=torch.long, device="meta"))
    ids, target = padded([6, 6, 6, 6])
    with pytest.raises(seqify.DeviceError, match="input 'i'"):
        pipe.step(ids.to("meta"), target, nn.CrossEntropyLoss())
    with pytest.raises(seqify.DeviceError, match="target of shape"):
        pipe.step(ids, target.to("meta"), nn.CrossEntropyLoss())
    plain = seqify.pipeline(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), devices=["cpu"] * 2, chunks=2)
    with pytest.raises(seqify.DeviceError, match="the pipeline's input of shape \\(4, 8\\)"):
        plain(torch.randn(4, 8, device="meta"))


def test_a_distributed_stage_refuses_meta_inputs_and_targets_before_any_message() -> None:
    import seqify.distributed as sd

    stage = sd.DistributedStage(seqify.convert(LM()), [8], index=0, device=torch.device("cpu"), chunks=2)
    ids, target = padded([6, 6, 6, 6])
    with pytest.raises(seqify.DeviceError, match="the pipeline's input 'i'"):
        stage.step(ids.to("meta"), target, nn.CrossEntropyLoss())
    with pytest.raises(seqify.DeviceError, match="target of shape"):
        stage.step(ids, target.to("meta"), nn.CrossEntropyLoss())

def test_one_sample_micro_batches_under_batch_norm_name_chunks_the_batch_and_the_layer() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
    pipe = seqify.pipeline(model, devices=["cpu"] * 2, chunks=8)
    before = [b.clone() for b in model.buffers()]
    with pytest.warns(UserWarning, match="chunks=8 but the batch has 4"), \
            pytest.raises(seqify.MicroBatchError, match="chunks=8 on a batch of 4.*BatchNorm1d layer '1'.*chunks=2"):
        pipe(torch.randn(4, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))  # statistics as they were
    with pytest.raises(ValueError):  # a ValueError too, as torch raised
        pipe.step(torch.randn(4, 8), torch.randn(4, 8), nn.MSELoss())


def test_chunks_above_the_batch_warn_once_and_run() -> None:
    pipe = seqify.pipeline(nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten()), devices=["cpu"] * 2,
                           chunks=8)
    with pytest.warns(UserWarning, match="clamped"):
        pipe(torch.randn(4, 2, 5, 5))  # one sample per micro-batch: nine values per channel, torch runs it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(torch.randn(4, 2, 5, 5))


# -- seqify.distributed: ranks and replicas weigh alike ----------------------------------------------------


@pytest.mark.parametrize("world,balance,schedule,loops,graphs", [
    (2, [4, 4], "1f1b", 1, False),
    (2, [2, 2, 2, 2], "zb-h1", 2, True),  # fixed programs (eager on the CPU), two partitions per rank in a V
    (4, [4, 4], "gpipe", 1, False),  # two replicas of a two-rank pipeline
])
def test_distributed_steps_weigh_padded_targets_over_ranks_and_replicas(tmp_path: Any, world: int,
                                                                        balance: list[int], schedule: str, loops: int,
                                                                        graphs: bool) -> None:
    """Gloo ranks (float64): each loss's gradients equal one process's on the global batch, what the loss
    divides by added over replicas; each replica's returned loss is its own shard's."""
    
    from helpers import dist_worker as worker
    from helpers.procs import free_port, spawn

    spawn(worker.padded_spawned, args=(world, free_port(), str(tmp_path), balance, schedule, loops, 2, graphs),
             nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    replicas = world * loops // len(balance)
    x, y = worker.padded_batch()
    for name, (loss_fn, _) in worker.PADDED_LOSSES.items():
        torch.manual_seed(0)
        model = worker.PaddedLM().double()
        loss_fn(model(x), y).backward()
        seen: dict[str, torch.Tensor] = {}
        for r in results:
            loss, grads = r[name]
            if loss is not None:
                shard = slice(r["replica"] * 8 // replicas, (r["replica"] + 1) * 8 // replicas)
                with torch.no_grad():
                    own = loss_fn(model(x[shard]), y[shard])
                assert abs(loss - float(own)) < 1e-12 * max(1.0, abs(float(own))), name
            seen.update(grads)
        assert set(seen) == {n for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            torch.testing.assert_close(seen[n], p.grad, rtol=1e-10, atol=1e-12, msg=f"{name}: {n}")
