"""The bad-input catalogue (docs/errors.md): one test per row. Each checks the SeqifyError subclass, that the
message names the offending module path, layer, argument or graph node, and that it says what to do."""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from helpers.exactness import assert_exact, assert_unchanged, by_micro_batch, snapshot
from seqify.skip import Namespace, pop, skippable, stash

pytestmark = pytest.mark.timeout(120)

CPU2 = ["cpu", "cpu"]


@contextmanager
def raises(kind: type[Exception], *phrases: str) -> Iterator[pytest.ExceptionInfo]:
    """pytest.raises that also checks the message holds every phrase (what it names, what to do)."""
    with pytest.raises(kind) as info:
        yield info
    assert isinstance(info.value, seqify.SeqifyError)
    text = str(info.value)
    for phrase in phrases:
        assert phrase in text, f"message lacks {phrase!r}: {text}"


class Lin(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.f = nn.Linear(n, n)
        self.g = nn.Linear(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g(torch.relu(self.f(x))) + x


# -- convert: tracing ------------------------------------------------------------------------------


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:  # on the tensor's values
            return self.f(x)
        return x


def test_data_dependent_control_flow_in_the_model_itself() -> None:
    with raises(seqify.UntraceableError, "ValueBranch.forward", "test_errors.py", "x.mean() > 0", "What to do",
                "submodule"):
        seqify.convert(ValueBranch())


class ShapeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            x = F.pad(x, [0, 1])
        return self.f(x[..., :4])


def test_shape_dependent_control_flow_without_example_inputs() -> None:
    with raises(seqify.UntraceableError, "ShapeBranch.forward", "x.shape[-1] % 2", "pass example_inputs"):
        seqify.convert(ShapeBranch())
    seq = seqify.convert(ShapeBranch(), example_inputs=torch.randn(2, 3))  # the fix: it converts, guarded
    assert seq.guards


def test_input_outside_the_shapes_a_specialised_conversion_is_valid_for() -> None:
    model = ShapeBranch()
    seq = seqify.convert(model, example_inputs=torch.randn(2, 3))
    x = torch.randn(5, 7)  # odd width: the branch the example took
    assert torch.equal(seq(x), model(x))
    with raises(seqify.SpecializationError, "x.shape[-1] % 2", "<model>", "test_errors.py", "example_inputs shaped like this input"):
        seq(torch.randn(2, 4))  # even width would skip the pad


class VarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.f(xs[0])


def test_forward_with_star_args() -> None:
    with raises(seqify.UntraceableError, "VarArgs.forward reads *xs", "wrap the model in a module"):
        seqify.convert(VarArgs())
    with raises(seqify.ExampleInputError, "VarArgs.forward takes *xs", "wrap the model"):
        seqify.convert(VarArgs(), example_inputs=(torch.randn(2, 3),))


class KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)
        self.g = nn.Linear(3, 3)

    def forward(self, *, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.g(torch.tanh(self.f(x))) * scale


def test_keyword_only_forward_converts_and_pipelines() -> None:
    """Keyword-only parameters work: example_inputs as a dict, calls by keyword."""
    x, scale = torch.randn(4, 3), torch.rand(4, 1)
    model = KeywordOnly()
    seq = assert_exact(model, (), kwargs={"x": x, "scale": scale}, train=True)
    seq2 = seqify.convert(model, example_inputs={"x": x, "scale": scale})
    assert torch.equal(seq2(x=x, scale=scale), model(x=x, scale=scale))
    reference = copy.deepcopy(model)
    pipe = seqify.pipeline(model, devices=CPU2, balance=[2, len(seq) - 2], chunks=2)
    assert torch.equal(pipe(x=x, scale=scale), by_micro_batch(reference, (), 2, {"x": x, "scale": scale}))


def test_keyword_only_forward_misused() -> None:
    x, scale = torch.randn(4, 3), torch.rand(4, 1)
    for frontend in ("auto", "fx", "export"):  # both frontends bind examples through one helper
        with raises(seqify.ExampleInputError, "KeywordOnly.forward", "keyword-only", "as a dict by parameter name"):
            seqify.convert(KeywordOnly(), example_inputs=(x, scale), frontend=frontend)
    seq = seqify.convert(KeywordOnly())
    with raises(seqify.InputError, "KeywordOnly", "pass x=..., scale=... by keyword"):
        seq(x, scale)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_example_inputs_that_do_not_fit_the_forward(frontend: str) -> None:
    with raises(seqify.ExampleInputError, "Lin.forward", "example_inputs miss", "'x'"):
        seqify.convert(Lin(), example_inputs={}, frontend=frontend)
    with raises(seqify.ExampleInputError, "Lin.forward", "pass a tensor, a tuple"):
        seqify.convert(Lin(), example_inputs=(torch.randn(2, 4), torch.randn(2, 4)), frontend=frontend)
    with raises(seqify.ExampleInputError, "must be a tensor, a tuple of arguments or a dict"):
        seqify.convert(Lin(), example_inputs=3, frontend=frontend)


def test_empty_models() -> None:
    with raises(seqify.EmptyModelError, "Sequential computes no tensor op", "nothing to convert"):
        seqify.convert(nn.Sequential())

    class Passthrough(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with raises(seqify.EmptyModelError, "Passthrough"):
        seqify.convert(Passthrough())
    with raises(seqify.EmptyModelError, "Sequential has no layers", "nothing to pipeline"):
        seqify.pipeline(nn.Sequential(), devices=CPU2, balance=[1, 1])


class Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.f(x), x.size(0) * 2  # a Python value computed at run time


def test_model_returns_a_python_value_computed_at_run_time() -> None:
    with raises(seqify.ConversionError, "returns 'mul'", "return it as a tensor"):
        seqify.convert(Counts(), example_inputs=torch.randn(2, 3))


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, double: bool = False) -> torch.Tensor:
        y = self.f(x)
        return y * 2 if double else y


def test_arguments_the_conversion_does_not_cover() -> None:
    seq = seqify.convert(Flagged())
    x = torch.randn(2, 3)
    with raises(seqify.InputError, "Flagged", "'double' was False", "Convert again with example_inputs that pass double=True"):
        seq(x, double=True)
    with raises(seqify.InputError, "'x' was a tensor", "pass a tensor"):
        seq([1.0, 2.0, 3.0])
    with raises(seqify.InputError, "unexpected keyword argument 'scale'", "takes (x, double)"):
        seq(x, scale=2)
    with raises(seqify.InputError, "missing argument 'x'", "takes (x, double)"):
        seq()


class TrainOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x) * 2 if self.training else self.f(x)


def test_mode_dependent_model_in_the_other_mode() -> None:
    seq = seqify.convert(TrainOnly().train())
    seq.eval()
    with raises(seqify.ModeError, "TrainOnly's forward", "made in train mode but runs in eval mode", "Convert a second time"):
        seq(torch.randn(2, 3))
    pipe = seqify.pipeline(seqify.convert(TrainOnly().train()), devices=["cpu"], balance=[2]).eval()
    with raises(seqify.ModeError, "TrainOnly's forward"):
        pipe(torch.randn(2, 3))


class RandomSkip(Lin):
    """Skips its layer on a random draw in train mode only: torch.export cannot capture train mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if not self.training or torch.rand([]) >= 0.5 else x


def test_a_mode_that_could_not_be_traced() -> None:
    seq = seqify.convert(RandomSkip().eval(), torch.randn(2, 4), frontend="export")
    seq.train()
    with raises(seqify.ModeError, "RandomSkip", "made in eval mode and runs in train mode", "torch.rand([])",
                "What to do"):
        seq(torch.randn(2, 4))


def test_convert_options_that_name_nothing() -> None:
    model = nn.Sequential(Lin(), nn.ReLU())
    with raises(seqify.OptionError, "leaf_paths names '0.h'", "not a submodule of Sequential", "model.named_modules()"):
        seqify.convert(model, leaf_paths=["0.h"])
    with raises(seqify.OptionError, "leaf_types=['Linear']", "give module classes"):
        seqify.convert(model, leaf_types=["Linear"])
    with raises(seqify.OptionError, "depth=0", "whole number >= 1"):
        seqify.convert(model, depth=0)
    with raises(seqify.OptionError, "takes an nn.Module, got function", "wrap the function in a module"):
        seqify.convert(lambda x: x)
    with raises(seqify.OptionError, "TorchScript module", "before torch.jit.script"):
        seqify.convert(torch.jit.script(model))
    # A single type or path is a list of one.
    seq = seqify.convert(model, leaf_types=Lin)
    assert isinstance(seq[0], Lin)
    assert isinstance(seqify.convert(model, leaf_paths="0")[0], Lin)


# -- convert: hooks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "full_backward"])
def test_hooks_on_the_model_itself_are_refused(kind: str) -> None:
    model = Lin()
    register = getattr(model, f"register_{kind}_hook")
    register(lambda *args: None)
    with raises(seqify.HookError, "Lin itself has", "Remove them before converting", "hooks on submodules are fine"):
        seqify.convert(model)


def test_hooks_on_submodules_are_kept_and_run_in_seq_and_in_a_pipeline() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Lin(), nn.Tanh(), Lin())
    seen: list[str] = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append("pre"))
    model[1].register_forward_hook(lambda m, args, out: seen.append("post"))
    model[3].f.register_forward_hook(lambda m, args, out: out * 0 + 1)  # replaces the output: must take effect
    x = torch.randn(6, 4)
    reference = copy.deepcopy(model)
    seq = seqify.convert(model)
    assert {o.path for o in seq.opaque} == {"1", "3.f"} and all("hooks" in o.reason for o in seq.opaque)
    seen.clear()
    assert torch.equal(seq(x), reference(x))
    assert seen == ["pre", "post"] * 2  # the reference's copied hooks and seq's
    seen.clear()
    pipe = seqify.pipeline(seq, devices=CPU2, balance=[2, len(seq) - 2], chunks=3)
    assert torch.equal(pipe(x), by_micro_batch(reference, (x,), 3))
    assert seen.count("pre") == 3 + 3 and seen.count("post") == 3 + 3  # 3 micro-batches, in both


def test_hook_added_after_conversion_to_a_flattened_submodule() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Lin())
    seq = seqify.convert(model)
    x = torch.randn(2, 4)
    handle = model[1].register_forward_hook(lambda m, args, out: None)
    with raises(seqify.HookError, "submodule '1' (Lin)", "after conversion", "would never run", "register it before converting"):
        seq(x)
    pipe = seqify.pipeline(seq, devices=CPU2, balance=[2, len(seq) - 2])
    with raises(seqify.HookError, "submodule '1' (Lin)"):
        pipe(x)
    handle.remove()
    seq(x)
    handle = model.register_forward_pre_hook(lambda m, args: None)
    with raises(seqify.HookError, "the source model itself (Sequential)"):
        seq(x)
    handle.remove()
    seq[0].register_forward_hook(lambda m, args, out: None)  # a layer of seq (the source's Linear): runs, fine
    seq(x)


def test_export_refuses_hooks_on_submodules_at_conversion() -> None:
    """The export frontend flattens every submodule: a hook there is refused at conversion, naming the
    submodule and frontend='fx' (which keeps it whole), not reported later as registered after conversion."""
    model = nn.Sequential(nn.Linear(4, 4), Lin())
    model[1].register_forward_hook(lambda m, args, out: out * 3)
    x = torch.randn(2, 4)
    with raises(seqify.HookError, "submodule '1' (Lin)", "has hooks", "frontend='fx'"):
        seqify.convert(model, example_inputs=(x,), frontend="export")
    seq = seqify.convert(model, example_inputs=(x,))
    assert torch.equal(seq(x), model(x)) and {o.path for o in seq.opaque} == {"1"}


# -- convert: meta device, dtypes, devices -----------------------------------------------------------


def meta_lin() -> Lin:
    with torch.device("meta"):
        return Lin()


def test_meta_model_converts_and_its_layers_hold_the_meta_parameters() -> None:
    model = meta_lin()
    seq = seqify.convert(model)
    held = {id(p) for p in seq.parameters()}
    assert held == {id(p) for p in model.parameters()} and all(p.is_meta for p in seq.parameters())
    out = seq(torch.randn(2, 4, device="meta"))  # meta inputs: shapes only, which works
    assert out.is_meta and out.shape == (2, 4)


def test_running_a_meta_model_on_real_inputs() -> None:
    seq = seqify.convert(meta_lin())
    with raises(seqify.MetaDeviceError, "layer 'f'", "f.weight is on the meta device", "seq.to_empty(device='cpu')",
                "load_original_state_dict"):
        seq(torch.randn(2, 4))


def test_pipelining_or_profiling_a_meta_model() -> None:
    with raises(seqify.MetaDeviceError, "layer 'f' (partition 0)", "f.weight on the meta device", "to_empty"):
        seqify.pipeline(meta_lin(), devices=CPU2, balance=[2, 2])
    with raises(seqify.MetaDeviceError, "f.weight", "by='params'"):
        seqify.balance(seqify.convert(meta_lin()), 2, sample=torch.randn(2, 4), by="time", progress=False)
    plan = seqify.balance(seqify.convert(meta_lin()), 2, by="params")  # needs no data: works
    assert sum(plan.balance) == 4


def test_materialising_a_meta_conversion_makes_it_exact() -> None:
    source = Lin()
    seq = seqify.convert(meta_lin())
    seq.to_empty(device="cpu")
    seq.load_original_state_dict(source.state_dict())
    x = torch.randn(3, 4)
    assert torch.equal(seq(x), source(x))


class HalfAndHalf(nn.Module):
    """Mixed dtypes: a float64 branch and a float32 branch with explicit casts."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4).double()
        self.norm = nn.BatchNorm1d(4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.b(x.double()))
        return self.a(x) + h.float(), h


def test_mixed_dtypes_convert_exactly_and_pipeline() -> None:
    x = torch.randn(6, 4)
    assert_exact(HalfAndHalf(), (x,), train=True)
    model = HalfAndHalf().train()
    reference = copy.deepcopy(model)
    seq = seqify.convert(model)
    pipe = seqify.pipeline(seq, devices=CPU2, balance=[3, len(seq) - 3], chunks=2)
    got = pipe(x)
    expected = by_micro_batch(reference, (x,), 2)
    assert [t.dtype for t in got] == [torch.float32, torch.float64]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_parameters_on_several_devices_fail_clearly() -> None:
    """Only CPU and meta exist here: a source with some parameters on meta converts, then says which."""
    model = Lin()
    model.g.to("meta")
    seq = seqify.convert(model)
    with raises(seqify.MetaDeviceError, "g.weight is on the meta device", "to_empty"):
        seq(torch.randn(2, 4))


# -- checkpoints ---------------------------------------------------------------------------------------


def test_checkpoints_that_do_not_fit() -> None:
    model = Lin()
    seq = seqify.convert(model)
    good = model.state_dict()
    with raises(seqify.StateDictError, "missing keys ['g.bias']", "strict=False"):
        seq.load_original_state_dict({k: v for k, v in good.items() if k != "g.bias"})
    with raises(seqify.StateDictError, "unexpected keys ['h.weight']"):
        seq.load_original_state_dict({**good, "h.weight": torch.zeros(1)})
    with raises(seqify.StateDictError, "f.weight: checkpoint (5, 4) vs model (4, 4)"):
        seq.load_original_state_dict({**good, "f.weight": torch.zeros(5, 4)})
    with raises(seqify.StateDictError, "'f.bias' is a list", "pass the state dict itself"):
        seq.load_original_state_dict({**good, "f.bias": [0.0] * 4})
    renamed = {f"module.{k}": v for k, v in good.items()}
    with raises(seqify.StateDictError, "Missing key(s)", "seq.load_original_state_dict"):
        seq.load_state_dict(renamed)


def test_source_checkpoint_loaded_with_load_state_dict() -> None:
    """The converted layers' keys differ from the source's: the error says which method loads those."""
    model = nn.Sequential(nn.Linear(4, 4), Lin())
    seq = seqify.convert(model)
    source_keys = model.state_dict()
    assert set(source_keys) != set(seq.state_dict())
    with raises(seqify.StateDictError, "keys are the source Sequential's", "seq.load_original_state_dict(state_dict)"):
        seq.load_state_dict(source_keys)
    assert isinstance(pytest.raises(RuntimeError, seq.load_state_dict, source_keys).value, seqify.StateDictError)


def test_checkpoint_folder_without_a_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from seqify import checkpoint

    with raises(seqify.CheckpointError, str(tmp_path / "none"), "seqify.json is missing", "seqify.checkpoint.save"):
        checkpoint.load(Lin(), tmp_path / "none")
    checkpoint.save(Lin(), tmp_path / "ck")
    (tmp_path / "ck" / "state.pt").unlink()
    with raises(seqify.StateDictError, "state.pt is missing", "copy the whole checkpoint folder"):
        checkpoint.load(Lin(), tmp_path / "ck")


def test_checkpoint_of_another_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from seqify import checkpoint

    checkpoint.save(seqify.pipeline(seqify.convert(Lin()), devices=CPU2, balance=[2, 2]), tmp_path / "ck")
    other = nn.Sequential(nn.Linear(4, 4))
    with raises(seqify.StateDictError, "holds the state of Lin", "missing keys ['0.bias', '0.weight']",
                "unexpected keys ['f.bias'", "same model (any balance)", "load_state_dict(folder)"):
        checkpoint.load(other, tmp_path / "ck")
    wider = Lin(5)
    before = wider.f.weight.clone()
    with raises(seqify.StateDictError, "f.weight: checkpoint (4, 4) vs model (5, 5)", "configuration it was saved"):
        checkpoint.load(wider, tmp_path / "ck")
    assert torch.equal(wider.f.weight, before)  # checked before anything loads


def test_checkpoint_optimizer_or_scheduler_that_does_not_fit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from seqify import checkpoint

    model = Lin()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    checkpoint.save(model, tmp_path / "bare")
    with raises(seqify.CheckpointError, "holds no optimizer state", "optimizer="):
        checkpoint.load(model, tmp_path / "bare", opt)
    with raises(seqify.CheckpointError, "holds no scheduler state", "scheduler="):
        checkpoint.load(model, tmp_path / "bare", scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    checkpoint.save(model, tmp_path / "ck", opt, torch.optim.lr_scheduler.StepLR(opt, 1))
    with raises(seqify.CheckpointError, "holds SGD optimizer state", "this optimizer is Adam", "build SGD"):
        checkpoint.load(model, tmp_path / "ck", torch.optim.Adam(model.parameters()))
    with raises(seqify.CheckpointError, "holds StepLR scheduler state", "this scheduler is ExponentialLR"):
        checkpoint.load(model, tmp_path / "ck", scheduler=torch.optim.lr_scheduler.ExponentialLR(opt, 0.5))
    split = torch.optim.SGD([{"params": model.f.parameters()}, {"params": model.g.parameters()}], lr=0.1)
    with raises(seqify.StateDictError, "1 parameter group(s) and this one has 2", "same groups"):
        checkpoint.load(model, tmp_path / "ck", split)
    with raises(seqify.StateDictError, "group 0", "saved, absent here: ['g.bias', 'g.weight']"):
        checkpoint.load(model, tmp_path / "ck", torch.optim.SGD(model.f.parameters(), lr=0.1))
    with raises(seqify.CheckpointError, "not the model's", "pipe.parameters()"):
        checkpoint.load(model, tmp_path / "ck", torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1))


def test_checkpoint_save_that_cannot_be_written(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from seqify import checkpoint

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.txt").write_text("")
    with raises(seqify.CheckpointError, str(tmp_path / "run"), "new or empty folder"):
        checkpoint.save(Lin(), tmp_path / "run")
    with raises(seqify.CheckpointError, "weights_only=True", "plain values"):
        checkpoint.save(Lin(), tmp_path / "ck", extra=Lin())


def test_export_without_safetensors(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from seqify import checkpoint

    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails, as when not installed
    with raises(seqify.CheckpointError, "safetensors", "pip install safetensors"):
        checkpoint.export(Lin(), tmp_path / "lin.safetensors")


# -- hand-written skips -------------------------------------------------------------------------------


@skippable(stash=["s"])
class Stash(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("s", x)
        return x * 2


@skippable(pop=["s"])
class Pop(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        s = yield pop("s")
        return x + s


def test_skips_in_the_wrong_order_or_number() -> None:
    with raises(seqify.SkipError, "layer '0' pops skip 's'", "move the stashing layer before it"):
        seqify.skip.verify(nn.Sequential(Pop(), Stash()))
    with raises(seqify.SkipError, "layer '1' stashes skip 's'", "isolate repeated layers"):
        seqify.skip.verify(nn.Sequential(Stash(), Stash(), Pop()))
    with raises(seqify.SkipError, "'s' (stashed by '0')", "every stash needs one pop"):
        seqify.pipeline(nn.Sequential(Stash(), nn.ReLU()), devices=CPU2, balance=[1, 1])
    ns = Namespace()
    seqify.skip.verify(nn.Sequential(Stash().isolate(ns), Stash(), Pop(), Pop().isolate(ns)))  # the fix


# -- pipeline: layout -------------------------------------------------------------------------------


def three_layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


LAYOUT_MISTAKES = {
    "balance-does-not-add-up": (seqify.BalanceError, dict(devices=CPU2, balance=[2, 2]),
                                ("sums to 4 but the model has 3 layers", "make the counts add up")),
    "balance-empty-partition": (seqify.BalanceError, dict(devices=CPU2, balance=[3, 0]),
                                ("[3, 0] has an empty partition", "at least one layer")),
    "balance-more-partitions-than-layers": (seqify.BalanceError, dict(devices=["cpu"] * 4, balance=[1, 1, 1, 1]),
                                            ("4 partitions", "only 3 layers")),
    "balance-not-a-list": (seqify.BalanceError, dict(devices=CPU2, balance=2),
                           ("balance=2", "give a list of layer counts", "[2, 1]")),
    "balance-not-whole-numbers": (seqify.BalanceError, dict(devices=CPU2, balance=[1.5, 1.5]),
                                  ("every entry must be a whole number", "1.5")),
    "balance-unknown-strategy": (seqify.BalanceError, dict(devices=CPU2, balance="fast"),
                                 ("balance='fast'", "one of ('time', 'memory', 'flops', 'params')")),
    "balance-strategy-without-sample": (seqify.BalanceError, dict(devices=CPU2, balance="time"),
                                        ("by='time' needs sample", "by='params' needs none")),
    "conversion-options-with-a-sequential": (seqify.BalanceError, dict(devices=CPU2, balance=[2, 1], depth=1),
                                             ("options ['depth'] apply to conversion",)),
    "chunks-below-one": (seqify.BalanceError, dict(devices=CPU2, balance=[2, 1], chunks=0),
                         ("chunks=0: need at least one micro-batch",)),
    "chunks-not-whole": (seqify.BalanceError, dict(devices=CPU2, balance=[2, 1], chunks=2.5),
                         ("chunks=2.5: give a whole number",)),
    "checkpoint-unknown": (seqify.BalanceError, dict(devices=CPU2, balance=[2, 1], checkpoint="sometimes"),
                           ("checkpoint='sometimes'", "choose one of")),
    "graphs-with-deferred-batch-norm": (seqify.BalanceError, dict(devices=CPU2, balance=[2, 1], graphs=True,
                                                                 deferred_batch_norm=True),
                                       ("graphs=True", "deferred_batch_norm=False")),
    "overlap-without-graphs": (seqify.BalanceError, dict(devices=CPU2, balance=[2, 1], overlap=True),
                               ("overlap=True", "pass graphs=True with it")),
    "loops-below-one": (seqify.BalanceError, dict(devices=CPU2, balance=[2, 1], loops=0),
                        ("loops=0", "partitions per device")),
    "balance-not-a-multiple-of-loops": (seqify.BalanceError, dict(devices=["cpu"], balance=[1, 1, 1], loops=2),
                                        ("3 partitions, not a multiple of loops=2", "loops partitions per device")),
    "graphs-on-cpu": (seqify.DeviceError, dict(devices=CPU2, balance=[2, 1], graphs=True, checkpoint="never"),
                      ("graphs=True needs every partition on a CUDA device",)),
    "device-string-not-a-device": (seqify.DeviceError, dict(devices=["cpu", "gpu0"], balance=[2, 1]),
                                   ("'gpu0' in devices is not a device", "'cuda:0'")),
    "devices-a-string-not-a-list": (seqify.DeviceError, dict(devices="cpu", balance=[2, 1]),
                                    ("devices='cpu'", "give a list with one device per partition")),
    "devices-count-mismatch": (seqify.DeviceError, dict(devices=["cpu"] * 3, balance=[2, 1]),
                               ("2 partitions but 3 devices", "one device per partition")),
    "devices-empty": (seqify.DeviceError, dict(devices=[], balance=[3]), ("devices=[] names no device",)),
    "device-unsupported": (seqify.DeviceError, dict(devices=["cpu", "mps"], balance=[2, 1]),
                           ("device mps is not supported", "use CUDA devices or 'cpu'")),
    "gpus-and-devices": (seqify.DeviceError, dict(gpus=1, devices=["cpu"], balance=[3]), ("either gpus=N or devices",)),
    "gpus-not-a-number": (seqify.DeviceError, dict(gpus="2", balance=[2, 1]), ("gpus='2'", "give a number of GPUs")),
    "cuda-device-missing": (seqify.DeviceError, dict(devices=["cpu", "cuda:7"], balance=[2, 1]),
                            ("device cuda:7 does not exist",)),
    "more-gpus-than-there-are": (seqify.DeviceError, dict(gpus=9, balance=[2, 1]), ("gpus=9 but this machine has",)),
}


@pytest.mark.parametrize("row", list(LAYOUT_MISTAKES))
def test_pipeline_layout_mistakes(row: str) -> None:
    kind, options, phrases = LAYOUT_MISTAKES[row]
    if row in ("cuda-device-missing", "more-gpus-than-there-are") and torch.cuda.device_count() > 8:
        pytest.skip("this machine has that many GPUs")
    with raises(kind, *phrases):
        seqify.pipeline(three_layers(), **options)


def test_moving_a_built_pipeline_to_another_device() -> None:
    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2)
    with raises(seqify.DeviceError, "pipe.to('meta')", "placed on [cpu, cpu], to meta", "nothing was moved",
                "Build the pipeline again", "devices=[...]", "pipe.double()"):
        pipe.to("meta", torch.float64)
    assert {(p.device.type, p.dtype) for p in pipe.parameters()} == {("cpu", torch.float32)}
    with raises(seqify.DeviceError, "pipe.cuda()", "to cuda", "Build the pipeline again"):
        pipe.cuda()
    assert pipe.cpu().double() is pipe  # its own devices, a cast in place


def test_backward_of_an_older_replayed_step() -> None:
    """graphs=True keeps one step's activations in fixed memory (exercised here with eager programs)."""
    pipe = seqify.pipeline(three_layers(), devices=CPU2, balance=[2, 1], chunks=2, checkpoint="never")
    pipe._replay_eager = True
    first = pipe(torch.randn(4, 2))
    pipe(torch.randn(4, 2))
    with raises(seqify.GraphError, "comes after a newer forward", "call backward on a step's output before the next forward"):
        first.sum().backward()


def test_chunks_set_on_a_pipeline() -> None:
    pipe = seqify.pipeline(three_layers(), devices=CPU2, balance=[2, 1], chunks=2)
    with raises(seqify.BalanceError, "chunks=0", "need at least one micro-batch"):
        pipe.chunks = 0
    with raises(seqify.BalanceError, "chunks='4'", "give a whole number"):
        pipe.chunks = "4"
    assert pipe.chunks == 2
    pipe.chunks = 3
    assert pipe(torch.randn(6, 2)).shape == (6, 2)


def test_one_sample_micro_batches_under_batch_norm() -> None:
    pipe = seqify.pipeline(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)), devices=CPU2, chunks=8)
    with pytest.warns(UserWarning, match="clamped"), \
            raises(seqify.MicroBatchError, "chunks=8", "a batch of 4 samples", "clamped", "BatchNorm1d layer '1'",
                   "Use chunks=2 or fewer", "a larger batch"):
        pipe(torch.randn(4, 8))


def test_meta_inputs_of_a_pipeline() -> None:
    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2)
    with raises(seqify.DeviceError, "the pipeline's input 'x'", "(4, 4)", "meta device", "copied to cpu",
                "Pass a tensor holding data"):
        pipe(torch.randn(4, 4, device="meta"))
    with raises(seqify.DeviceError, "target of shape (4, 4)", "meta device", "Pass a tensor holding data"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4, device="meta"), F.mse_loss)


def masked_mean(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    keep = target[:, 0] > 0
    return ((out - target) ** 2).sum(1)[keep].sum() / keep.sum()


def test_a_loss_that_divides_by_a_count_the_data_decides() -> None:
    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2, schedule="1f1b")
    target = torch.randn(8, 4)
    target[:4, 0], target[4:, 0] = 1.0, torch.tensor([1.0, -1.0, -1.0, -1.0])
    with raises(seqify.LossError, "masked_mean", "neither a sum nor a mean over samples", "denominator=",
                "reduction='sum'", "loss_fn(pipe(x), target).backward()"):
        pipe.step(torch.randn(8, 4), target, masked_mean)
    pipe.step(torch.randn(8, 4), target, masked_mean, denominator=lambda t: (t[:, 0] > 0).sum())


def test_a_loss_its_probe_cannot_tell() -> None:
    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2)
    x = torch.randn(4, 4)
    with raises(seqify.LossError, "cannot tell", "reduction='sum' or 'mean'"):
        pipe.step(x, x, lambda out, t: (out * 0).sum())
    with raises(seqify.LossError, "probing it", "ZeroDivisionError", "reduction='sum' or 'mean'"):
        pipe.step(x, x, lambda out, t: out.sum() if out.size(0) == 2 else 1 / 0)  # the pieces put together: 4


def test_loss_declarations_that_contradict_the_loss() -> None:
    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2)
    x = torch.randn(4, 4)
    with raises(seqify.LossError, "reduction='sum' but MSELoss(reduction='mean')", "leave reduction= out"):
        pipe.step(x, x, nn.MSELoss(), reduction="sum")
    with raises(seqify.LossError, "denominator=", "reduction='sum'", "pass one"):
        pipe.step(x, x, F.mse_loss, reduction="sum", denominator=lambda t: 1)
    with raises(seqify.LossError, "denominator=4", "pass a function of a micro-batch's target"):
        pipe.step(x, x, F.mse_loss, denominator=4)
    with raises(seqify.LossError, "denominator returned Tensor (4,)", "one number per micro-batch"):
        pipe.step(x, x, F.mse_loss, denominator=lambda t: torch.ones(4))
    with raises(seqify.LossError, "CTCLoss", "batch second", "ctc(out.transpose(0, 1), *t)"):
        pipe.step(x, x, nn.CTCLoss())


def test_a_loss_scale_pipe_step_cannot_use() -> None:
    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2)
    x = torch.randn(4, 4)
    with raises(seqify.ScheduleError, "loss_scale='2'", "a number (1 / k", "torch.amp.GradScaler"):
        pipe.step(x, x, F.mse_loss, loss_scale="2")
    with raises(seqify.ScheduleError, "loss_scale=0.0", "finite number > 0"):
        pipe.step(x, x, F.mse_loss, loss_scale=0)


def test_clipping_what_is_not_a_pipeline_or_by_no_norm() -> None:
    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2)
    with raises(seqify.OptionError, "clip_grad_norm_ got list", "pass the Pipeline", "torch.nn.utils.clip_grad_norm_"):
        seqify.clip_grad_norm_(list(pipe.parameters()), 1.0)
    with raises(seqify.OptionError, "norm_type='two'", "a number such as 2.0, or 'inf'"):
        seqify.clip_grad_norm_(pipe, 1.0, norm_type="two")


def test_clipping_a_stage_outside_its_job() -> None:
    import seqify.distributed as sd

    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    stage = sd.DistributedStage(seqify.convert(Lin()), [2, 2], index=0, device=torch.device("cpu"))
    weight = next(stage.partition.parameters())
    weight.grad = torch.ones_like(weight)
    with raises(seqify.DeviceError, "clip_grad_norm_ adds gradient norms over the job's processes", "2 ranks x 1",
                "no process group", "seqify.distributed.stage() under torchrun", "on every rank"):
        seqify.clip_grad_norm_(stage, 1.0)

def test_balancing_on_a_sample_that_does_not_fit() -> None:
    model = three_layers()
    with raises(seqify.BalanceError, "layer 0 '0' (Linear) fails on the sample while profiling", "check that the sample fits"):
        seqify.balance(model, 2, sample=torch.randn(2, 5), by="time", progress=False)
    with raises(seqify.BalanceError, "layer 0 '0' (Linear) fails on the sample while propagating shapes", "check that the sample fits"):
        seqify.balance(model, 2, sample=torch.randn(2, 5), by="flops")


def test_memory_cap_no_plan_meets() -> None:
    with raises(seqify.NoPlanFitsError, "memory_cap", "raise memory_cap to at least"):
        seqify.balance(three_layers(), 2, by="params", memory_cap=1)


def test_tied_parameter_changed_in_place_across_partitions() -> None:
    class Decaying(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(self.a(x))
            self.a.weight.mul_(0.5)
            return self.b(y)

    model = Decaying()
    model.a.weight.requires_grad_(False)
    seq = seqify.convert(model)
    with raises(seqify.TiedParameterError, "parameter a.weight (partition 0)", "(partition 1)", "changes it in place",
                "Change the balance"):
        seqify.pipeline(seq, devices=CPU2, balance=[1, len(seq) - 1])
    seqify.pipeline(seq, devices=["cpu"], balance=[len(seq)])  # the fix: both uses in one partition


CPU_META = [torch.device("cpu"), torch.device("meta")]


class ReadsStatistics(nn.Module):
    """A buffer that changes (BatchNorm's running mean) read directly by the next layer."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.f = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(torch.tanh(self.norm(x) + self.norm.running_mean))


class ReadsOffset(nn.Module):
    """A read-only buffer read by a first and a last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.g = nn.Linear(4, 4)
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g(torch.tanh(self.f(x + self.offset))) * self.offset


def test_changing_buffer_used_by_two_partitions() -> None:
    """Partition 0 runs micro-batch i + 1 before partition 1 runs micro-batch i: a later partition would read
    BatchNorm statistics already updated by later micro-batches (and, on another device, a stale copy)."""
    seq = seqify.convert(ReadsStatistics().train())
    assert list(seq._modules) == ["norm", "add", "tanh", "f"]
    with raises(seqify.SharedParameterError, "buffer 'running_mean'", "layer 'norm' (partition 0, cpu)",
                "layer 'add' (partition 1, cpu)", "Change the balance"):
        seqify.pipeline(seq, devices=CPU2, balance=[1, 3])
    # Across devices too (only CPU and meta exist here: a Pipeline built directly, as pipeline() takes CUDA or CPU).
    with raises(seqify.SharedParameterError, "(partition 1, meta)"):
        seqify.Pipeline(seq, [1, 3], CPU_META)
    # The fix: BatchNorm and the layer reading its statistics in one partition. Exact, micro-batch by micro-batch.
    model = ReadsStatistics().train()
    reference = copy.deepcopy(model)
    pipe = seqify.pipeline(model, devices=CPU2, balance=[2, 2], chunks=2)
    x = torch.randn(6, 4)
    expected = torch.cat([reference(c) for c in x.tensor_split(2)])
    torch.testing.assert_close(pipe(x), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean, rtol=1e-6, atol=1e-7)


def test_read_only_buffer_gets_a_copy_on_each_device() -> None:
    seq = seqify.convert(ReadsOffset())
    readers = [name for name, layer in seq.named_children() if any(k == "offset" for _, k in _buffer_names(layer))]
    assert len(readers) == 2 and readers[0] == list(seq._modules)[0] and readers[1] == list(seq._modules)[-1]
    pipe = seqify.Pipeline(seq, [1, len(seq) - 1], CPU_META)
    # The pipeline moved each partition to its device.
    held = [{t.device.type for t in [*part.parameters(), *part.buffers()]} for part in pipe.partitions]
    assert held == [{"cpu"}, {"meta"}] and any(True for _ in pipe.partitions[1].parameters())
    devices = [{t.device.type for m in part.modules() for k, t in m._buffers.items() if k == "offset"} for part in pipe.partitions]
    assert devices == [{"cpu"}, {"meta"}]
    assert seq.original_state_dict()["offset"].device.type in ("cpu", "meta")
    # Loading a checkpoint writes every copy.
    state = {k: torch.zeros_like(v, device="cpu") for k, v in ReadsOffset().state_dict().items()}
    seq.load_original_state_dict(state)
    assert all(torch.equal(t.cpu(), torch.zeros(4)) for t in seq._tensors("offset") if not t.is_meta)
    assert len(seq._tensors("offset")) == 2


def _buffer_names(layer: nn.Module) -> list[tuple[str, str]]:
    return [(path, name) for path, m in layer.named_modules() for name in m._buffers]


# -- pipeline: values crossing partitions -------------------------------------------------------------


class ToDict(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": x}


class FromDict(nn.Module):
    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return d["x"] * 2


def test_non_tensor_value_crossing_a_partition_boundary() -> None:
    pipe = seqify.pipeline(nn.Sequential(nn.Linear(2, 2), ToDict(), FromDict()), devices=CPU2, balance=[2, 1])
    with raises(seqify.BoundaryError, "layer '1', the last of partition 0, returns dict", "Move the cut"):
        pipe(torch.randn(2, 2))
    pipe = seqify.pipeline(nn.Sequential(nn.Linear(2, 2), ToDict(), FromDict()), devices=CPU2, balance=[1, 2])
    pipe(torch.randn(2, 2))  # the fix: the dict stays inside partition 1


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.f(x) + y


class Total(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x).sum()


def test_inputs_and_outputs_without_a_batch_dimension() -> None:
    plain = seqify.pipeline(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), devices=CPU2, balance=[1, 1], chunks=2)
    with raises(seqify.BoundaryError, "must be a tensor or a tuple of tensors", "got list"):
        plain([torch.randn(2, 2)])
    with raises(seqify.BoundaryError, "takes one argument"):
        plain(torch.randn(2, 2), torch.randn(2, 2))
    with raises(seqify.BoundaryError, "same batch size along dim 0", "[()]"):
        plain(torch.tensor(1.0))
    two = seqify.pipeline(TwoInputs(), devices=CPU2, balance=[1, 2], chunks=2)
    with raises(seqify.BoundaryError, "same batch size along dim 0", "(4, 2), (3, 2)"):
        two(torch.randn(4, 2), torch.randn(3, 2))
    with raises(seqify.BoundaryError, "Without the batch size 4 first: y (2,)", "expand"):
        two(torch.randn(4, 2), torch.randn(2))  # y broadcasts: the model runs it, a pipeline cannot split it
    total = seqify.pipeline(Total(), devices=CPU2, balance=[1, 1], chunks=2)
    with raises(seqify.BoundaryError, "cannot be concatenated along dim 0", "needs a batch dimension first",
                "The output is a scalar", "pipe.step"):
        total(torch.randn(4, 2))
    assert total.chunks == 2
    total.chunks = 1  # the fix for a scalar output: one micro-batch (or return per-sample values)
    total(torch.randn(4, 2))


# -- the model's own errors -------------------------------------------------------------------------


def test_errors_in_the_model_itself_keep_their_type_and_name_the_layer() -> None:
    """A wrong input shape fails inside a layer, as in the source: same exception type, plus a note
    naming the layer (and in a pipeline, the partition and device)."""
    seq = seqify.convert(Lin())
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        seq(torch.randn(2, 3))
    assert "in layer 'f' of the converted Lin" in " ".join(info.value.__notes__)
    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2])
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        pipe(torch.randn(2, 3))
    assert "in pipeline partition 0 (cpu), layer 'f'" in " ".join(info.value.__notes__)


# -- schedules and memory caps ---------------------------------------------------------------------


def test_schedule_errors_name_the_schedule_and_the_fix() -> None:
    with raises(seqify.ScheduleError, "schedule='2f2b'", "choose one of", "zb-h1"):
        seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], schedule="2f2b")
    with raises(seqify.ScheduleError, "1f1b", "one partition per device", "interleaved"):  # when built
        seqify.pipeline(Lin(), devices=CPU2[:1], loops=2, balance=[2, 2], schedule="1f1b", chunks=2)
    with raises(seqify.ScheduleError, "zb-h2", "one per device", "zb-h1' with loops=2"):
        seqify.pipeline(Lin(), devices=CPU2, loops=2, balance=[1, 1, 1, 1], schedule="zb-h2", chunks=2)
    import seqify.distributed as sd

    with raises(seqify.ScheduleError, "zb-h2", "one partition per rank", "interleaved"):
        sd.placement_for("zb-h2", 2, 2)
    from seqify.schedule.actions import gpipe

    pipe = seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2, schedule=gpipe((0, 1), 3))
    with raises(seqify.ScheduleError, "3 micro-batches", "build it for this pipeline"):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)


def test_memory_cap_below_every_plan_names_the_smallest_cap() -> None:
    with raises(seqify.MemoryCapError, "memory_cap=100", "smallest cap that works is", "Raise memory_cap"):
        seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], chunks=2, memory_cap=100, sample=torch.randn(4, 4))
    with raises(seqify.MemoryCapError, "memory_cap='lots'", "40GiB"):
        seqify.pipeline(Lin(), devices=CPU2, balance=[2, 2], memory_cap="lots", sample=torch.randn(4, 4))


# -- seqify.distributed checkpoints (a lost peer, PeerError, is tested in test_dist_nodes.py) -----------


def test_distributed_checkpoint_errors_name_the_folder_and_the_fix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import seqify.distributed as sd
    from seqify import checkpoint

    seq = seqify.convert(Lin())
    stage = sd.DistributedStage(seq, [2, 2], index=0, device=torch.device("cpu"))
    with raises(seqify.CheckpointError, "pipeline of 2 process(es)", "this job has 1", "every rank"):
        checkpoint.save(stage, tmp_path / "ckpt")  # one rank's stage, saved outside its job
    with raises(seqify.CheckpointError, "holds no seqify checkpoint", "stage{i}.pt", "seqify.distributed.load"):
        sd.merge(tmp_path / "elsewhere")
    (tmp_path / "old").mkdir()
    torch.save({"format": "seqify.distributed/1", "balance": [1, 3], "stages": 2, "state": {}, "optimizer": None,
                "extra": None}, sd.checkpoint.stage_file(tmp_path / "old", 0))
    with raises(seqify.StateDictError, "stage0.pt", "balance [1, 3]", "[2, 2]", "merge(path)"):
        sd.load(stage, tmp_path / "old")


class _Counts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.f(x) * self.calls


def test_export_frontend_options() -> None:
    with raises(seqify.OptionError, "example_inputs"):
        seqify.convert(Lin(), frontend="export")
    with raises(seqify.OptionError, "frontend='fx'"):
        seqify.convert(Lin(), torch.randn(2, 4), frontend="export", leaf_paths=["f"])
    with raises(seqify.OptionError, "'auto', 'fx' or 'export'"):
        seqify.convert(Lin(), frontend="onnx")


def test_export_frontend_refuses_attribute_writes() -> None:
    with raises(seqify.ConversionError, "calls", "buffer"):
        seqify.convert(_Counts(), torch.randn(2, 4), frontend="export")


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x - 1


def test_export_error_names_the_forward() -> None:
    with raises(seqify.ExportError, "_DataDependent.forward", "What to do"):
        seqify.convert(_DataDependent(), torch.randn(2, 4), frontend="export")


def test_verify_error_names_the_layer() -> None:
    from seqify.convert.verify import check

    model = Lin().eval()
    x = torch.randn(2, 4)
    seq = seqify.convert(model, x)
    check(model, seq, x)
    wrong = copy.deepcopy(model.g)
    with torch.no_grad():
        wrong.bias += 1
    seq._modules["g"] = wrong
    with raises(seqify.VerifyError, "layer 'g'", "verify=False"):
        check(model, seq, x)

# -- convert: fx-path rows --------------------------------------------------------------------------


def _star_decorator(fn):  # type: ignore[no-untyped-def]
    import functools

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        kwargs.setdefault("scale", 2.0)  # as transformers' decorators fill in config defaults
        return fn(self, *args, **kwargs)

    return wrapper


class StarDecorated(Lin):
    @_star_decorator
    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * scale


def test_decorated_forward() -> None:
    with raises(seqify.DecoratedForwardError, "StarDecorated.forward", "_star_decorator.<locals>.wrapper",
                "(self, *args, **kwargs)", "What to do", "frontend="):
        seqify.convert(StarDecorated(), torch.randn(2, 4), frontend="fx")


class StepCounter(Lin):
    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return super().forward(x) * self.step


def test_forward_that_writes_an_attribute() -> None:
    with raises(seqify.StatefulForwardError, "StepCounter.forward", "self.step", "What to do", "submodule"):
        seqify.convert(StepCounter(), torch.randn(2, 4))


class ListedLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(4, 4)]  # a plain list: the layer's weights are outside the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


@pytest.mark.parametrize("frontend", ["auto", "fx", "export"])
def test_a_module_kept_outside_the_module_tree(frontend: str) -> None:
    with raises(seqify.UnregisteredError, "ListedLayer.forward", "ListedLayer.layers[0]", "What to do",
                "nn.ModuleList"):
        seqify.convert(ListedLayer(), torch.randn(2, 4), frontend=frontend)


class BufferCounter(Lin):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return super().forward(x) * self.n


def test_a_buffer_update_fx_does_not_record() -> None:
    with raises(seqify.StatefulForwardError, "BufferCounter.forward", "self.n", "What to do", "frontend='export'"):
        seqify.convert(BufferCounter(), torch.randn(2, 4), frontend="fx")
    assert seqify.convert(BufferCounter(), torch.randn(2, 4)).frontend == "export"  # auto falls back to it


class OwnGenerator(Lin):
    def __init__(self) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.randn(x.shape, generator=self.gen)


def test_a_private_generator() -> None:
    with raises(seqify.StatefulForwardError, "OwnGenerator.forward", "OwnGenerator.gen", "What to do", "submodule"):
        seqify.convert(OwnGenerator(), torch.randn(2, 4))


class Reseeding(Lin):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        return F.dropout(super().forward(x), 0.5, self.training)


def test_a_reseed_inside_forward() -> None:
    with raises(seqify.StatefulForwardError, "Reseeding.forward", "torch.manual_seed", "test_errors.py:",
                "What to do", "seed before calling the model"):
        seqify.convert(Reseeding(), torch.randn(2, 4))


class NumpyMask(Lin):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.5)
        return super().forward(x) * keep


def test_a_draw_outside_torch_with_the_export_frontend() -> None:
    with raises(seqify.StatefulForwardError, "NumpyMask.forward", "with numpy", "What to do", "draw with torch"):
        seqify.convert(NumpyMask(), torch.randn(2, 4), frontend="export")


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_scripted_submodule_with_the_export_frontend() -> None:
    model = Lin()
    model.f = torch.jit.script(nn.Linear(4, 4))
    with raises(seqify.ExportError, "submodule 'f' (Linear)", "TorchScript", "frontend='fx'"):
        seqify.convert(model, torch.randn(2, 4), frontend="export")
    assert [o.path for o in seqify.convert(model, torch.randn(2, 4)).opaque] == ["f"]


class HooksItself(Lin):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.f(x)
        h.register_hook(lambda g: g * 2)
        return self.g(h)


def test_autograd_context_in_the_model_itself() -> None:
    model, x = HooksItself(), torch.randn(2, 4)
    before = snapshot(model)
    with raises(seqify.AutogradContextError, "HooksItself.forward", "register_hook", "test_errors.py",
                "h.register_hook", "What to do", "submodule"):
        seqify.convert(model, x, frontend="fx")
    assert_unchanged(model, before)


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            g = torch.sigmoid(self.f(x))
        return x * g.clone()


class FrozenInside(Lin):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = _Frozen()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(super().forward(x))


def test_export_refuses_autograd_context_it_would_drop() -> None:
    model, x = FrozenInside(), torch.randn(2, 4)
    with raises(seqify.AutogradContextError, "'frozen'", "_Frozen", "inference_mode", "test_errors.py",
                "frontend='fx'", "torch.no_grad()"):
        seqify.convert(model, x, frontend="export")
    seq = seqify.convert(model, x)  # the fix: fx keeps the submodule whole
    assert [o.path for o in seq.opaque] == [] and torch.equal(seq(x), model(x))

class KeptInDict(Lin):
    """A hidden state carried between calls in a dict attribute (mutated, never reassigned)."""

    def __init__(self) -> None:
        super().__init__()
        self.memory: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = super().forward(x) + self.memory.get("h", torch.zeros_like(x))
        self.memory["h"] = h.detach()
        return h


class CountedInList(Lin):
    """A count kept as a list's length (appended to every call)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x) * (len(self.seen) + 1)
        self.seen.append(1)
        return y


class Ticker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ticks = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ticks += 1
        return x * self.ticks


class TicksInside(Lin):
    def __init__(self) -> None:
        super().__init__()
        self.ticker = Ticker()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ticker(super().forward(x))


@pytest.mark.parametrize("frontend", ["fx", "export", "auto"])
@pytest.mark.parametrize(("model_cls", "attribute"), [(KeptInDict, "memory"), (CountedInList, "seen")])
def test_state_kept_in_a_container_between_calls_is_refused(frontend: str, model_cls: type[nn.Module],
                                                            attribute: str) -> None:
    # every frontend returned these: equal on the first call, wrong from the second on (the graph read the
    # container as it was at conversion). The self-check now calls source and result twice when the first call
    # changed Python state, and names what changed
    model = model_cls()
    before = snapshot(model)
    with raises(seqify.VerifyError, "second call", repr(attribute), "buffer", "verify=False"):
        seqify.convert(model, example_inputs=torch.randn(2, 4), frontend=frontend)
    assert_unchanged(model, before)


def test_state_changed_inside_a_kept_submodule_still_converts() -> None:
    # fx keeps a submodule that changes its attributes whole (one layer, the source's own module), so the
    # converted model carries that state: the second-call check passes, and calls stay equal to the source's
    model, x = TicksInside(), torch.randn(2, 4)
    twin = copy.deepcopy(model)
    seq = seqify.convert(model, example_inputs=x, frontend="fx")
    for _ in range(3):
        assert torch.equal(seq(x), twin(x))


class KVCache:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class ReturnsKVCache(Lin):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, KVCache]:  # type: ignore[override]
        y = super().forward(x)
        return y, KVCache(y)


def test_key_value_cache() -> None:
    with raises(seqify.UntraceableError, "KVCache", "use_cache=False", "What to do"):
        seqify.convert(ReturnsKVCache(), torch.randn(2, 4))


class NotATensorPath(Lin):
    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if type(t) is not torch.Tensor:  # fx's stand-in is no tensor by type()
            t = torch.tensor([t], device=x.device)
        return super().forward(x) * t


def test_op_failing_on_example_values() -> None:
    with raises(seqify.UntraceableError, "NotATensorPath.forward", "device=x.device", "fails on the example values",
                "test_errors.py", "What to do"):
        seqify.convert(NotATensorPath(), (torch.randn(2, 4), torch.tensor([2.0])), frontend="fx")


def test_zoo_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    from seqify import zoo

    with raises(seqify.ZooError, "resnet1011", "did you mean resnet101"):
        zoo.get("resnet1011")
    pytest.importorskip("transformers")
    with raises(seqify.ZooError, "'llama'", "no preset '9b'", "0.89b"):
        zoo.build("llama", preset="9b")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails, as when not installed
    assert "llama" in zoo.list()
    with raises(seqify.ZooError, "'gpt2'", "transformers is not installed", "pip install 'seqify[hf]'"):
        zoo.get("gpt2")
