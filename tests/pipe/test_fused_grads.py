"""Fused sums: under autocast, a replayed backward writes cast linear weights' gradients into their float32 sums
as it runs. On the CPU the product is the one autograd computes, so steps are bit-equal with the sums filled
the usual way; the backward then runs no weight-gradient product of its own for a fused weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import seqify
from seqify.pipe.executors import fused_grads
from seqify.pipe.executors.options import ReplayOptions


def even(n: int, parts: int) -> list[int]:
    return [n // parts + (k < n % parts) for k in range(parts)]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(8, 16), nn.Linear(16, 8, bias=False), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Block(), Block(), Block(), nn.Linear(8, 3))


def train(schedule: str, fuse: bool, loops: int = 1, steps: int = 3, device: str = "cpu",
          checkpoint: str = "never") -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], int, int]:
    """``steps`` SGD steps of a 2-partition pipeline under bfloat16 autocast, as fixed programs (on the CPU run
    eagerly over two devices, on a GPU captured as CUDA graphs); before every step after the first the sums hold
    NaN (what a step must never read). Returns the losses, each step's gradients, and how many fused products
    wrote and added (run in Python: eagerly, or while capturing)."""
    seq = seqify.convert(net().to(device))
    parts = 2 * loops
    cuda = device.startswith("cuda")
    pipe = seqify.pipeline(seq, devices=[device, device], loops=loops, balance=even(len(seq), parts), chunks=4,
                           checkpoint=checkpoint, schedule=schedule, graphs=cuda,
                           replay_options=ReplayOptions(fuse_grads=fuse))
    pipe._replay_eager = not cuda
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, target = torch.randn(8, 6, device=device), torch.randn(8, 3, device=device)
    losses, grads, counts = [], [], {True: 0, False: 0}
    real = fused_grads._accumulate

    def counted(sum_: torch.Tensor, grad: torch.Tensor, left: torch.Tensor, write: bool) -> None:
        counts[write] += 1
        real(sum_, grad, left, write)

    for step in range(steps):
        if step:
            assert pipe._graphed is not None and pipe._graphed[1].sums is not None
            for flats in pipe._graphed[1].sums:
                for flat in flats:
                    flat.fill_(float("nan"))
        opt.zero_grad(set_to_none=True)
        fused_grads._accumulate = counted
        try:
            with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, cache_enabled=False):
                loss = pipe.step(x, target, lambda y, t: F.mse_loss(y.float(), t))
        finally:
            fused_grads._accumulate = real
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in pipe.named_parameters()})
        opt.step()
    assert pipe.graph_error is None and (not cuda or pipe.graphs)
    return losses, grads, counts[True], counts[False]


@pytest.mark.parametrize(("schedule", "loops", "checkpoint"), [
    ("gpipe", 1, "never"), ("1f1b", 1, "never"), ("interleaved", 2, "never"),
    # split backwards: W multiplies the gradient B kept at the product, or (the first partition, whose input
    # needs no gradient) the product's backward writes it while W walks from the outputs
    ("zb-h1", 1, "never"), ("zb-h2", 1, "never"), ("zb-h1", 2, "never"),
    # a checkpointed split program's W walks its recomputed graph, an ordinary one
    ("zb-h1", 1, "always")])
def test_fused_sums_equal_the_usual_sums_bit_for_bit_on_the_cpu(schedule: str, loops: int, checkpoint: str) -> None:
    losses, grads, writes, adds = train(schedule, True, loops, checkpoint=checkpoint)
    want, want_grads, none_written, none_added = train(schedule, False, loops, checkpoint=checkpoint)
    assert none_written == none_added == 0
    # 8 cast linear weights (the first and last layers', each Block's up and down) over 4 micro-batches a step;
    # each is written once a step (its partition's first backward), added to in the other three (and in the
    # first step's extra backwards that find where gradients reach, before the programs are fixed)
    linears, chunks, steps = 8, 4, 3
    if schedule.startswith("zb"):
        # a partition whose B writes the sums (it adds its LayerNorms' gradients) leaves W only adds
        assert 0 < writes <= linears * steps and writes + adds >= linears * chunks * steps, (writes, adds)
    else:
        assert writes == linears * steps and adds >= linears * (chunks - 1) * steps, (writes, adds)
    for a, b in zip(losses, want):
        assert torch.equal(a, b)
    for got, exp in zip(grads, want_grads):
        for name, g in exp.items():
            assert torch.equal(got[name], g), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zb-h1"])
def test_captured_fused_sums_are_float32_products_close_to_the_usual_sums(schedule: str) -> None:
    """On a GPU the fused product keeps its float32 result (bfloat16 inputs, a float32 output added to the sum):
    captured into the step's graphs, gradients equal the usual bfloat16 products widened, within their rounding."""
    assert fused_grads._float32_products(torch.device("cuda:0"))
    loops = 2 if schedule == "interleaved" else 1
    losses, grads, writes, _ = train(schedule, True, loops, device="cuda:0")
    want, want_grads, none, _ = train(schedule, False, loops, device="cuda:0")
    assert writes > 0 and none == 0
    for a, b in zip(losses, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
    for got, exp in zip(grads, want_grads):
        for name, g in exp.items():
            torch.testing.assert_close(got[name], g, rtol=2e-2, atol=2e-3, msg=name)


class _Products(TorchDispatchMode):
    """Counts matrix products by their output shape."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.shapes.append(tuple(out.shape))
        return out


def test_a_fused_weight_gets_no_gradient_product_of_its_own() -> None:
    """The product's backward computes the input's gradient only; the weight's is the fused one, added once."""
    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    w = torch.randn(3, 4).bfloat16().requires_grad_()
    b = torch.randn(3).bfloat16().requires_grad_()
    y = F.linear(x.bfloat16(), w, b).float().sum()
    acc = [torch.zeros(3, 4), torch.zeros(3)]
    fused = fused_grads.fusable([y], [w, b], [x], acc, {0, 1})
    assert [f.index for f in fused] == [0]  # the bias is no matrix product's right operand
    seen = _Products()
    with fused_grads.accumulating(fused, acc, write=True), seen:
        gx, gb = torch.autograd.grad([y], [x, b])
    # the fused (3, 4) product, then dX: autograd computes no (4, 3) gradient for the transposed weight
    assert fused[0].reached and seen.shapes == [(3, 4), (5, 4)]
    want = torch.autograd.grad(F.linear(x.bfloat16(), w, b).float().sum(), [w])[0]
    assert torch.equal(acc[0], want.float())


def test_a_product_the_backward_would_not_run_keeps_its_weight_requested() -> None:
    """A linear layer without a bias on an input that needs no gradient runs in the backward only for its weight:
    it is not fused (its hook would never run), and nor is a layer that needs it to run."""
    torch.manual_seed(0)
    x = torch.randn(5, 4).bfloat16()
    w1, w2 = (torch.randn(4, 4).bfloat16().requires_grad_() for _ in range(2))
    w3 = torch.randn(2, 4).bfloat16().requires_grad_()
    b3 = torch.randn(2).bfloat16().requires_grad_()
    y = F.linear(F.linear(F.linear(x, w1), w2), w3, b3).float().sum()
    acc = [torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(2, 4), torch.zeros(2)]
    assert [f.index for f in fused_grads.fusable([y], [w1, w2, w3, b3], [], acc, {0, 1, 2, 3})] == [2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_rank_under_autocast_fuses_like_in_process() -> None:
    """seqify.distributed's programs (one rank holding four partitions, captured as CUDA graphs) under bfloat16
    autocast: the fused products write the sums over three SGD steps whose sums held NaN before them, within
    bfloat16's rounding of the same rank with the sums filled the usual way."""
    from helpers import dist_worker as worker

    import seqify.distributed as sd

    device = torch.device("cuda:0")

    def run(fuse: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = worker.build("skippy").float().train().to(device)
        stage = sd.DistributedStage(seqify.convert(model), [3, 3, 4, 4], index=0, device=device, chunks=4,
                                    schedule="interleaved", loops=4, checkpoint="never", graphs=True,
                                    replay_options=ReplayOptions(fuse_grads=fuse))
        opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for k in range(3):
            x, y = (t.to(device, torch.float32 if t.is_floating_point() else t.dtype)
                    for t in worker.data("skippy", 8, k))
            for prog in stage._programs.values() if k else ():
                for flat in prog.sums():
                    flat.fill_(float("nan"))
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
                losses.append(stage.step(x, y, loss_fn=worker.loss_fn("skippy")).detach())
            opt.step()
        assert all(prog.captured for prog in stage._programs.values())
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

    losses, params = run(True)
    want, want_params = run(False)
    for a, b in zip(losses, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
    for name, p in want_params.items():
        torch.testing.assert_close(params[name], p, rtol=2e-2, atol=2e-3, msg=name)


def test_a_split_weights_part_fuses_only_products_it_runs() -> None:
    """W of a split backward that walks from the outputs (B could not cover every weight from its boundary: the
    weights reach an output the input does not) asks only for the weights B left owed. A product
    that only a weight B already took (the LayerNorm's) would make run is not fused: W never runs it, so its
    weight is asked of autograd, and every weight's gradient equals the plain backward's."""
    from seqify.pipe import split_backward

    torch.manual_seed(0)
    x0 = torch.randn(5, 4).bfloat16()
    x = torch.randn(5, 3, requires_grad=True)
    norm = torch.randn(4).bfloat16().requires_grad_()
    w = torch.randn(2, 4).bfloat16().requires_grad_()
    e = torch.randn(2).requires_grad_()

    def outputs() -> list[torch.Tensor]:
        return [(F.linear(F.layer_norm(x0, (4,), norm), w).float() + e).sum(), (2 * x).sum()]

    wrt = [norm, w, e]
    want = torch.autograd.grad(sum(outputs()), wrt)
    ys, seeds = outputs(), [torch.ones(()), torch.ones(())]
    _, now, later = split_backward.input_grads(ys, seeds, [x], wrt)
    assert later.groups is None and now[0] is not None and later.owed == [False, True, True]
    acc = [torch.zeros(4), torch.zeros(2, 4), torch.zeros(2)]
    fused = fused_grads.fusable(ys, wrt, [], acc, {1}, asked=split_backward.owing(wrt, later))
    assert fused == []
    unguarded = fused_grads.fusable(ys, wrt, [], acc, {1})
    assert [f.index for f in unguarded] == [1]  # counted on the LayerNorm's weight, which W does not ask for
    got = split_backward.weight_values(ys, seeds, wrt, later, retain_graph=False)
    assert torch.equal(now[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


def test_a_split_weights_part_multiplies_the_gradient_kept_at_the_product() -> None:
    """W of a split backward from B's boundary: each linear weight's gradient is the gradient B kept at its
    product times the product's saved input, written into its sum; autograd is asked only for the others."""
    from seqify.pipe import split_backward

    torch.manual_seed(0)
    x = torch.randn(5, 4, requires_grad=True)
    w1, w2 = torch.randn(6, 4).bfloat16().requires_grad_(), torch.randn(3, 6).bfloat16().requires_grad_()
    b1 = torch.randn(6).bfloat16().requires_grad_()

    def loss() -> torch.Tensor:
        return F.linear(F.gelu(F.linear(x.bfloat16(), w1, b1)), w2).float().square().sum()

    wrt = [w1, b1, w2]
    want = torch.autograd.grad(loss(), wrt)
    y, seed = loss(), torch.ones(())
    _, _, later = split_backward.input_grads([y], [seed], [x], wrt)
    assert later.groups
    acc = [torch.full((6, 4), float("nan")), torch.zeros(6), torch.zeros(3, 6)]
    fused = fused_grads.from_kept([y], wrt, acc, {0, 1, 2}, later.groups)
    assert sorted(f.index for f in fused) == [0, 2]
    seen = _Products()
    with seen:
        got = split_backward.weight_values([y], [seed], wrt, later, retain_graph=False, skip=frozenset({0, 2}))
        fused_grads.write_kept(fused, acc, write=True)
    assert got[0] is None and got[2] is None and torch.equal(got[1], want[1])
    assert seen.shapes == [(6, 4), (3, 6)]  # the two fused products, nothing else
    assert torch.equal(acc[0], want[0].float()) and torch.equal(acc[2], want[2].float())
