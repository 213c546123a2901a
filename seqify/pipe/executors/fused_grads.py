"""Fused sums: a cast weight's gradient multiplied straight into its float32 sum inside the backward.

Under autocast, a linear layer's weight gradient is a low-precision matrix product (``dY^T @ X``) that a
program would hand back whole and then widen into the weight's float32 sum: a full low-precision tensor per
weight, alive until the program's backward ends, then read again. Here the backward of each such product
writes the sum itself as it runs: on CUDA one matrix product with a float32 output that adds to the sum
(``addmm`` with ``out_dtype``; the product is kept in float32, not rounded to the low precision first), elsewhere
the same low-precision product autograd computes, added at once. Only weights whose one use is one product
through their transpose are fused (a linear layer's weight read through its once-per-step cast,
:mod:`.casts`); everything else is differentiated as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from seqify.pipe.split_backward import autograd_node

__all__ = ["Fused", "accumulating", "from_kept", "fusable", "write_kept"]

# Autograd nodes of a matrix product and the slot of their right operand (a linear layer's transposed
# weight); the left operand (the layer's 2-D input) is saved under ``left``.
_PRODUCTS = {"MmBackward0": (1, "_saved_self"), "AddmmBackward0": (2, "_saved_mat1")}


@dataclass
class Fused:
    """One weight whose gradient its product's backward writes into ``acc``: the product's autograd ``node``,
    the attribute its saved left operand is read from, and whether a gradient reached it this backward. A
    split backward's W writes it from the gradient B ``kept`` at the product instead (:func:`from_kept`)."""

    index: int
    node: Any
    left: str
    reached: bool = False
    kept: torch.Tensor | None = None


def _consumers(roots: Sequence[Any]) -> dict[Any, list[tuple[Any, int]]]:
    """Every node of the graph below ``roots`` with the (node, slot) pairs that read it."""
    users: dict[Any, list[tuple[Any, int]]] = {}
    seen, stack = set(roots), list(roots)
    while stack:
        node = stack.pop()
        for slot, (child, _) in enumerate(node.next_functions):
            if child is None:
                continue
            users.setdefault(child, []).append((node, slot))
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return users


def _product_of(leaf: Any, users: dict[Any, list[tuple[Any, int]]]) -> tuple[Any, str] | None:
    """The one matrix product that reads this weight, through one transpose and as its right operand."""
    reads = users.get(leaf, [])
    if len(reads) != 1 or reads[0][0].name() != "TBackward0":
        return None
    after = users.get(reads[0][0], [])
    if len(after) != 1:
        return None
    node, slot = after[0]
    kind = _PRODUCTS.get(node.name())
    if kind is None or slot != kind[0] or (kind[0] == 2 and node._saved_alpha != 1):
        return None
    return node, kind[1]


def _needed(roots: Sequence[Any], wanted: set[Any], skip: set[tuple[Any, int]]) -> set[Any]:
    """The nodes the engine runs to reach ``wanted``: those with a path to one, not through the ``skip`` slots
    (a fused product's weight slot, whose gradient nobody asks for)."""
    needed: set[Any] = set()
    done: set[Any] = set()
    stack: list[tuple[Any, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            kids = [c for s, (c, _) in enumerate(node.next_functions) if c is not None and (node, s) not in skip]
            if node in wanted or any(c in needed for c in kids):
                needed.add(node)
            continue
        if node in done:
            continue
        done.add(node)
        stack.append((node, True))
        stack.extend((c, False) for s, (c, _) in enumerate(node.next_functions)
                     if c is not None and c not in done and (node, s) not in skip)
    return needed


def _products(roots: Sequence[Any], wrt: Sequence[torch.Tensor], acc: Sequence[torch.Tensor],
              casts: set[int]) -> dict[int, tuple[Any, str]]:
    """Each weight of ``wrt`` at ``casts`` whose one use below ``roots`` is a product through its transpose."""
    users = _consumers(roots)
    found: dict[int, tuple[Any, str]] = {}
    for k in sorted(casts):
        if acc[k].is_contiguous() and wrt[k].dim() == 2:
            product = _product_of(autograd_node(wrt[k]), users)
            if product is not None:
                found[k] = product
    return found


def fusable(outs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
            acc: Sequence[torch.Tensor], casts: set[int], asked: Sequence[bool] | None = None) -> list[Fused]:
    """The weights of ``wrt`` (positions ``casts``: read through a once-per-step cast) whose one use is a
    matrix product the backward of ``outs`` runs anyway, for the inputs or the other weights: their gradients
    can be written into ``acc`` by that product's backward. A product nothing else needs would not run.
    ``asked``: the weights the backward differentiates by (default all); the others are neither fused nor
    counted on to make a product run."""
    roots = [n for n in map(autograd_node, outs) if n is not None]
    asked = list(asked) if asked is not None else [True] * len(wrt)
    casts = {k for k in casts if asked[k]}
    if not roots or not casts:
        return []
    found = _products(roots, wrt, acc, casts)
    if not found:
        return []
    # Conservative: a product that runs only because another left unfused asks for its weight stays unfused too
    wanted = {autograd_node(t) for t in inputs} | {autograd_node(w) for k, w in enumerate(wrt)
                                                    if k not in found and asked[k]}
    skip = {(node, _PRODUCTS[node.name()][0]) for node, _ in found.values()}
    needed = _needed(roots, wanted, skip)
    return [Fused(k, node, left) for k, (node, left) in found.items() if node in needed]


def from_kept(outs: Sequence[torch.Tensor], wrt: Sequence[torch.Tensor], acc: Sequence[torch.Tensor],
              casts: set[int], groups: Sequence[dict[str, Any]]) -> list[Fused]:
    """A split backward's fusable weights: those whose product is a node where B kept the gradient arriving
    (a boundary node of :func:`~seqify.pipe.split_backward.input_grads`' parameter groups). B ran every use of
    such a product's output, so that gradient is whole, and W multiplies it by the saved input itself."""
    roots = [n for n in map(autograd_node, outs) if n is not None]
    if not roots or not casts:
        return []
    kept = {node: grads[0] for group in groups for node, grads in zip(group["intermediates"], group["grads"])
            if grads and grads[0] is not None}
    return [Fused(k, node, left, kept=kept[node])
            for k, (node, left) in _products(roots, wrt, acc, casts).items() if node in kept]


def write_kept(fused: Sequence[Fused], acc: Sequence[torch.Tensor], write: bool) -> None:
    """Write (``write``) or add each of ``fused``'s gradient from the product's kept gradient into its sum."""
    with torch.no_grad():  # as inside the backward: the saved input is part of the graph
        for f in fused:
            if f.kept is not None:
                _accumulate(acc[f.index], f.kept, getattr(f.node, f.left), write)
                f.reached = True


_FLOAT32_PRODUCTS: dict[tuple[torch.device, torch.dtype], bool] = {}


def _float32_products(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this device multiplies ``dtype`` matrices into a float32 output that it adds to: tried once, on
    tiny matrices, outside any CUDA-graph capture (a step's programs run eagerly before they are captured)."""
    key = (device, dtype)
    if device.type != "cuda":
        return False
    if key not in _FLOAT32_PRODUCTS:
        if torch.cuda.is_current_stream_capturing():
            return False
        try:
            a = torch.ones(2, 2, device=device, dtype=dtype)
            out = torch.ones(2, 2, device=device)
            torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
            _FLOAT32_PRODUCTS[key] = bool(out[0, 0] == 3)
        except (RuntimeError, NotImplementedError, TypeError):
            _FLOAT32_PRODUCTS[key] = False
    return _FLOAT32_PRODUCTS[key]


def _accumulate(sum_: torch.Tensor, grad: torch.Tensor, left: torch.Tensor, write: bool) -> None:
    """``sum_`` (+)= ``grad^T @ left``: in float32 on devices that can, else the product autograd would
    compute (the same kernel, the same rounding), widened into the sum."""
    if sum_.dtype != grad.dtype and _float32_products(sum_.device, grad.dtype):
        torch.addmm(sum_, grad.t(), left, out_dtype=sum_.dtype, beta=0 if write else 1, out=sum_)
    elif write:
        sum_.copy_(grad.t().mm(left))
    else:
        sum_.add_(grad.t().mm(left))


@contextmanager
def accumulating(fused: Sequence[Fused], acc: Sequence[torch.Tensor], write: bool) -> Iterator[None]:
    """While a backward runs: each fused product, before its own backward, writes (``write``: the step's first
    gradients) or adds its weight's gradient into that weight's sum and notes that one reached it."""
    handles = []
    for f in fused:
        def hook(grads: tuple[torch.Tensor | None, ...], f: Fused = f) -> None:
            if grads[0] is not None:
                _accumulate(acc[f.index], grads[0], getattr(f.node, f.left), write)
                f.reached = True
        handles.append(f.node.register_prehook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
