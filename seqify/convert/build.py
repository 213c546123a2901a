"""Build: emit a layer for every step (the source module itself where it fits) and assemble the Sequential."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from seqify.convert.kinds import CONST, TENSOR, module_path
from seqify.convert.linearize import Plan, Step
from seqify.frontend.fx.autograd import GRAD_MODE
from seqify.frontend.outside import Held, find, outside, registered, unregistered_error
from seqify.frontend.traced import Traced, value_of
from seqify.model.layer import Attr, Layer, Op, Ref
from seqify.model.sequential import OpaqueInfo, Sequential, SkipInfo, _Unused
from seqify.model.signature import OutputSpec
from seqify.skip.namespace import Namespace

__all__ = ["build", "RESERVED"]

#: Names a layer may not take: attributes of seqify.Sequential.
RESERVED = set(dir(Sequential)) | {
    "input_spec", "entry", "output_spec", "namespace", "skips", "opaque", "guards", "converted_training",
    "mode_dependent", "source",
}
_LAYER_RESERVED = set(dir(Layer)) | {"inputs", "ops", "outputs", "pops", "stashes", "namespaces", "code"}


class Tensors(nn.Module):
    """Buffers and constants a traced forward reads directly, shared by every layer that reads them.

    A tensor the source does not register (a plain attribute, a tensor in a list, one its forward made) is
    held with its dtype fixed: the source's ``.double()`` or ``.to(dtype)`` leaves such a tensor as it is, so
    the converted model's must too. Device moves still move it (a pipeline puts a copy where each partition
    runs); otherwise it stays the source's own object, so in-place changes to it reach both."""

    def __init__(self) -> None:
        super().__init__()
        self._fixed: set[str] = set()

    def _apply(self, fn: Any, recurse: bool = True) -> Tensors:
        fixed: set[str] = getattr(self, "_fixed", set())
        before = {name: t for name in fixed if (t := self._buffers.get(name)) is not None}
        super()._apply(fn, recurse)
        for name, t in before.items():
            moved = self._buffers[name]
            if moved is None:
                continue
            if moved.device == t.device:
                self._buffers[name] = t  # a cast: the source's own tensor, as its cast leaves it
            elif moved.dtype != t.dtype:
                self._buffers[name] = t.to(moved.device)  # a move with a cast: moved only
        return self


def _safe(name: str, taken: set[str]) -> str:
    name = re.sub(r"\W", "_", name) or "attr"
    if name[0].isdigit():
        name = f"a{name}"
    base, i = name, 0
    while name in taken or name in _LAYER_RESERVED:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def _map(a: Any, fn: Any) -> Any:
    """Apply ``fn`` to the nodes inside an fx argument, rebuilding plain tuples, lists, dicts and slices."""
    if isinstance(a, fx.Node):
        return fn(a)
    if isinstance(a, tuple):
        items = [_map(x, fn) for x in a]
        return type(a)(*items) if hasattr(a, "_fields") else tuple(items)
    if isinstance(a, list):
        return [_map(x, fn) for x in a]
    if isinstance(a, dict):
        return {k: _map(v, fn) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_map(a.start, fn), _map(a.stop, fn), _map(a.step, fn))
    return a


class _Builder:
    def __init__(self, traced: Traced, plan: Plan) -> None:
        self.traced = traced
        self.plan = plan
        self.namespace = Namespace()
        self.mine = registered(traced.model)  # the source's own parameters and buffers (what its casts reach)
        self.held: list[Held] | None = None

    def holder_attr(self, holders: dict[str, Tensors], target: str, tensor: torch.Tensor) -> tuple[Tensors, str]:
        """The layer's own holder of the tensors that the source module ``owner`` owns. Each layer has its
        own holders (holding the very same tensors), so a pipeline can give each partition's layers
        copies on that partition's device."""
        owner, _, attr = target.rpartition(".")
        holder = holders.get(owner)
        if holder is None:
            holder = holders[owner] = Tensors()
        if attr not in holder._buffers:
            persistent = False
            if target not in self.traced.constants:
                module = self.traced.model.get_submodule(owner)
                persistent = attr in module._buffers and attr not in module._non_persistent_buffers_set
            holder.register_buffer(attr, tensor, persistent=persistent)
            if id(tensor) not in self.mine:
                holder._fixed.add(attr)
        return holder, attr

    def refuse_trained(self, tensor: torch.Tensor) -> None:
        """A tensor requiring grad that the source holds outside its module tree cannot be layer state: the
        source trains it where no optimizer, ``.to()`` or ``state_dict`` sees it. (One its forward makes is
        made afresh each call: a layer may keep it.)"""
        if not tensor.requires_grad:
            return
        if self.held is None:
            self.held = outside(self.traced.model)
        held = find(self.traced.model, tensor, self.held)
        if held is not None:
            raise unregistered_error(self.traced.model, held, tensor, frontend="export")

    def layer(self, step: Step) -> nn.Module:
        bare = self.bare(step)
        if bare is not None:
            return bare
        modules: dict[str, nn.Module] = {}
        params: dict[str, nn.Parameter] = {}
        taken: set[str] = set()
        by_target: dict[str, Attr] = {}
        holders: dict[str, Tensors] = {}

        def attr(node: fx.Node) -> Attr:
            target = str(node.target)
            if target in by_target:
                return by_target[target]
            obj = self.traced.attribute(target)
            local = target.rpartition(".")[2].lstrip("_") or "attr"
            if isinstance(obj, torch.Tensor) and id(obj) not in self.mine:
                self.refuse_trained(obj)
            if isinstance(obj, nn.Parameter) and id(obj) in self.mine:
                name = _safe(local, taken)
                params[name] = obj
                ref = Attr(name)
            elif isinstance(obj, torch.Tensor):
                holder, name = self.holder_attr(holders, target, obj)
                hname = next((k for k, m in modules.items() if m is holder), None)
                if hname is None:
                    hname = _safe((target.rpartition(".")[0].replace(".", "_") or "root") + "_tensors", taken)
                    modules[hname] = holder
                ref = Attr(f"{hname}.{name}")
            elif isinstance(obj, nn.Module):
                name = _safe(local, taken)
                modules[name] = obj
                ref = Attr(name)
            else:
                raise TypeError(f"get_attr {target!r} is a {type(obj).__name__}")
            by_target[target] = ref
            return ref

        def arg(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return attr(a) if self.plan.kinds[a] == CONST else Ref(a.name)
            return a

        ops: list[Op] = []
        module_names: dict[str, str] = {}
        for node in step.nodes:
            args = tuple(_map(node.args, arg))
            kwargs = {k: _map(v, arg) for k, v in node.kwargs.items()}
            grad = node.meta.get(GRAD_MODE)
            if node.op == "call_module":
                path = module_path(node)
                target = module_names.get(path)
                if target is None:
                    target = module_names[path] = _safe(path.rpartition(".")[2], taken)
                    modules[target] = self.traced.model.get_submodule(path)
                ops.append(Op(node.name, "call_module", target, args, kwargs, grad))
            else:
                ops.append(Op(node.name, node.op, node.target, args, kwargs, grad))
        return Layer(
            inputs=[n.name for n in step.carried_in],
            ops=ops,
            outputs=[n.name for n in step.carried_out],
            pops=[((self.namespace, name), v.name) for name, v in step.pops],
            stashes=[((self.namespace, name), v.name) for name, v in step.stashes],
            modules=modules,
            parameters=params,
        )

    def bare(self, step: Step) -> nn.Module | None:
        """The source module itself, when a step is exactly one call of it on the carried tensor."""
        h = step.head
        if (
            step.role == "op" and h is not None and h.op == "call_module" and step.nodes == [h]
            and not step.pops and not step.stashes and not h.kwargs
            and len(h.args) == 1 and step.carried_in == [h.args[0]] and step.carried_out == [h]
            and self.plan.kinds[h] == TENSOR and GRAD_MODE not in h.meta  # a region's call runs in its mode
        ):
            return self.traced.model.get_submodule(module_path(h))
        return None


def _skip_info(plan: Plan) -> list[SkipInfo]:
    out = []
    for name, value, a, b in plan.skips:
        val = value_of(value)
        if isinstance(val, torch.Tensor):
            # A symbolic (dynamic batch) size is recorded as its example value.
            shape = tuple(d.node.hint if isinstance(d, torch.SymInt) else int(d) for d in val.shape)
            out.append(SkipInfo(name, a, b, shape, val.dtype, "tensor"))
        else:
            out.append(SkipInfo(name, a, b, None, None, plan.kinds[value]))
    return out


def _output_spec(plan: Plan) -> OutputSpec:
    leaves, spec = pytree.tree_flatten(plan.output)
    slots = {n: i for i, n in enumerate(plan.final)}
    return OutputSpec(spec, [(True, slots[x]) if isinstance(x, fx.Node) else (False, x) for x in leaves])


def _state_map(model: nn.Module, seq: nn.Module, unused: _Unused) -> OrderedDict[str, tuple[tuple[str, str], ...]]:
    """Every source state key -> all the places in the converted model that hold its tensor (one tensor at
    conversion; a pipeline may later give partitions on other devices copies of a read-only buffer)."""
    where: dict[int, list[tuple[str, str]]] = {}
    for path, module in seq.named_modules(remove_duplicate=False):
        for name, t in list(module._parameters.items()) + list(module._buffers.items()):
            if t is not None and (path, name) not in where.setdefault(id(t), []):
                where[id(t)].append((path, name))
    mapping: OrderedDict[str, tuple[tuple[str, str], ...]] = OrderedDict()
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) in where:
            mapping[key] = tuple(where[id(t)])
            continue
        local = re.sub(r"\W", "_", key)
        if isinstance(t, nn.Parameter):
            unused.register_parameter(local, t)
        else:
            unused.register_buffer(local, t)
        where[id(t)] = [("<unused>", local)]
        mapping[key] = tuple(where[id(t)])
    return mapping


def build(traced: Traced, plan: Plan, *, mode_dependent: bool = False, frontend: str = "fx") -> Sequential:
    """The Sequential of ``plan``'s steps; ``frontend`` made the graph, except steps headed by a node marked
    ``meta['seqify_frontend']`` (an export graph spliced into an fx graph), which that frontend made."""
    builder = _Builder(traced, plan)
    layers: OrderedDict[str, nn.Module] = OrderedDict((s.name, builder.layer(s)) for s in plan.steps)
    for layer in layers.values():
        if isinstance(layer, Layer):  # in the mode traced, as the Sequential: a layer with two programs reads it
            layer.training = traced.training
    opaque_paths = {o.path: o for o in traced.opaque}
    opaque = []
    for step in plan.steps:
        for node in step.nodes:
            key = node.target if node.op == "call_module" else node.meta.get("seqify_method")
            if key in opaque_paths:
                o = opaque_paths[key]
                opaque.append(OpaqueInfo(step.name, o.path, o.type, o.reason, o.diverged))
    unused = _Unused()
    holder = nn.Module()
    holder._modules.update(layers)
    seq = Sequential(
        layers,
        inputs=traced.inputs,
        entry=plan.entry,
        outputs=_output_spec(plan),
        namespace=builder.namespace,
        skips=_skip_info(plan),
        opaque=opaque,
        guards=traced.guards,
        state_map=_state_map(traced.model, holder, unused),
        unused=unused,
        training=traced.training,
        mode_dependent=mode_dependent,
        source=type(traced.model).__name__,
        flattened=traced.flattened,
    )
    seq.layer_paths = {step.name: _module_paths(step.nodes) for step in plan.steps}
    seq.layer_frontends = {
        step.name: step.head.meta.get("seqify_frontend", frontend) if step.head is not None else frontend
        for step in plan.steps
    }
    seq.frontend = "+".join(dict.fromkeys([frontend, *seq.layer_frontends.values()]))
    return seq


def _module_paths(nodes: list[fx.Node]) -> tuple[str, ...]:
    """The source module paths whose code a layer's nodes run, in order ('' for the model's own forward):
    what split points by module name (``seqify.compat.pipelining``) are mapped through."""
    paths: dict[str, None] = {}
    for node in nodes:
        if node.op == "call_module":
            paths[str(node.target)] = None
        elif node.op in ("call_function", "call_method"):
            stack = node.meta.get("nn_module_stack") or {}
            paths[next(reversed(stack.values()))[0] if stack else ""] = None
    return tuple(paths)
