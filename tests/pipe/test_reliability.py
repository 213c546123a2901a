"""Nothing is lost: conversion never changes its source; a pipeline step that fails (forward or backward, any
partition, any checkpointing, an exception, KeyboardInterrupt or out of memory) ends promptly, leaves
parameters, optimizer state and running statistics as before the step and the pipeline usable; converted
models and pipelines save, load, copy and move between devices and dtypes."""

from __future__ import annotations

import copy
import io
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers.exactness import assert_unchanged, snapshot
from helpers.nets import Shares
from torch import nn
from torchvision.models import resnet18

import seqify
from seqify.model.sequential import tied_slots

pytestmark = pytest.mark.timeout(120)

CPU3 = ["cpu"] * 3


# -- convert never changes its source -------------------------------------------------------------


class Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x) if x.sum() > 0 else -x  # data-dependent: kept whole


class Busy(nn.Module):
    """Tied weights, a frozen parameter, persistent and non-persistent buffers, a hooked submodule, a
    module called twice, a submodule in eval mode inside a model in train mode, an opaque submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.frozen = nn.Parameter(torch.randn(6), requires_grad=False)
        self.register_buffer("offset", torch.randn(6))
        self.register_buffer("scratch", torch.zeros(6), persistent=False)
        self.norm = nn.BatchNorm1d(6)
        self.hooked = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.hooked.register_forward_hook(lambda m, i, o: o * 1.0)
        self.odd = Opaque()
        self.steady = nn.Dropout(0.5).eval()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.a(x) + self.offset) * self.frozen
        h = self.a(torch.relu(h))  # called twice
        h = self.steady(self.hooked(h)) + self.b(h)
        return self.odd(h), h + self.scratch


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # untraceable at the top level: convert raises
            return self.f(x)
        return x


def _sources() -> list[tuple[str, nn.Module, Any]]:
    return [
        ("resnet18", resnet18(num_classes=4).train(), torch.randn(2, 3, 32, 32)),
        ("unet", seqify.zoo.unet(depth=3, blocks=1, channels=4).eval(), torch.randn(2, 3, 16, 16)),
        ("busy", Busy().train(), torch.randn(3, 6)),
    ]


@pytest.mark.parametrize("with_examples", [False, True], ids=["symbolic", "example_inputs"])
def test_convert_never_changes_its_source(with_examples: bool) -> None:
    for name, model, x in _sources():
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        before = snapshot(model)
        grads = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        rng = torch.random.get_rng_state()
        seq = seqify.convert(model, example_inputs=x if with_examples else None)
        assert_unchanged(model, before)
        assert torch.equal(rng, torch.random.get_rng_state()), name
        assert {n: p.requires_grad for n, p in model.named_parameters()} == flags, name
        for n, p in model.named_parameters():
            assert (p.grad is None) == (grads[n] is None) and (p.grad is None or torch.equal(p.grad, grads[n])), n
        assert len(seq) > 1, name


def test_a_conversion_that_fails_changes_nothing() -> None:
    for model, options in [(Branchy(), {}), (Busy(), {"leaf_paths": ["nope"]}), (Busy(), {"example_inputs": {"y": 1}})]:
        before = snapshot(model)
        with pytest.raises(seqify.SeqifyError):
            seqify.convert(model, **options)
        assert_unchanged(model, before)


def test_pipelining_with_deferred_batch_norm_keeps_the_source_tree() -> None:
    """A pipeline shares the source's modules (and moves them to their devices) but does not rebuild it."""
    model = seqify.zoo.unet(depth=2, blocks=1, channels=4)
    before = snapshot(model)
    seq = seqify.convert(model)
    pipe = seqify.pipeline(seq, devices=CPU3, balance=_even(len(seq), 3), chunks=2, deferred_batch_norm=True)
    assert any(isinstance(m, seqify.DeferredBatchNorm) for m in pipe.modules())
    assert not any(isinstance(m, seqify.DeferredBatchNorm) for m in model.modules())
    assert_unchanged(model, before)


# -- a failed step loses nothing ------------------------------------------------------------------


def _even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fault: Fault) -> torch.Tensor:  # type: ignore[override]
        ctx.fault = fault
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.fault.tick("backward")
        return grad, None


class Fault(nn.Module):
    """A layer that raises ``error()`` on its ``at``-th micro-batch, in forward or in backward, when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.where: str | None = None
        self.error: Callable[[], BaseException] = lambda: ValueError("boom")
        self.at = 0
        self.calls = 0

    def arm(self, where: str, error: Callable[[], BaseException], at: int = 1) -> None:
        self.where, self.error, self.at, self.calls = where, error, at, 0

    def disarm(self) -> None:
        self.where = None

    def tick(self, where: str) -> None:
        if self.where == where:
            self.calls += 1
            if self.calls - 1 == self.at:
                raise self.error()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not seqify.is_recomputing():
            self.tick("forward")
        return _Boom.apply(x, self)


def faulty_net(part: int) -> tuple[nn.Sequential, Fault, list[int]]:
    """Three partitions of conv-BatchNorm-ReLU, the fault in partition ``part`` after its BatchNorm."""
    fault = Fault()
    blocks: list[list[nn.Module]] = [
        [nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()],
        [nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()],
        [nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)],
    ]
    blocks[part].insert(2, fault)
    return nn.Sequential(*[m for b in blocks for m in b]), fault, [len(b) for b in blocks]


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _state(opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    return [(f"{i}.{k}", v.clone()) for i, s in enumerate(opt.state.values()) for k, v in sorted(s.items())
            if isinstance(v, torch.Tensor)]


def _statistics(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for b in model.buffers()]


class Step:
    """One training step on the pipeline and on a one-device reference that runs the micro-batches in turn."""

    def __init__(self, part: int, optimizer: str, checkpoint: str, chunks: int = 3, deferred: bool = False) -> None:
        torch.manual_seed(0)
        self.model, self.fault, balance = faulty_net(part)
        self.reference = copy.deepcopy(self.model)
        self.chunks = chunks
        self.pipe = seqify.pipeline(self.model, devices=CPU3, balance=balance, chunks=chunks, checkpoint=checkpoint,
                                    deferred_batch_norm=deferred)
        self.opt = _optimizer(optimizer, self.pipe.parameters())
        self.ref_opt = _optimizer(optimizer, self.reference.parameters())
        g = torch.Generator().manual_seed(1)
        self.batches = [(torch.randn(6, 3, 4, 4, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]

    def ref_forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.reference(c) for c in x.tensor_split(self.chunks)])

    @staticmethod
    def run(forward: Callable[[torch.Tensor], torch.Tensor], opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        opt.step()

    def both(self, i: int) -> None:
        x, y = self.batches[i]
        self.run(self.pipe, self.opt, x, y)
        self.run(self.ref_forward, self.ref_opt, x, y)

    def assert_equal_to_reference(self) -> None:
        for (name, p), q in zip(self.model.named_parameters(), self.reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        for (name, b), c in zip(self.model.named_buffers(), self.reference.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("part", [0, 1, 2])
def test_a_failed_step_loses_nothing(part: int, where: str, checkpoint: str, optimizer: str) -> None:
    s = Step(part, optimizer, checkpoint)
    s.both(0)  # the optimizer has state (momentum, Adam moments)
    params = [p.detach().clone() for p in s.model.parameters()]
    state = _state(s.opt)
    statistics = _statistics(s.model)
    threads = threading.active_count()
    s.fault.arm(where, lambda: ValueError("boom"), at=1)  # the second micro-batch: others already ran
    x, y = s.batches[1]
    with pytest.raises(ValueError, match="boom") as info:
        s.run(s.pipe, s.opt, x, y)
    s.fault.disarm()
    if where == "forward":
        layer = sum(s.pipe.balance[:part]) + 2
        assert f"in pipeline partition {part} (cpu), layer '{layer}'" in " ".join(info.value.__notes__)
    # The optimizer step never ran: parameters and optimizer state are as before the step.
    assert all(torch.equal(p, q) for p, q in zip(s.model.parameters(), params))
    assert [k for k, _ in _state(s.opt)] == [k for k, _ in state]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(_state(s.opt), state))
    if where == "forward":
        # Partitions before the fault had run micro-batches: their BatchNorm statistics are restored.
        assert all(torch.equal(a, b) for a, b in zip(_statistics(s.model), statistics))
        assert all(p.grad is None for p in s.model.parameters())  # zero_grad set them to None; nothing ran backward
    else:
        # The forward completed, as on one device: statistics are those of the whole forward.
        with torch.no_grad():
            s.ref_forward(x)
        for a, b in zip(s.model.buffers(), s.reference.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not seqify.is_recomputing() and not seqify.is_checkpointing()
    assert threading.active_count() == threads
    # Usable again: the next step (zero_grad discards partial gradients) lands where one device does.
    s.both(2)
    s.assert_equal_to_reference()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_deferred_batch_norm_statistics_are_restored_after_a_failed_forward(checkpoint: str) -> None:
    """With deferred BatchNorm, partition 0 has committed its statistics (all its micro-batches ran) when
    partition 1 fails on the last micro-batch: they are restored, and the accumulators are reset."""
    s = Step(1, "sgd", checkpoint, chunks=3, deferred=True)
    twin = Step(1, "sgd", checkpoint, chunks=3, deferred=True)  # the same pipeline, never failing
    s.run(s.pipe, s.opt, *s.batches[0])
    twin.run(twin.pipe, twin.opt, *twin.batches[0])
    statistics = _statistics(s.model)
    s.fault.arm("forward", lambda: RuntimeError("boom"), at=2)
    with pytest.raises(RuntimeError, match="boom"):
        s.run(s.pipe, s.opt, *s.batches[1])
    s.fault.disarm()
    assert all(torch.equal(a, b) for a, b in zip(_statistics(s.model), statistics))
    assert s.model[1].num_batches_tracked.item() == 1
    deferred = [m for m in s.pipe.modules() if isinstance(m, seqify.DeferredBatchNorm)]
    assert len(deferred) == 3 and all(m.tracked == 0 for m in deferred)
    s.run(s.pipe, s.opt, *s.batches[2])
    twin.run(twin.pipe, twin.opt, *twin.batches[2])
    for a, b in zip(s.model.state_dict().values(), twin.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# -- no hangs ----------------------------------------------------------------------------------------


ERRORS: dict[str, Callable[[], BaseException]] = {
    "KeyboardInterrupt": KeyboardInterrupt,
    "OutOfMemoryError": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"),
    "RuntimeError-oom": lambda: RuntimeError("out of memory (simulated)"),
}


@pytest.mark.timeout(20)
@pytest.mark.parametrize("error", list(ERRORS))
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_interrupts_and_out_of_memory_end_the_step_promptly(where: str, checkpoint: str, error: str) -> None:
    s = Step(1, "sgd", checkpoint)
    s.both(0)
    statistics = _statistics(s.model)
    threads = threading.active_count()
    make = ERRORS[error]
    s.fault.arm(where, make, at=1)
    start = time.monotonic()
    with pytest.raises(type(make())) as info:
        s.run(s.pipe, s.opt, *s.batches[1])
    assert time.monotonic() - start < 5
    assert "simulated" in str(info.value) or error == "KeyboardInterrupt"
    s.fault.disarm()
    assert threading.active_count() == threads
    if where == "forward":
        assert all(torch.equal(a, b) for a, b in zip(_statistics(s.model), statistics))
    else:
        with torch.no_grad():
            s.ref_forward(s.batches[1][0])
    s.both(2)
    s.assert_equal_to_reference()


# -- saving, loading, copying, moving ---------------------------------------------------------------


def _models() -> list[tuple[str, Callable[[], nn.Module], torch.Tensor]]:
    return [
        ("resnet18", lambda: resnet18(num_classes=5), torch.randn(4, 3, 32, 32)),
        ("unet", lambda: seqify.zoo.unet(depth=3, blocks=1, channels=4), torch.randn(2, 3, 16, 16)),
    ]


def _round_trip(obj: Any, **load: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load)


def _trained(make: Callable[[], nn.Module], x: torch.Tensor, seed: int) -> nn.Module:
    """A source whose state is not the initial one: parameters moved, BatchNorm statistics updated."""
    torch.manual_seed(seed)
    model = make().train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
        model(x)
    return model.eval()


def _same(a: nn.Module, b: nn.Module, x: torch.Tensor) -> bool:
    with torch.no_grad():
        got, expected = a(x), b(x)
    assert torch.isfinite(expected).all()
    return torch.equal(got, expected)


@pytest.mark.parametrize("name", ["resnet18", "unet"])
def test_pickle_torch_save_and_deepcopy(name: str) -> None:
    _, make, x = next(m for m in _models() if m[0] == name)
    source = _trained(make, x, 0)
    seq = seqify.convert(source)
    loaded = [pickle.loads(pickle.dumps(seq)), _round_trip(seq, weights_only=False), copy.deepcopy(seq)]
    for clone in loaded:
        assert _same(clone, source, x)
        assert clone.skips == seq.skips and list(clone._modules) == list(seq._modules)
        assert not {id(p) for p in clone.parameters()} & {id(p) for p in seq.parameters()}, "a copy shares tensors"
        assert len(tied_slots(clone)) == len(tied_slots(seq)), "a copy lost or gained shared tensors"
    # A copy trains on its own: the source does not move.
    before = [p.clone() for p in source.parameters()]
    copied = loaded[2].train()
    copied(x).float().pow(2).mean().backward()
    torch.optim.SGD(copied.parameters(), lr=0.1).step()
    assert all(torch.equal(p, q) for p, q in zip(source.parameters(), before))


@pytest.mark.parametrize("name", ["resnet18", "unet"])
def test_state_dicts_load_with_weights_only(name: str) -> None:
    _, make, x = next(m for m in _models() if m[0] == name)
    source = _trained(make, x, 0)
    seq = seqify.convert(source)
    # The converted model's own state dict, into a fresh conversion of a differently initialised source.
    fresh = seqify.convert(_trained(make, x, 1))
    assert not _same(fresh, source, x)
    fresh.load_state_dict(_round_trip(seq.state_dict(), weights_only=True))
    assert _same(fresh.eval(), source, x)
    # The source's keys: original_state_dict -> load_original_state_dict.
    original = _round_trip(seq.original_state_dict(), weights_only=True)
    assert list(original) == list(source.state_dict())
    assert all(torch.equal(original[k], v) for k, v in source.state_dict().items())
    other_source = _trained(make, x, 2)
    other = seqify.convert(other_source)
    other.load_original_state_dict(original)
    assert _same(other.eval(), source, x)
    assert all(torch.equal(a, b) for a, b in zip(other_source.state_dict().values(), source.state_dict().values()))


@pytest.mark.parametrize("name", ["resnet18", "unet"])
def test_moving_to_meta_and_back_and_changing_dtype(name: str) -> None:
    _, make, x = next(m for m in _models() if m[0] == name)
    source = _trained(make, x, 0)
    reference = copy.deepcopy(source)
    seq = seqify.convert(source)
    saved = copy.deepcopy(seq.state_dict())
    ties = len(tied_slots(seq))
    seq.to("meta")
    assert all(t.is_meta for t in list(seq.parameters()) + list(seq.buffers()))
    assert seq(x.to("meta")).shape == reference(x).shape
    assert len(tied_slots(seq)) == ties
    seq.to_empty(device="cpu")
    assert len(tied_slots(seq)) == ties
    seq.load_state_dict(saved)
    assert _same(seq, reference, x)
    # dtype changes keep the conversion exact, in eval and in train mode (BatchNorm statistics in float64).
    seq.double()
    reference.double()
    assert _same(seq, reference, x.double())
    seq.train()
    reference.train()
    assert torch.equal(seq(x.double()), reference(x.double()))
    assert all(torch.equal(a, b) for a, b in zip(seq.original_state_dict().values(), reference.state_dict().values()))


@pytest.mark.parametrize("name", ["resnet18", "unet"])
def test_pipeline_state_dict_round_trips(name: str) -> None:
    _, make, x = next(m for m in _models() if m[0] == name)
    torch.manual_seed(0)
    seq = seqify.convert(make().train())
    balance = _even(len(seq), 3)
    pipe = seqify.pipeline(seq, devices=CPU3, balance=balance, chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        pipe(x).float().pow(2).mean().backward()
        opt.step()
    state = _round_trip(pipe.state_dict(), weights_only=True)
    torch.manual_seed(1)
    other = seqify.pipeline(seqify.convert(make().train()), devices=CPU3, balance=balance, chunks=2)
    pipe.eval()
    other.eval()
    with torch.no_grad():
        assert not torch.equal(other(x), pipe(x))
    other.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(other(x), pipe(x))
    assert other.state_dict().keys() == pipe.state_dict().keys()


def test_moving_keeps_shared_tensors_shared() -> None:
    """``Module._apply`` converts each place a tensor is held on its own: buffers always, parameters when
    moving to or from meta. The converted model keeps them one tensor (else a layer reads a stale copy)."""
    torch.manual_seed(0)
    source = Shares().train()
    reference = copy.deepcopy(source).double()
    seq = seqify.convert(source)
    ties = len(tied_slots(seq))
    assert ties >= 2
    seq.double()
    assert len(tied_slots(seq)) == ties
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(2):  # train mode: BatchNorm updates the running mean that the next layer reads
        assert torch.equal(seq(x), reference(x))
    saved = {k: v.clone() for k, v in seq.original_state_dict().items()}
    seq.to("meta")
    assert len(tied_slots(seq)) == ties
    seq.to_empty(device="cpu")
    assert len(tied_slots(seq)) == ties
    seq.load_original_state_dict(saved)
    seq.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(seq(x), reference(x))
