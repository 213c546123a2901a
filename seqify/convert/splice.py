"""Splice: submodules fx could not trace, captured by torch.export and inlined into the fx graph (auto per
submodule)."""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from seqify.convert.modes import exported_mode_dependent
from seqify.frontend.fx.autograd import GRAD_MODE
from seqify.frontend.preserve import preserved
from seqify.frontend.real import record_inputs
from seqify.frontend.traced import Opaque, Traced, caller
from seqify.model.guard import Guard, check_bool, check_equal
from seqify.model.hooks import HOOK_DICTS

__all__ = ["Spliced", "candidates", "copied", "splice", "opaque_with", "FRONTEND", "EXPORT"]

#: ``node.meta[FRONTEND]`` is EXPORT on the nodes an export graph brought into an fx graph.
FRONTEND = "seqify_frontend"
EXPORT = "export"


@dataclass(frozen=True)
class Spliced:
    """A submodule call that fx kept whole, now made of its torch.export graph."""

    path: str
    type: str
    reason: str  # why fx could not trace it
    mode_dependent: bool  # its export graph differs between train and eval mode


class _Refused(Exception):
    """This call cannot be spliced (the reason says why); it stays one opaque layer."""


def _inside(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    module = model.get_submodule(path)
    return [(f"{path}.{p}" if p else path, m) for p, m in module.named_modules()]


def _excluded(model: nn.Module, path: str, leaf_types: tuple[type, ...], leaf_paths: tuple[str, ...],
              depth: int | None) -> bool:
    """A module inside ``path`` has hooks, or convert's options ask to keep it whole: export would flatten it."""
    for p, m in _inside(model, path):
        if p != path and any(getattr(m, h, None) for h in HOOK_DICTS):
            return True
        too_deep = depth is not None and p.count(".") + 1 >= depth
        if p != path and (isinstance(m, leaf_types) or p in leaf_paths or too_deep):
            return True
    return False


def candidates(traced: Traced, leaf_types: tuple[type, ...] = (), leaf_paths: tuple[str, ...] = (),
               depth: int | None = None) -> list[fx.Node]:
    """The opaque call nodes whose module fx could not trace through, which export may capture instead."""
    why = {o.path: o for o in traced.opaque if o.untraceable}
    return [
        n for n in traced.graph.nodes
        if n.op == "call_module" and n.target in why and "seqify_call" in n.meta
        and not _excluded(traced.model, str(n.target), leaf_types, leaf_paths, depth)
    ]


def copied(traced: Traced) -> Traced:
    """A copy of ``traced`` whose graph can change without touching the original's."""
    graph = fx.Graph()
    nodes: dict[fx.Node, fx.Node] = {}
    for node in traced.graph.nodes:
        nodes[node] = graph.node_copy(node, lambda n: nodes[n])
    output = pytree.tree_map(lambda x: nodes[x] if isinstance(x, fx.Node) else x, traced.output)
    return dataclasses.replace(
        traced, graph=graph, constants=dict(traced.constants), opaque=list(traced.opaque),
        guards=list(traced.guards), output=output, flattened=list(traced.flattened),
    )


def _projection(user: fx.Node, node: fx.Node) -> Any:
    """The constant key of ``user`` = ``node[key]`` or ``getattr(node, key)``; raises where it is another use."""
    if (
        user.op == "call_function" and user.target in (operator.getitem, builtins.getattr) and len(user.args) == 2
        and user.args[0] is node and not user.kwargs and not isinstance(user.args[1], fx.Node)
    ):
        return user.args[1]
    target = getattr(user.target, "__name__", user.target)
    raise _Refused(f"its result is used whole by {user.name} ({user.op} {target})")


def _uses(node: fx.Node, structure: Any, output: bool) -> list[tuple[fx.Node, Any]]:
    """Each use of ``node`` (a projection on the call's result, or on a piece of it) and the piece of the
    export graph's ``structure`` it picks; refuses other uses (the model's output takes the whole result)."""
    found: list[tuple[fx.Node, Any]] = []
    for user in node.users:
        if user.op == "output" and output:
            continue
        key = _projection(user, node)
        try:
            piece = operator.getitem(structure, key) if user.target is operator.getitem else getattr(structure, key)
        except Exception as e:
            raise _Refused(f"{user.name} picks {key!r}, which the export graph's output does not have") from e
        found.append((user, piece))
        if not isinstance(piece, fx.Node) and any(isinstance(x, fx.Node) for x in pytree.tree_leaves(piece)):
            found += _uses(user, piece, False)
    return found


def _arguments(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by parameter name, in signature order."""
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise _Refused(f"its call does not bind to {type(module).__name__}.forward: {e}") from e
    return dict(bound.arguments)


def _inputs(real: dict[str, Any], given: dict[str, Any]) -> list[fx.Node]:
    """The fx nodes that feed the export graph's tensor inputs, in its placeholder order (signature order,
    flattened); every other argument must be a constant of the fx graph, which export bakes in."""
    if set(real) != set(given):
        raise _Refused("the traced call and the real call bind different arguments")
    feeds: list[fx.Node] = []
    for name, value in real.items():
        leaves, spec = pytree.tree_flatten(value)
        ours, our_spec = pytree.tree_flatten(given[name])
        tensors = [isinstance(x, torch.Tensor) for x in leaves]
        if not any(tensors):
            if any(isinstance(x, fx.Node) for x in ours):
                raise _Refused(f"argument {name!r} is a Python value computed at run time; export would bake it in")
            continue
        if isinstance(value, torch.Tensor) and isinstance(given[name], fx.Node):
            feeds.append(given[name])
        elif our_spec == spec and all(isinstance(x, fx.Node) for x in ours) and all(tensors):
            feeds.extend(ours)
        else:
            raise _Refused(f"argument {name!r} is a container the traced call does not spell out element by element")
    return feeds


def _batch_of_one(example_inputs: Any) -> bool:
    first = next((t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    return first is not None and first.shape[0] == 1


def _refuse_batch_of_one(exported: Traced) -> None:
    """With an example batch of 1, export fixes the batch dimension at 1 (it frees only larger ones): the
    opaque layer ran any batch, and micro-batches of a pipeline would be refused, so the call stays whole."""
    fixed = [g.expr for g in exported.guards if g.expr.endswith(".size(0)") and g.expected == 1]
    if fixed:
        raise _Refused(f"export fixes {fixed[0]} to the example's 1, so only a batch of 1 would run; pass "
                       "example_inputs with a batch of 2 or more to have it captured")


def _key(path: str) -> str:
    return re.sub(r"\W", "_", path)


def _splice_one(traced: Traced, node: fx.Node, exported: Traced, feeds: list[fx.Node], index: int) -> None:
    """Copy ``exported``'s graph in before ``node`` (the ``index``-th spliced call) and point every use of
    ``node`` at the piece of the export graph's output it picks."""
    graph = traced.graph
    path = str(node.target)
    placeholders = [n for n in exported.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(feeds):
        raise _Refused(f"the export graph takes {len(placeholders)} tensors, the call passes {len(feeds)}")
    in_output = any(x is node for x in pytree.tree_leaves(traced.output))
    tensor = isinstance(exported.output, fx.Node)  # one tensor: every use takes the export graph's result
    uses = [] if tensor else _uses(node, exported.output, in_output)  # a refusal leaves the graph as it was
    copies: dict[fx.Node, fx.Node] = dict(zip(placeholders, feeds))
    outer = dict(node.meta.get("nn_module_stack") or {})
    if outer and next(reversed(outer.values()))[0] == path:
        outer.popitem()  # the call's own entry: the export graph's root entry stands for it
    with graph.inserting_before(node):
        for n in exported.graph.nodes:
            if n.op not in ("placeholder", "output"):
                copies[n] = _copy(traced, n, copies, exported.constants, path, index, outer)
                if GRAD_MODE in node.meta:  # the call sat in a grad-mode region: so do the ops that replace it
                    copies[n].meta[GRAD_MODE] = node.meta[GRAD_MODE]

    def mapped(x: Any) -> Any:
        return pytree.tree_map(lambda v: copies[v] if isinstance(v, fx.Node) else v, x)

    if tensor:
        node.replace_all_uses_with(copies[exported.output])
    # The model's output may hold the call's result or projections of it (an output's .hidden_states that
    # the export graph returns as None): each becomes what it picks, and the output node reads the new nodes.
    picked = {user: mapped(piece) for user, piece in uses}
    if in_output:
        picked[node] = mapped(exported.output)
    leaves = pytree.tree_leaves(traced.output)
    if any(isinstance(x, fx.Node) and x in picked for x in leaves):
        traced.output = pytree.tree_map(lambda x: picked[x] if isinstance(x, fx.Node) and x in picked else x,
                                        traced.output)
        output_node = next(n for n in graph.nodes if n.op == "output")
        output_node.args = (tuple(x for x in pytree.tree_leaves(traced.output) if isinstance(x, fx.Node)),)
    for user, _ in reversed(uses):  # innermost projections first
        value = picked[user]
        if isinstance(value, fx.Node) or not any(isinstance(x, fx.Node) for x in pytree.tree_leaves(value)):
            user.replace_all_uses_with(value)
        graph.erase_node(user)
    graph.erase_node(node)
    traced.flattened += [(f"{path}.{p}" if p else path, m) for p, m in exported.flattened]


def _copy(traced: Traced, n: fx.Node, copies: dict[fx.Node, fx.Node], constants: dict[str, Any], path: str,
          index: int, outer: dict[str, Any]) -> fx.Node:
    """One export-graph node in the fx graph: targets and module paths under ``path``, constants renamed,
    guards named after the submodule, and marked as made by the export frontend."""
    new = traced.graph.node_copy(n, lambda a: copies[a])
    if n.op == "get_attr":
        target = str(n.target)
        if target in constants:
            key = f"{target}_{_key(path)}_{index}"
            traced.constants[key] = constants[target]
            new.target = key
        else:
            new.target = f"{path}.{target}"
    elif n.op == "call_module":
        new.target = f"{path}.{n.target}"
    elif n.target in (check_bool, check_equal):
        value, expected, expr, where = new.args
        assert isinstance(where, str)  # a guard call's last argument is the text naming its place
        new.args = (value, expected, f"{path}: {expr}", where)
        traced.guards.append(Guard(f"{path}: {expr}", expected, where))
    stack = dict(outer)
    for k, (p, t) in (n.meta.get("nn_module_stack") or {}).items():
        stack[f"{path}@{index}:{k}"] = (f"{path}.{p}" if p else path, t)
    new.meta["nn_module_stack"] = stack
    new.meta[FRONTEND] = EXPORT
    return new


def splice(
    traced: Traced, example_inputs: Any, nodes: list[fx.Node], *, check_modes: bool
) -> tuple[list[Spliced], dict[str, str]]:
    """Replace each opaque call in ``nodes`` (of ``traced``, changed in place) by its submodule's torch.export
    graph, captured on the arguments that call gets when the source runs on ``example_inputs``.

    Returns what was spliced, and for each submodule whose call stays opaque a note saying why.
    """
    from seqify.frontend.export.capture import export_trace

    model = traced.model
    wanted = {(str(n.target), int(n.meta["seqify_call"])) for n in nodes}
    real = record_inputs(model, caller(model, example_inputs), lambda: preserved(model), wanted)
    why = {o.path: o for o in traced.opaque}
    done: list[Spliced] = []
    failed: dict[str, str] = {}
    for index, node in enumerate(nodes):
        path = str(node.target)
        module = model.get_submodule(path)
        try:
            call = real.get((path, int(node.meta["seqify_call"])))
            if call is None:
                raise _Refused("the source did not make this call when run on the example")
            arguments = _arguments(module, *call)
            feeds = _inputs(arguments, _arguments(module, tuple(node.args), dict(node.kwargs)))
            exported = export_trace(module, arguments)
            if _batch_of_one(example_inputs):
                _refuse_batch_of_one(exported)
            mode_dependent = check_modes and exported_mode_dependent(module, exported.graph, arguments)
            _splice_one(traced, node, exported, feeds, index)
        except Exception as e:  # the call stays opaque; the reason goes into the summary
            first = str(e).splitlines()[0] if str(e) else ""
            cause = first if isinstance(e, _Refused) else f"{type(e).__name__}: {first}"
            failed[path] = f"torch.export could not capture it either ({cause})"
            continue
        done.append(Spliced(path, why[path].type, why[path].reason, mode_dependent))
    called = {str(n.target) for n in traced.graph.nodes if n.op == "call_module"}
    traced.opaque = [o for o in traced.opaque if o.path in called]
    return done, failed


def opaque_with(opaque: list[Opaque], notes: dict[str, str]) -> list[Opaque]:
    """``opaque`` with a note (why it was not made by the export frontend) added to the entries it names."""
    return [dataclasses.replace(o, reason=f"{o.reason}; {notes[o.path]}") if o.path in notes else o for o in opaque]
