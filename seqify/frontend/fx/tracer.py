"""The fx tracer: a leaf policy, example values riding on proxies (fake tensors), guards where Python needs a
concrete value, and the opaque fallback for submodules it cannot trace through."""

from __future__ import annotations

import copy
import math
import operator
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.proxy import Scope, ScopeContextManager

from seqify.errors import ExampleInputError, SeqifyError, UntraceableError
from seqify.frontend.fx.autograd import AUTOGRAD_CALLS, GRAD_MODE, PROXY_USES, FxAutograd
from seqify.frontend.fx.describe import call_text, expr, readable
from seqify.frontend.fx.kept import KeepWhole, keep_generator, keep_unregistered
from seqify.frontend.grad_watch import GRAD, Use, watching
from seqify.frontend.outside import Held, find, outside, registered
from seqify.frontend.real import RealRun, tracing, unpatched
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


class _Proxy(fx.Proxy):
    """A proxy that asks the tracer for concrete values where Python needs them."""

    tracer: Tracer

    def __getattr__(self, k: str) -> _Attribute:  # type: ignore[override]  # ours asks for concrete values
        return _Attribute(self, k)

    def __len__(self) -> int:
        return self.tracer.concrete_len(self)

    def __int__(self) -> int:
        return self.tracer.concrete(self, int)

    def __index__(self) -> int:
        return self.tracer.concrete(self, int)

    def __float__(self) -> float:
        return self.tracer.concrete(self, float)

    def __setitem__(self, key: Any, value: Any) -> None:
        # ``x[i] = v`` modifies x in place (fx has no proxy for it): record it as the in-place operator.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


def _inplace(op: Any) -> Any:
    def method(self: _Proxy, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


# fx turns ``x += y`` into ``x = x + y``: a copy, so an alias of x would not see the change. Recording
# the in-place operator keeps the source's semantics (the tensor is modified; aliases see it).
for _name, _op in {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv, "__imod__": operator.imod,
    "__ipow__": operator.ipow, "__imatmul__": operator.imatmul, "__iand__": operator.iand,
    "__ior__": operator.ior, "__ixor__": operator.ixor, "__ilshift__": operator.ilshift,
    "__irshift__": operator.irshift,
}.items():
    setattr(_Proxy, _name, _inplace(_op))


class _Attribute(_Proxy):
    def __init__(self, root: _Proxy, attr: str) -> None:
        self.root = root
        self.attr = attr
        self.tracer = root.tracer
        self._node: fx.Node | None = None

    @property
    def node(self) -> fx.Node:  # type: ignore[override]
        if self._node is None:
            self._node = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {}).node
        return self._node

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.attr in PROXY_USES:  # a hook or autograd run on a traced value: no graph op holds it
            kind, what = PROXY_USES[self.attr]
            self.tracer.autograd.use(Use(kind, what, user_frame()))
        return self.tracer.create_proxy("call_method", self.attr, (self.root,) + args, kwargs)


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
    ) -> None:
        super().__init__(autowrap_modules=(math,), param_shapes_constant=True)
        self.leaf_types = leaf_types
        self.leaf_paths = leaf_paths
        self.depth = depth
        self.fake_mode = fake_mode
        self.placeholder_plan = iter(placeholders)
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

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with tracing(self), watching(self.autograd):
            return super().trace(root, concrete_args)

    # -- proxies ---------------------------------------------------------------------------------

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

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
                obj = self.constants[target] if target in self.constants else self._attr(target)
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
                with unpatched(), self.fake_mode:
                    return self._fake_module(attribute(self.root, str(node.target))).forward(*inputs[0], **inputs[1])
            except Exception as e:
                error = e
        path, index = self._calling
        if self.real is None or path != node.target:
            if error is not None:
                raise error
            return UNKNOWN
        real = self.real.output(path, index)
        node.meta["seqify_real"] = True
        return pytree.tree_map_only(torch.Tensor, self._fake, real)

    def _attr(self, target: str) -> Any:
        return attribute(self.root, target)

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
        result = bool(self._value(obj, "bool()"))
        self.create_proxy("call_function", check_bool, (obj, result, expr(obj.node), self._where()), {})
        return result

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
                self.flattened[path] = m
                depth = len(self.autograd.regions)
                try:
                    out = forward(*args, **kwargs)
                    self.autograd.left_open(depth)
                    return out
                except SeqifyError:
                    raise
                except KeepWhole as e:  # exact as one layer: no export splice, which would flatten it again
                    self._rollback(mark)
                    del self.autograd.regions[depth:]
                    for inner in [p for p in self.flattened if p == path or p.startswith(f"{path}.")]:
                        del self.flattened[inner]
                    self.opaque[path] = Opaque(path, type(m).__name__, e.reason)
                    return self._leaf_call(path, calls, args, kwargs)
                except Exception as e:
                    self._rollback(mark)
                    del self.autograd.regions[depth:]
                    for inner in [p for p in self.flattened if p == path or p.startswith(f"{path}.")]:
                        del self.flattened[inner]
                    site = error_site(e)
                    reason = f"{first_line(e)} at {site}" if site else first_line(e)
                    self.opaque[path] = Opaque(path, type(m).__name__, reason, untraceable=True,
                                               diverged=isinstance(e, Diverged))
                    return self._leaf_call(path, calls, args, kwargs)
            finally:
                self.module_stack.pop(key, None)

    def _leaf_call(self, path: str, calls: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call_module node for the ``calls``-th call of ``path``; the node records that index
        (``meta['seqify_call']``), which matches the real run's calls of that module."""
        self._calling = (path, calls)
        proxy = self.create_proxy("call_module", path, args, kwargs)
        proxy.node.meta["seqify_call"] = calls
        return proxy

    def _rollback(self, mark: fx.Node | None) -> None:
        nodes = list(self.graph.nodes)
        start = 0 if mark is None else nodes.index(mark) + 1
        doomed = nodes[start:]
        gone = set(doomed)
        for node in reversed(doomed):
            self.graph.erase_node(node)
        if self._param_cache:
            for name in [n for n, p in self._param_cache.items() if p.node in gone]:
                del self._param_cache[name]
