"""The fx path on hard cases: parameters read in forward, opaque values, shape factories, decorators, state."""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer

import seqify
from helpers.exactness import assert_exact

pytestmark = pytest.mark.timeout(120)


# -- parameters read directly in forward, with example inputs ---------------------------------------


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x * self.w)
        cls = self.cls.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1)


@pytest.mark.parametrize("train", [False, True])
def test_parameter_read_in_forward_with_example_inputs(train: bool) -> None:
    model = Scale()
    x = torch.randn(2, 3, 4)
    seq = assert_exact(model, (x,), train=train, convert=lambda m: seqify.convert(m, x))
    for name, layer in seq.named_children():  # no fake tensor or proxy is kept in a layer
        for t in [*layer.parameters(), *layer.buffers()]:
            assert type(t) in (torch.Tensor, nn.Parameter), f"{name} holds a {type(t).__name__}"
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}


def test_vision_transformer_with_example_inputs() -> None:
    torch.manual_seed(0)
    model = VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16,
                              num_classes=3)
    x = torch.randn(2, 3, 16, 16)
    start = time.perf_counter()
    assert_exact(model, (x,), train=False, convert=lambda m: seqify.convert(m, x))
    assert time.perf_counter() - start < 60
    seq = seqify.convert(model, x)
    assert not seq.opaque


# -- opaque submodules get real example values ------------------------------------------------------


class ValueGate(nn.Module):
    """Kept whole (branches on tensor values); has children; its output's shape is used afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if x.sum() > 0 else self.b(x)


class AfterGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = ValueGate()
        self.out = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.gate(x)
        if y.shape[-1] == 6:  # shape-dependent code after an opaque submodule
            y = y * 2
        return self.out(y.reshape(y.shape[0], -1))


def test_opaque_submodule_value_from_the_real_example() -> None:
    x = torch.randn(3, 4).abs()
    seq = assert_exact(AfterGate(), (x,), train=True, convert=lambda m: seqify.convert(m, x))
    assert [o.path for o in seq.opaque] == ["gate"]
    assert seq.guards  # the branch on y.shape was resolved from the example and is checked at run time
    model = AfterGate()
    assert torch.equal(seqify.convert(model, x)(-x), model(-x))  # the other branch inside the opaque part


class Norm(nn.Module):
    """Traced through elsewhere but called here on a value fx cannot evaluate: children run unpatched."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max() > 100:  # on values: kept whole
            x = x / 100
        return self.lin(self.bn(x))


class UsesNormShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = Norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        if y.shape[1] == 4:  # needs the opaque part's example value
            y = torch.cat([y, y], 1)
        return y


def test_opaque_submodule_with_children_in_train_mode_leaves_batchnorm_alone() -> None:
    x = torch.randn(5, 4)
    assert_exact(UsesNormShape(), (x,), train=True, convert=lambda m: seqify.convert(m, x))


# -- shape arithmetic fx cannot record --------------------------------------------------------------


class Factories(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(16).unsqueeze(0))
        self.table = nn.Embedding(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n = x.shape[0], x.shape[1]
        mask = torch.ones(n, n).tril()
        pos = self.positions[:, :n].expand(b, n)
        return mask @ x + self.table(pos)


@pytest.mark.parametrize("example", [True, False])
def test_factories_and_buffer_methods_with_traced_sizes(example: bool) -> None:
    x = torch.randn(2, 5, 4)
    model = Factories()
    seq = assert_exact(model, (x,), train=False, convert=lambda m: seqify.convert(m, x if example else None))
    y = torch.randn(3, 7, 4)  # sizes are recorded, not baked: another shape works without guards failing
    assert torch.equal(seq(y), model(y))


# -- decorated forwards (transformers 5) ------------------------------------------------------------


def returns_tuple(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("scale", 2.0)
        return fn(self, *args, **kwargs)

    return wrapper


class Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @returns_tuple
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(x) * scale


class CallsDecorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Decorated()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_decorated_forward_is_refused_naming_the_decorator() -> None:
    with pytest.raises(seqify.DecoratedForwardError) as info:
        seqify.convert(Decorated(), torch.randn(2, 4), frontend="fx")
    assert isinstance(info.value, seqify.UntraceableError)
    text = str(info.value)
    for phrase in ("Decorated.forward", "returns_tuple.<locals>.wrapper", "(self, *args, **kwargs)", "frontend="):
        assert phrase in text, text
    x = torch.randn(2, 4)  # what the message suggests: a module calling it converts
    assert_exact(CallsDecorated(), (x,), train=False, convert=lambda m: seqify.convert(m, x))
    # and frontend="auto" (the default) takes the decorated model itself to the export frontend
    assert_exact(Decorated(), (x,), train=False, convert=lambda m: seqify.convert(m, x))


# -- failures of the fake evaluation are not swallowed ----------------------------------------------


class TimestepLike(nn.Module):
    """As diffusers' UNet: a non-tensor timestep is wrapped with torch.tensor([t])."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(t):
            t = torch.tensor([t], dtype=torch.long)
        elif len(t.shape) == 0:
            t = t[None]
        t = t * torch.ones(x.shape[0], dtype=t.dtype)
        return x + self.lin(t.float()[:, None])


@pytest.mark.parametrize("t", [torch.tensor([3]), torch.tensor(3)])
def test_is_tensor_on_a_traced_tensor(t: torch.Tensor) -> None:
    x = torch.randn(2, 4)
    model = TimestepLike()
    seq = assert_exact(model, (x, t), train=False, convert=lambda m: seqify.convert(m, (x, t)))
    assert torch.equal(seq(x, t + 4), model(x, t + 4))


class ChecksItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):  # as diffusers UNet2DModel does: the source passes a tensor
            t = torch.tensor([t], device=x.device)
        return self.lin(x) * t


class HoldsChecksItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ChecksItsInput()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.inner(x, t) * 2


@pytest.mark.parametrize("model", [ChecksItsInput, HoldsChecksItsInput])
def test_isinstance_of_a_traced_tensor_takes_the_source_path(model: type[nn.Module]) -> None:
    """The model's own code sees a traced tensor as a tensor, so fx traces the path the source runs."""
    x, t = torch.randn(2, 4), torch.tensor([3.0])
    seq = assert_exact(model(), (x, t), train=False, convert=lambda m: seqify.convert(m, (x, t), frontend="fx"))
    assert not seq.opaque


class BadBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor and type(t) is not nn.Parameter:  # fx's stand-in is neither
            t = torch.tensor([t], device=x.device)
        return self.lin(x) * t


def test_op_failing_on_example_values_is_refused_at_convert_time() -> None:
    x, t = torch.randn(2, 4), torch.tensor([3.0])
    with pytest.raises(seqify.UntraceableError) as info:
        seqify.convert(BadBranch(), (x, t), frontend="fx")
    text = str(info.value)
    assert "BadBranch.forward" in text and "tensor([t], device=x.device)" in text and "fails on the example values" in text


class HoldsBadBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = BadBranch()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.inner(x, t) * 2


def test_op_failing_on_example_values_in_a_submodule_keeps_it_whole() -> None:
    x, t = torch.randn(2, 4), torch.tensor([3.0])
    seq = assert_exact(HoldsBadBranch(), (x, t), train=False, convert=lambda m: seqify.convert(m, (x, t), frontend="fx"))
    assert [o.path for o in seq.opaque] == ["inner"]
    assert "fails on the example values" in seq.opaque[0].reason and seq.opaque[0].diverged
    # frontend="auto" (the default) tries torch.export on it, whose stand-ins are not plain tensors either
    seq = assert_exact(HoldsBadBranch(), (x, t), train=False, convert=lambda m: seqify.convert(m, (x, t)))
    assert [o.path for o in seq.opaque] == ["inner"]


# -- key/value caches -------------------------------------------------------------------------------


class DynamicCache:
    """Stands for transformers' cache object (a Python object built inside forward)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class ReturnsCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> Any:
        y = self.lin(x)
        if use_cache:
            cache = DynamicCache()
            cache.keys.append(y)
            return y, cache
        return y


def test_cache_is_refused_naming_it_and_use_cache_false() -> None:
    x = torch.randn(2, 4)
    with pytest.raises(seqify.SeqifyError) as info:
        seqify.convert(ReturnsCache(), x)
    assert "DynamicCache" in str(info.value) and "use_cache=False" in str(info.value)
    model = ReturnsCache()
    seq = seqify.convert(model, {"x": x, "use_cache": False})  # the fix the message gives
    assert torch.equal(seq(x, use_cache=False), model(x, use_cache=False))


# -- forwards that change Python attributes ---------------------------------------------------------


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x) * self.calls


class HasCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.count = Counter()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.count(x)))


@pytest.mark.parametrize("example", [True, False])
def test_submodule_writing_an_attribute_is_kept_whole(example: bool) -> None:
    x = torch.randn(2, 4)
    source = HasCounter()
    reference = HasCounter()
    reference.load_state_dict(source.state_dict())
    seq = seqify.convert(source, x if example else None)
    assert source.count.calls == 0  # converting changed nothing
    assert [o.path for o in seq.opaque] == ["count"] and "calls" in seq.opaque[0].reason
    for call in (1, 2, 3):
        assert torch.equal(seq(x), reference(x)), f"call {call}"
    assert source.count.calls == 3


class CountsItself(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return self.lin(x) + self.steps


class WritesChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = Scale()
        self.child.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.child.seen += 1  # a write into a child from the parent's forward
        return self.child(x) + self.child.seen


def test_root_writing_an_attribute_is_refused() -> None:
    for model in (CountsItself(), WritesChild()):
        with pytest.raises(seqify.StatefulForwardError) as info:
            seqify.convert(model, torch.randn(2, 3, 4))
        assert "self.steps" in str(info.value) or "child.seen" in str(info.value)
        assert "What to do" in str(info.value)


class FillsCache(nn.Module):
    """Like timm's attention-bias cache: forward fills a dict attribute in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bias = nn.Parameter(torch.randn(4))
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            if "b" not in self.cache:
                self.cache["b"] = self.bias * 2
            return self.lin(x) + self.cache["b"]
        return self.lin(x) + self.bias * 2


def test_a_cache_the_forward_fills_keeps_no_trace_values() -> None:
    model = FillsCache().eval()
    x = torch.randn(2, 4)
    seqify.convert(model, x, frontend="fx", verify=False)
    assert model.cache == {}  # the trace's fake or proxy values did not stay in the source's dict
    with torch.no_grad():
        assert torch.equal(model(x), model.lin(x) + model.bias * 2)


def test_a_models_own_check_failing_on_the_example_names_the_values_not_tracer_internals() -> None:
    import torchvision

    vit = torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2,
                                               hidden_dim=8, mlp_dim=8)
    with pytest.raises(seqify.ExampleInputError) as info:
        seqify.convert(vit, torch.randn(1, 3, 16, 16))
    text = str(info.value)
    assert "Expected 32 but got 16" in text and "Proxy" not in text and "accepts" in text, text


class Positions(nn.Module):
    """transformers' mask helper: positions made for one row, expanded to the batch only where it differs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], dtype=x.dtype).unsqueeze(0)
        if x.shape[0] != pos.shape[0]:
            pos = pos.expand(x.shape[0], -1)
        return self.proj(x + pos.unsqueeze(-1))


def test_a_branch_on_batch_one_leaves_fx_for_export_so_micro_batches_of_one_run() -> None:
    model = Positions().eval()
    x = torch.randn(4, 5, 6)
    fx_only = seqify.convert(model, example_inputs=(x,), frontend="fx")
    with pytest.raises(seqify.SpecializationError, match="shape"):
        fx_only(x[:1])
    seq = seqify.convert(model, example_inputs=(x,))
    assert seq.frontend == "export"
    for rows in (x[:1], x, torch.randn(3, 5, 6)):
        assert torch.equal(seq(rows), model(rows))
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[1, len(seq) - 1], chunks=4)
    assert torch.equal(pipe(x), torch.cat([model(x[i:i + 1]) for i in range(4)]))


class WidthBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) if x.shape[-1] == 6 else x


def test_traced_on_one_sample_a_branch_on_batch_one_still_serves_bigger_batches() -> None:
    model = Positions().eval()
    x = torch.randn(1, 5, 6)
    seq = seqify.convert(model, example_inputs=(x,))
    assert seq.frontend == "export"
    for rows in (x, torch.randn(4, 5, 6)):
        assert torch.equal(seq(rows), model(rows))


def test_guards_that_hold_at_batch_one_keep_the_fx_result() -> None:
    seq = seqify.convert(WidthBranch(), example_inputs=(torch.randn(4, 6),))
    assert seq.frontend == "fx" and seq.guards


class ScaledByWidth(nn.Module):
    """RAFT's correlation scale: a tensor made from a traced size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(torch.tensor(x.shape[1])) + torch.as_tensor(x.shape[-1]) * torch.scalar_tensor(x.size(0))


@pytest.mark.parametrize("example", [True, False])
def test_a_tensor_made_from_a_traced_size(example: bool) -> None:
    model = ScaledByWidth()
    x = torch.randn(2, 3, 5)
    seq = seqify.convert(model, example_inputs=(x,) if example else None)
    for rows in (x, torch.randn(4, 7, 6)):
        assert torch.equal(seq(rows), model(rows))


class RefusesOneSample(nn.Module):
    """A model that itself refuses a batch of one (as BatchNorm does in training on one value per channel)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            raise ValueError("expected more than one sample")
        return self.proj(x)


def test_a_source_that_refuses_one_sample_keeps_the_fx_result() -> None:
    # fx's guard refuses one sample and export's graph would run it, but the source refuses it: nothing to gain
    model = RefusesOneSample()
    x = torch.randn(4, 6)
    seq = seqify.convert(model, example_inputs=(x,))
    assert seq.frontend == "fx" and seq.guards
    assert torch.equal(seq(x), model(x))


def test_example_values_of_leaves_leave_nn_module_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaf's example value runs its forward plainly by a switch on the tracer, not by undoing fx's
    patches of ``nn.Module`` (each undo and redo invalidates the attribute caches of every subclass: seconds
    per large model); the conversion stays exact, including a leaf whose children are called inside it."""
    import torch.fx._symbolic_trace as fx_trace
    from torchvision.models import resnet18

    import seqify.frontend.real

    undone = []
    revert = fx_trace._maybe_revert_all_patches

    def counted() -> Any:  # fx's patches undone while a trace holds them
        if fx_trace.CURRENT_PATCHER is not None:
            undone.append(1)
        return revert()

    monkeypatch.setattr(seqify.frontend.real, "_maybe_revert_all_patches", counted)

    class Block(nn.Module):  # kept whole (leaf_types): its children run inside its plain forward
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.conv(x)) + x

    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    model.layer1[0] = Block()
    x = torch.randn(2, 3, 32, 32)
    for train in (False, True):
        seq = assert_exact(model, (x,), train=train,
                           convert=lambda m: seqify.convert(m, (x,), leaf_types=(Block,)))
        assert any(isinstance(layer, Block) for layer in seq.modules())
    assert not undone
