"""The replayed step (what graphs=True runs) driven with eager programs on CPU partitions: it must compute
what the source model computes over micro-batches, in GPipe order and in the looped order."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torchvision.models import resnet18

import seqify
from helpers.exactness import loss_of
from seqify.pipe.executors.wiring import order

pytestmark = pytest.mark.timeout(300)


def even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def replayed(model: nn.Module, parts: int, chunks: int, loops: int = 1) -> seqify.Pipeline:
    seq = seqify.convert(model)
    pipe = seqify.pipeline(seq, devices=["cpu"] * (parts // loops), loops=loops, balance=even(len(seq), parts),
                           chunks=chunks, checkpoint="never")
    assert len(pipe.partitions) == parts
    pipe._replay_eager = True
    return pipe


def reference_step(model: nn.Module, x: torch.Tensor, chunks: int) -> torch.Tensor:
    out = torch.cat([model(c) for c in x.tensor_split(chunks)])
    loss_of(out).backward()
    return out


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: resnet18(num_classes=7), (6, 3, 32, 32)),
        (lambda: seqify.zoo.unet(depth=3, blocks=1, channels=4), (5, 3, 32, 32)),
    ],
    ids=["resnet18", "unet"],
)
@pytest.mark.parametrize("parts, loops", [(2, 1), (4, 1), (4, 2)])
def test_replayed_steps_follow_the_source(make, shape, parts: int, loops: int) -> None:  # type: ignore[no-untyped-def]
    """Three SGD steps: outputs bit-equal, gradients and BatchNorm statistics as the source's, with the
    zero_grad styles alternating (a fresh .grad, and one added into)."""
    torch.manual_seed(0)
    source = make().train()
    reference = copy.deepcopy(source)
    pipe = replayed(source, parts, chunks=3, loops=loops)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x = torch.randn(*shape)
        opt.zero_grad(set_to_none=step % 2 == 0)
        opt_ref.zero_grad(set_to_none=step % 2 == 0)
        out = pipe(x)
        expected = reference_step(reference, x, 3)
        assert torch.equal(out, expected), f"step {step}"
        loss_of(out).backward()
        for (name, p), q in zip(source.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
        for (name, b), r in zip(source.named_buffers(), reference.buffers()):
            assert torch.equal(b, r), f"step {step} {name}"
        opt.step()
        opt_ref.step()
    assert pipe._graphed is not None


def test_input_gradients_flow_back() -> None:
    torch.manual_seed(0)
    source = resnet18(num_classes=5).train()
    reference = copy.deepcopy(source)
    pipe = replayed(source, 2, chunks=2)
    x = torch.randn(4, 3, 32, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = pipe(x)
    loss_of(out).backward()
    loss_of(reference_step_input(reference, x_ref)).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)


def reference_step_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(c) for c in x.tensor_split(2)])


def test_a_new_batch_shape_rebuilds_the_programs() -> None:
    torch.manual_seed(0)
    source = resnet18(num_classes=5).train()
    reference = copy.deepcopy(source)
    pipe = replayed(source, 2, chunks=2)
    for batch in (4, 6):
        x = torch.randn(batch, 3, 32, 32)
        out = pipe(x)
        assert torch.equal(out, torch.cat([reference(c) for c in x.tensor_split(2)]))
        first = pipe._graphed
        loss_of(out).backward()
    assert pipe._graphed is first


def test_eval_with_gradients_runs_eagerly() -> None:
    """Eval mode with autograd on (gradients through a frozen model, say) is neither a training step nor
    inference under no_grad: it runs eagerly."""
    pipe = replayed(resnet18(num_classes=5), 2, chunks=2)
    pipe.eval()
    pipe(torch.randn(4, 3, 32, 32))
    assert pipe._graphed is None


def test_issue_order_is_fill_drain_per_device_and_looped_across_repeats() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("meta")
    chain = lambda i, j: [(i, j - 1)] if j else []  # noqa: E731
    two = order([cpu, gpu], 3, chain, backward=False)
    assert [ij for ij in two if ij[1] == 0] == [(0, 0), (1, 0), (2, 0)]
    assert [ij for ij in two if ij[1] == 1] == [(0, 1), (1, 1), (2, 1)]
    looped = order([cpu, gpu, cpu, gpu], 2, chain, backward=False)
    on_cpu = [ij for ij in looped if ij[1] in (0, 2)]
    assert on_cpu == [(0, 0), (1, 0), (0, 2), (1, 2)]  # a device finishes one partition's micro-batches first
    for k, (i, j) in enumerate(looped):  # and nothing is issued before what it reads
        assert all(dep in looped[:k] for dep in chain(i, j))
    back = order([cpu, gpu, cpu, gpu], 2, lambda i, j: [(i, j + 1)] if j < 3 else [], backward=True)
    assert [ij for ij in back if ij[1] in (1, 3)] == [(1, 3), (0, 3), (1, 1), (0, 1)]


@pytest.mark.parametrize("train_mode", [False, True], ids=["eval", "train-mode"])
def test_inference_under_no_grad_replays_forward_programs(train_mode: bool) -> None:
    """Under torch.no_grad() the pipeline replays forward-only programs (no gradient buffers), bit-equal
    to the source over the same micro-batches, BatchNorm statistics too in train mode; a training step
    afterwards gets programs of its own and still trains like the source."""
    torch.manual_seed(0)
    source = seqify.zoo.unet(depth=3, blocks=1, channels=4).train(train_mode)
    reference = copy.deepcopy(source)
    pipe = replayed(source, 2, chunks=3)
    pipe.train(train_mode)
    for _ in range(2):
        x = torch.randn(5, 3, 32, 32)
        with torch.no_grad():
            got = pipe(x)
            want = torch.cat([reference(c) for c in x.tensor_split(3)])
        assert torch.equal(got, want)
    key, replay = pipe._graphed
    assert pipe.graph_error is None and key[1] is False  # built for inference
    assert all(not p.acc and not p.params and not any(p.out_grads) for row in replay.programs for p in row)
    for (name, a), b in zip(reference.named_buffers(), source.buffers()):  # the pipeline shares source's
        assert torch.equal(a, b), name
    pipe.train()
    reference.train()
    x = torch.randn(5, 3, 32, 32)
    assert torch.equal(reference_step(pipe, x, 1), reference_step(reference, x, 3))
    assert pipe._graphed[0][1] is True
    for (name, a), b in zip(reference.named_parameters(), source.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_split_backward_recomputes_with_the_forward_random_draws() -> None:
    """A split, checkpointed program recomputes in B (seqify.pipe.recompute.recomputed): dropout
    draws what the forward drew, BatchNorm statistics are left alone, the caller's generator is untouched."""
    from seqify.pipe.recompute import is_recomputing, norms_of, recomputed, rng_state

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).double().train()
    x = torch.randn(6, 4, dtype=torch.float64)
    state = rng_state(x)
    first = net(x)
    stats = [b.clone() for b in net.buffers()]
    after = torch.get_rng_state()
    seen: list[bool] = []
    net.register_forward_hook(lambda *_: seen.append(is_recomputing()))
    with torch.no_grad():  # a replayed step's context: the recomputation still builds a graph
        again = recomputed(net, x, norms=norms_of(net), rng=state)
    assert again.requires_grad and seen == [True]
    assert torch.equal(again, first)
    assert all(torch.equal(a, b) for a, b in zip(net.buffers(), stats))
    assert torch.equal(torch.get_rng_state(), after)
    other = recomputed(net, x, norms=norms_of(net))  # no state: other draws
    assert not torch.equal(other, first)


@pytest.mark.parametrize("how", ["pipe(x) and backward()", "pipe.step"])
def test_grad_views_the_step_sums_and_what_a_caller_holds_keeps_its_values(how: str) -> None:
    """``.grad`` after a replayed step is the programs' own gradient sums, not a copy (one copy of the
    gradients where a copy holds two). Autograd's contract still holds: a tensor a caller keeps from one step
    keeps its values through the next (it is given memory of its own first), nothing is copied where nothing
    is kept, and a ``.grad`` left in place is added into."""
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(source)
    pipe = replayed(source, parts=2, chunks=2)
    xs = [torch.randn(4, 6, dtype=torch.float64) for _ in range(3)]

    def step(x: torch.Tensor) -> None:
        if how == "pipe.step":
            pipe.step(x, None, lambda out, _: loss_of(out))
        else:
            loss_of(pipe(x)).backward()

    def expected(*batches: torch.Tensor) -> list[torch.Tensor]:
        reference.zero_grad(set_to_none=True)
        for x in batches:
            reference_step(reference, x, 2)
        return [q.grad.clone() for q in reference.parameters()]  # type: ignore[union-attr]

    def viewed() -> bool:
        graphed = pipe._graphed
        assert graphed is not None and graphed[1].sums is not None
        own = {flat.untyped_storage().data_ptr() for flats in graphed[1].sums for flat in flats}
        return all(p.grad is not None and p.grad.untyped_storage().data_ptr() in own for p in source.parameters())

    def grads_are(values: list[torch.Tensor]) -> None:
        for p, e in zip(source.parameters(), values):
            torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-14)

    step(xs[0])
    assert viewed()
    grads_are(expected(xs[0]))
    kept = [p.grad for p in source.parameters()]
    values = [g.clone() for g in kept if g is not None]
    pipe.zero_grad(set_to_none=True)
    step(xs[1])
    assert viewed()
    grads_are(expected(xs[1]))
    assert all(torch.equal(g, v) for g, v in zip(kept, values))  # the caller's tensors kept their values
    del kept, values
    pipe.zero_grad(set_to_none=True)
    graphed = pipe._graphed
    assert graphed is not None and sum(len(views) for views in graphed[1].views) == 0  # nothing left to copy
    step(xs[1])
    held = [p.grad for p in source.parameters()]
    step(xs[2])  # no zero_grad: added into .grad, as autograd does
    assert all(p.grad is g for p, g in zip(source.parameters(), held))
    grads_are(expected(xs[1], xs[2]))


@pytest.mark.parametrize("schedule, loops, parts", [("gpipe", 1, 2), ("1f1b", 1, 2), ("zb-h1", 1, 2),
                                                    ("interleaved", 2, 4)])
def test_each_partitions_first_backward_writes_its_sums(monkeypatch: pytest.MonkeyPatch, schedule: str, loops: int,
                                                        parts: int) -> None:
    """A replayed step does not zero its gradient sums first: each partition's first backward writes them (its
    gradients copied in, every sum it yields nothing for zeroed), the later ones add. The gradients stay the
    source's over steps whose sums held garbage before they ran."""
    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                           nn.Linear(8, 3)).double()
    reference = copy.deepcopy(source)
    seq = seqify.convert(source)
    pipe = seqify.pipeline(seq, devices=["cpu"] * (parts // loops), loops=loops, balance=even(len(seq), parts),
                           chunks=3, checkpoint="never", schedule=schedule)
    pipe._replay_eager = True
    pipe.step(torch.randn(6, 6, dtype=torch.float64), None, lambda out, _: loss_of(out))  # builds the programs
    graphed = pipe._graphed
    assert graphed is not None and graphed[1].sums is not None
    sums = [flat for flats in graphed[1].sums for flat in flats]
    trained = sum(1 for part in pipe.partitions if any(True for _ in part.parameters()))  # partitions with sums
    writers = [[p.writes_sums for p in row if p.writes_sums] for row in graphed[1].programs]
    assert sum(len(w) for w in writers) == trained and all(len(w) <= 1 for w in writers), writers
    if schedule == "zb-h1":  # the first partition's inputs need no gradient: its B adds nothing, its W writes
        assert writers[0] == ["W"], writers
    calls = {"zero": 0, "copy": 0, "add": 0}

    def counted(name: str, op: object) -> object:
        def run(tensors: list[torch.Tensor], *args: object) -> object:
            if any(t._base is not None and any(t._base is s for s in sums) for t in tensors):
                calls[name] += 1
            return op(tensors, *args)  # type: ignore[operator]
        return run

    for name in calls:
        monkeypatch.setattr(torch, f"_foreach_{name}_", counted(name, getattr(torch, f"_foreach_{name}_")))
    for _ in range(3):
        pipe.zero_grad(set_to_none=True)
        for flat in sums:
            flat.fill_(float("nan"))  # what a step must never read
        calls.update(zero=0, copy=0, add=0)
        x = torch.randn(6, 6, dtype=torch.float64)
        pipe.step(x, None, lambda out, _: loss_of(out))
        reference.zero_grad(set_to_none=True)
        reference_step(reference, x, 3)
        for p, q in zip(source.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)
        if schedule != "zb-h1":  # a split B yields only some gradients: the counts are W's and B's
            assert calls == {"zero": 0, "copy": trained, "add": trained * 2}, calls
