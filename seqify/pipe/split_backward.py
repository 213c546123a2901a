"""Zero bubble's split backward: B the input gradients now, W the weight gradients later from B's boundary."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["NOW", "Later", "accumulate", "autograd_node", "input_grads", "owing", "weight_grads", "weight_values"]


@functools.cache
def _pipelining() -> Any:
    """torch.distributed.pipelining's private backward helpers (torch >= 2.5), or None (W then walks the
    whole graph again). Imported at first use, not with seqify: the package imports DTensor and dynamo,
    seconds at every process start."""
    try:
        from torch.distributed.pipelining import _backward
    except ImportError:  # pragma: no cover - older or trimmed torch
        return None
    return _backward


def autograd_node(t: torch.Tensor) -> Any:
    """``t``'s autograd node (a leaf's gradient accumulator), also where gradients are off (a replayed
    step runs under ``torch.no_grad()``; finding a leaf's accumulator takes a view that records one)."""
    with torch.enable_grad():
        if t.requires_grad and t.grad_fn is None:
            view = t.view_as(t).grad_fn
            return view.next_functions[0][0] if view is not None else None
        return t.grad_fn


#: Autograd nodes whose backward yields their weights' gradients with the input's, from the same
#: reductions (normalisations): B takes those weights' gradients along, so W neither runs the node again
#: nor keeps the gradient at its output. Mirrored for modules by :func:`seqify.pipe.memory.weighted`.
NOW = ("BatchNormBackward", "LayerNormBackward", "GroupNormBackward")


@dataclass
class Later:
    """What B leaves for W: which weights W still owes a gradient (``owed``; B returned the others'), and
    the gradients B kept where the owed weights' sub-graphs join the inputs' path (``groups``; None: W
    walks from the outputs again)."""

    owed: list[bool]
    groups: list[dict[str, Any]] | None


def _now(node: Any, reverse: dict[Any, list[Any]]) -> bool:
    """Whether every node reading this weight is a normalisation whose backward yields its gradient."""
    users = reverse.get(node, [])
    return bool(users) and all(any(k in u.name() for k in NOW) for u in users)


def _plan(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
          params: Sequence[torch.Tensor]) -> tuple[list[bool], list[dict[str, Any]] | None]:
    """Which weights B differentiates along with the inputs, and torch's parameter groups of the rest
    (weights with the boundary nodes they meet the inputs' path at), or None where some owed weight
    the outputs reach is in no group."""
    helpers = _pipelining()
    if helpers is None or not inputs or not params:
        return [False] * len(params), None
    roots = [n for n in map(autograd_node, outs) if n is not None]
    reverse = helpers.construct_reverse_graph(roots)
    nodes = [autograd_node(p) for p in params]
    now = [_now(n, reverse) for n in nodes]
    reached = [n for n, b in zip(nodes, now) if not b and (n in reverse or n in roots)]  # owed, reached
    if not reached:
        return now, []
    groups = helpers.get_param_groups([n for n in map(autograd_node, inputs) if n is not None], reached, reverse)
    covered = {n for g in groups for n in g["params"]}
    if covered != set(reached) or any(not g["intermediates"] for g in groups):
        return now, None
    return now, groups


def input_grads(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor],
                params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], Later]:
    """B: the gradients of ``inputs`` (None where unused), those of the normalisations' weights (:data:`NOW`;
    None for every other weight), and what :func:`weight_grads` needs for the rest.

    ``torch.autograd.grad`` runs to the inputs only, with hooks that keep the gradients arriving at the
    *boundary*: the nodes where each owed weight's sub-graph joins the path from inputs to outputs
    (torch.distributed.pipelining's ``stage_backward_input``, without its in-place detach of the
    outputs). W then differentiates from those saved gradients to the weights only
    (``stage_backward_weight``), so B + W walk the graph about once, not twice. A normalisation computes
    its weights' gradients from the reductions its input's gradient needs, so B takes them along rather
    than W running the node a second time (on a ResNet, half its W nodes and half what B keeps). Where the
    boundary cannot cover every owed weight (a weight reaching an output without meeting the inputs'
    path, say a learned embedding stashed as a skip), or torch's helpers are missing, W walks the
    retained graph again from the outputs (``torch.autograd.backward(..., inputs=weights)``): exact either
    way."""
    now, groups = _plan(outs, inputs, params)
    early = [p for p, b in zip(params, now) if b]
    handles = []
    try:
        for group in groups or []:
            group["intermediates"] = list(group["intermediates"])
            group["grads"] = [None] * len(group["intermediates"])
            for k, node in enumerate(group["intermediates"]):
                def keep(grad_outputs: Any, group: dict[str, Any] = group, k: int = k) -> None:
                    group["grads"][k] = grad_outputs

                handles.append(node.register_prehook(keep))
        got = torch.autograd.grad(outs, list(inputs) + early, list(grads), retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if groups is not None and any(g is None for group in groups for g in group["grads"]):
        groups = None  # a boundary node B never ran: fall back rather than miss its weights
    found = iter(got[len(inputs):])
    weights = [next(found) if b else None for b in now]
    return list(got[: len(inputs)]), weights, Later([not b for b in now], groups)


def _from_boundary(params: Sequence[torch.Tensor], groups: list[dict[str, Any]],
                   skip: frozenset[int] = frozenset()) -> list[torch.Tensor | None]:
    """Each weight's gradient from the gradients B kept at its group's boundary nodes (the graph is
    retained: groups may share nodes), but for the weights at ``skip``."""
    index = {autograd_node(p): k for k, p in enumerate(params)}
    got: list[torch.Tensor | None] = [None] * len(params)
    for group in groups:
        nodes = [n for n in group["params"] if index.get(n) not in skip]
        edges, seeds = [], []
        for kept, node in zip(group["grads"], group["intermediates"]):
            for k, g in enumerate(kept):
                if g is not None:
                    edges.append(GradientEdge(node, k))
                    seeds.append(g)
        if not edges or not nodes:
            continue
        handles = []
        try:
            if len(group["intermediates"]) > 1:
                # a boundary node below another gets what B saw there, not that plus what W sends it
                for kept, node in zip(group["grads"], group["intermediates"]):
                    handles.append(node.register_prehook(functools.partial(_clamp, kept)))
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
                  later: Later | None, retain_graph: bool = True,
                  skip: frozenset[int] = frozenset()) -> list[torch.Tensor | None]:
    """W, returned rather than written: the gradient of each of ``params`` that B left owed (None where B
    took it or none arrives), from B's boundary or else from the outputs (``later`` None: B took nothing,
    W is the whole weights' backward). Touches no ``.grad`` (what a captured W graph needs: the caller
    adds these into its own accumulators). ``skip``: weights the caller differentiates itself (None here,
    and not asked of autograd). The graph stays unless ``retain_graph`` is False and W walked it from the
    outputs; dropping ``outs`` and ``later`` releases it."""
    if later is not None and later.groups is not None:
        return _from_boundary(params, later.groups, skip)
    owed = [o and k not in skip for k, o in enumerate(owing(params, later))]
    wanted = [p for p, o in zip(params, owed) if o]
    if not outs or not wanted:
        return [None] * len(params)
    found = iter(torch.autograd.grad(list(outs), wanted, list(grads), retain_graph=retain_graph, allow_unused=True))
    return [next(found) if o else None for o in owed]


def owing(params: Sequence[torch.Tensor], later: Later | None) -> list[bool]:
    """Which of ``params`` W owes a gradient: those B did not take (all, where B took nothing)."""
    return list(later.owed) if later is not None else [True] * len(params)


def accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add ``grads`` into the parameters' ``.grad`` (None: nothing arrived)."""
    for p, g in zip(params, grads):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g


def weight_grads(outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor],
                 later: Later | None) -> None:
    """W: add the owed weights' gradients into ``.grad``, from B's boundary or else from the outputs
    (:func:`weight_values`, releasing the graph when it walked from the outputs)."""
    accumulate(params, weight_values(outs, grads, params, later, retain_graph=False))
