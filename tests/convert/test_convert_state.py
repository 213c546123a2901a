"""State a forward reaches outside the module tree, changes in place, draws from or reseeds: each converts
exactly under every frontend (forward bit-equal, gradients and buffers equal over several calls) or is
refused at convert time by a SeqifyError naming the attribute or call and the fix."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from helpers.exactness import assert_unchanged, snapshot
from seqify.frontend.outside import outside

pytestmark = pytest.mark.timeout(120)

FRONTENDS = ["auto", "fx", "export"]


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def _exact(make: Callable[[], nn.Module], frontend: str, *, calls: int = 3, train: bool = True,
           backward: bool = True, clone: Callable[[nn.Module], nn.Module] = copy.deepcopy) -> seqify.Sequential:
    """Convert ``make()`` and run it ``calls`` times against a copy (``clone``) made before converting:
    outputs bit-equal, gradients equal, buffers and the tensors held outside the module tree equal after
    each call; converting leaves the source's parameters, buffers and outside tensors as they were."""
    torch.manual_seed(0)
    model = make().train(train)
    reference = clone(model)
    before = snapshot(model)
    held = [(h.where, h.obj.detach().clone()) for h in outside(model) if isinstance(h.obj, torch.Tensor)]
    seq = seqify.convert(model, example_inputs=(_x(),), frontend=frontend)
    assert_unchanged(model, before)
    for where, value in held:
        now = next(h.obj for h in outside(model) if h.where == where)
        assert torch.equal(now, value), f"converting changed {where}"
    for i in range(calls):
        x = _x(i + 1)
        torch.manual_seed(100 + i)
        want = reference(x)
        torch.manual_seed(100 + i)
        got = seq(x)
        assert want.dtype == got.dtype and torch.equal(want, got), f"call {i}: outputs differ"
        if backward:
            want.pow(2).mean().backward()
            got.pow(2).mean().backward()
            for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
                assert (p.grad is None) == (q.grad is None), f"call {i}: {name} gradient presence differs"
                if p.grad is not None:
                    assert torch.equal(p.grad, q.grad), f"call {i}: gradient of {name} differs"
        for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
            assert torch.equal(b, c), f"call {i}: buffer {name} differs"
        mine = {h.where: h.obj for h in outside(model) if isinstance(h.obj, torch.Tensor)}
        theirs = {h.where: h.obj for h in outside(reference) if isinstance(h.obj, torch.Tensor)}
        assert mine.keys() == theirs.keys()
        for where in mine:
            assert torch.equal(mine[where], theirs[where]), f"call {i}: {where} differs"
    return seq


def _refused(make: Callable[[], nn.Module], frontend: str, kind: type[Exception], *phrases: str) -> None:
    """Converting ``make()`` raises ``kind`` (a SeqifyError) whose message holds every phrase, and leaves it as
    it was."""
    model = make()
    before = snapshot(model)
    with pytest.raises(kind) as info:
        seqify.convert(model, example_inputs=(_x(),), frontend=frontend)
    assert isinstance(info.value, seqify.SeqifyError)
    for phrase in phrases:
        assert phrase in str(info.value), f"message lacks {phrase!r}: {info.value}"
    assert "verify=False" not in str(info.value)
    assert_unchanged(model, before)


# -- modules and tensors held outside the module tree -----------------------------------------------------


class M3(nn.Module):  # a module in a plain list: its weights train, no optimizer over parameters() sees them
    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(8, 8)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_trained_module_in_a_plain_list_is_refused_by_name(frontend: str) -> None:
    _refused(M3, frontend, seqify.UnregisteredError, "M3.layers[0]", "nn.ModuleList")


class InDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.heads = {"a": nn.Linear(8, 8)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["a"](self.l(x))


class Helper:
    def __init__(self) -> None:
        self.scale = nn.Parameter(torch.ones(8))


class InHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.helper = Helper()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) * self.helper.scale


class InTuple(nn.Module):  # the weight read directly, not through the module's call
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.pair = (nn.Linear(8, 8), 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.l(x), self.pair[0].weight)


class TrainedTensor(nn.Module):  # a plain attribute that requires grad: trained, but not a parameter
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.w = torch.randn(8, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) * self.w


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("make, where, fix", [
    (InDict, "InDict.heads['a']", "nn.ModuleDict"),
    (InHelper, "InHelper.helper.scale", "nn.Parameter"),
    (InTuple, "InTuple.pair[0].weight", "nn.Parameter"),
    (TrainedTensor, "TrainedTensor.w", "nn.Parameter"),
])
def test_trained_state_outside_the_module_tree_is_refused_by_path(
        make: Callable[[], nn.Module], where: str, fix: str, frontend: str) -> None:
    _refused(make, frontend, seqify.UnregisteredError, where, fix)


class Frozen(nn.Module):  # a frozen teacher kept in a list so that no optimizer or checkpoint sees it
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.teacher = [nn.Linear(8, 8).requires_grad_(False)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) + self.teacher[0](x)


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_a_frozen_module_in_a_list_converts_exactly(frontend: str) -> None:
    _exact(Frozen, frontend)


def test_a_frozen_module_in_a_list_shares_and_keeps_its_dtype() -> None:
    model = Frozen()
    seq = seqify.convert(model, example_inputs=(_x(),), frontend="export")
    teacher = model.teacher[0]
    assert {id(teacher.weight), id(teacher.bias)} <= {id(t) for t in seq.buffers()}
    with torch.no_grad():
        teacher.weight.add_(1.0)  # a load into the teacher reaches the converted model
    assert torch.equal(model(_x()), seq(_x()))
    seq.double()  # the source's .double() leaves the list's module alone: so does the converted model's
    assert teacher.weight.dtype == torch.float32
    assert {id(teacher.weight), id(teacher.bias)} <= {id(t) for t in seq.buffers()}
    assert model.l.weight.dtype == torch.float64


class FrozenWeight(nn.Module):  # a frozen module's weight read directly: a constant, the source's own tensor
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.teacher = [nn.Linear(8, 8).requires_grad_(False)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.l(x), self.teacher[0].weight)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_frozen_weight_read_directly_converts_exactly(frontend: str) -> None:
    model = FrozenWeight()
    seq = _exact(lambda: model, frontend)
    assert any(t is model.teacher[0].weight for t in seq.buffers())
    assert not any(p is model.teacher[0].weight for p in seq.parameters())


def test_fx_refuses_a_frozen_module_in_a_list_and_points_to_export() -> None:
    _refused(Frozen, "fx", seqify.UnregisteredError, "Frozen.teacher[0]", "frontend='export'")


class Sub(nn.Module):  # the list sits in a submodule: fx keeps that submodule whole
    def __init__(self) -> None:
        super().__init__()
        self.inner = M3()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inner(x)))


@pytest.mark.parametrize("frontend", ["auto", "fx"])
def test_a_submodule_using_a_listed_module_is_kept_whole(frontend: str) -> None:
    seq = _exact(Sub, frontend)
    assert [o.path for o in seq.opaque] == ["inner"]
    assert "held outside the module tree" in seq.opaque[0].reason


def test_export_refuses_a_submodule_using_a_listed_module() -> None:
    _refused(Sub, "export", seqify.UnregisteredError, "Sub.inner.layers[0]", "frontend='fx'")


class Const(nn.Module):  # a plain constant: harmless, converted as before
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.c = torch.randn(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) + self.c


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_plain_tensor_constant_converts_and_casts_like_the_source(frontend: str) -> None:
    seq = _exact(Const, frontend)
    model = Const()
    seq = seqify.convert(model, example_inputs=(_x(),), frontend=frontend)
    reference = copy.deepcopy(model).double()
    seq.double()
    assert model.c.dtype == torch.float32 and any(t is model.c for t in seq.buffers())
    x = _x(3).double()
    assert torch.equal(reference(x), seq(x))


class PlainMut(nn.Module):  # a plain tensor changed in place: the source sees it change every call
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.t = torch.zeros(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.t.add_(1)
        return self.l(x) + self.t


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_a_plain_tensor_changed_in_place_converts_exactly(frontend: str) -> None:
    _exact(PlainMut, frontend)


def test_fx_refuses_a_plain_tensor_changed_in_place() -> None:
    _refused(PlainMut, "fx", seqify.StatefulForwardError, "self.t", "in place", "frontend='export'")


# -- buffers updated in place ---------------------------------------------------------------------------


class M8(nn.Module):  # a buffer counter the output reads after the update
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        return self.l(x) * self.n


@pytest.mark.parametrize("frontend", ["auto", "export"])
def test_a_buffer_counter_updates_and_trains_like_the_source(frontend: str) -> None:
    seq = _exact(M8, frontend)
    assert seq.frontend == "export"


def test_fx_refuses_a_buffer_counter_it_cannot_record() -> None:
    _refused(M8, "fx", seqify.StatefulForwardError, "self.n", "frontend='export'")


class CounterInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.count = M8()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.count(x))


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_submodule_with_a_buffer_counter_converts_exactly(frontend: str) -> None:
    seq = _exact(CounterInside, frontend)
    if frontend == "fx":
        assert [o.path for o in seq.opaque] == ["count"]


# -- TorchScript children -------------------------------------------------------------------------------


class M9(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.jit.script(nn.Linear(8, 8))
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("frontend", ["auto", "fx"])
def test_a_scripted_child_is_kept_whole(frontend: str) -> None:
    def clone(model: nn.Module) -> nn.Module:  # a deep copy of a TorchScript module gets no gradients
        twin = M9()
        twin.load_state_dict(model.state_dict())
        return twin.train(model.training)

    seq = _exact(M9, frontend, clone=clone)
    assert [o.path for o in seq.opaque] == ["a"]
    assert "TorchScript" in seq.opaque[0].reason


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_export_refuses_a_scripted_child_by_name() -> None:
    _refused(M9, "export", seqify.ExportError, "'a'", "TorchScript", "frontend='fx'")


# -- private generators and reseeds ---------------------------------------------------------------------


class M13(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) + torch.randn(x.shape, generator=self.gen)


class FixedDraw(nn.Module):  # sizes fx knows: the draw would run once, while tracing
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.gen = torch.Generator().manual_seed(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) + torch.randn(8, generator=self.gen)


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("make", [M13, FixedDraw])
def test_a_private_generator_is_refused_by_its_attribute(make: Callable[[], nn.Module], frontend: str) -> None:
    name = make.__name__
    _refused(make, frontend, seqify.StatefulForwardError, f"{name}.gen", "torch.Generator", "submodule")


def test_converting_leaves_a_private_generator_where_it_was() -> None:
    model = FixedDraw()
    state = model.gen.get_state()
    with pytest.raises(seqify.StatefulForwardError):
        seqify.convert(model, example_inputs=(_x(),), frontend="fx")
    assert torch.equal(model.gen.get_state(), state)


class NoisyInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.noise = M13()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.noise(x))


@pytest.mark.parametrize("frontend", ["auto", "fx"])
def test_a_submodule_with_a_private_generator_is_kept_whole(frontend: str) -> None:
    seq = _exact(NoisyInside, frontend)
    assert [o.path for o in seq.opaque] == ["noise"]
    assert "noise.gen" in seq.opaque[0].reason


class M12(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        return F.dropout(self.l(x), 0.5, self.training)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_reseed_in_the_models_forward_is_refused(frontend: str) -> None:
    _refused(M12, frontend, seqify.StatefulForwardError, "M12.forward", "torch.manual_seed", "seed before calling")


def _reseeding(call: Callable[[], object]) -> type[nn.Module]:
    class Reseeds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            call()
            return F.dropout(self.l(x), 0.5, self.training)

    return Reseeds


_STATE = torch.get_rng_state()


@pytest.mark.parametrize("frontend", ["fx", "export"])
@pytest.mark.parametrize("call, name", [
    (lambda: torch.random.manual_seed(3), "torch.random.manual_seed"),
    (lambda: torch.cuda.manual_seed(3), "torch.cuda.manual_seed"),
    (lambda: torch.set_rng_state(_STATE), "torch.set_rng_state"),
    (lambda: torch.seed(), "torch.seed"),
])
def test_every_reseed_is_caught(call: Callable[[], object], name: str, frontend: str) -> None:
    _refused(_reseeding(call), frontend, seqify.StatefulForwardError, name, "Reseeds.forward")


def test_a_manual_seed_imported_before_converting_is_caught() -> None:
    from torch import manual_seed

    _refused(_reseeding(lambda: manual_seed(3)), "fx", seqify.StatefulForwardError, "manual_seed(3)")


class ReseedInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seeded = M12()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.out(self.seeded(x)), 0.5, self.training)


@pytest.mark.parametrize("frontend", ["auto", "fx"])
def test_a_submodule_that_reseeds_is_kept_whole(frontend: str) -> None:
    seq = _exact(ReseedInside, frontend)
    assert [o.path for o in seq.opaque] == ["seeded"]
    assert "torch.manual_seed" in seq.opaque[0].reason


def test_export_refuses_a_submodule_that_reseeds_by_name() -> None:
    _refused(ReseedInside, "export", seqify.StatefulForwardError, "'seeded'", "torch.manual_seed", "frontend='fx'")


class Forked(nn.Module):  # the state fork_rng puts back undoes the draws inside it: a reseed too
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.random.fork_rng(devices=[]):
            x = F.dropout(x, 0.5, self.training)
        return F.dropout(self.l(x), 0.5, self.training)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_a_fork_rng_in_forward_is_caught(frontend: str) -> None:
    _refused(Forked, frontend, seqify.StatefulForwardError, "torch.set_rng_state", "with torch.random.fork_rng")
