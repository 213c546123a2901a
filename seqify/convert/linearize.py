"""Linearize: order a traced graph into steps and decide what each carries forward and what skips.

Every tensor-producing op heads a step, in the source's execution order (so random ops draw in the
source's order and in-place ops see the values they saw there). Elements picked out of a container
stay in the step that made it. Python values (sizes, dtypes, guards) are recomputed in the step that
needs them when its inputs are at hand there, else computed as early as possible and skipped forward.

A value then travels along the steps that read it: to the very next step it is carried (tensors only);
to any later step it is stashed by the last step holding it and popped by the reader. No value is ever
threaded through a step that does not read it.
"""

from __future__ import annotations

import operator
import re
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from seqify.convert.kinds import AUX, CONST, CONTAINER, TENSOR, classify, is_projection
from seqify.errors import ConversionError, EmptyModelError
from seqify.frontend.traced import UNKNOWN, Traced, is_cache, value_of

__all__ = ["Step", "Plan", "linearize"]


@dataclass
class Step:
    """One future layer: the nodes it computes and the values it receives and passes on."""

    name: str
    role: str  # "input", "op" or "output"
    head: fx.Node | None
    nodes: list[fx.Node] = field(default_factory=list)
    carried_in: list[fx.Node] = field(default_factory=list)
    carried_out: list[fx.Node] = field(default_factory=list)
    pops: list[tuple[str, fx.Node]] = field(default_factory=list)
    stashes: list[tuple[str, fx.Node]] = field(default_factory=list)


@dataclass
class Plan:
    """Steps in order, plus how the converted model's inputs enter and its outputs leave."""

    steps: list[Step]
    kinds: dict[fx.Node, str]
    inputs: list[fx.Node]  # dynamic placeholders, in signature order
    entry: list[int]  # which inputs the first step receives, in order
    output: Any  # the source's output structure, with nodes and constants as leaves
    final: list[fx.Node]  # what the last step returns, in order
    skips: list[tuple[str, fx.Node, str, str]]  # (name, value, stashing step, popping step)


def _inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return list(dict.fromkeys(found))


def _expand_outputs(graph: fx.Graph, output: fx.Node, structure: Any, kinds: dict[fx.Node, str]) -> Any:
    """Replace containers in the output by their elements, so the last layer returns tensors."""

    def expand(node: fx.Node) -> Any:
        val = value_of(node)
        if kinds.get(node) != CONTAINER or val is UNKNOWN:
            return node
        leaves, spec = pytree.tree_flatten(val)
        paths = [p for p, _ in pytree.tree_flatten_with_path(val)[0]]
        picked = []
        for path, leaf in zip(paths, leaves):
            current = node
            for key in path:
                index = getattr(key, "idx", getattr(key, "key", getattr(key, "name", None)))
                target = getattr if isinstance(key, pytree.GetAttrKey) else operator.getitem
                with graph.inserting_before(output):
                    current = graph.call_function(target, (current, index))
            current.meta["val"] = leaf
            kinds[current] = TENSOR if isinstance(leaf, torch.Tensor) else AUX
            picked.append(current)
        return pytree.tree_unflatten(picked, spec)

    return pytree.tree_map(lambda x: expand(x) if isinstance(x, fx.Node) else x, structure)


def _step_name(node: fx.Node, scope_only: bool = False) -> str:
    if node.op == "call_module":
        base = str(node.target)
    else:
        stack = node.meta.get("nn_module_stack") or {}
        scope = next(reversed(stack.values()))[0] if stack else ""
        target = node.target if node.op == "call_method" else getattr(node.target, "__name__", "op")
        op = str(target).strip("_") or "op"
        base = scope if scope and scope_only else f"{scope}.{op}" if scope else op
    name = re.sub(r"\W", "_", base.replace(".", "_"))
    return name or "op"


def _unique(names: Iterable[str], reserved: set[str]) -> list[str]:
    seen: dict[str, int] = {}
    out: list[str] = []
    taken = set(reserved)
    for base in names:
        name = base
        while name in taken:
            seen[base] = seen.get(base, 0) + 1
            name = f"{base}_{seen[base]}"
        taken.add(name)
        out.append(name)
    return out


def _group(heads: list[fx.Node], key: Callable[[fx.Node], Any] | None) -> tuple[list[fx.Node], dict[fx.Node, fx.Node]]:
    """Consecutive heads with one (non-None) group key join the first one's step."""
    if key is None:
        return heads, {}
    firsts: list[fx.Node] = []
    joined: dict[fx.Node, fx.Node] = {}
    previous: Any = None
    for h in heads:
        k = key(h)
        if firsts and k is not None and k == previous:
            joined[h] = firsts[-1]
        else:
            firsts.append(h)
        previous = k
    return firsts, joined


def linearize(
    traced: Traced, reserved: set[str] = frozenset(), group: Callable[[fx.Node], Any] | None = None  # type: ignore[assignment]
) -> Plan:
    """Order ``traced`` into steps; with ``group``, consecutive ops of one group key share a step."""
    graph = traced.graph
    kinds = classify(graph, traced.model)
    output_node = next(n for n in graph.nodes if n.op == "output")
    structure = _expand_outputs(graph, output_node, traced.output, kinds)
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]

    heads = [
        n for n in graph.nodes
        if n.op.startswith("call") and kinds[n] in (TENSOR, CONTAINER) and not is_projection(n, kinds)
    ]
    if not heads:
        raise EmptyModelError(
            f"{type(traced.model).__name__} computes no tensor op (its forward only returns or inspects "
            "its inputs); there is nothing to convert or to pipeline"
        )
    heads, joined = _group(heads, group)
    N = len(heads)
    OUT = N
    step_of: dict[fx.Node, int] = {ph: -1 for ph in placeholders}
    computed: dict[int, list[fx.Node]] = defaultdict(list)
    for i, h in enumerate(heads):
        step_of[h] = i
    for n, first in joined.items():
        step_of[n] = step_of[first]
    for n in graph.nodes:
        if n.op.startswith("call") and is_projection(n, kinds):
            step_of[n] = step_of[n.args[0]]
    for n, s in step_of.items():
        if s >= 0:
            computed[s].append(n)

    direct: dict[int, set[fx.Node]] = defaultdict(set)
    for s, nodes in computed.items():
        for n in nodes:
            for a in _inputs(n):
                if kinds[a] not in (AUX, CONST) and step_of.get(a) != s:
                    direct[s].add(a)

    # -- Python values: recompute where needed if possible, else compute early and skip ------------
    aux_home: dict[fx.Node, int] = {}
    aux_done: dict[int, set[fx.Node]] = defaultdict(set)
    aux_received: dict[int, set[fx.Node]] = defaultdict(set)
    extra: dict[int, set[fx.Node]] = defaultdict(set)
    can_memo: dict[tuple[fx.Node, int], bool] = {}

    def consumers(u: fx.Node) -> list[int]:
        return sorted({step_of[c] for c in u.users if c in step_of})

    def home(u: fx.Node) -> int:
        if u not in aux_home:
            h = -1
            for a in _inputs(u):
                if kinds[a] == CONST:
                    continue
                h = max(h, home(a) if kinds[a] == AUX else step_of[a])
            if h < 0:
                first = consumers(u)
                h = first[0] if first else 0
            aux_home[u] = min(max(h, 0), N - 1)
        return aux_home[u]

    def can_compute(u: fx.Node, s: int) -> bool:
        key = (u, s)
        if key not in can_memo:
            ok = True
            for a in _inputs(u):
                k = kinds[a]
                if k == CONST:
                    continue
                if k == AUX:
                    ok = can_compute(a, s)
                else:
                    ok = step_of.get(a) == s or a in direct[s]
                if not ok:
                    break
            can_memo[key] = ok
        return can_memo[key]

    def compute_in(u: fx.Node, s: int) -> None:
        if u in aux_done[s]:
            return
        aux_done[s].add(u)
        for a in _inputs(u):
            k = kinds[a]
            if k == AUX:
                ensure(a, s)
            elif k != CONST and step_of.get(a) != s and a not in direct[s]:
                extra[s].add(a)

    def ensure(u: fx.Node, s: int) -> None:
        if u in aux_done[s] or u in aux_received[s]:
            return
        h = home(u)
        if can_compute(u, s) or h >= s:
            compute_in(u, s)
        else:
            compute_in(u, h)
            aux_received[s].add(u)

    aux_nodes = [n for n in graph.nodes if n.op.startswith("call") and kinds[n] == AUX]
    for u in aux_nodes:
        targets = consumers(u)
        if not u.users:
            ensure(u, home(u))
        for s in targets:
            ensure(u, s)
    for s, us in aux_done.items():
        computed[s].extend(us)

    # -- what each step reads from elsewhere -------------------------------------------------------
    reads: dict[int, set[fx.Node]] = defaultdict(set)
    for s in range(N):
        mine = set(computed[s])
        for n in computed[s]:
            for a in _inputs(n):
                if kinds[a] == CONST or a in mine:
                    continue
                if kinds[a] == AUX and a not in aux_received[s]:
                    continue
                reads[s].add(a)
        reads[s] |= extra[s] | aux_received[s]

    def output_leaf(x: Any) -> Any:
        if not isinstance(x, fx.Node):
            return x
        if kinds.get(x) == AUX:
            if value_of(x) is None:
                return None
            if is_cache(value_of(x)):
                raise ConversionError(
                    f"the model returns {x.name!r}, a {type(value_of(x)).__name__} (a key/value cache, as "
                    "transformers models return with use_cache=True); converted models return tensors: pass "
                    "use_cache=False (or set model.config.use_cache = False before converting)"
                )
            raise ConversionError(
                f"the model returns {x.name!r}, a Python value computed at run time "
                f"({value_of(x)!r} in the example); converted models return tensors: return it as a tensor "
                "or compute it outside the model"
            )
        if kinds.get(x) == CONST:
            raise ConversionError(
                f"the model returns its attribute {x.target!r} directly; return a tensor computed from it"
            )
        reads[OUT].add(x)
        return x

    structure = pytree.tree_map(output_leaf, structure)

    # -- hand-off chains ---------------------------------------------------------------------------
    carried: dict[int, list[fx.Node]] = defaultdict(list)  # from step s to s + 1
    stashes: dict[int, list[tuple[str, fx.Node]]] = defaultdict(list)
    pops: dict[int, list[tuple[str, fx.Node]]] = defaultdict(list)
    routes: list[tuple[str, fx.Node, int, int]] = []
    readers: dict[fx.Node, list[int]] = defaultdict(list)
    taken_names: dict[fx.Node, int] = {}
    for s in sorted(reads):
        for v in reads[s]:
            readers[v].append(s)
    for v in sorted(readers, key=order.__getitem__):
        holder = aux_home[v] if kinds[v] == AUX else step_of[v]
        for hop, r in enumerate(sorted(readers[v])):
            if kinds[v] == TENSOR and r == holder + 1:
                carried[holder].append(v)
            else:
                name = v.name if not taken_names.get(v) else f"{v.name}#{taken_names[v]}"
                taken_names[v] = taken_names.get(v, 0) + 1
                stashes[holder].append((name, v))
                pops[r].append((name, v))
                routes.append((name, v, holder, r))
            holder = r
    for lists in (carried, stashes, pops):
        for s in lists:
            lists[s].sort(key=lambda item: order[item[1]] if isinstance(item, tuple) else order[item])

    # -- steps, named after the source ---------------------------------------------------------------
    names = _unique([_step_name(h, group is not None and group(h) is not None) for h in heads],
                    set(reserved) | {"input", "output"})
    steps: list[Step] = []
    index: dict[int, int] = {}
    if stashes[-1]:
        index[-1] = len(steps)
        steps.append(Step(
            _unique(["input"], set(names) | set(reserved))[0], "input", None,
            carried_in=list(placeholders), carried_out=carried[-1], stashes=stashes[-1],
        ))
        entry = list(range(len(placeholders)))
    else:
        entry = [placeholders.index(p) for p in carried[-1]]
    for s, h in enumerate(heads):
        index[s] = len(steps)
        steps.append(Step(
            names[s], "op", h, nodes=sorted(computed[s], key=order.__getitem__),
            carried_in=carried[s - 1], carried_out=carried[s], pops=pops[s], stashes=stashes[s],
        ))
    finals = list(dict.fromkeys(n for n in pytree.tree_leaves(structure) if isinstance(n, fx.Node)))
    if pops[OUT]:
        index[OUT] = len(steps)
        steps.append(Step(
            _unique(["output"], set(names) | set(reserved))[0], "output", None,
            carried_in=carried[N - 1], carried_out=finals, pops=pops[OUT],
        ))
    else:
        finals = carried[N - 1]
    skips = [(name, v, steps[index[a]].name, steps[index[b]].name) for name, v, a, b in routes]
    return Plan(steps, kinds, placeholders, entry, structure, finals, skips)
