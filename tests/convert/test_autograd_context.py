"""Autograd context in forwards (grad-mode regions, tensor hooks, requires_grad_, autograd.grad, custom Functions):
each frontend keeps it exactly or refuses at convert time, naming the cause."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import seqify
from helpers.exactness import assert_unchanged, snapshot

pytestmark = pytest.mark.timeout(300)

N = 8


def example() -> torch.Tensor:
    return torch.randn(4, N, generator=torch.Generator().manual_seed(1))


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(N, N), nn.Linear(N, N)


class Block(Two):
    """A frozen feature path: a no_grad block in the model's own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            g = torch.sigmoid(self.a(x))
        return self.b(x) * g


class SetGradOff(Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(False):
            g = torch.sigmoid(self.a(x))
        return self.b(x) * g


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N, N)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Decorated(nn.Module):
    """``@torch.no_grad()`` on a child's forward (an EMA teacher, a frozen extractor)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen, self.b = Frozen(), nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) + self.frozen(x)


class Nested(Two):
    """enable_grad inside no_grad; the region spans several module calls and layers."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.a(x)
            with torch.enable_grad():
                h = self.b(h)
                k = self.c(x)
            h = torch.relu(h)
        return k + h


class Inference(Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            g = torch.sigmoid(self.a(x))
        return self.b(x) * g.clone()


class InferenceChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.b = Inference(), nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.inner(x))


class Hooked(Two):
    """A tensor hook registered on an intermediate in the model's own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return self.b(h.relu())


class Hooker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.requires_grad:
            h.register_hook(lambda g: g * 3)
        return h.relu()


class HookedChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hooker, self.b = Hooker(), nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.hooker(x))


class RequiresGrad(Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_()
        return self.b(torch.relu(self.a(x)))


class Detached(Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.a(x), self.b(x)
        h.detach_()
        return g * h


class Freezer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.lin.parameters():
            p.requires_grad_(False)
        return self.lin(x)


class FreezesChild(nn.Module):
    """A forward that freezes its parameters: requires_grad_ on what .parameters() gives."""

    def __init__(self) -> None:
        super().__init__()
        self.freezer, self.b = Freezer(), nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) + self.freezer(x)


class Penalty(nn.Module):
    """A gradient penalty: torch.autograd.grad inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(N, N), nn.Linear(N, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = self.b(torch.tanh(self.a(x)))
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + (g**2).sum(dim=1, keepdim=True)


class PenaltyChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.critic, self.c = Penalty(), nn.Linear(N, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x) + self.c(x)


class Reverse(torch.autograd.Function):
    """Gradient reversal: the forward copies, the backward negates and scales."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:  # type: ignore[override]
        ctx.alpha = alpha
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return -ctx.alpha * grad, None


class Reversed(Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(Reverse.apply(self.a(x), 0.5))


class Leaker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.set_grad_enabled(False)
        y = self.lin(x)
        torch.set_grad_enabled(True)
        return y


class LeakerChild(nn.Module):
    """set_grad_enabled called as a function: grad mode is whatever the forward left."""

    def __init__(self) -> None:
        super().__init__()
        self.leaker, self.b = Leaker(), nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) + self.leaker(x)


class Picky(nn.Module):
    """fx cannot trace it (torch.finfo of a traced dtype); torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).clamp(min=torch.finfo(x.dtype).min / 2)


class SplicedInRegion(nn.Module):
    """A submodule export makes (frontend='auto') called inside a no_grad block of fx's graph."""

    def __init__(self) -> None:
        super().__init__()
        self.picky, self.b = Picky(), nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.picky(x)
        return self.b(x) * h


class PostAccumulate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N, N)
        self.seen = 0

    def count(self, p: torch.Tensor) -> None:
        self.seen += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin.weight.register_post_accumulate_grad_hook(self.count)
        return self.lin(x)


class HooksAParameter(nn.Module):
    """A hook registered on a parameter in forward (one more every call, as the source does)."""

    def __init__(self) -> None:
        super().__init__()
        self.hooker, self.b = PostAccumulate(), nn.Linear(N, N)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(x) * self.hooker(x)


class Checkpointed(Two):
    """Reentrant checkpointing of a block whose input is an activation (it requires grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(N, N), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(checkpoint(self.block, h, use_reentrant=True))


class CheckpointsInput(Two):
    """Reentrant checkpointing of the input itself: the source gives ``a`` no gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(checkpoint(self.a, x, use_reentrant=True))


EXACT = "exact"
Expect = Any  # EXACT, or (error class, phrases the message holds)


def refused(*phrases: str) -> Expect:
    return (seqify.AutogradContextError, phrases)


#: pattern -> (model, what each frontend does: fx, export, auto)
PATTERNS: dict[str, tuple[Callable[[], nn.Module], Expect, Expect, Expect]] = {
    "no_grad block": (Block, EXACT, EXACT, EXACT),
    "set_grad_enabled(False)": (SetGradOff, EXACT, EXACT, EXACT),
    "no_grad decorator on a child": (Decorated, EXACT, EXACT, EXACT),
    "enable_grad nested in no_grad": (Nested, EXACT, EXACT, EXACT),
    "inference_mode": (Inference, EXACT, refused("Inference.forward", "inference_mode", "frontend='fx'",
                                                 "torch.no_grad()"), EXACT),
    "inference_mode in a child": (InferenceChild, EXACT, refused("'inner'", "inference_mode"), EXACT),
    "hook on an intermediate": (
        Hooked, refused("Hooked.forward", "register_hook", "test_autograd_context.py", "submodule"),
        refused("Hooked.forward", "register_hook", "test_autograd_context.py"),
        refused("Hooked.forward", "register_hook", "export frontend failed too")),
    "hook in a child": (HookedChild, EXACT, refused("'hooker'", "register_hook", "frontend='fx'"), EXACT),
    "requires_grad_ on an intermediate": (RequiresGrad, EXACT, refused("requires_grad_", "frontend='fx'"), EXACT),
    "detach_ on an intermediate": (Detached, EXACT, refused("detach_", "frontend='fx'"), EXACT),
    "requires_grad_ on parameters in a child": (FreezesChild, EXACT, refused("'freezer'", "requires_grad_"), EXACT),
    "autograd.grad penalty": (
        Penalty, refused("Penalty.forward", "torch.autograd.grad", "submodule"), refused("Penalty.forward"),
        refused("Penalty.forward", "torch.autograd.grad")),
    "autograd.grad penalty in a child": (PenaltyChild, EXACT, refused("'critic'"), EXACT),
    "custom autograd.Function": (Reversed, EXACT, refused("Reverse", "backward", "frontend='fx'"), EXACT),
    "set_grad_enabled as a function in a child": (LeakerChild, EXACT, refused("'leaker'", "outside a with block"),
                                                  EXACT),
    "region around a submodule export makes": (SplicedInRegion, EXACT, EXACT, EXACT),
    "post-accumulate hook on a parameter in a child": (
        HooksAParameter, EXACT, refused("'hooker'", "register_post_accumulate_grad_hook"), EXACT),
    "reentrant checkpoint of an activation": (Checkpointed, EXACT, refused("use_reentrant=False"), EXACT),
    "reentrant checkpoint of the input": (
        CheckpointsInput, refused("CheckpointsInput.forward", "do not require grad", "use_reentrant=False"),
        refused("use_reentrant=False"), refused("use_reentrant=False")),
}
FRONTENDS = ("fx", "export", "auto")


def grads_equal(model: nn.Module, reference: nn.Module) -> list[str]:
    """The parameters whose .grad differs between ``model`` and ``reference`` (None where the other has one)."""
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    return [k for k, p in ours.items() if (p.grad is None) != (theirs[k].grad is None)
            or (p.grad is not None and not torch.equal(p.grad, theirs[k].grad))]


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_pattern_is_kept_exactly_or_refused(pattern: str, frontend: str) -> None:
    make, *expected = PATTERNS[pattern]
    expect = expected[FRONTENDS.index(frontend)]
    torch.manual_seed(0)
    model, x = make(), example()
    reference = copy.deepcopy(model)  # before converting: the conversion shares the model's parameters
    before = snapshot(model)
    flags = [p.requires_grad for p in model.parameters()]
    hooks = [(p._backward_hooks, p._post_accumulate_grad_hooks) for p in model.parameters()]
    if expect != EXACT:
        kind, phrases = expect
        with pytest.raises(kind) as info:
            seqify.convert(model, example_inputs=(x,), frontend=frontend)
        for phrase in phrases:
            assert phrase in str(info.value), f"message lacks {phrase!r}: {info.value}"
        assert_unchanged(model, before)
        assert [p.requires_grad for p in model.parameters()] == flags
        assert [(p._backward_hooks, p._post_accumulate_grad_hooks) for p in model.parameters()] == hooks
        return
    seq = seqify.convert(model, example_inputs=(x,), frontend=frontend)
    assert_unchanged(model, before)
    assert [p.requires_grad for p in model.parameters()] == flags, "convert changed requires_grad"
    assert [(p._backward_hooks, p._post_accumulate_grad_hooks) for p in model.parameters()] == hooks, "hooked"
    for _ in range(2):  # a second call: hooks and flags set by the first do not accumulate differently
        for p in (*model.parameters(), *reference.parameters()):
            p.grad = None
        out, ref = seq(x), reference(x)
        assert torch.equal(out, ref)
        assert out.requires_grad == ref.requires_grad
        out.sum().backward()
        ref.sum().backward()
        assert grads_equal(model, reference) == [], seq.summary()


def test_auto_keeps_the_region_of_a_spliced_submodule() -> None:
    seq = seqify.convert(SplicedInRegion(), example_inputs=(example(),))
    assert seq.frontend == "fx+export" and [e.path for e in seq.exported] == ["picky"]


def test_layers_show_their_grad_mode_and_run_it_under_any_caller() -> None:
    model, x = Nested(), example()
    seq = seqify.convert(model, example_inputs=(x,), frontend="fx")
    text = str(seq)
    assert "[no grad]" in text and "[grad]" in text
    with torch.no_grad():  # the enable_grad region builds its graph under the caller's no_grad too
        assert torch.equal(seq(x), model(x))
    with torch.inference_mode():
        assert torch.equal(seq(x), model(x))


class Escapes(Two):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return self.a(x) + self.b(x)


def test_fx_runs_an_enable_grad_region_with_gradients_under_no_grad() -> None:
    model, x = Escapes(), example()
    seq = seqify.convert(model, example_inputs=(x,), frontend="fx")
    with torch.no_grad():
        out, ref = seq(x), model(x)
    assert out.requires_grad and ref.requires_grad and torch.equal(out, ref)


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_regions_are_kept_when_convert_runs_under_no_grad(frontend: str) -> None:
    torch.manual_seed(0)
    model, x = Block(), example()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        seq = seqify.convert(model, example_inputs=(x,), frontend=frontend)
    seq(x).sum().backward()
    reference(x).sum().backward()
    assert model.a.weight.grad is None and grads_equal(model, reference) == []


@pytest.mark.parametrize("make", [Nested, Reversed], ids=["region", "function"])
def test_saved_and_loaded_layers_keep_regions_and_functions(make: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    model, x = make(), example()
    buffer = io.BytesIO()
    torch.save(seqify.convert(model, example_inputs=(x,), frontend="fx"), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = loaded(ours), model(theirs)
    out.sum().backward()
    ref.sum().backward()
    assert torch.equal(out, ref) and torch.equal(ours.grad, theirs.grad)


def test_opaque_reason_names_the_hook() -> None:
    seq = seqify.convert(HookedChild(), example_inputs=(example(),), frontend="fx")
    assert [o.path for o in seq.opaque] == ["hooker"]
    assert "register_hook" in seq.opaque[0].reason and "kept whole" in seq.opaque[0].reason
