"""torch.export frontend: a non-strict export graph in the traced form that convert's linearize and build consume."""

from __future__ import annotations

import copyreg
import inspect
import io
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from seqify.errors import ConversionError, ExampleInputError, ExportError, HookError, SeqifyError, StatefulForwardError
from seqify.frontend.export.autograd import Watch, refuse_autograd
from seqify.frontend.export.hf_masks import causal_skip
from seqify.frontend.export.regions import graphs as regions
from seqify.frontend.export.regions import neutral_autocast, prepare_regions
from seqify.frontend.fx.trace import Traced, _error_site, _first_line
from seqify.frontend.grad_watch import watching
from seqify.frontend.outside import Held, find, generator_error, outside
from seqify.frontend.preserve import preserved
from seqify.frontend.real import raises_itself, source_error
from seqify.frontend.reseeds import Reseed, reseeds
from seqify.model.guard import Guard, check_equal
from seqify.model.hooks import HOOK_DICTS, user_hooks
from seqify.model.signature import EMPTY, InputSpec, Param, bind_examples

__all__ = ["export_trace"]

_aten = torch.ops.aten


def aten_op(name: str, overload: str, namespace: str = "aten") -> Any:
    """The ATen operator ``namespace::name.overload``: how a saved converted model finds its ops again."""
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _reduce_op(op: torch._ops.OpOverload) -> tuple[Any, tuple[str, str, str]]:
    return aten_op, (op._schema.name.split("::")[1], op._overloadname, op.namespace)


# Layers made from export graphs call ATen operators, which torch cannot pickle: save them by name.
copyreg.pickle(torch._ops.OpOverload, _reduce_op)
#: Checks export inserts that compute nothing (they also bake the example's device in).
_ASSERTS = {
    _aten._assert_tensor_metadata.default,
    _aten._assert_scalar.default,
    _aten.sym_constrain_range_for_size.default,
}


def _bind(model: nn.Module, example_inputs: Any) -> tuple[list[Param], dict[str, Any], dict[str, Any]]:
    """Bind example inputs to ``model.forward``: params for the InputSpec, export kwargs in signature order,
    and dynamic shapes (dim 0 of every tensor is one shared batch dimension)."""
    name = type(model).__name__
    sig = inspect.signature(model.forward)
    given = bind_examples(model.forward, name, example_inputs)
    batch = torch.export.Dim.AUTO  # export infers the batch range; a batch it cannot free stays fixed (guarded)
    params: list[Param] = []
    kwargs: dict[str, Any] = {}
    dynamic: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.kind == inspect.Parameter.VAR_KEYWORD and isinstance(given.get(p.name), dict):
            extra = given[p.name]  # transformers 5 takes output_hidden_states=... through **kwargs
            dynamic[p.name] = {key: None for key in extra}  # export matches dynamic shapes to the signature
            continue
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if given.get(p.name):
                raise ExampleInputError(
                    f"example_inputs pass {sorted(given[p.name]) if isinstance(given[p.name], dict) else 'extra values'} "
                    f"through {name}.forward's *{'*' if p.kind == inspect.Parameter.VAR_KEYWORD else ''}{p.name}; "
                    "seqify converts named parameters: pass only the forward's named parameters, or wrap the model "
                    "in a module whose forward names them"
                )
            continue
        if p.kind == inspect.Parameter.POSITIONAL_ONLY:
            raise ExampleInputError(f"{name}.forward has the positional-only parameter {p.name!r}; wrap the model in a module whose forward takes it by name")
        default = EMPTY if p.default is inspect.Parameter.empty else p.default
        if p.name not in given:
            if default is EMPTY:
                raise ExampleInputError(f"example_inputs miss the required argument {p.name!r} of {name}.forward")
            params.append(Param(p.name, int(p.kind), default, dynamic=False, baked=(default,)))
            continue
        value = given[p.name]
        leaves, spec = pytree.tree_flatten(value)
        if isinstance(value, torch.Tensor):
            params.append(Param(p.name, int(p.kind), default, dynamic=True))
        elif any(isinstance(x, torch.Tensor) for x in leaves):
            if not all(isinstance(x, torch.Tensor) for x in leaves):
                raise ExampleInputError(
                    f"argument {p.name!r} of {name}.forward mixes tensors with other values; pass the non-tensor "
                    "values as separate arguments"
                )
            params.append(Param(p.name, int(p.kind), default, dynamic=True, spec=spec,
                                baked=tuple(None for _ in leaves), tensor_leaves=tuple(True for _ in leaves)))
        else:
            params.append(Param(p.name, int(p.kind), default, dynamic=False, baked=(value,)))
        kwargs[p.name] = value
        dynamic[p.name] = pytree.tree_map(
            lambda x: {0: batch} if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] > 1 else None, value
        ) if isinstance(value, (torch.Tensor, tuple, list, dict)) else None
    for key, value in extra.items():
        # A keyword the forward takes through **kwargs: a value baked into the conversion, which every call
        # must pass again (its default is the forward's own, unknown here); tensors there are refused.
        if any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value)):
            raise ExampleInputError(
                f"example_inputs pass the tensor {key!r} through {name}.forward's **kwargs; seqify converts tensors "
                "of named parameters: wrap the model in a module whose forward names it"
            )
        params.append(Param(key, int(inspect.Parameter.KEYWORD_ONLY), EMPTY, dynamic=False, baked=(value,)))
        kwargs[key] = value
    return params, kwargs, dynamic


def _refuse_cache(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """A key/value cache is state carried between calls: a pipeline cannot split it. Refuse it up front."""
    name = type(model).__name__
    if kwargs.get("past_key_values") is not None:
        raise ExampleInputError(
            f"example_inputs pass past_key_values to {name}: seqify converts the model for whole-sequence "
            "forwards (training, prefill); pass use_cache=False and no past_key_values"
        )
    if kwargs.get("use_cache"):
        raise ExampleInputError(_CACHE.format(name=name, source="example_inputs"))


_CACHE = (
    "{name} would return a key/value cache (use_cache is on, from {source}): a cache is state kept between "
    "calls, which a converted model cannot return. Pass use_cache=False in example_inputs (and to every call), "
    "or set model.config.use_cache = False before converting"
)


def _refuse_cache_output(model: nn.Module, structure: Any, spec: Any) -> None:
    """A cache object in the output (use_cache from the model's config) is refused like an explicit one."""
    past = structure.get("past_key_values") if isinstance(structure, dict) else None
    if past is not None or "Cache" in str(spec):
        raise ExampleInputError(_CACHE.format(name=type(model).__name__, source="model.config.use_cache"))


@contextmanager
def _writes(model: nn.Module) -> Iterator[list[tuple[str, Any, Any]]]:
    """Record the plain attributes (not parameters, buffers or submodules) the forward changes on the model's
    modules, tensors included (export itself restores them)."""
    paths = {id(m): p for p, m in model.named_modules()}
    seen: list[tuple[str, Any, Any]] = []
    original = nn.Module.__setattr__

    def setattr_(self: nn.Module, name: str, value: Any) -> None:
        if (id(self) in paths and not name.startswith("_") and name != "training"
                and name not in self._parameters and name not in self._buffers and name not in self._modules):
            old = self.__dict__.get(name, _MISSING)
            if old is not value and not isinstance(value, nn.Module) and not _same(old, value):
                seen.append((f"{paths[id(self)]}.{name}".lstrip("."), old, value))
        original(self, name, value)

    nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        nn.Module.__setattr__ = original  # type: ignore[method-assign]


def _refuse_reseeds(model: nn.Module, seeded: list[Reseed]) -> None:
    """A reseed inside forward runs once, while exporting: the graph has no such op, so a converted model
    would never reseed and every draw after it would differ. Refused; fx keeps a submodule that does it whole."""
    if not seeded:
        return
    first = seeded[0]
    where = first.where(model)
    fix = ("seed before calling the model instead of inside forward" if not first.module else
           "convert with frontend='fx' (or 'auto'), which keeps a submodule that reseeds whole as one layer, or seed "
           "before calling the model instead of inside forward")
    raise StatefulForwardError(
        f"{where} reseeds torch's random number generator ({first.call} at {first.site}) while it runs: the export "
        "frontend runs that call once, while capturing, and records no op for it, so a converted model would never "
        f"reseed and every random draw after it (dropout, sampling) would differ from the source's. What to do: {fix}"
    )


def _refuse_writes(model: nn.Module, kwargs: dict[str, Any], seen: list[tuple[str, Any, Any]]) -> None:
    """A forward that sets an attribute it read before (a step counter, a state carried between calls) would
    have the value seen at conversion baked in: refused. One that always writes an attribute before reading it
    (RecurrentGemma's recurrent state without a cache: reset, then computed, every call) computes it afresh
    each call, as the graph does: kept."""
    if not seen or _fresh_each_call(model, kwargs, {where for where, _, _ in seen}):
        return
    where, old, value = seen[0]
    raise ConversionError(
        f"{type(model).__name__}: forward writes the attribute {where} ({_shown(old)} -> {_shown(value)}) after "
        "reading the value an earlier call left; a converted model would compute every call with the value seen "
        "at conversion. Keep the value in a buffer (register_buffer, updated in place), or convert with "
        "frontend='fx', which refuses or keeps such modules whole"
    )


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "unset"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return repr(value)


class _Unread:
    """Stands in for an attribute's value from before a call: reading it in any way raises."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"read of a value from before the call ({name})")

    def __bool__(self) -> bool:
        raise TypeError("read of a value from before the call")

    def __eq__(self, other: object) -> bool:
        raise TypeError("read of a value from before the call")

    __hash__ = None  # type: ignore[assignment]


def _fresh_each_call(model: nn.Module, kwargs: dict[str, Any], written: set[str]) -> bool:
    """Whether the forward computes the same with the ``written`` attributes (``module.path.name``)
    unreadable as with their values from before: then it writes each before reading it."""
    def run(hide: bool) -> Any:
        with preserved(model), torch.random.fork_rng(devices=[]), torch.no_grad():
            if hide:
                for where in written:
                    owner, _, name = where.rpartition(".")
                    (model.get_submodule(owner) if owner else model).__dict__[name] = _Unread()
            torch.manual_seed(0)
            return model(**kwargs)

    try:
        before, hidden = run(False), run(True)
    except Exception:
        return False
    a, spec_a = pytree.tree_flatten(before)
    b, spec_b = pytree.tree_flatten(hidden)
    if spec_a != spec_b:
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
               else type(x) is type(y) and _same(x, y) for x, y in zip(a, b))


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


@contextmanager
def _quiet() -> Iterator[None]:
    """torch.export logs each failed guard with the graph so far; seqify's own error says what matters."""
    names = [n for n in logging.root.manager.loggerDict if n == "torch" or n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with redirect_stderr(io.StringIO()):  # a failed export also prints its partial graph to stderr
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _export(model: nn.Module, kwargs: dict[str, Any], dynamic: dict[str, Any]) -> torch.export.ExportedProgram:
    name = type(model).__name__
    last: Exception | None = None
    for shapes in (dynamic, None):  # a batch dimension the model fixes falls back to static shapes (guarded)
        watch = Watch()
        with preserved(model), torch.random.fork_rng(devices=[]), _writes(model) as seen, reseeds(model) as seeded:
            try:
                # captured with gradients on, as the source trains: export records the regions that turn them
                # off (and the layers run them so), whatever the mode convert is called in
                with _quiet(), neutral_autocast(model, kwargs), causal_skip(kwargs), torch.enable_grad(), \
                        watching(watch):
                    ep = torch.export.export(model, (), kwargs, strict=False, dynamic_shapes=shapes)
            except SeqifyError:
                raise
            except Exception as e:
                refuse_autograd(model, watch)
                last = e
                continue
        _refuse_reseeds(model, seeded)
        refuse_autograd(model, watch)
        _refuse_writes(model, kwargs, seen)
        return ep
    assert last is not None
    failed = source_error(model, lambda: model(**kwargs), lambda: preserved(model))
    if failed is not None:  # the example inputs are wrong (BEiT's bool_masked_pos without a mask token)
        raise raises_itself(name, failed) from failed
    config = getattr(model, "config", None)
    if "use_cache" not in kwargs and getattr(config, "use_cache", False) and "use_cache" in inspect.signature(model.forward).parameters:
        raise ExampleInputError(_CACHE.format(name=name, source="model.config.use_cache")) from last
    site = _error_site(last)
    drawn = _generator_on(model, site)
    if drawn is not None:  # export fails on the draw itself (sizes from a symbolic batch): say what is wrong
        raise generator_error(model, drawn, drawn.obj) from last
    raise ExportError(
        f"torch.export cannot capture {name}.forward: {_first_line(last)}"
        + (f"\n  at {site}" if site else "")
        + "\nWhat to do: pass example_inputs the model accepts as a whole (a dict of keyword arguments "
        "works for transformers models); keep data-dependent code (branches on tensor values) in a submodule "
        "and use frontend='fx', which keeps such submodules whole"
        + _hints(model, kwargs, site, last)
    ) from last


def _generator_on(model: nn.Module, site: str) -> Held | None:
    """A private generator the model holds whose attribute the failing line reads (``generator=self.gen``)."""
    code = site.partition(" (")[2]
    for held in outside(model):
        if isinstance(held.obj, torch.Generator) and re.search(rf"\.{re.escape(held.where.rpartition('.')[2])}\b", code):
            return held
    return None


def _hints(model: nn.Module, kwargs: dict[str, Any], site: str, error: Exception) -> str:
    """What a failed capture's own site suggests: an example input read on the failing line (a check or loss
    on labels=) can stay out of the converted model; a data-dependent branch in train mode may be a random
    draw (LayerDrop) that eval mode skips."""
    code = site.partition(" (")[2]
    read = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and re.search(rf"\b{re.escape(k)}\b", code)]
    hints = []
    if read:
        hints.append(f"the failing line reads the example input {read[0]}=: leave it out of example_inputs and "
                     "compute what needs it (a loss from labels=) on the converted model's output")
    if model.training and "data-dependent" in str(error):
        hints.append("in train mode, a branch on a random draw (LayerDrop: config.layerdrop > 0) cannot be "
                     "captured: convert in eval mode, or set the drop probability to 0 to train")
    return "".join(f"; {h}" for h in hints)


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


def _clean(gm: fx.GraphModule, model: nn.Module, kwargs: dict[str, Any]) -> tuple[dict[str, Any], list[fx.Node]]:
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
        raise ExportError(f"the exported graph of {type(model).__name__} has {len(placeholders)} inputs for {len(flat)} given")
    inputs: list[fx.Node] = []
    for node, value in zip(placeholders, flat):
        if isinstance(value, torch.Tensor):
            inputs.append(node)
        else:
            node.replace_all_uses_with(value)  # type: ignore[arg-type]
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
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(n) or n)
    return found


def _module_calls(graph: fx.Graph, model: nn.Module) -> None:
    """A run of ops that is exactly one call of a leaf module (one tensor in, one tensor out, its own
    parameters and buffers only) becomes a call of that very module, so the layer *is* the source module."""
    keys: dict[str, int] = {}
    for key, _, nodes in _runs(graph):
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


def on_device_of(like: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` creating its result on ``like``'s device: export bakes the example's device
    into factory ops (``arange``, ``ones``, ``to``); a layer on another device must make them where it runs."""
    return op(*args, **kwargs, device=like.device)


def at_device_of(like: torch.Tensor, op: Any, at: int, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` with its ``at``-th argument (a device export baked in) replaced by ``like``'s device."""
    return op(*args[:at], like.device, *args[at + 1:], **kwargs)


def _devices(graph: fx.Graph, device: torch.device) -> bool:
    """Rewrite ops that name the example's device to take the device of a tensor they travel with;
    whether any did."""
    previous: fx.Node | None = None
    changed = False
    for node in list(graph.nodes):
        here = node.kwargs.get("device") if node.op == "call_function" else None
        at = None
        if node.op == "call_function" and here is None:
            at = next((i for i, a in enumerate(node.args) if isinstance(a, torch.device) and a == device), None)
        if isinstance(here, (torch.device, str)) and torch.device(here) == device:
            tensors = [a for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            like = tensors[0] if tensors else previous
            if like is not None:
                kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}
                node.args = (like, node.target, *node.args)
                node.kwargs = kwargs
                node.target = on_device_of
                changed = True
        elif at is not None and previous is not None:
            # t.to(x.device) (aten.to.device): the device of the value computed last, as x is in the source
            node.args = (previous, node.target, at, *node.args)
            node.target = at_device_of
            changed = True
        if node.op in ("placeholder", "call_function", "call_module") and isinstance(node.meta.get("val"), torch.Tensor):
            previous = node
    return changed


def _shape_guards(graph: fx.Graph, inputs: list[fx.Node], names: list[str]) -> list[Guard]:
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


def _refuse_scripted(model: nn.Module) -> None:
    """A TorchScript submodule runs compiled code that export cannot flatten into ops; fx keeps it whole."""
    path, module = next(((p, m) for p, m in model.named_modules() if p and isinstance(m, torch.jit.ScriptModule)),
                        ("", None))
    if module is not None:
        kind = getattr(module, "original_name", type(module).__name__)
        raise ExportError(
            f"submodule {path!r} ({kind}) of {type(model).__name__} is a TorchScript module (torch.jit.script): "
            "its forward is compiled code that the torch.export frontend cannot flatten into ops. Convert with "
            "frontend='fx' (or 'auto'), which keeps it whole as one layer, or convert the Python module before "
            "scripting it"
        )


def export_trace(model: nn.Module, example_inputs: Any) -> Traced:
    """Capture ``model`` with non-strict ``torch.export`` on ``example_inputs`` and return it in the traced form.

    Graph nodes carry their module path (``nn_module_stack``) and example value (``val``, symbolic in the
    batch dimension); ``get_attr`` nodes name the source's own parameters and buffers, so in-place buffer
    updates (BatchNorm statistics) land in the source's buffers.
    """
    name = type(model).__name__
    hooked = user_hooks(model)
    if hooked:
        raise HookError(f"{name} itself has hooks ({', '.join(hooked)}); remove them before converting")
    inner = next(((p, m) for p, m in model.named_modules() if p and user_hooks(m)), None)
    if inner is not None:
        path, module = inner
        raise HookError(
            f"submodule {path!r} ({type(module).__name__}) of {name} has hooks ({', '.join(user_hooks(module))}); "
            "the torch.export frontend flattens every submodule into graph ops, so its hooks would never run in "
            "the converted model. Convert with frontend='fx', which keeps a hooked submodule whole as one layer "
            "whose hooks run, or remove the hooks before converting (and register them on the converted layers)"
        )
    _refuse_scripted(model)
    params, kwargs, dynamic = _bind(model, example_inputs)
    _refuse_cache(model, kwargs)
    ep = _export(model, kwargs, dynamic)
    try:
        gm = ep.module()
    except Exception as e:
        raise ExportError(f"torch.export captured {name} but could not unlift it: {_first_line(e)}") from e
    graph = gm.graph
    constants, inputs = _clean(gm, model, kwargs)
    example = next((t for t in pytree.tree_leaves(kwargs) if isinstance(t, torch.Tensor)), None)
    prepare_regions(graph, constants, example.device.type if example is not None else None)
    _module_calls(graph, model)
    if example is not None:
        # Also inside the regions the graph calls (a no_grad or autocast block such as a rotary embedding's):
        # a device baked there would pin a layer to the example's device wherever the layer runs.
        for region in regions(graph, constants):
            if _devices(region, example.device) and region is not graph:
                owner = region.owning_module
                if isinstance(owner, fx.GraphModule):
                    owner.recompile()
    input_names = [k for k, v in kwargs.items() for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor)]
    guards = _shape_guards(graph, inputs, input_names)
    out = next(n for n in graph.nodes if n.op == "output")
    spec = ep.module_call_graph[0].signature.out_spec if ep.module_call_graph[0].signature else None
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    structure = pytree.tree_unflatten(flat, spec) if spec is not None else out.args[0]
    _refuse_cache_output(model, structure, spec)
    graph._codegen = fx.graph.CodeGen()
    out.args = (structure,)
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    return Traced(
        model=model,
        graph=graph,
        constants=constants,
        opaque=[],
        inputs=InputSpec(name, params),
        training=model.training,
        has_values=True,
        guards=guards,
        output=structure,
        flattened=[(p, m) for p, m in model.named_modules() if p not in called],
    )
