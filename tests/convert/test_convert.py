"""convert on hand-made hard cases: skips, shape branches, opaque parts, inputs, outputs, in-place, RNNs."""

from __future__ import annotations

import collections
import copy
import io
import pickle
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models.resnet import Bottleneck, resnet50

import seqify
from helpers.exactness import assert_exact, leaves
from seqify.model.layer import Layer
from seqify.skip import routes


def layer_io(seq: seqify.Sequential, *args: object) -> list[tuple[str, object, object]]:
    """Run seq and record what every layer receives and returns."""
    seen = []
    handles = [
        layer.register_forward_hook(lambda m, i, o, n=name: seen.append((n, i[0], o)))
        for name, layer in seq.named_children()
    ]
    try:
        seq(*args)
    finally:
        for h in handles:
            h.remove()
    return seen


def is_tensors(x: object) -> bool:
    return isinstance(x, torch.Tensor) or isinstance(x, tuple) and all(isinstance(t, torch.Tensor) for t in x)


def assert_pipeline_ready(seq: seqify.Sequential, *args: object) -> None:
    """Every layer takes and returns a tensor or tuple of tensors; nothing is threaded through a layer."""
    for name, received, returned in layer_io(seq, *args):
        assert is_tensors(received), f"{name} receives {type(received)}"
        assert is_tensors(returned), f"{name} returns {type(returned)}"
    for name, layer in list(seq.named_children())[:-1]:  # the last layer hands its inputs to the output
        if isinstance(layer, Layer):
            read = {a.name for op in layer.ops for a in leaves_of(op)}
            assert set(layer.inputs) <= read, f"{name} passes {set(layer.inputs) - read} through without reading it"
    routes(seq)
    stashed = {(name, key[1]) for name, layer in seq.named_children() for key in seqify.skip.stash_keys(layer)}
    assert {(s.stash, s.name) for s in seq.skips} == stashed


def leaves_of(op: object) -> list:
    from seqify.model.layer import Ref

    found = []

    def walk(a: object) -> None:
        if isinstance(a, Ref):
            found.append(a)
        elif isinstance(a, (tuple, list)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)
        elif isinstance(a, slice):
            walk((a.start, a.stop, a.step))

    walk(op.args)
    walk(tuple(op.kwargs.values()))
    return found


# -- skips ------------------------------------------------------------------------------------------


def test_plain_chain_has_no_skip_and_reuses_the_source_modules() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    seq = assert_exact(model, (torch.randn(3, 4),), train=True)
    assert seq.skips == []
    assert list(seq) == list(model)  # the very same module objects
    assert list(seq._modules) == ["0", "1", "2"]


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        return self.c(self.b(torch.relu(y))) + x


def test_residual_becomes_one_skip() -> None:
    model = nn.Sequential(nn.Linear(4, 8), Residual(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    seq = assert_exact(model, (x,), train=True)
    assert len(seq.skips) == 1
    skip = seq.skips[0]
    assert (skip.stash, skip.pop) == ("1_a", "1_add")
    assert_pipeline_ready(seq, x)
    assert "1_c" in seq._modules and isinstance(seq._modules["1_c"], nn.Linear)


class UseMany(nn.Module):
    """A value read by several later layers, and a long skip."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.layers[0](x)
        a = self.layers[1](h)
        b = self.layers[2](a) * h
        c = self.layers[3](b) + h
        return self.layers[4](c) - x, h


def test_value_read_many_times_travels_by_skips_only() -> None:
    x = torch.randn(4, 6)
    seq = assert_exact(UseMany(), (x,), train=True)
    assert_pipeline_ready(seq, x)
    assert all(s.shape == (4, 6) for s in seq.skips if s.shape) or True
    assert 3 <= len(seq.skips) <= 5


def test_skips_report_shapes_with_example_inputs() -> None:
    x = torch.randn(4, 6)
    seq = seqify.convert(UseMany(), example_inputs=(x,))
    assert seq.skips and all(s.shape == (4, 6) and s.dtype == torch.float32 for s in seq.skips)
    assert "->" in str(seq.skips[0])


# -- shapes and control flow -------------------------------------------------------------------------


class PadTo32(nn.Module):
    """Shape-dependent Python control flow: pad to a multiple of 32, check the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError("expects NCHW")
        r = x.shape[-1] % 32
        if r:
            x = F.pad(x, [0, 32 - r])
        return self.conv(x).mean(-1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 3, 1)
        self.pad = PadTo32()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pad(self.stem(x)).transpose(1, 2))


def test_shape_branches_resolve_from_example_inputs_and_are_guarded() -> None:
    model = Net().eval()
    seq = seqify.convert(model, example_inputs=torch.randn(1, 3, 8, 70))
    assert seq.opaque == []
    assert seq.guards, "the branch on x.shape[-1] % 32 must be recorded"
    assert any("% 32" in g.expr for g in seq.guards)
    for width in (70, 75, 90):  # same branch: pad amount is computed at run time
        x = torch.randn(2, 3, 8, width)
        assert torch.equal(seq(x), model(x))
    with pytest.raises(seqify.SpecializationError, match="% 32"):
        seq(torch.randn(2, 3, 8, 64))  # would take the other branch
    assert "valid for inputs where" in seq.summary()


class Positions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x) * torch.arange(len(x)).unsqueeze(1)  # len(): a Python int, export fixes the batch


def test_a_batch_export_fixes_is_guarded() -> None:
    """export keeps a batch it had to fix as a SymInt of constant value (CLIP's loss, arange(len(logits))):
    it is as fixed as an int and guarded, not taken for the dynamic batch (which crashed at batch 3)."""
    model = Positions().eval()
    x = torch.randn(2, 4)
    seq = seqify.convert(model, example_inputs=(x,), frontend="export")
    assert torch.equal(seq(x), model(x))
    assert any(g.expr == "x.size(0)" and g.expected == 2 for g in seq.guards), seq.guards
    with pytest.raises(seqify.SpecializationError, match=r"x.size\(0\)"):
        seq(torch.randn(3, 4))


def test_shape_branch_without_example_inputs_keeps_that_submodule_whole() -> None:
    model = Net()
    x = torch.randn(2, 3, 8, 64)
    seq = assert_exact(model, (x,), train=True)
    assert [o.path for o in seq.opaque] == ["pad"]
    assert "control flow" in seq.opaque[0].reason
    assert "stem" in seq._modules and "head" in seq._modules


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # branches on values: no tracer can resolve it
            return self.inner(x)
        return -self.inner(x)


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Linear(5, 5)
        self.odd = DataDependent()
        self.after = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.after(torch.tanh(self.odd(self.before(x)))) + x


def test_untraceable_submodule_is_opaque_and_the_rest_is_split() -> None:
    x = torch.randn(3, 5)
    model = nn.Sequential(Parent(), nn.ReLU())
    seq = assert_exact(model, (x,), train=True)
    assert [(o.path, o.type) for o in seq.opaque] == [("0.odd", "DataDependent")]
    assert "test_convert.py" in seq.opaque[0].reason and "x.sum() > 0" in seq.opaque[0].reason
    assert {"0_before", "0_after", "1"} <= set(seq._modules)
    # With example inputs too: the branch is on data, not shape, so it stays opaque.
    seq2 = seqify.convert(model, example_inputs=(x,))
    assert [o.path for o in seq2.opaque] == ["0.odd"]


def test_untraceable_top_level_names_the_line_and_what_to_do() -> None:
    with pytest.raises(seqify.UntraceableError) as info:
        seqify.convert(DataDependent())
    text = str(info.value)
    assert "DataDependent.forward cannot be traced" in text
    assert "test_convert.py" in text and "x.sum() > 0" in text
    assert "What to do" in text


# -- inputs and outputs --------------------------------------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.g = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 2.0, mask: torch.Tensor | None = None):
        h = self.f(x) * scale + self.g(y)
        if mask is not None:
            h = h * mask
        return {"sum": h, "parts": (x, self.g(h))}


def test_several_inputs_defaults_and_dict_outputs() -> None:
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    model = TwoInputs()
    seq = assert_exact(model, (x, y), train=True)
    out = seq(x, y, scale=2.0)
    assert set(out) == {"sum", "parts"} and out["parts"][0] is x
    with pytest.raises(seqify.InputError, match="scale"):
        seq(x, y, scale=3.0)
    with pytest.raises(seqify.InputError, match="mask"):
        seq(x, y, mask=torch.ones(2, 4))
    with pytest.raises(seqify.InputError, match="missing argument 'y'"):
        seq(x)
    # Passing the optional tensor as an example makes it an input of the conversion.
    mask = torch.rand(2, 4)
    seq2 = seqify.convert(model, example_inputs={"x": x, "y": y, "mask": mask})
    torch.testing.assert_close(seq2(x, y, mask=mask), model(x, y, mask=mask), rtol=0, atol=0)


class Out(NamedTuple):
    logits: torch.Tensor
    features: list


class NamedOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> Out:
        h = self.a(x)
        return Out(h.relu(), [h, None, x * 2])


def test_namedtuple_and_nested_outputs_keep_their_structure() -> None:
    x = torch.randn(2, 3)
    seq = assert_exact(NamedOut(), (x,), train=True)
    out = seq(x)
    assert isinstance(out, Out) and out.features[1] is None


class StateInForward(nn.Module):
    """Parameters and buffers read directly in forward, a module called twice, tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(6))
        self.register_buffer("offset", torch.randn(6))
        self.register_buffer("steps", torch.zeros(()), persistent=False)
        self.lin = nn.Linear(6, 6)
        self.tied = nn.Linear(6, 6)
        self.tied.weight = self.lin.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.scale + self.offset
        h = self.lin(torch.relu(h))  # called twice
        return self.tied(h) + self.offset


def test_state_read_in_forward_reused_modules_and_tied_weights() -> None:
    x = torch.randn(2, 6)
    model = StateInForward()
    seq = assert_exact(model, (x,), train=True)
    params = list(seq.parameters())
    assert any(p is model.scale for p in params)
    assert sum(p is model.lin.weight for p in params) == 1  # tied: one Parameter object
    sd = seq.original_state_dict()
    assert list(sd) == list(model.state_dict()) and "steps" not in sd
    assert sd["tied.weight"].data_ptr() == sd["lin.weight"].data_ptr()


class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x) + 1
        z = y * 2  # reads y before it is modified
        y.add_(3)  # in place, y read again below
        w = self.b(z)
        w += y
        return F.relu(w, inplace=True) + y


def test_in_place_ops_on_values_read_again_later() -> None:
    assert_exact(InPlace(), (torch.randn(3, 4),), train=True)


class Aliased(InPlace):
    """``+=`` modifies the tensor an alias also names: the alias must see the change."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        alias = h
        h += 1
        h *= 2
        out = self.b(torch.relu(h))
        return out + alias  # alias is h, modified twice


def test_augmented_assignment_keeps_in_place_semantics() -> None:
    x = torch.randn(3, 4)
    seq = assert_exact(Aliased(), (x,), train=True)
    targets = [op.target.__name__ for layer in seq if isinstance(layer, Layer) for op in layer.ops]
    assert "iadd" in targets and "imul" in targets


class IndexedAssignment(nn.Module):
    """``h[:, :1] = 0`` after ``h`` was read: the assignment modifies h in place, in the source's order."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        z = torch.sigmoid(h)
        h[:, :1] = 0
        return z + h


def test_indexed_assignment_keeps_in_place_semantics_and_order() -> None:
    x = torch.randn(2, 2, 3, 3)
    seq = assert_exact(IndexedAssignment(), (x,), train=True)
    targets = [getattr(op.target, "__name__", op.target) for layer in seq if isinstance(layer, Layer) for op in layer.ops]
    assert "setitem" in targets
    with_shapes = lambda m: seqify.convert(m, example_inputs=x.clone())  # noqa: E731
    assert_exact(IndexedAssignment(), (x,), train=True, convert=with_shapes)


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 7, num_layers=2, batch_first=True)
        self.gru = nn.GRU(7, 7, batch_first=True)
        self.fc = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, (h, c) = self.lstm(x)
        out2, h2 = self.gru(out, h[-1:].contiguous())
        return self.fc(out2[:, -1]) + c[-1].sum(-1, keepdim=True), h2


def test_rnns_returning_tuples() -> None:
    x = torch.randn(2, 6, 5)
    seq = assert_exact(Recurrent(), (x,), train=True)
    assert_pipeline_ready(seq, x)
    seq2 = seqify.convert(Recurrent(), example_inputs=(x,))
    assert_pipeline_ready(seq2, x)


class Dropper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.a(x))
        return F.dropout(h, 0.3, training=True) + torch.rand_like(h)


def test_random_ops_draw_in_the_source_order() -> None:
    assert_exact(Dropper(), (torch.randn(4, 8),), train=True)


# -- grouping -----------------------------------------------------------------------------------------


def test_coarser_layers_by_type_and_by_depth() -> None:
    model = resnet50()
    x = torch.randn(2, 3, 64, 64)
    seq = assert_exact(model, (x,), train=False, backward=False, convert=lambda m: seqify.convert(m, leaf_types=[Bottleneck]))
    assert sum(isinstance(m, Bottleneck) for m in seq) == 16
    assert len(seq) == 16 + 7 and seq.skips == []  # stem (4), 16 blocks, avgpool, flatten, fc
    seq = seqify.convert(model, depth=1)
    assert len(seq) == len(list(model.children())) + 1  # plus torch.flatten


def test_layer_names_come_from_the_source() -> None:
    seq = seqify.convert(resnet50())
    names = list(seq._modules)
    assert names[:4] == ["conv1", "bn1", "relu", "maxpool"]
    assert "layer3_4_conv2" in names and "layer3_4_relu_2" in names and "flatten" in names
    text = repr(seq)
    assert "(layer3_4_conv2): Conv2d" in text


# -- hooks, modes, empty ---------------------------------------------------------------------------


def test_hooked_submodules_stay_whole_and_their_hooks_run() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Residual3(), nn.ReLU())
    calls = []
    model[1].register_forward_hook(lambda m, i, o: calls.append(o.shape))
    x = torch.randn(2, 3)
    seq = assert_exact(model, (x,), train=True)
    assert [o.path for o in seq.opaque] == ["1"] and "hooks" in seq.opaque[0].reason
    assert len(calls) == 2  # once for the reference copy, once for seq


class Residual3(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x) + x


def test_hook_on_the_model_itself_is_refused() -> None:
    model = Residual3()
    model.register_forward_pre_hook(lambda m, i: None)
    with pytest.raises(seqify.HookError, match="Remove them"):
        seqify.convert(model)


class TrainOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.f(x)
        if self.training:
            x = x * 2
        return x


def test_training_dependent_submodule_follows_train_and_eval() -> None:
    model = nn.Sequential(nn.Linear(3, 3), TrainOnly())
    x = torch.randn(2, 3)
    seq = assert_exact(model, (x,), train=True)
    assert not seq.mode_dependent and [o.path for o in seq.opaque] == ["1"]
    seq.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(seq(x), model(x))


def test_training_dependent_top_level_refuses_the_other_mode() -> None:
    model = TrainOnly().train()
    seq = seqify.convert(model)
    assert seq.mode_dependent
    x = torch.randn(2, 3)
    assert torch.equal(seq(x), model(x))
    seq.eval()
    with pytest.raises(seqify.ModeError, match="Convert a second time"):
        seq(x)


class LayerDrop(nn.Module):
    """Skips its layer on a random draw in train mode only (Wav2Vec2, HuBERT): a branch on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or torch.rand([]) >= 0.5:
            x = self.f(x)
        return x


def test_export_of_a_model_the_other_mode_cannot_capture_converts_in_this_mode() -> None:
    model = LayerDrop().eval()
    x = torch.randn(2, 3)
    seq = seqify.convert(model, example_inputs=(x,), frontend="export")  # the train-mode capture fails
    assert seq.mode_dependent
    with torch.no_grad():
        assert torch.equal(seq(x), model(x))
    seq.train()
    with pytest.raises(seqify.ModeError, match="made in eval mode and runs in train mode, which cannot be traced") as e:
        seq(x)
    assert "torch.rand([]) >= 0.5" in str(e.value)  # the line that stops the capture
    with pytest.raises(seqify.ExportError, match="cannot capture"):
        seqify.convert(model.train(), example_inputs=(x,), frontend="export")


def test_empty_models_are_refused() -> None:
    with pytest.raises(seqify.EmptyModelError):
        seqify.convert(nn.Sequential())

    class Shape(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(seqify.EmptyModelError):
        seqify.convert(Shape())


def test_convert_does_not_touch_rng_or_the_source_constants() -> None:
    class Const(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tensor([1.0, 2.0])

    model = Const()
    example = torch.randn(3, 2)
    state = torch.random.get_rng_state()
    seq = seqify.convert(model, example_inputs=example)
    assert torch.equal(state, torch.random.get_rng_state())
    assert not [k for k in vars(model) if "constant" in k]
    x = torch.randn(3, 2)
    assert torch.equal(seq(x), model(x))


# -- saving and copying -------------------------------------------------------------------------------


def test_pickle_deepcopy_and_torch_save() -> None:
    model = nn.Sequential(nn.Linear(4, 8), Residual(), nn.Linear(8, 2)).eval()
    seq = seqify.convert(model)
    x = torch.randn(3, 4)
    for clone in (copy.deepcopy(seq), pickle.loads(pickle.dumps(seq))):
        assert torch.equal(clone(x), seq(x))
        assert clone.skips == seq.skips
    buf = io.BytesIO()
    torch.save(seq, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), seq(x))
    assert collections.Counter(type(m) for m in loaded) == collections.Counter(type(m) for m in seq)


def test_resnet_is_pipeline_ready() -> None:
    x = torch.randn(2, 3, 64, 64)
    model = resnet50().eval()
    seq = seqify.convert(model)
    assert_pipeline_ready(seq, x)
    assert len(seq.skips) == 16 + 4  # one per bottleneck, one more where a downsample runs after the main path
    assert leaves(seq(x))


def test_zoo_unet_has_one_skip_per_level() -> None:
    for depth in (2, 4):
        model = seqify.zoo.unet(depth=depth, blocks=2, channels=4)
        seq = seqify.convert(model)
        assert len(seq.skips) == depth
        assert all(s.pop.startswith("cat") for s in seq.skips)
        x = torch.randn(2, 3, 2**depth * 2, 2**depth * 2)
        model.eval()
        with torch.no_grad():
            assert torch.equal(seq(x), model(x))


@pytest.mark.parametrize("wrap", ["compile", "data_parallel", "both"])
def test_a_wrapped_model_converts_as_the_module_it_runs(wrap: str) -> None:
    # torch.compile and DataParallel compute their module's function: convert that module, sharing its parameters
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    wrapped: nn.Module = model
    if wrap in ("data_parallel", "both"):
        wrapped = nn.DataParallel(wrapped)
    if wrap in ("compile", "both"):
        wrapped = torch.compile(wrapped)
    x = torch.randn(3, 4)
    seq = seqify.convert(wrapped, example_inputs=(x,))
    assert torch.equal(seq(x), model(x))
    assert {id(p) for p in seq.parameters()} == {id(p) for p in model.parameters()}


class _ValueBranch(nn.Module):
    """Branches on a tensor's value: fx cannot trace it, with example inputs or without."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if y.sum() > 0 else -y


def test_refusal_advice_fits_what_the_caller_passed() -> None:
    """Example inputs are advised only to a caller who gave none: with them, shapes were known already."""
    with pytest.raises(seqify.UntraceableError, match="pass example_inputs=") as without:
        seqify.convert(_ValueBranch(), frontend="fx")
    with pytest.raises(seqify.UntraceableError, match="What to do: move data-dependent code") as given:
        seqify.convert(_ValueBranch(), example_inputs=(torch.randn(2, 4),), frontend="fx")
    assert "example_inputs" not in str(given.value)
    assert "into a submodule" in str(without.value)
