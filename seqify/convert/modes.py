"""Modes: which module paths' traced ops differ between a model's train-mode and eval-mode graphs."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch.fx as fx
from torch import nn

from seqify.errors import ExportError

__all__ = ["exported_mode_dependent", "mode_differences", "other_mode_trace"]


def _signature(node: fx.Node) -> tuple[Any, ...]:
    def constant(a: Any) -> Any:
        return "<node>" if isinstance(a, fx.Node) else repr(a)

    target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", repr(node.target))
    args = repr(fx.node.map_aggregate(node.args, constant))
    return (node.op, target, args, repr(fx.node.map_aggregate(node.kwargs, constant)))


def _scope(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return ""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values()]
    if node.op == "call_module" and paths and paths[-1] == node.target:
        paths = paths[:-1]
    return paths[-1] if paths else ""


def mode_differences(a: fx.Graph, b: fx.Graph) -> set[str]:
    """Module paths whose own traced ops differ between two graphs of one model."""
    seqs: list[dict[str, list[tuple[Any, ...]]]] = []
    for graph in (a, b):
        by_scope: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for node in graph.nodes:
            by_scope[_scope(node)].append(_signature(node))
        seqs.append(by_scope)
    return {p for p in set(seqs[0]) | set(seqs[1]) if seqs[0].get(p) != seqs[1].get(p)}


def other_mode_trace(module: nn.Module, example_inputs: Any) -> Any:
    """``module``'s torch.export trace in the mode it is not in (``module`` is left as it was), or the
    :class:`~seqify.SeqifyError` that says why that mode cannot be captured (LayerDrop's random branch in train
    mode only)."""
    from seqify.errors import SeqifyError
    from seqify.frontend.export.capture import export_trace
    from seqify.frontend.preserve import preserved

    with preserved(module):
        module.train(not module.training)
        try:
            return export_trace(module, example_inputs)
        except SeqifyError as e:
            return e
        except Exception as e:  # noqa: BLE001 - any failure means: not this mode
            return ExportError(f"{type(e).__name__}: {e}")


def exported_mode_dependent(module: nn.Module, graph: fx.Graph, example_inputs: Any) -> bool:
    """Whether ``module``'s torch.export graph (``graph``, captured in its current mode) differs from the one
    captured in the other mode on the same inputs. Where the other mode cannot be captured, it is: the
    conversion then runs only in the mode it was made in, as the fx frontend does, instead of refusing a model
    that converts in this one."""
    other = other_mode_trace(module, example_inputs)
    return isinstance(other, Exception) or bool(mode_differences(graph, other.graph))
