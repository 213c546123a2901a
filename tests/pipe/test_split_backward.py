"""Zero bubble's split backward (seqify.pipe.split_backward): B's input gradients and W's weight gradients add up
to one backward, from B's boundary where it covers every weight, else walking from the outputs again."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from seqify.pipe.split_backward import input_grads, weight_grads, weight_values

pytestmark = pytest.mark.timeout(60)


class Net(nn.Module):
    """A residual, a Linear called twice (two paths into one weight), normalisations (whose weights'
    gradients B takes along) and an output the inputs never reach."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.ln = nn.LayerNorm(4)
        self.emb = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor, stray: bool) -> list[torch.Tensor]:
        h = self.bn(torch.relu(self.a(x)) + x)
        y = self.b(torch.tanh(self.b(h))) * self.ln(h)
        return [y, self.emb * 2] if stray else [y]


NORMS = ("bn.weight", "bn.bias", "ln.weight", "ln.bias")


def ran(run: Callable[[nn.Module, torch.Tensor], list[torch.Tensor]]) -> tuple[
        nn.Module, torch.Tensor, list[torch.Tensor], list[torch.Tensor], list[nn.Parameter]]:
    """A seeded float64 Net run by ``run`` on an input that needs a gradient: the net, the input, the
    outputs, random gradients for them, and the parameters."""
    torch.manual_seed(0)
    net = Net().double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    outs = run(net, x)
    return net, x, outs, [torch.randn_like(o) for o in outs], list(net.parameters())


def split_vs_whole(run: Callable[[nn.Module, torch.Tensor], list[torch.Tensor]]) -> bool:
    """Compare B + W with one backward; whether W started from B's boundary. B returns the
    normalisations' weights' gradients and W the others', each normalisation's backward running once."""
    net, x, outs, grads, params = ran(run)
    names = [n for n, _ in net.named_parameters()]
    runs = {"bn": 0, "ln": 0}
    found = {}

    def seen(name: str) -> Callable[..., None]:
        def count(*_: object) -> None:
            runs[name] += 1
        return count

    def find(node: object) -> None:  # the normalisations' autograd nodes, by walking from the outputs
        if node is None or id(node) in found:
            return
        found[id(node)] = node
        for k in ("BatchNorm", "LayerNorm"):
            if k in node.name():
                node.register_hook(seen("bn" if k == "BatchNorm" else "ln"))
        for nxt, _ in node.next_functions:
            find(nxt)

    for o in outs:
        find(o.grad_fn)
    dx, now, later = input_grads(outs, grads, [x], params)
    assert all(p.grad is None for p in params)  # B returns gradients, writes no .grad
    assert [n for n, g in zip(names, now) if g is not None] == list(NORMS)
    assert later.owed == [n not in NORMS for n in names]
    assert runs == {"bn": 1, "ln": 1}
    weight_grads(outs, grads, params, later)
    if later.groups is not None:  # from the boundary W runs no normalisation again (walking from the
        assert runs == {"bn": 1, "ln": 1}  # outputs it must pass through them to reach `a`)
    assert all(p.grad is None for n, p in zip(names, params) if n in NORMS)
    split = [g.clone() if g is not None else torch.zeros_like(p) if p.grad is None else p.grad.clone()
             for p, g in zip(params, now)]
    for p in params:
        p.grad = None
    again = run(net, x)
    whole = torch.autograd.grad(again, [x, *params], grads, allow_unused=True)
    torch.testing.assert_close(dx[0], whole[0], rtol=1e-12, atol=1e-14)
    for got, want in zip(split, whole[1:]):
        torch.testing.assert_close(got, want if want is not None else torch.zeros_like(got), rtol=1e-12, atol=1e-14)
    return later.groups is not None


def test_w_starts_from_b_boundary_and_adds_up() -> None:
    assert split_vs_whole(lambda net, x: net(x, False))


def test_a_weight_the_inputs_never_meet_falls_back_to_the_outputs() -> None:
    assert not split_vs_whole(lambda net, x: net(x, True))


def test_checkpointed_partition_recomputes_for_both_halves() -> None:
    assert split_vs_whole(lambda net, x: [checkpoint(lambda t: net(t, False)[0], x, use_reentrant=False)])


@pytest.mark.parametrize("stray", [False, True])
def test_weight_values_returns_w_without_touching_grad(stray: bool) -> None:
    """What a captured W needs: the weights' gradients returned (from the boundary, or from the outputs
    where it does not cover every weight), .grad left alone, under no_grad too (a replayed step)."""
    _, x, outs, grads, params = ran(lambda net, x: net(x, stray))
    whole = torch.autograd.grad(outs, params, grads, retain_graph=True, allow_unused=True)
    with torch.no_grad():
        _, now, later = input_grads(outs, grads, [x], params)
        got = weight_values(outs, grads, params, later)
    assert (later.groups is None) == stray
    assert all(p.grad is None for p in params)
    assert all((a is None) != (b is None) for a, b in zip(now, got) if a is not None or b is not None)
    for g, want in zip((b if a is None else a for a, b in zip(now, got)), whole):
        assert (g is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-14)
