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

    def note(n: fx.Node) -> fx.Node:
        found.append(n)
        return n

    fx.node.map_arg((node.args, node.kwargs), note)
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
        made: dict[tuple[fx.Node, Any], fx.Node] = {}  # (container, index): its element, made once
        for path, leaf in zip(paths, leaves):
            current, inner = node, val
            for key in path:
                index = getattr(key, "idx", getattr(key, "key", getattr(key, "name", None)))
                getter: Any = getattr if isinstance(key, pytree.GetAttrKey) else operator.getitem
                inner = getter(inner, index)
                if (current, index) not in made:
                    with graph.inserting_before(output):
                        element = graph.call_function(getter, (current, index))
                    element.meta["val"] = inner
                    kinds[element] = CONTAINER  # an element that holds more elements; a leaf is set below
                    made[current, index] = element
                current = made[current, index]
            kinds[current] = TENSOR if isinstance(leaf, torch.Tensor) else AUX
            picked.append(current)
        return pytree.tree_unflatten(picked, spec)

    return pytree.tree_map(lambda x: expand(x) if isinstance(x, fx.Node) else x, structure)


def _step_name(node: fx.Node, scope_only: bool = False) -> str:
    if node.op == "call_module":
        base = str(node.target)
    elif "seqify_method" in node.meta:  # a method call kept whole: named after the method
        base = str(node.meta["seqify_method"]).rstrip("()")
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


@dataclass
class _Layout:
    """What linearizing has decided so far about one traced graph; each phase below fills in its part.

    Steps are numbered 0..N-1 for the heads, -1 for the model's inputs and N (``out``) for its outputs.
    """

    graph: fx.Graph
    kinds: dict[fx.Node, str]
    structure: Any  # the output structure, containers expanded into their elements
    order: dict[fx.Node, int]
    placeholders: list[fx.Node]
    heads: list[fx.Node]
    #: the step computing each tensor node (placeholders: -1)
    step_of: dict[fx.Node, int] = field(default_factory=dict)
    computed: defaultdict[int, list[fx.Node]] = field(default_factory=lambda: defaultdict(list))
    #: non-Python values each step's own nodes take from another step
    direct: defaultdict[int, set[fx.Node]] = field(default_factory=lambda: defaultdict(set))
    #: the earliest step that can compute each Python value
    aux_home: dict[fx.Node, int] = field(default_factory=dict)
    aux_done: defaultdict[int, set[fx.Node]] = field(default_factory=lambda: defaultdict(set))
    aux_received: defaultdict[int, set[fx.Node]] = field(default_factory=lambda: defaultdict(set))
    #: values a step needs only to recompute a Python value there
    extra: defaultdict[int, set[fx.Node]] = field(default_factory=lambda: defaultdict(set))
    can_memo: dict[tuple[fx.Node, int], bool] = field(default_factory=dict)
    #: everything each step (and ``out``) takes from elsewhere
    reads: defaultdict[int, set[fx.Node]] = field(default_factory=lambda: defaultdict(set))
    carried: defaultdict[int, list[fx.Node]] = field(default_factory=lambda: defaultdict(list))  # s to s + 1
    stashes: defaultdict[int, list[tuple[str, fx.Node]]] = field(default_factory=lambda: defaultdict(list))
    pops: defaultdict[int, list[tuple[str, fx.Node]]] = field(default_factory=lambda: defaultdict(list))
    routes: list[tuple[str, fx.Node, int, int]] = field(default_factory=list)  # (name, value, stasher, popper)

    @property
    def out(self) -> int:
        return len(self.heads)


def _start(traced: Traced, group: Callable[[fx.Node], Any] | None) -> tuple[_Layout, dict[fx.Node, fx.Node]]:
    """Classify the nodes, expand returned containers, and pick the heads: every tensor-producing op that is
    not a projection out of a container heads a step (after ``group`` joins consecutive ones)."""
    graph = traced.graph
    kinds = classify(graph, traced.model)
    output_node = next(n for n in graph.nodes if n.op == "output")
    structure = _expand_outputs(graph, output_node, traced.output, kinds)
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
    order = {n: i for i, n in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return _Layout(graph, kinds, structure, order, placeholders, heads), joined


def _assign_tensor_steps(lay: _Layout, joined: dict[fx.Node, fx.Node]) -> None:
    """Decide which step computes each tensor op: its own if a head, its group's first head's if joined, the
    container's if it projects an element out of one; and which values each step takes from other steps."""
    lay.step_of.update({ph: -1 for ph in lay.placeholders})
    for i, h in enumerate(lay.heads):
        lay.step_of[h] = i
    for n, first in joined.items():
        lay.step_of[n] = lay.step_of[first]
    for n in lay.graph.nodes:
        if n.op.startswith("call") and is_projection(n, lay.kinds):
            lay.step_of[n] = lay.step_of[n.args[0]]
    for n, s in lay.step_of.items():
        if s >= 0:
            lay.computed[s].append(n)
    for s, nodes in lay.computed.items():
        for n in nodes:
            for a in _inputs(n):
                if lay.kinds[a] not in (AUX, CONST) and lay.step_of.get(a) != s:
                    lay.direct[s].add(a)


def _place_python_values(lay: _Layout) -> None:
    """Decide where each Python value is computed: in every step that reads it when its inputs are at hand
    there, else once in its home step (the earliest with all its inputs), whence it is skipped forward."""
    for u in (n for n in lay.graph.nodes if n.op.startswith("call") and lay.kinds[n] == AUX):
        targets = _consumers(lay, u)
        if not u.users:
            _ensure(lay, u, _home(lay, u))
        for s in targets:
            _ensure(lay, u, s)
    for s, us in lay.aux_done.items():
        lay.computed[s].extend(us)


def _consumers(lay: _Layout, u: fx.Node) -> list[int]:
    return sorted({lay.step_of[c] for c in u.users if c in lay.step_of})


def _home(lay: _Layout, u: fx.Node) -> int:
    """The earliest step holding all of ``u``'s inputs (its first reader's if it has none)."""
    if u not in lay.aux_home:
        h = -1
        for a in _inputs(u):
            if lay.kinds[a] == CONST:
                continue
            h = max(h, _home(lay, a) if lay.kinds[a] == AUX else lay.step_of[a])
        if h < 0:
            first = _consumers(lay, u)
            h = first[0] if first else 0
        lay.aux_home[u] = min(max(h, 0), lay.out - 1)
    return lay.aux_home[u]


def _can_compute(lay: _Layout, u: fx.Node, s: int) -> bool:
    """Whether step ``s`` has every input of ``u`` without receiving anything extra."""
    key = (u, s)
    if key not in lay.can_memo:
        ok = True
        for a in _inputs(u):
            k = lay.kinds[a]
            if k == CONST:
                continue
            if k == AUX:
                ok = _can_compute(lay, a, s)
            else:
                ok = lay.step_of.get(a) == s or a in lay.direct[s]
            if not ok:
                break
        lay.can_memo[key] = ok
    return lay.can_memo[key]


def _compute_in(lay: _Layout, u: fx.Node, s: int) -> None:
    if u in lay.aux_done[s]:
        return
    lay.aux_done[s].add(u)
    for a in _inputs(u):
        k = lay.kinds[a]
        if k == AUX:
            _ensure(lay, a, s)
        elif k != CONST and lay.step_of.get(a) != s and a not in lay.direct[s]:
            lay.extra[s].add(a)


def _ensure(lay: _Layout, u: fx.Node, s: int) -> None:
    """Make Python value ``u`` available in step ``s``: recomputed there, or received from its home."""
    if u in lay.aux_done[s] or u in lay.aux_received[s]:
        return
    h = _home(lay, u)
    if _can_compute(lay, u, s) or h >= s:
        _compute_in(lay, u, s)
    else:
        _compute_in(lay, u, h)
        lay.aux_received[s].add(u)


def _collect_reads(lay: _Layout) -> None:
    """Decide what each step reads from elsewhere: inputs of its nodes it does not compute, Python values it
    receives rather than recomputes, and what it needs to recompute the others."""
    for s in range(lay.out):
        mine = set(lay.computed[s])
        for n in lay.computed[s]:
            for a in _inputs(n):
                if lay.kinds[a] == CONST or a in mine:
                    continue
                if lay.kinds[a] == AUX and a not in lay.aux_received[s]:
                    continue
                lay.reads[s].add(a)
        lay.reads[s] |= lay.extra[s] | lay.aux_received[s]


def _read_outputs(lay: _Layout) -> None:
    """The output step reads every tensor the model returns; returning a Python value or an attribute
    directly cannot be converted (the error says what to do instead)."""

    def output_leaf(x: Any) -> Any:
        if not isinstance(x, fx.Node):
            return x
        if lay.kinds.get(x) == AUX:
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
        if lay.kinds.get(x) == CONST:
            raise ConversionError(
                f"the model returns its attribute {x.target!r} directly; return a tensor computed from it"
            )
        lay.reads[lay.out].add(x)
        return x

    lay.structure = pytree.tree_map(output_leaf, lay.structure)


def _route(lay: _Layout) -> None:
    """Decide how each value reaches its readers, hop by hop from the last step holding it: a tensor read by
    the very next step is carried; anything else is stashed by the holder and popped by the reader."""
    readers: dict[fx.Node, list[int]] = defaultdict(list)
    taken_names: dict[fx.Node, int] = {}
    for s in sorted(lay.reads):
        for v in lay.reads[s]:
            readers[v].append(s)
    for v in sorted(readers, key=lay.order.__getitem__):
        holder = lay.aux_home[v] if lay.kinds[v] == AUX else lay.step_of[v]
        for r in sorted(readers[v]):
            if lay.kinds[v] == TENSOR and r == holder + 1:
                lay.carried[holder].append(v)
            else:
                name = v.name if not taken_names.get(v) else f"{v.name}#{taken_names[v]}"
                taken_names[v] = taken_names.get(v, 0) + 1
                lay.stashes[holder].append((name, v))
                lay.pops[r].append((name, v))
                lay.routes.append((name, v, holder, r))
            holder = r
    order = lay.order
    for lists in (lay.carried, lay.stashes, lay.pops):
        for s in lists:
            lists[s].sort(key=lambda item: order[item[1]] if isinstance(item, tuple) else order[item])


def _plan(lay: _Layout, reserved: set[str], group: Callable[[fx.Node], Any] | None) -> Plan:
    """Name the steps after the source and add an input step (only if the inputs are stashed) and an output
    step (only if an output is popped)."""
    names = _unique([_step_name(h, group is not None and group(h) is not None) for h in lay.heads],
                    set(reserved) | {"input", "output"})
    steps: list[Step] = []
    index: dict[int, int] = {}
    carried, stashes, pops, placeholders = lay.carried, lay.stashes, lay.pops, lay.placeholders
    if stashes[-1]:
        index[-1] = len(steps)
        steps.append(Step(
            _unique(["input"], set(names) | set(reserved))[0], "input", None,
            carried_in=list(placeholders), carried_out=carried[-1], stashes=stashes[-1],
        ))
        entry = list(range(len(placeholders)))
    else:
        entry = [placeholders.index(p) for p in carried[-1]]
    for s, h in enumerate(lay.heads):
        index[s] = len(steps)
        steps.append(Step(
            names[s], "op", h, nodes=sorted(lay.computed[s], key=lay.order.__getitem__),
            carried_in=carried[s - 1], carried_out=carried[s], pops=pops[s], stashes=stashes[s],
        ))
    last = lay.out - 1
    finals = list(dict.fromkeys(n for n in pytree.tree_leaves(lay.structure) if isinstance(n, fx.Node)))
    if pops[lay.out]:
        index[lay.out] = len(steps)
        steps.append(Step(
            _unique(["output"], set(names) | set(reserved))[0], "output", None,
            carried_in=carried[last], carried_out=finals, pops=pops[lay.out],
        ))
    else:
        finals = carried[last]
    skips = [(name, v, steps[index[a]].name, steps[index[b]].name) for name, v, a, b in lay.routes]
    return Plan(steps, lay.kinds, placeholders, entry, lay.structure, finals, skips)


def linearize(
    traced: Traced, reserved: set[str] = frozenset(), group: Callable[[fx.Node], Any] | None = None  # type: ignore[assignment]
) -> Plan:
    """Order ``traced`` into steps; with ``group``, consecutive ops of one group key share a step."""
    lay, joined = _start(traced, group)
    _assign_tensor_steps(lay, joined)
    _place_python_values(lay)
    _collect_reads(lay)
    _read_outputs(lay)
    _route(lay)
    return _plan(lay, reserved, group)
