"""seqify.pipeline on CPU partitions: equal to one-device training, skips routed directly, errors, faults."""

from __future__ import annotations

import copy
import gc
import threading
import weakref

import pytest
import torch
from torch import nn
from torchvision.models import resnet18, resnet50

import seqify
from helpers.exactness import by_micro_batch, leaves, loss_of
from seqify.skip import Namespace, pop, skippable, stash

pytestmark = pytest.mark.timeout(300)

CPU2, CPU3, CPU4 = ["cpu"] * 2, ["cpu"] * 3, ["cpu"] * 4


def even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def one_device(model: nn.Module, x: torch.Tensor, chunks: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What GPipe computes, on one device: the micro-batches one after another, gradients summed."""
    outs = [model(c) for c in x.tensor_split(chunks)] if chunks > 1 else [model(x)]
    out = torch.cat(outs)
    loss_of(out).backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


def check_against_one_device(source: nn.Module, x: torch.Tensor, *, devices: list[str], chunks: int,
                             checkpoint: str, train: bool = True, deferred: bool = False) -> seqify.Pipeline:
    source.train(train)
    reference = copy.deepcopy(source)
    model = copy.deepcopy(source)
    seq = seqify.convert(model)
    pipe = seqify.pipeline(seq, devices=devices, balance=even(len(seq), len(devices)), chunks=chunks,
                           checkpoint=checkpoint, deferred_batch_norm=deferred)
    out = pipe(x)
    loss_of(out).backward()
    # With deferred BatchNorm the reference trains on the whole batch: GPipe's outputs still use
    # micro-batch statistics, so only the running statistics are compared then.
    expected, grads = one_device(reference, x, 1 if deferred else chunks)
    if not deferred:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-6, msg=name)
    ref_buffers = dict(reference.named_buffers())
    for name, b in model.named_buffers():
        torch.testing.assert_close(b, ref_buffers[name], rtol=1e-5, atol=1e-6, msg=name)
    return pipe


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("devices", [CPU2, CPU3, CPU4], ids=["2", "3", "4"])
def test_resnet18_equals_one_device(checkpoint: str, devices: list[str]) -> None:
    torch.manual_seed(0)
    check_against_one_device(resnet18(), torch.randn(6, 3, 32, 32), devices=devices, chunks=3, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_resnet50_equals_one_device(checkpoint: str) -> None:
    torch.manual_seed(0)
    check_against_one_device(resnet50(), torch.randn(4, 3, 32, 32), devices=CPU3, chunks=2, checkpoint=checkpoint)


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_unet_equals_one_device(checkpoint: str) -> None:
    torch.manual_seed(0)
    unet = seqify.zoo.unet(depth=3, blocks=2, channels=4)
    check_against_one_device(unet, torch.randn(5, 3, 16, 16), devices=CPU4, chunks=3, checkpoint=checkpoint)


def test_full_batch_equals_the_source_exactly() -> None:
    """One micro-batch: the pipeline is the source model, bit for bit."""
    torch.manual_seed(0)
    source = resnet18().train()
    reference = copy.deepcopy(source)
    pipe = seqify.pipeline(source, devices=CPU3, balance=[20, 30, len(seqify.convert(copy.deepcopy(source))) - 50],
                           checkpoint="never")
    x = torch.randn(4, 3, 32, 32)
    out = pipe(x)
    assert torch.equal(out, reference(x))


def test_eval_mode_micro_batches_equal_the_whole_batch() -> None:
    torch.manual_seed(0)
    pipe = check_against_one_device(resnet18(), torch.randn(6, 3, 32, 32), devices=CPU2, chunks=3,
                                    checkpoint="except_last", train=False)
    assert not pipe.training


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("shape", [(12, 5), (12, 5, 3, 3)], ids=["1d", "2d"])
def test_deferred_batch_norm_equals_whole_batch_norm(momentum: float | None, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    bn = (nn.BatchNorm1d if len(shape) == 2 else nn.BatchNorm2d)(5, momentum=momentum)
    reference = copy.deepcopy(bn)
    deferred = seqify.DeferredBatchNorm.of(bn, chunks=4)
    for _ in range(3):
        x = torch.randn(*shape) * 3 + 1
        for part in x.tensor_split(4):
            deferred(part)
        reference(x)
    torch.testing.assert_close(bn.running_mean, reference.running_mean, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bn.running_var, reference.running_var, rtol=1e-6, atol=1e-7)
    assert bn.num_batches_tracked.item() == reference.num_batches_tracked.item() == 3


def test_deferred_batch_norm_in_a_pipeline_updates_once_per_mini_batch() -> None:
    torch.manual_seed(0)
    source = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.Flatten())
    reference = copy.deepcopy(source)
    pipe = seqify.pipeline(source, devices=CPU2, balance=[2, 3], chunks=4, checkpoint="always", deferred_batch_norm=True)
    for _ in range(2):
        x = torch.randn(8, 3, 6, 6)
        pipe(x).sum().backward()
        reference(x)  # one device, the whole mini-batch
    assert any(isinstance(m, seqify.DeferredBatchNorm) for m in pipe.modules())
    for a, b in zip(source[1].buffers(), reference[1].buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert source[1].num_batches_tracked.item() == 2


def test_deferred_batch_norm_resnet_matches_one_device_deferred() -> None:
    """Deep nets: each BatchNorm folds the statistics its micro-batches saw, once per mini-batch."""
    torch.manual_seed(0)
    source = resnet18().train()
    one = copy.deepcopy(source)
    x = torch.randn(8, 3, 32, 32)
    pipe = seqify.pipeline(source, devices=CPU3, balance=even(len(seqify.convert(copy.deepcopy(source))), 3),
                           chunks=4, checkpoint="except_last", deferred_batch_norm=True)
    single = seqify.pipeline(one, devices=["cpu"], balance=[sum(pipe.balance)], chunks=4,
                             checkpoint="never", deferred_batch_norm=True)
    pipe(x).sum().backward()
    single(x).sum().backward()
    for (name, a), b in zip(source.named_buffers(), one.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert source.bn1.num_batches_tracked.item() == 1
    whole = torch.nn.BatchNorm2d(64)
    whole(source.conv1(x))  # the first BatchNorm sees the raw input: whole-batch statistics exactly
    torch.testing.assert_close(source.bn1.running_var, whole.running_var, rtol=1e-5, atol=1e-6)


@skippable(stash=["skip"])
class Stash(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return self.f(x)


@skippable(pop=["skip"])
class Pop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return self.f(x) * skip


def hand_written() -> nn.Sequential:
    outer, inner = Namespace(), Namespace()
    return nn.Sequential(
        Stash().isolate(outer), nn.Tanh(), Stash().isolate(inner), nn.Linear(6, 6), nn.ReLU(),
        Pop().isolate(inner), nn.Linear(6, 6), Pop().isolate(outer),
    )


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_hand_written_skippable_model_equals_one_device(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = hand_written()
    reference = copy.deepcopy(model)
    pipe = seqify.pipeline(model, devices=CPU4, balance=[2, 2, 2, 2], chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 6)
    out = pipe(x)
    loss_of(out).backward()
    expected, grads = one_device(reference, x, 3)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-6, atol=1e-6)


# -- skips and memory ----------------------------------------------------------------------------


def test_skips_go_straight_from_stash_to_pop_partition() -> None:
    model = hand_written()
    pipe = seqify.pipeline(model, devices=CPU4, balance=[2, 2, 2, 2], chunks=2)
    seen: list[tuple[str, str, int, int, int]] = []
    pipe.on_transfer = lambda *event: seen.append(event)
    pipe(torch.randn(4, 6)).sum().backward()
    skips = [(name, a, b) for kind, name, a, b, _ in seen if kind == "skip"]
    # 'skip' of the outer namespace: stashed in partition 0, popped in 3; the inner: 1 -> 2.
    assert sorted(set(skips)) == [("skip", 0, 3), ("skip", 1, 2)]
    assert len(skips) == 4  # each skip once per micro-batch, never through partitions in between
    carries = [(a, b) for kind, _, a, b, _ in seen if kind == "carry"]
    assert all(b == a + 1 for a, b in carries)


def test_converted_unet_skips_cross_from_encoder_to_decoder_directly() -> None:
    seq = seqify.convert(seqify.zoo.unet(depth=3, blocks=1, channels=4))
    pipe = seqify.pipeline(seq, devices=CPU4, balance=even(len(seq), 4), chunks=2)
    seen = []
    pipe.on_transfer = lambda *event: seen.append(event)
    pipe(torch.randn(2, 3, 16, 16))
    hops = {(name, a, b) for kind, name, a, b, _ in seen if kind == "skip"}
    assert hops and all(b > a for _, a, b in hops)
    per_name = {}
    for name, a, b in hops:
        per_name.setdefault(name, []).append((a, b))
    assert all(len(v) == 1 for v in per_name.values()), "a skip visited an intermediate partition"


def test_no_memory_is_held_after_a_step() -> None:
    captured: list[weakref.ref] = []

    @skippable(stash=["keep"])
    class Spy(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            y = x * 2
            captured.append(weakref.ref(y))
            yield stash("keep", y)
            return x + 1

    @skippable(pop=["keep"])
    class Take(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            keep = yield pop("keep")
            return x * keep

    model = nn.Sequential(nn.Linear(4, 4), Spy(), nn.Linear(4, 4), Take(), nn.Linear(4, 4))
    pipe = seqify.pipeline(model, devices=CPU3, balance=[2, 2, 1], chunks=2, checkpoint="always")
    x = torch.randn(4, 4)
    pipe(x).sum().backward()
    gc.collect()
    assert captured and all(ref() is None for ref in captured), "a skip tensor outlived the step"


# -- options --------------------------------------------------------------------------------------


def test_uneven_and_too_many_micro_batches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2))
    reference = copy.deepcopy(model)
    pipe = seqify.pipeline(model, devices=CPU3, balance=[1, 1, 1], chunks=3)
    x = torch.randn(7, 3)  # 3 + 2 + 2
    assert torch.equal(pipe(x), by_micro_batch(reference, (x,), 3))
    pipe.chunks = 8  # more than the batch of 2: clamped to 2 micro-batches, which a warning says
    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match="chunks=8 but the batch has 2 samples"):
        assert torch.equal(pipe(x), torch.cat([reference(x[:1]), reference(x[1:])]))


class Probe(nn.Module):
    """Records what the pipeline's context looks like from inside a stage."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.log: list[tuple[bool, bool, bool, torch.dtype]] = []
        self.forward_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not seqify.is_recomputing():
            self.forward_calls += 1
        autocast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        self.log.append((torch.is_grad_enabled(), seqify.is_checkpointing(), seqify.is_recomputing(), autocast))
        return self.f(x)


def test_autocast_grad_mode_and_recompute_flags_hold_inside_stages() -> None:
    probe = Probe()
    model = nn.Sequential(nn.Linear(4, 4), probe, nn.Linear(4, 4))
    pipe = seqify.pipeline(model, devices=CPU2, balance=[2, 1], chunks=2, checkpoint="always")
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    forward = [entry for entry in probe.log if not entry[2]]
    recompute = [entry for entry in probe.log if entry[2]]
    assert forward == [(True, True, False, torch.bfloat16)] * 2
    assert recompute == [(True, False, True, torch.bfloat16)] * 2  # autocast survives into recomputation
    assert probe.forward_calls == 2

    probe.log.clear()
    pipe.eval()
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    assert probe.log == [(False, False, False, torch.float32)] * 2  # no checkpointing, no backward bookkeeping


def test_autocast_result_equals_one_device_autocast() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    pipe = seqify.pipeline(model, devices=CPU3, balance=[2, 2, 1], chunks=1)
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = pipe(x), reference(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(got, expected)


def test_pipeline_exposes_its_layout() -> None:
    seq = seqify.convert(resnet18())
    pipe = seqify.pipeline(seq, devices=CPU2, balance=[30, len(seq) - 30], chunks=4)
    assert pipe.devices == [torch.device("cpu")] * 2 and pipe.balance == [30, len(seq) - 30]
    assert [len(p) for p in pipe.partitions] == pipe.balance
    assert pipe.input_device == pipe.output_device == torch.device("cpu")
    assert "chunks=4" in repr(pipe)
    assert sum(p.numel() for p in pipe.parameters()) == sum(p.numel() for p in seq.parameters())


def test_outputs_keep_the_source_structure() -> None:
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.a = nn.Linear(4, 2)
            self.b = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            h = torch.relu(self.body(x))
            return {"a": self.a(h), "b": self.b(h), "none": None}

    model = Heads()
    reference = copy.deepcopy(model)
    seq = seqify.convert(model)
    pipe = seqify.pipeline(seq, devices=CPU2, balance=even(len(seq), 2), chunks=2)
    x = torch.randn(6, 4)
    out = pipe(x)
    expected = by_micro_batch(reference, (x,), 2)
    assert set(out) == {"a", "b", "none"} and out["none"] is None
    assert torch.equal(out["a"], expected["a"]) and torch.equal(out["b"], expected["b"])


# -- errors ------------------------------------------------------------------------------------------


def test_balance_and_device_errors_say_what_to_change() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(seqify.BalanceError, match="sums to 4 but the model has 3 layers"):
        seqify.pipeline(model, devices=CPU2, balance=[2, 2])
    with pytest.raises(seqify.BalanceError, match="only 3 layers"):
        seqify.pipeline(model, devices=CPU4, balance=[1, 1, 1, 1])
    with pytest.raises(seqify.BalanceError, match="empty partition"):
        seqify.pipeline(model, devices=CPU2, balance=[3, 0])
    with pytest.raises(seqify.DeviceError, match="does not exist"):
        seqify.pipeline(model, devices=["cpu", "cuda:7"], balance=[2, 1])
    with pytest.raises(seqify.DeviceError, match="one device per partition"):
        seqify.pipeline(model, devices=CPU3, balance=[2, 1])
    if not torch.cuda.is_available():
        with pytest.raises(seqify.DeviceError, match="GPU"):
            seqify.pipeline(model, gpus=2, balance=[2, 1])
    with pytest.raises(seqify.BalanceError, match="checkpoint"):
        seqify.pipeline(model, devices=CPU2, balance=[2, 1], checkpoint="sometimes")


def test_parameter_shared_across_partitions_is_tied() -> None:
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    model = nn.Sequential(a, nn.ReLU(), b)
    x = torch.randn(2, 3)
    expected = model(x)
    pipe = seqify.pipeline(model, devices=CPU2, balance=[2, 1])  # was a SharedParameterError; see test_tied.py
    assert torch.equal(pipe(x), expected) and b.weight is a.weight


def test_non_tensor_crossing_a_boundary_is_an_error() -> None:
    class Dict(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"x": x}

    class Undict(nn.Module):
        def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
            return d["x"]

    pipe = seqify.pipeline(nn.Sequential(nn.Linear(2, 2), Dict(), Undict()), devices=CPU2, balance=[2, 1])
    with pytest.raises(seqify.BoundaryError, match="layer '1', the last of partition 0, returns dict"):
        pipe(torch.randn(2, 2))


class Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("boom in forward")
        return x * 1.0


class BadBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def, override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        if BadBackward.armed:
            raise ValueError("boom in backward")
        return grad


class BackwardFails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return BadBackward.apply(x)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_exceptions_propagate_and_the_pipeline_recovers(checkpoint: str) -> None:
    fails = Fails()
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), fails, BackwardFails(), nn.Linear(3, 3))
    pipe = seqify.pipeline(model, devices=CPU3, balance=[2, 2, 1], chunks=2, checkpoint=checkpoint)
    threads = threading.active_count()
    x = torch.randn(4, 3)
    fails.armed = True
    with pytest.raises(ValueError, match="boom in forward") as info:
        pipe(x)
    notes = " ".join(getattr(info.value, "__notes__", [])) or str(info.value)
    assert "partition 1" in notes and "layer '2'" in notes
    fails.armed = False
    BadBackward.armed = True
    try:
        with pytest.raises(ValueError, match="boom in backward"):
            pipe(x).sum().backward()
    finally:
        BadBackward.armed = False
    out = pipe(x)  # usable again
    out.sum().backward()
    assert threading.active_count() == threads
    assert all(p.grad is not None for p in model.parameters())


def test_converted_model_runs_through_pipeline_from_any_module() -> None:
    torch.manual_seed(0)
    source = seqify.zoo.unet(depth=2, blocks=1, channels=4).eval()
    reference = copy.deepcopy(source)
    pipe = seqify.pipeline(source, devices=CPU2, balance="params", chunks=2)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(pipe(x), by_micro_batch(reference, (x,), 2))
    assert len(leaves(pipe.balance)) == 0 or sum(pipe.balance) == len(pipe.model)


def test_training_steps_follow_one_device_training() -> None:
    """Several optimizer steps through the pipeline land on the parameters one device reaches."""
    torch.manual_seed(0)
    source = resnet18(num_classes=5).train()
    reference = copy.deepcopy(source)
    seq = seqify.convert(source)
    pipe = seqify.pipeline(seq, devices=CPU2, balance=even(len(seq), 2), chunks=2, checkpoint="except_last")
    opt_p = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    opt_r = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(6, 3, 32, 32), torch.randint(0, 5, (6,))
    for _ in range(4):
        for opt, run in ((opt_p, pipe), (opt_r, None)):
            opt.zero_grad()
            if run is None:
                out = torch.cat([reference(c) for c in x.tensor_split(2)])
            else:
                out = run(x)
            torch.nn.functional.cross_entropy(out, y).backward()
            opt.step()
    for (name, p), q in zip(source.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
