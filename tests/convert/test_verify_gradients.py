"""The self-check compares gradients as well as outputs, and leaves the source model as it found it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from seqify.convert.verify import check


class FrozenGate(nn.Module):
    """``a`` runs under no_grad: only ``b`` trains."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            g = torch.sigmoid(self.a(x))
        return self.b(x) * g


class GateWithoutNoGrad(nn.Module):
    """FrozenGate's function with its no_grad region lost (same parameters)."""

    def __init__(self, source: FrozenGate) -> None:
        super().__init__()
        self.a, self.b = source.a, source.b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) * torch.sigmoid(self.a(x))


class Scaled(nn.Module):
    """A hook triples the gradient that reaches ``a``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return self.b(h.relu())


class ScaledWithoutHook(nn.Module):
    def __init__(self, source: Scaled) -> None:
        super().__init__()
        self.a, self.b = source.a, source.b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def test_a_lost_no_grad_region_fails_the_check_naming_the_parameter() -> None:
    source = FrozenGate()
    with pytest.raises(seqify.VerifyError, match=r"parameter 'a\.weight' gets a gradient in the converted model"
                       ) as caught:
        check(source, GateWithoutNoGrad(source), torch.randn(4, 8))
    assert "use it only for inference" in str(caught.value)  # verify=False is no way to train it
    assert caught.value.module_path == "a"


def test_a_lost_hook_fails_the_check_naming_the_parameter() -> None:
    source = Scaled()
    with pytest.raises(seqify.VerifyError, match=r"gradient of parameter 'a\.weight' differs \(norm ratio 0\.333"):
        check(source, ScaledWithoutHook(source), torch.randn(4, 8))


def test_the_check_passes_an_exact_copy_and_leaves_grads_alone() -> None:
    source = FrozenGate()
    source.b.weight.grad = torch.ones_like(source.b.weight)
    check(source, source, torch.randn(4, 8))
    assert torch.equal(source.b.weight.grad, torch.ones_like(source.b.weight))
    assert source.a.weight.grad is None


def test_a_frozen_part_converts_exactly_through_auto() -> None:
    x = torch.randn(4, 8)
    model = FrozenGate()
    ref = copy.deepcopy(model)
    seq = seqify.convert(model, example_inputs=(x,))
    assert torch.equal(seq(x), ref(x))
    seq(x).sum().backward()
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


class Renormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(10, 8, max_norm=1.0)
        self.out = nn.Linear(8, 8)

    def forward(self, i: torch.Tensor) -> torch.Tensor:
        return self.out(self.e(i))


class Clamped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.l.weight.clamp_(-0.1, 0.1)
        return F.dropout(self.l(x), 0.5, self.training)


@pytest.mark.parametrize("frontend", ["auto", "fx", "export"])
@pytest.mark.parametrize("make, inputs", [
    (Renormed, lambda: (torch.randint(0, 10, (4,)),)),
    (Clamped, lambda: (torch.randn(4, 8),)),
])
def test_convert_leaves_weights_buffers_grads_and_rng_as_they_were(make, inputs, frontend: str) -> None:
    torch.manual_seed(0)
    model = make()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    example = inputs()
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    try:
        seqify.convert(model, example_inputs=example, frontend=frontend)
    except seqify.SeqifyError:
        pass  # a refusal is fine here; what matters is that nothing changed
    assert all(torch.equal(model.state_dict()[n], v) for n, v in before.items())
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


class SparseMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.register_buffer("mix", torch.eye(8).to_sparse())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.mix, self.l(x).t()).t()


def test_a_sparse_buffer_converts_exactly() -> None:
    x = torch.randn(4, 8)
    model = SparseMix()
    ref = copy.deepcopy(model)
    seq = seqify.convert(model, example_inputs=(x,))
    assert torch.equal(seq(x), ref(x))


class Penalty(nn.Module):
    """A gradient penalty computed inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_() if not x.requires_grad else x
        y = self.l(x)
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + g


def test_autograd_grad_in_forward_is_not_blamed_on_the_source() -> None:
    x = torch.randn(4, 8)
    try:
        seqify.convert(Penalty(), example_inputs=(x,))
    except seqify.SourceRaisesError as e:  # the source runs: the check ran it without gradients
        pytest.fail(f"blamed the source: {e}")
    except seqify.SeqifyError:
        pass


class RunningMean(nn.Module):
    """A buffer updated in place by a chain whose first step changes nothing on a zero buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("avg", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.avg.mul_(0.9).add_(0.1 * x.mean().detach())
        return self.lin(x) + self.avg


def test_a_lost_step_of_a_buffer_update_shows_on_the_second_call() -> None:
    x = torch.randn(3, 3)
    with pytest.raises(seqify.VerifyError, match=r"second call.*buffer avg.*frontend='export'"):
        seqify.convert(RunningMean(), example_inputs=(x,), frontend="fx")
    model = RunningMean()
    ref = copy.deepcopy(model)
    seq = seqify.convert(model, example_inputs=(x,))  # auto: export records the whole update
    for _ in range(3):
        assert torch.equal(seq(x), ref(x))
        assert torch.equal(model.avg, ref.avg)
