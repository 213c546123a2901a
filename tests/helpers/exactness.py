"""Shared checks: a converted model against its source, and that conversion leaves the source alone."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import seqify

__all__ = ["snapshot", "assert_unchanged", "assert_exact", "leaves", "loss_of", "by_micro_batch"]


def leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def loss_of(out: Any) -> torch.Tensor:
    """A scalar that depends on every floating output."""
    parts = [t.float().pow(2).mean() * (i + 1) for i, t in enumerate(leaves(out)) if t.is_floating_point()]
    return torch.stack(parts).sum()


def by_micro_batch(model: Callable[..., Any], args: tuple[Any, ...], chunks: int,
                   kwargs: dict[str, Any] | None = None) -> Any:
    """The source run on each micro-batch, outputs joined along dim 0: what a pipeline of ``chunks``
    micro-batches computes, to compare it with bit for bit.

    Never compare a pipeline with the source run on the whole batch: a BLAS may take other kernels for
    other batch sizes (MKL on AVX512 Xeons does for float64 ``nn.Linear``), so whole-batch bits can differ
    in the last place. Tensors with a batch dimension are split as a pipeline splits them
    (``tensor_split``, ``chunks`` clamped to the batch size); each micro-batch is a tensor of its own
    (views of one tensor would share autograd's version counter). Other arguments go to every call.
    """
    kwargs = kwargs or {}
    batched = [t for t in leaves((args, kwargs)) if t.dim() > 0]
    chunks = max(1, min(chunks, batched[0].size(0))) if batched else 1

    def part(i: int) -> Any:
        return pytree.tree_map(
            lambda t: t.tensor_split(chunks)[i].clone() if isinstance(t, torch.Tensor) and t.dim() > 0 else t,
            (args, kwargs),
        )

    outs = [model(*a, **k) for a, k in map(part, range(chunks))]
    flat = [pytree.tree_flatten(o)[0] for o in outs]
    joined = [torch.cat(xs) if isinstance(xs[0], torch.Tensor) else xs[0] for xs in zip(*flat)]
    return pytree.tree_unflatten(joined, pytree.tree_flatten(outs[0])[1])


def _forward(m: nn.Module) -> Any:
    """The forward ``m``'s class defines, read without running descriptors (a TorchScript module's forward
    is one that fails on the class)."""
    return inspect.getattr_static(type(m), "forward")


def snapshot(model: nn.Module) -> dict[str, Any]:
    """What conversion must not change: tree, attributes, flags, hooks and state values."""
    return {
        "modules": [(n, id(m), type(m)) for n, m in model.named_modules()],
        "dicts": {n: {k: id(v) for k, v in m.__dict__.items()} for n, m in model.named_modules()},
        "training": [m.training for m in model.modules()],
        "hooks": [
            (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()
        ],
        "state": {k: (id(v), v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()},
        "forward": [_forward(m) for m in model.modules()],
    }


def assert_unchanged(model: nn.Module, before: dict[str, Any]) -> None:
    """Compare ``model`` now with ``snapshot(model)`` taken before, reading state values in place (no
    second copy of the weights: the largest torchvision models hold 2.6 GB of them)."""
    assert [(n, id(m), type(m)) for n, m in model.named_modules()] == before["modules"], "module tree changed"
    dicts = {n: {k: id(v) for k, v in m.__dict__.items()} for n, m in model.named_modules()}
    assert dicts == before["dicts"], "module attributes changed"
    assert [m.training for m in model.modules()] == before["training"], "training flags changed"
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]
    assert hooks == before["hooks"], "hooks changed"
    assert [_forward(m) for m in model.modules()] == before["forward"], "forward changed"
    state = model.state_dict(keep_vars=True)
    assert before["state"].keys() == state.keys()
    for k, (ident, value) in before["state"].items():
        assert id(state[k]) == ident, f"{k} was replaced"
        assert torch.equal(state[k].detach(), value), f"{k} changed value"


def assert_exact(
    model: nn.Module,
    args: tuple[Any, ...],
    *,
    train: bool,
    convert: Callable[[nn.Module], seqify.Sequential] | None = None,
    kwargs: dict[str, Any] | None = None,
    backward: bool = True,
    seed: int = 0,
) -> seqify.Sequential:
    """Convert ``model`` and check it against an untouched deep copy of the source.

    Forward outputs must be bit-equal (same structure), gradients allclose(1e-5), buffers (BatchNorm
    statistics) equal, and the conversion must leave the source unchanged.
    """
    kwargs = kwargs or {}
    model.train(train)
    # Memory: at most the source, one copy (snapshot or reference) and the gradients are alive at once.
    before = snapshot(model)
    seq = (convert or seqify.convert)(model)
    assert_unchanged(model, before)
    del before
    assert isinstance(seq, seqify.Sequential)
    reference = copy.deepcopy(model)

    def run(fn: Callable[..., Any]) -> Any:
        # Fresh copies of the inputs: a model may modify its inputs in place.
        a, k = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        torch.manual_seed(seed)
        if backward:
            out = fn(*a, **k)
            loss_of(out).backward()
            # Detached: the output's graph keeps every parameter it accumulated into alive.
            return pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
        with torch.no_grad():
            return fn(*a, **k)

    expected = run(reference)
    # Keep only what is compared (gradients, buffers); the reference's weights go before seq runs.
    ref_grads = {name: q.grad for name, q in reference.named_parameters()}
    ref_buffers = dict(reference.named_buffers())
    del reference
    got = run(seq)
    assert pytree.tree_structure(expected) == pytree.tree_structure(got), "output structure differs"
    for a, b in zip(pytree.tree_leaves(expected), pytree.tree_leaves(got)):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b), "outputs are not bit-equal"
        else:
            assert a == b
    del expected, got
    for name, p in model.named_parameters():
        q_grad = ref_grads[name]
        if q_grad is None:
            assert p.grad is None, f"{name} got a gradient the source does not give"
        else:
            assert p.grad is not None, f"{name} has no gradient"
            if not torch.equal(p.grad, q_grad):  # bit-equal is the common case, and one pass instead of five
                torch.testing.assert_close(p.grad, q_grad, rtol=1e-5, atol=1e-5, msg=f"gradient of {name}")
    for name, b in model.named_buffers():
        assert torch.equal(b, ref_buffers[name]), f"buffer {name} differs (BatchNorm statistics?)"
    model.zero_grad(set_to_none=True)
    return seq
