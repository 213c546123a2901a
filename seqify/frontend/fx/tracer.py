"""The fx tracer: a leaf policy, example values riding on proxies (fake tensors), guards where Python needs a
concrete value, and the opaque fallback for submodules it cannot trace through."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.proxy import Scope, ScopeContextManager

from seqify.errors import ExampleInputError, SeqifyError, UntraceableError
from seqify.frontend.fx.autograd import AUTOGRAD_CALLS, GRAD_MODE, FxAutograd
from seqify.frontend.fx.describe import call_text, expr, readable
from seqify.frontend.fx.kept import DRAW, KeepWhole, UnrecordedDraw, keep_drawer, keep_generator, keep_unregistered
from seqify.frontend.fx.methods import detached, methods_watched, run_method
from seqify.frontend.fx.objects import class_name, holds_proxies, map_tensors, rebuilt
from seqify.frontend.fx.proxies import ValueProxy
from seqify.frontend.fx.root_values import Site, checks_input, evaluate, forward_site
from seqify.frontend.grad_watch import GRAD, Use, watching
from seqify.frontend.outside import Held, find, outside, registered
from seqify.frontend.preserve import attributes_of, kept_attributes, preserved, put_back
from seqify.frontend.real import RealRun, buffers_kept, tracing, unpatched
from seqify.frontend.traced import UNKNOWN, Opaque, attribute, error_site, first_line, is_cache, user_frame
from seqify.model.guard import check_bool, check_equal
from seqify.model.hooks import ALL_HOOK_DICTS, HOOK_DICTS

__all__ = ["Diverged", "Tracer"]


class Diverged(fx.proxy.TraceError):
    """An op fails on the example values while tracing: the traced code is not the path the source runs."""


def _fake_limit(error: BaseException) -> bool:
    """Whether ``error`` is a limit of fake tensors (no data: data-dependent shapes, ``.item()``), not a
    failure the real op would have too."""
    from torch._subclasses import fake_tensor as ft

    limits = (
        ft.DynamicOutputShapeException, ft.DataDependentOutputException, ft.UnsupportedOperatorException,
        ft.UnsupportedFakeTensorException, NotImplementedError,
    )
    return isinstance(error, limits) or "FakeTensor" in str(error) or "data pointer" in str(error)


class Tracer(fx.Tracer):
    """torch.fx's tracer with seqify's leaf policy, example values on nodes (``meta['val']``), a guard for each
    concrete value Python asked for, and submodules it cannot trace through kept whole (``opaque``)."""

    def __init__(
        self,
        *,
        leaf_types: tuple[type, ...],
        leaf_paths: frozenset[str],
        depth: int | None,
        fake_mode: Any,
        placeholders: list[Any],
        real: RealRun | None = None,
        real_inputs: list[Any] | None = None,
    ) -> None:
        super().__init__(autowrap_modules=(math,), param_shapes_constant=True)
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths
        self.depth = depth
        self.fake_mode = fake_mode
        self.placeholder_plan = iter(placeholders)
        self._real_plan = iter(real_inputs or ())  # the example's real values, placeholder by placeholder
        self._real_inputs: dict[fx.Node, Any] = {}
        self.root_site: Site | None = None  # where the root's forward is defined
        self.opaque: dict[str, Opaque] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self._constant_names: dict[int, str] = {}
        self._clones: dict[int, nn.Module] = {}
        self._param_cache: dict[str, fx.Proxy] | None = None
        self._known_tensors: set[int] | None = None
        self._mine: set[int] | None = None  # ids of the model's own modules, parameters and buffers
        self._held: list[Held] | None = None  # what the model holds outside its module tree
        self._depth = 0
        self._raw: Any = None
        self.raw_output: Any = None
        self.flattened: dict[str, nn.Module] = {}
        self.real = real
        self._calling: tuple[str, int] = ("", 0)  # the leaf module call being recorded, and its index
        self.plain = 0  # > 0: module calls and attribute reads act plainly (trace_real.unpatched)
        self.autograd = FxAutograd(self)
        self._method_calls: dict[str, int] = {}  # calls so far of each method the root's forward calls

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self.root_site = forward_site(root)
        with tracing(self), watching(self.autograd), methods_watched(root, self):
            return super().trace(root, concrete_args)

    # -- proxies ---------------------------------------------------------------------------------

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ValueProxy(node, self)

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any = None,
        proxy_factory_fn: Any = None,
    ) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        if kind in ("call_function", "call_method", "call_module"):
            mode = self.autograd.mode()
            if mode is not None:  # made inside a grad-mode region of the model's code: its layer runs it so
                node.meta[GRAD_MODE] = mode
            what = next((w for f, w in AUTOGRAD_CALLS.items() if f is target), None)
            if what is not None and not self.plain:
                self.autograd.note(Use(GRAD, what, user_frame()))
        if kind == "placeholder":
            planned = next(self.placeholder_plan, ("baked", None))
            self._real_inputs[node] = next(self._real_plan, None)
            node.meta["seqify_baked"] = planned[0] == "baked"
            if planned[0] == "value" and planned[1] is not UNKNOWN:
                node.meta["val"] = planned[1]
        elif kind not in ("output", "get_attr") and self.fake_mode is not None:
            self._infer(node)
        return proxy

    def create_node(
        self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None, type_expr: Any = None
    ) -> fx.Node:
        if kind == "output":
            self.raw_output = self._raw
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind == "get_attr" and self.fake_mode is not None:  # tensors fx reads as attributes: no proxy made
            self._infer(node)
        return node

    def create_arg(self, a: Any) -> Any:
        if self._depth == 0:
            self._raw = a
        self._depth += 1
        try:
            return self._create_arg(a)
        finally:
            self._depth -= 1

    def _create_arg(self, a: Any) -> Any:
        if isinstance(a, FakeTensor):  # an example value leaked into traced code: never bake it into a layer
            raise fx.proxy.TraceError(
                f"{self._where()}: an example value (a fake tensor without data) reached the traced code as "
                "a constant; please report this with the model"
            )
        if is_cache(a):
            raise UntraceableError(
                f"{self._where() if self.module_stack else type(self.root).__name__ + '.forward'}: the traced "
                f"forward passes on a {type(a).__name__} (a key/value cache, as "
                "transformers models make with use_cache=True); converted models take and return tensors. "
                "What to do: pass use_cache=False (in the call inside forward, or set model.config.use_cache = "
                "False before converting)."
            )
        if isinstance(a, torch.Generator):
            raise keep_generator(self.root, a)
        if holds_proxies(a):  # ImageList(tensors=proxy, ...): a node rebuilds it where the source passes it
            return self.create_proxy("call_function", rebuilt, (class_name(type(a)), dict(a.__dict__)), {}).node
        outside_tree = isinstance(a, torch.Tensor) and id(a) not in self._registered()
        if outside_tree and a.requires_grad:
            # trained where no optimizer sees it: a layer can neither bake it nor hold it as the source does (a
            # tensor made in forward is made afresh each call, and stays a constant)
            held = find(self.root, a, self._outside())
            if held is not None or isinstance(a, nn.Parameter):
                raise keep_unregistered(self.root, held, a)
        if isinstance(a, torch.Tensor) and (not isinstance(a, nn.Parameter) or outside_tree):
            if self._known_tensors is None:
                self._known_tensors = {id(t) for t in self.root.buffers()} | {id(t) for t in self.tensor_attrs}
            if id(a) not in self._known_tensors:
                name = self._constant_names.get(id(a))
                if name is None:
                    name = self._constant_names[id(a)] = f"_seqify_constant{len(self.constants)}"
                    self.constants[name] = a
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def _registered(self) -> set[int]:
        if self._mine is None:
            self._mine = registered(self.root)
        return self._mine

    def _outside(self) -> list[Held]:
        if self._held is None:
            self._held = outside(self.root)
        return self._held

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, fx.Proxy]) -> Any:
        if self.plain:
            return attr_val
        self._param_cache = parameter_proxy_cache
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    # -- example values --------------------------------------------------------------------------

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        return self.fake_mode.from_tensor(t)

    def _fake_module(self, m: nn.Module) -> nn.Module:
        clone = self._clones.get(id(m))
        if clone is None:
            clone = copy.copy(m)
            clone.__dict__["_parameters"] = {k: None if v is None else self._fake(v) for k, v in m._parameters.items()}
            clone.__dict__["_buffers"] = {k: None if v is None else self._fake(v) for k, v in m._buffers.items()}
            clone.__dict__["_modules"] = {k: None if v is None else self._fake_module(v) for k, v in m._modules.items()}
            for hooks in ALL_HOOK_DICTS:
                if hooks in clone.__dict__:
                    clone.__dict__[hooks] = OrderedDict()
            if isinstance(clone, nn.RNNBase):
                clone._init_flat_weights()
            self._clones[id(m)] = clone
        return clone

    def _infer(self, node: fx.Node) -> None:
        if node.target in (check_bool, check_equal):
            node.meta["val"] = None
            return
        unknown = False

        def val(n: fx.Node) -> Any:
            nonlocal unknown
            v = n.meta.get("val", UNKNOWN)
            if v is UNKNOWN:
                unknown = True
            return v

        try:
            if node.op == "get_attr":
                target = str(node.target)  # a get_attr node names an attribute path
                obj = self._get_attr_value(target)
                node.meta["val"] = self._fake(obj) if isinstance(obj, torch.Tensor) else obj
                return
            args = fx.node.map_arg(node.args, val)
            kwargs = fx.node.map_arg(node.kwargs, val)
            if node.op == "call_module":
                value = self._module_value(node, None if unknown else (args, kwargs))
                if value is not UNKNOWN:
                    node.meta["val"] = value
                return
            if unknown or node.op not in ("call_function", "call_method"):
                return
            with self.fake_mode:
                fn: Any = node.target  # call_function: the callable; call_method: the method's name
                if node.op == "call_function":
                    result = fn(*args, **kwargs)
                else:
                    result = getattr(args[0], fn)(*args[1:], **kwargs)
            node.meta["val"] = result
        except Exception as e:  # unknown value: later steps fall back to rules
            node.meta["val_error"] = first_line(e)
            if not unknown and node.target is torch._assert:
                # The model checks its input (ViT's image size, say) and the example fails that check.
                raise ExampleInputError(
                    f"{type(self.root).__name__}'s own check fails on example_inputs: "
                    f"{readable(first_line(e), node.graph)} (at {self._where()}). Pass example inputs the "
                    "model accepts (the shape its check asks for)"
                ) from e
            if not unknown and node.op in ("call_function", "call_method") and not _fake_limit(e):
                # The source would fail here too: tracing took a path the source does not take on this
                # example (e.g. `torch.is_tensor(x)` is False for fx's stand-in). Never bake it into a layer.
                raise Diverged(
                    f"`{expr(node)}` = {call_text(node)} fails on the example values ({first_line(e)}), so "
                    f"the traced code is not what the source runs; at {self._where()}"
                ) from e

    def _module_value(self, node: fx.Node, inputs: tuple[Any, dict[str, Any]] | None) -> Any:
        """A leaf's example value: its forward on fake tensors (fx's patches undone, so its children run as
        plain modules); failing that (it branches on tensor values, or its inputs have no example value),
        its output when the source runs on the real example."""
        error: Exception | None = None
        if inputs is not None:
            try:
                module = attribute(self.root, str(node.target))
                with unpatched(), self.fake_mode, torch.random.fork_rng(devices=[]), kept_attributes(module):
                    return self._fake_module(module).forward(*inputs[0], **inputs[1])
            except Exception as e:
                error = e
        path, index = self._calling
        if self.real is None or path != node.target:
            if error is not None:
                raise error
            return UNKNOWN
        real = self.real.output(path, index)
        node.meta["seqify_real"] = True
        return map_tensors(self._fake, real)

    def _get_attr_value(self, target: str) -> Any:
        """What a ``get_attr`` node reads: a constant the trace made, or an attribute of the model."""
        return self.constants[target] if target in self.constants else attribute(self.root, target)

    # -- concrete values where Python needs them ---------------------------------------------------

    def _value(self, obj: fx.Proxy, what: str) -> Any:
        node = obj.node
        v = node.meta.get("val", UNKNOWN)
        if v is UNKNOWN:
            hint = (
                "pass example_inputs to seqify.convert so shape-dependent code can be resolved"
                if self.fake_mode is None
                else f"its example value is unknown ({node.meta.get('val_error', 'no example value')})"
            )
            raise fx.proxy.TraceError(
                f"Python control flow ({what}) on the traced value `{expr(node)}` needs a concrete value; {hint}"
            )
        if isinstance(v, torch.Tensor):
            raise fx.proxy.TraceError(
                f"Python control flow ({what}) on tensor `{expr(node)}` depends on the tensor's data, not "
                "its shape (data-dependent control flow)"
            )
        return v

    def _where(self) -> str:
        path = next(reversed(self.module_stack.values()))[0] if self.module_stack else ""
        return f"{path or '<model>'}: {user_frame()}"

    def to_bool(self, obj: fx.Proxy) -> bool:
        if self.real is not None and not self.plain and checks_input(obj.node, self.root_site):
            result = bool(self._real_value(obj.node))  # the root's own branch on values: guarded, as on shapes
        else:
            result = bool(self._value(obj, "bool()"))
        self.create_proxy("call_function", check_bool, (obj, result, expr(obj.node), self._where()), {})
        return result

    def _real_value(self, node: fx.Node) -> Any:
        with unpatched(), preserved(self.root), buffers_kept(self.root), torch.random.fork_rng(devices=[]):
            return evaluate(self.graph, node, self._real_inputs, self._get_attr_value, self.root)

    def concrete(self, obj: fx.Proxy, kind: type) -> Any:
        value = self._value(obj, f"{kind.__name__}()")
        self.create_proxy("call_function", check_equal, (obj, value, expr(obj.node), self._where()), {})
        return kind(value)

    def concrete_len(self, obj: fx.Proxy) -> int:
        known = obj.node.meta.get("val")
        value = known if isinstance(known, torch.Tensor) else self._value(obj, "len()")
        n = len(value)
        length = self.create_proxy("call_function", len, (obj,), {})
        self.create_proxy("call_function", check_equal, (length, n, expr(length.node), self._where()), {})
        return n

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        value = obj.node.meta.get("val")
        if isinstance(value, Mapping):  # iterating a dict gives its keys: constants, guarded as the length is
            found = self.create_proxy("call_function", tuple, (obj,), {})
            self.create_proxy("call_function", check_equal, (found, tuple(value), expr(found.node), self._where()), {})
            return iter(tuple(value))
        n = self.concrete_len(obj)
        items: Any = obj  # a proxy indexes by position as the value it stands for would
        return iter([items[i] for i in range(n)])

    def keys(self, obj: fx.Proxy) -> Any:
        value = self._value(obj, "keys()")
        return list(value.keys())

    # -- leaves and the opaque fallback ------------------------------------------------------------

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        path = module_qualified_name
        if path in self.opaque:
            return True
        if isinstance(m, torch.jit.ScriptModule):
            # compiled code fx cannot read; called whole, it computes what the source's call computes
            kind = getattr(m, "original_name", type(m).__name__)
            self.opaque[path] = Opaque(path, kind, "a TorchScript module (its forward is compiled code), kept whole")
            return True
        if path and any(getattr(m, h, None) for h in HOOK_DICTS):
            self.opaque[path] = Opaque(path, type(m).__name__, "has hooks, kept whole so they still run")
            return True
        if isinstance(m, self.leaf_types) or path in self.leaf_paths:
            return True
        if self.depth is not None and path and path.count(".") + 1 >= self.depth:
            return True
        return super().is_leaf_module(m, path)

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.plain:
            return forward(*args, **kwargs)
        try:
            path = self.path_of_module(m)
        except NameError:
            raise keep_unregistered(self.root, find(self.root, m, self._outside()), m) from None
        with ScopeContextManager(self.scope, Scope(path, type(m))) as scope:
            calls = self.num_calls.get(path, 0)
            key = f"{scope.module_path}@{calls}" if calls > 0 else scope.module_path
            self.module_stack[key] = (path, scope.module_type)
            self.num_calls[path] = calls + 1
            try:
                if self.is_leaf_module(m, path):
                    return self._leaf_call(path, calls, args, kwargs)
                mark = next(iter(reversed(self.graph.nodes)), None)
                before = attributes_of(m)
                self.flattened[path] = m
                depth, rng = len(self.autograd.regions), torch.random.get_rng_state()
                try:
                    out = forward(*args, **kwargs)
                    if not torch.equal(torch.random.get_rng_state(), rng):
                        raise keep_drawer(m)
                    self.autograd.left_open(depth)
                    return out
                except SeqifyError:
                    raise
                except KeepWhole as e:  # exact as one layer: no export splice, which would flatten it again
                    self._undo(path, mark, before, depth, rng)
                    self.opaque[path] = Opaque(path, type(m).__name__, e.reason)
                    return self._leaf_call(path, calls, args, kwargs)
                except Exception as e:
                    self._undo(path, mark, before, depth, rng)
                    site = error_site(e)
                    reason = f"{first_line(e)} at {site}" if site else first_line(e)
                    self.opaque[path] = Opaque(path, type(m).__name__, reason, untraceable=True,
                                               diverged=isinstance(e, Diverged))
                    return self._leaf_call(path, calls, args, kwargs)
            finally:
                self.module_stack.pop(key, None)

    def _undo(self, path: str, mark: fx.Node | None, attributes: list[tuple[nn.Module, dict[str, Any]]], depth: int,
              rng: torch.Tensor) -> None:
        """Undo a failed attempt to trace through ``path``: its nodes, attribute writes, grad-mode regions,
        flattened submodules and draws."""
        self._rollback(mark, attributes)
        del self.autograd.regions[depth:]
        for inner in [p for p in self.flattened if p == path or p.startswith(f"{path}.")]:
            del self.flattened[inner]
        torch.random.set_rng_state(rng)

    def method_call(self, owner: nn.Module, path: str, name: str, fn: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """``owner.name(*args, **kwargs)`` called from the root's forward: traced through where fx can, else
        one opaque op (``run_method`` on the owner without its tensors) whose example value is the source's
        on the real example."""
        key = f"{path}.{name}" if path else name
        index = self._method_calls.get(key, 0)
        self._method_calls[key] = index + 1
        mark = next(iter(reversed(self.graph.nodes)), None)
        before = attributes_of(owner)
        flattened, depth, rng = set(self.flattened), len(self.autograd.regions), torch.random.get_rng_state()
        try:
            out = fn(owner, *args, **kwargs)
            if not torch.equal(torch.random.get_rng_state(), rng) and self.real is not None:
                raise UnrecordedDraw(DRAW)
            return out
        except (SeqifyError, KeepWhole):
            raise
        except Exception as e:
            if self.real is None:
                raise
            self._rollback(mark, before)
            del self.autograd.regions[depth:]
            for inner in set(self.flattened) - flattened:
                del self.flattened[inner]
            torch.random.set_rng_state(rng)
            real = self.real.method_output(key, index)
            site = error_site(e)
            reason = f"{first_line(e)} at {site}" if site else first_line(e)
            self.opaque[f"{key}()"] = Opaque(f"{key}()", f"{type(owner).__name__}.{name}", reason)
            node = self.create_node("call_function", run_method,
                                    (detached(owner), name, *self.create_arg(args)), self.create_arg(kwargs))
            node.meta["val"] = map_tensors(self._fake, real)
            node.meta["seqify_real"] = True
            node.meta["seqify_method"] = f"{key}()"
            return self.proxy(node)

    def method_ran(self, path: str, name: str, out: Any) -> None:
        """A method the root's forward calls returned ``out`` in a plain run (the real one records it)."""
        if self.real is not None and self.real.running:
            self.real.method_returned(f"{path}.{name}" if path else name, out)

    def _leaf_call(self, path: str, calls: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call_module node for the ``calls``-th call of ``path``; the node records that index
        (``meta['seqify_call']``), which matches the real run's calls of that module."""
        self._calling = (path, calls)
        proxy = self.create_proxy("call_module", path, args, kwargs)
        proxy.node.meta["seqify_call"] = calls
        return proxy

    def _rollback(self, mark: fx.Node | None, attributes: list[tuple[nn.Module, dict[str, Any]]]) -> None:
        """Erase the nodes made since ``mark`` and put back the attributes the failed forward wrote (proxies
        it cached, such as torchvision's anchors, must not reach the call that keeps the module whole)."""
        put_back(attributes)
        nodes = list(self.graph.nodes)
        start = 0 if mark is None else nodes.index(mark) + 1
        doomed = nodes[start:]
        gone = set(doomed)
        for node in reversed(doomed):
            self.graph.erase_node(node)
        if self._param_cache:
            for name in [n for n, p in self._param_cache.items() if p.node in gone]:
                del self._param_cache[name]
