"""Convert: any nn.Module becomes an exact, pipeline-ready seqify.Sequential (trace, linearize, build)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
from torch import nn

from ..errors import OptionError
from ..sequential import Sequential
from ..trace import Opaque, preserved, trace
from .build import RESERVED, build
from .linearize import Plan, linearize

__all__ = ["convert", "Plan", "linearize", "build"]


def _signature(node: fx.Node) -> tuple[Any, ...]:
    def constant(a: Any) -> Any:
        return "<node>" if isinstance(a, fx.Node) else repr(a)

    target = node.target if isinstance(node.target, str) else getattr(node.target, "__qualname__", repr(node.target))
    return (node.op, target, repr(fx.node.map_aggregate(node.args, constant)), repr(fx.node.map_aggregate(node.kwargs, constant)))


def _scope(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return ""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [path for path, _ in stack.values()]
    if node.op == "call_module" and paths and paths[-1] == node.target:
        paths = paths[:-1]
    return paths[-1] if paths else ""


def _mode_differences(a: fx.Graph, b: fx.Graph) -> set[str]:
    """Module paths whose own traced ops differ between two graphs of one model."""
    seqs: list[dict[str, list[tuple[Any, ...]]]] = []
    for graph in (a, b):
        by_scope: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        for node in graph.nodes:
            by_scope[_scope(node)].append(_signature(node))
        seqs.append(by_scope)
    return {p for p in set(seqs[0]) | set(seqs[1]) if seqs[0].get(p) != seqs[1].get(p)}


def _check_options(
    model: Any, leaf_types: Any, leaf_paths: Any, depth: Any
) -> tuple[tuple[type, ...], tuple[str, ...]]:
    """Validate convert's options; a single type or path is taken as a list of one."""
    if not isinstance(model, nn.Module):
        raise OptionError(
            f"seqify.convert takes an nn.Module, got {type(model).__name__}; wrap the function in a module "
            "whose forward calls it"
        )
    name = type(model).__name__
    types = (leaf_types,) if isinstance(leaf_types, type) else tuple(leaf_types)
    bad = [t for t in types if not isinstance(t, type)]
    if bad:
        raise OptionError(f"leaf_types={leaf_types!r}: give module classes (e.g. leaf_types=[Bottleneck]), not {bad[0]!r}")
    paths = (leaf_paths,) if isinstance(leaf_paths, str) else tuple(leaf_paths)
    known = dict(model.named_modules())
    for path in paths:
        if not isinstance(path, str) or path not in known or path == "":
            children = ", ".join(repr(n) for n, _ in model.named_children()) or "none"
            raise OptionError(
                f"leaf_paths names {path!r}, which is not a submodule of {name}; give qualified names as in "
                f"model.named_modules() (its children: {children})"
            )
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise OptionError(f"depth={depth!r}: give a whole number >= 1 (1 keeps the model's children whole), or None")
    return types, paths


def convert(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    leaf_types: Sequence[type] = (),
    leaf_paths: Sequence[str] = (),
    depth: int | None = None,
    check_modes: bool = True,
) -> Sequential:
    """Flatten ``model`` into a :class:`seqify.Sequential` that computes exactly what ``model`` computes.

    Args:
        model: any ``nn.Module``. It is never modified: the layers share its parameter, buffer and leaf
            module objects.
        example_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments. With
            them, Python branches on shapes are resolved (and re-checked at run time, see ``seq.guards``)
            and skips are annotated with shapes. Without them, forwards that branch on shapes keep those
            submodules whole (``seq.opaque``).
        leaf_types / leaf_paths: module types or qualified names to keep whole as single layers
            (coarser layers), e.g. ``leaf_types=[torchvision.models.resnet.Bottleneck]``.
        depth: keep every module at this depth whole (1: the model's children).
        check_modes: also trace in the other train/eval mode to detect forwards whose graph depends on
            ``self.training``; such conversions refuse to run in the other mode.

    Returns:
        A :class:`seqify.Sequential`; ``seq(*args)`` returns what ``model(*args)`` returns.
    """
    if isinstance(model, Sequential):
        return model
    leaf_types, leaf_paths = _check_options(model, leaf_types, leaf_paths, depth)
    paths = set(leaf_paths)
    traced = trace(model, example_inputs, leaf_types=leaf_types, leaf_paths=sorted(paths), depth=depth)
    mode_dependent = False
    mode_leaves: set[str] = set()
    for _ in range(4 if check_modes else 0):
        with preserved(model):
            model.train(not traced.training)
            try:
                other = trace(model, example_inputs, leaf_types=leaf_types, leaf_paths=sorted(paths), depth=depth)
            except Exception:
                mode_dependent = True
                break
        differ = _mode_differences(traced.graph, other.graph)
        if not differ:
            break
        if "" in differ:
            mode_dependent = True
            break
        # Submodules whose traced ops depend on self.training stay whole: they follow train()/eval() live.
        mode_leaves |= differ
        paths |= differ
        traced = trace(model, example_inputs, leaf_types=leaf_types, leaf_paths=sorted(paths), depth=depth)
    for path in sorted(mode_leaves):
        if path not in {o.path for o in traced.opaque}:
            module = model.get_submodule(path)
            traced.opaque.append(Opaque(path, type(module).__name__, "its forward depends on self.training; kept whole so it follows train()/eval()"))
    plan = linearize(traced, reserved=RESERVED)
    return build(traced, plan, mode_dependent=mode_dependent)
