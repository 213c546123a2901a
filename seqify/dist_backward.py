"""Zero bubble's split backward: B the input gradients now, W the weight gradients later from B's boundary."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

try:  # private helpers of torch.distributed.pipelining (torch >= 2.5): optional, checked below
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        get_param_groups,
    )
except ImportError:  # pragma: no cover - older or trimmed torch: W walks the whole graph again
    get_param_groups = None

__all__ = ["input_grads", "weight_grads", "weight_values"]


def _node(t: torch.Tensor) -> Any:
    """``t``'s autograd node (a leaf's gradient accumulator), also where gradients are off (a replayed
    step runs under ``torch.no_grad()``; finding a leaf's accumulator takes a view that records one)."""
    with torch.enable_grad():
        return _get_grad_fn_or_grad_acc(t)


def _groups(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
            params: Sequence[torch.Tensor]) -> list[dict[str, Any]] | None:
    """torch's parameter groups (weights with the boundary nodes they meet the inputs' path at), or
    None when some weight the outputs reach is in no group."""
    if get_param_groups is None or not inputs or not params:
        return None
    roots = [n for n in map(_node, outs) if n is not None]
    reverse = construct_reverse_graph(roots)
    nodes = {p: _node(p) for p in params}
    reached = [n for n in nodes.values() if n in reverse or n in roots]  # weights some output depends on
    groups = get_param_groups([n for n in map(_node, inputs) if n is not None],
                              reached, reverse)
    covered = {n for g in groups for n in g["params"]}
    if covered != set(reached) or any(not g["intermediates"] for g in groups):
        return None
    return groups


def input_grads(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor],
                params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], list[dict[str, Any]] | None]:
    """B: the gradients of ``inputs`` (None where unused), and what :func:`weight_grads` needs (None:
    walk from the outputs again).

    ``torch.autograd.grad`` runs to the inputs only, with hooks that keep the gradients arriving at the
    *boundary*: the nodes where each weight's sub-graph joins the path from inputs to outputs
    (torch.distributed.pipelining's ``stage_backward_input``, without its in-place detach of the
    outputs). W then differentiates from those saved gradients to the weights only
    (``stage_backward_weight``), so B + W walk the graph about once, not twice. Where that cannot cover
    every weight (a weight reaching an output without meeting the inputs' path, say a learned
    embedding stashed as a skip), or torch's helpers are missing, W walks the retained graph again from
    the outputs (``torch.autograd.backward(..., inputs=weights)``): exact either way."""
    groups = _groups(outs, inputs, params)
    handles = []
    try:
        for group in groups or []:
            group["intermediates"] = list(group["intermediates"])
            group["grads"] = [None] * len(group["intermediates"])
            for k, node in enumerate(group["intermediates"]):
                def keep(grad_outputs: Any, group: dict[str, Any] = group, k: int = k) -> None:
                    group["grads"][k] = grad_outputs

                handles.append(node.register_prehook(keep))
        got = torch.autograd.grad(outs, list(inputs), list(grads), retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if groups is not None and any(g is None for group in groups for g in group["grads"]):
        groups = None  # a boundary node B never ran: fall back rather than miss its weights
    return list(got), groups


def _from_boundary(params: Sequence[torch.Tensor], groups: list[dict[str, Any]]) -> list[torch.Tensor | None]:
    """Each weight's gradient from the gradients B kept at its group's boundary nodes (the graph is
    retained: groups may share nodes)."""
    index = {_node(p): k for k, p in enumerate(params)}
    got: list[torch.Tensor | None] = [None] * len(params)
    for group in groups:
        edges, seeds = [], []
        for kept, node in zip(group["grads"], group["intermediates"]):
            for k, g in enumerate(kept):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    seeds.append(g)
        if not edges:
            continue
        handles = []
        try:
            if len(group["intermediates"]) > 1:
                # a boundary node below another gets what B saw there, not that plus what W sends it
                for kept, node in zip(group["grads"], group["intermediates"]):
                    handles.append(node.register_prehook(functools.partial(_clamp, kept)))
            nodes = list(group["params"])
            found = torch.autograd.grad(edges, [GradientEdge(n, 0) for n in nodes], seeds, retain_graph=True,
                                        allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for n, g in zip(nodes, found):
            k = index[n]
            if g is not None:
                before = got[k]
                got[k] = g if before is None else before + g
    return got


def _clamp(kept: tuple[torch.Tensor | None, ...], _: Any) -> tuple[torch.Tensor | None, ...]:
    return kept


def weight_values(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor],
                  groups: list[dict[str, Any]] | None, retain_graph: bool = True) -> list[torch.Tensor | None]:
    """W, returned rather than written: each of ``params``' gradient (None where none arrives), from
    B's boundary (``groups``) or else from the outputs. Touches no ``.grad`` (what a captured W graph
    needs: the caller adds these into its own accumulators). The graph stays unless ``retain_graph`` is
    False and W walked it from the outputs; dropping ``outs`` and ``groups`` releases it."""
    if groups is not None:
        return _from_boundary(params, groups)
    if not outs or not params:
        return [None] * len(params)
    return list(torch.autograd.grad(list(outs), list(params), list(grads), retain_graph=retain_graph,
                                    allow_unused=True))


def weight_grads(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor],
                 groups: list[dict[str, Any]] | None) -> None:
    """W: add the weights' gradients into ``.grad``, from B's boundary or else from the outputs
    (:func:`weight_values`, releasing the graph when it walked from the outputs)."""
    for p, g in zip(params, weight_values(outs, grads, params, groups, retain_graph=False)):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g
