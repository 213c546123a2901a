"""The exported graph made into seqify's traced form: export's own checks dropped, constant inputs baked,
get_attr pointed at the source's tensors, leaf-module runs made calls again, specialised sizes guarded."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from seqify.errors import ExportError
from seqify.frontend.outside import Held, find, generator_error, outside
from seqify.model.guard import Guard, check_equal
from seqify.model.hooks import HOOK_DICTS

__all__ = ["clean", "module_calls", "shape_guards"]


_aten = torch.ops.aten


#: Checks export inserts that compute nothing (they also bake the example's device in).
_ASSERTS = {
    _aten._assert_tensor_metadata.default,
    _aten._assert_scalar.default,
    _aten.sym_constrain_range_for_size.default,
}


_MISSING = object()


def _resolve(model: nn.Module, target: str) -> Any:
    obj: Any = model
    for atom in target.split("."):
        obj = getattr(obj, atom, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _written(node: Any) -> Any:
    """The tensor an in-place op's result is (``add_(b, 1)`` returns ``b`` itself), through chains of them."""
    while (isinstance(node, fx.Node) and node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
           and node.args and node.target._schema.arguments
           and (info := node.target._schema.arguments[0].alias_info) is not None and info.is_write):
        node = node.args[0]
    return node


def _same_tensor(a: Any, b: Any) -> bool:
    return a is b or (isinstance(a, fx.Node) and isinstance(b, fx.Node) and a.op == b.op == "get_attr"
                      and a.target == b.target)


def _drop_self_copies(graph: fx.Graph) -> None:
    """Drop the write-back export appends for a buffer the forward updated in place (``self.n += 1`` records
    ``add_(n, 1)``, then ``copy_(n, add_)``): it copies the buffer onto itself, which changes nothing but
    its version, so the backward of an op that saved the updated buffer (``y * self.n``) would refuse it."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _aten.copy_.default and len(node.args) >= 2:
            dst, src = node.args[0], node.args[1]
            if _same_tensor(_written(src), dst):
                node.replace_all_uses_with(dst)
                graph.erase_node(node)


def clean(gm: fx.GraphModule, model: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[fx.Node]]:
    """Drop export's own checks, bake constant inputs, and point get_attr at the source's tensors."""
    graph = gm.graph
    constants: dict[str, Any] = {}
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
        elif node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)
    _drop_self_copies(graph)
    flat, _ = pytree.tree_flatten(((), kwargs))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):
        raise ExportError(
            f"the exported graph of {type(model).__name__} has {len(placeholders)} inputs for {len(flat)} given"
        )
    inputs: list[fx.Node] = []
    for node, value in zip(placeholders, flat):
        if isinstance(value, torch.Tensor):
            inputs.append(node)
        else:
            node.replace_all_uses_with(value)
            graph.erase_node(node)
    held: list[Held] | None = None
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        source = _resolve(model, str(node.target))
        if isinstance(source, (torch.Tensor, nn.Module)):
            continue  # the source's own parameter, buffer or module: shared, never copied
        obj = _resolve(gm, str(node.target))
        if isinstance(obj, (torch.Tensor, torch.Generator)):
            held = outside(model) if held is None else held
            hit = find(model, obj, held)
            if isinstance(obj, torch.Generator):
                raise generator_error(model, hit, obj)
            if hit is not None:
                # export lifts a tensor the model holds outside its module tree (a module in a plain list) as a
                # detached alias: the layers read the source's own tensor instead, which the source's in-place
                # changes reach (build refuses it where it requires grad)
                obj = hit.obj
        key = f"_seqify_export_{len(constants)}"
        constants[key] = obj
        node.target = key
    return constants, inputs


def _leaf(model: nn.Module, path: str) -> nn.Module | None:
    module = _resolve(model, path) if path else model
    if not isinstance(module, nn.Module) or any(True for _ in module.children()):
        return None
    if any(getattr(module, h, None) for h in HOOK_DICTS):
        return None
    if not _one_parameter(module):
        return None
    return module


def _one_parameter(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes exactly one argument, so the one tensor a run of its ops reads is that
    argument. A forward with more (even defaulted ones, BART's positional embedding ``forward(input_ids, past=0,
    position_ids=None)``) may have been called with the tensor in another place; export does not record which."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _runs(graph: fx.Graph) -> Iterator[tuple[str, str, list[fx.Node]]]:
    """Maximal runs of consecutive call nodes with the same innermost module call (key, path, nodes)."""
    current: tuple[str, str] | None = None
    nodes: list[fx.Node] = []
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        key = next(reversed(stack.items())) if node.op == "call_function" and stack else None
        here = (key[0], key[1][0]) if key else None
        if here != current:
            if current is not None and nodes:
                yield current[0], current[1], nodes
            current, nodes = here, []
        if here is not None:
            nodes.append(node)
    if current is not None and nodes:
        yield current[0], current[1], nodes


def _inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []

    def note(n: fx.Node) -> fx.Node:
        found.append(n)
        return n

    fx.node.map_arg((node.args, node.kwargs), note)
    return found


def module_calls(graph: fx.Graph, model: nn.Module) -> None:
    """A run of ops that is exactly one call of a leaf module (one tensor in, one tensor out, its own
    parameters and buffers only) becomes a call of that very module, so the layer *is* the source module."""
    keys: dict[str, int] = {}
    for key, _, _nodes in _runs(graph):
        keys[key] = keys.get(key, 0) + 1
    for key, path, nodes in list(_runs(graph)):
        module = _leaf(model, path)
        if module is None or keys[key] != 1 or not path:
            continue
        own = {id(t) for t in list(module.parameters()) + list(module.buffers())}
        inside = set(nodes)
        outer: list[fx.Node] = []
        ok = True
        for n in nodes:
            for a in _inputs(n):
                if a in inside:
                    continue
                if a.op == "get_attr":
                    ok = ok and id(_resolve(model, str(a.target))) in own
                elif a not in outer:
                    outer.append(a)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        if not ok or len(outer) != 1 or len(outputs) != 1 or not isinstance(outer[0].meta.get("val"), torch.Tensor):
            continue
        out = outputs[0]
        if not isinstance(out.meta.get("val"), torch.Tensor):
            continue
        with graph.inserting_after(out):
            call = graph.create_node("call_module", path, (outer[0],), {})
        call.meta.update(val=out.meta["val"], nn_module_stack=out.meta.get("nn_module_stack"))
        out.replace_all_uses_with(call)
        for n in reversed(nodes):
            graph.erase_node(n)


def shape_guards(graph: fx.Graph, inputs: list[fx.Node], names: list[str]) -> list[Guard]:
    """Every input dimension export specialised (all but a dynamic batch) is re-checked on each call."""
    guards: list[Guard] = []
    for node, name in zip(inputs, names):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for d, size in enumerate(val.shape):
            # A SymInt export specialised (len(x) on a batched tensor: CLIP's loss labels arange(len(logits)))
            # stays a SymInt of constant value: it is as fixed as an int, and needs its guard too.
            if isinstance(size, torch.SymInt) and not is_concrete_int(size):
                continue
            guard = Guard(f"{name}.size({d})", int(size), "torch.export specialised this dimension")
            with graph.inserting_after(node):
                size_node = graph.call_function(_aten.sym_size.int, (node, d))
            size_node.meta["val"] = int(size)
            with graph.inserting_after(size_node):
                check = graph.call_function(check_equal, (size_node, guard.expected, guard.expr, guard.where))
            check.meta["val"] = None
            guards.append(guard)
    return guards
