"""A property over random small nets that use autograd's own machinery in their forward: ``no_grad`` regions,
``enable_grad`` nested inside them, tensor hooks registered as the forward runs, buffers updated in place,
parametrizations (a symmetric weight, weight norm), frozen parameters and a ``@torch.no_grad()`` forward.

For every net and frontend ('auto', 'fx', 'export'), ``seqify.convert`` either refuses (a ``SeqifyError``) or
returns a model that trains like the source: forward bit-equal, the same parameters with and without
``.grad`` (values allclose), the input's gradient as the source gives it, buffers equal after each call; and
converting, refused or not, leaves the source as it was (tree, hooks, parameter and buffer values).

A falsifying example prints as ``spec=Spec(blocks=(...), ...)``: plain data, pasted back as an
``@example(spec=...)`` line to keep it. Draws are fixed unless ``SEQIFY_FUZZ=random``, as in test_fuzz.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import seqify
from helpers.exactness import assert_unchanged, snapshot

pytestmark = pytest.mark.timeout(300)

FIXED = os.environ.get("SEQIFY_FUZZ", "fixed") != "random"
# No shrinking: a net is at most three blocks, already small to read, and shrinking one failure takes
# minutes of conversions.
AUTOGRAD_FUZZ = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                         derandomize=FIXED, phases=[Phase.explicit, Phase.reuse, Phase.generate])

W = 4  # features

#: Every block kind a net can hold (the strategy draws from all of them).
BLOCKS = ("no_grad", "enable_grad", "hook", "count", "running_mean", "symmetric", "weight_norm", "frozen",
          "no_grad_forward")


class Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


class NoGradForward(nn.Module):
    """A submodule whose forward is decorated: nothing it computes carries a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(W, W)
        if kind == "enable_grad":
            self.inner = nn.Linear(W, W)
        elif kind == "count":
            self.register_buffer("count", torch.zeros(()))
        elif kind == "running_mean":
            self.register_buffer("avg", torch.zeros(()))
        elif kind == "symmetric":
            parametrize.register_parametrization(self.lin, "weight", Symmetric())
        elif kind == "weight_norm":
            self.lin = parametrizations.weight_norm(self.lin)
        elif kind == "frozen":
            self.lin.requires_grad_(False)
        elif kind == "no_grad_forward":
            self.sub = NoGradForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = self.kind
        if kind == "no_grad":
            with torch.no_grad():
                h = self.lin(x)
            return torch.relu(x * h)  # the gradient flows through x alone
        if kind == "enable_grad":
            with torch.no_grad():
                a = self.lin(x)
                with torch.enable_grad():
                    b = self.inner(x)
            return a + b
        if kind == "hook":
            h = self.lin(x)
            if h.requires_grad:
                h.register_hook(lambda g: g * 2)
            return torch.tanh(h)
        if kind == "count":
            self.count.add_(1)
            return self.lin(x) * (1.0 + 1.0 / (1.0 + self.count))
        if kind == "running_mean":
            self.avg.mul_(0.9).add_(0.1 * x.mean().detach())
            return self.lin(x) - self.avg
        if kind in ("symmetric", "weight_norm", "frozen"):
            return torch.relu(self.lin(x))
        if kind == "no_grad_forward":
            return self.lin(x) + self.sub(x)
        raise ValueError(kind)


@dataclass(frozen=True)
class Spec:
    """Blocks in order (each with a residual connection or not), the loss and whether the input wants a grad."""

    blocks: tuple[tuple[str, bool], ...]
    loss: str = "sum"  # or "projection": a fixed random projection of the output
    input_grad: bool = False


class Net(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.blocks = nn.ModuleList(Block(kind) for kind, _ in spec.blocks)
        self.head = nn.Linear(W, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, (_, residual) in zip(self.blocks, self.spec.blocks):
            x = x + block(x) if residual else block(x)
        return self.head(x)


def build(spec: Spec) -> Net:
    torch.manual_seed(0)
    return Net(spec)


specs = st.builds(
    Spec,
    blocks=st.lists(st.tuples(st.sampled_from(BLOCKS), st.booleans()), min_size=1, max_size=3).map(tuple),
    loss=st.sampled_from(["sum", "projection"]),
    input_grad=st.booleans(),
)


def inputs(seed: int, requires_grad: bool) -> torch.Tensor:
    x = torch.randn(3, W, generator=torch.Generator().manual_seed(seed))
    return x.requires_grad_(requires_grad)


def loss(out: torch.Tensor, spec: Spec) -> torch.Tensor:
    if spec.loss == "sum":
        return out.sum()
    projection = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    return (out * projection).sum()


def check(spec: Spec, frontend: str) -> None:
    net = build(spec)
    reference = copy.deepcopy(net)  # the converted model shares net's parameters and buffers; this does not
    before = snapshot(net)
    try:
        seq = seqify.convert(net, example_inputs=(inputs(0, False),), frontend=frontend)
    except seqify.SeqifyError:
        assert_unchanged(net, before)  # a refusal is fine; a refusal that changed the source is not
        return
    assert_unchanged(net, before)
    assert all(p.grad is None for p in net.parameters()), "converting left gradients on the source's parameters"
    for step in range(2):  # twice: buffers changed by the first call feed the second
        x, x_ref = inputs(step + 1, spec.input_grad), inputs(step + 1, spec.input_grad)
        expected = reference(x_ref)
        got = seq(x)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected), f"step {step}: forward differs"
        assert got.requires_grad == expected.requires_grad, f"step {step}"
        if expected.requires_grad:
            loss(expected, spec).backward()
            loss(got, spec).backward()
        ref_params = dict(reference.named_parameters())
        for name, p in net.named_parameters():
            q = ref_params[name]
            assert (p.grad is None) == (q.grad is None), (
                f"step {step}: {name} has {'no gradient' if p.grad is None else 'a gradient'} where the source "
                f"{'has one' if p.grad is None else 'has none'}")
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"step {step}: gradient of {name}")
        if spec.input_grad:
            assert (x.grad is None) == (x_ref.grad is None), f"step {step}: input gradient"
            if x_ref.grad is not None:
                torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6, msg=f"step {step}: input gradient")
        ref_buffers = dict(reference.named_buffers())
        for name, b in net.named_buffers():
            assert torch.equal(b, ref_buffers[name]), f"step {step}: buffer {name} differs"


@pytest.mark.parametrize("frontend", ["auto", "fx", "export"])
@AUTOGRAD_FUZZ
@given(spec=specs)
def test_autograd_in_forward_converts_exactly_or_is_refused(frontend: str, spec: Spec) -> None:
    check(spec, frontend)


@pytest.mark.parametrize("frontend", ["auto", "fx", "export"])
@pytest.mark.parametrize("kind", BLOCKS)
def test_each_block_alone_converts_exactly_or_is_refused(frontend: str, kind: str) -> None:
    """Every block kind on its own, whatever the draws above reach: a failure here names the pattern."""
    check(Spec(blocks=((kind, False),), loss="projection", input_grad=True), frontend)
