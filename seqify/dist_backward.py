"""Zero bubble's split backward: B the input gradients now, W the weight gradients later from B's boundary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # private helpers of torch.distributed.pipelining (torch >= 2.5): optional, checked below
    from torch.distributed.pipelining._backward import (
        _get_grad_fn_or_grad_acc,
        construct_reverse_graph,
        get_param_groups,
        stage_backward_weight,
    )
except ImportError:  # pragma: no cover - older or trimmed torch: W walks the whole graph again
    get_param_groups = None

__all__ = ["input_grads", "weight_grads"]


def _groups(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
            params: Sequence[torch.Tensor]) -> list[dict[str, Any]] | None:
    """torch's parameter groups (weights with the boundary nodes they meet the inputs' path at), or
    None when some weight the outputs reach is in no group."""
    if get_param_groups is None or not inputs or not params:
        return None
    roots = [n for n in map(_get_grad_fn_or_grad_acc, outs) if n is not None]
    reverse = construct_reverse_graph(roots)
    nodes = {p: _get_grad_fn_or_grad_acc(p) for p in params}
    reached = [n for n in nodes.values() if n in reverse or n in roots]  # weights some output depends on
    groups = get_param_groups([n for n in map(_get_grad_fn_or_grad_acc, inputs) if n is not None],
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


def weight_grads(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor],
                 groups: list[dict[str, Any]] | None) -> None:
    """W: add the weights' gradients into ``.grad``, from B's boundary or else from the outputs."""
    if groups is not None:
        stage_backward_weight(iter(params), groups, retain_graph=True)  # groups may share nodes
    elif outs and params:
        torch.autograd.backward(list(outs), list(grads), inputs=list(params))
