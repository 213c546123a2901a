"""Tracing: torch.fx with a leaf policy, example shapes riding on proxies, and an opaque fallback."""

from __future__ import annotations

import copy
import inspect
import linecache
import math
import operator
import os
import re
import traceback
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx._symbolic_trace import PH
from torch.fx.proxy import Scope, ScopeContextManager

from seqify._paths import PACKAGE_DIR
from seqify.errors import (
    ExampleInputError,
    HookError,
    KeywordArgumentsError,
    SeqifyError,
    StatefulForwardError,
    UntraceableError,
)
from seqify.frontend.fx.autograd import AUTOGRAD_CALLS, GRAD_MODE, PROXY_USES, FxAutograd, keep_reason, refusal
from seqify.frontend.fx.checks import attributes, check_decorated, passthrough, writes_since
from seqify.frontend.fx.factories import recording_shape_ops
from seqify.frontend.grad_watch import GRAD, Use, watching
from seqify.frontend.outside import Held, find, generator_error, outside, registered, unregistered_error, what_is
from seqify.frontend.preserve import preserved
from seqify.frontend.real import RealRun, buffers_kept, raises_itself, source_error, tracing, unpatched
from seqify.frontend.reseeds import Reseed, reseeds
from seqify.model.guard import Guard, check_bool, check_equal
from seqify.model.hooks import ALL_HOOK_DICTS, HOOK_DICTS
from seqify.model.signature import EMPTY, InputSpec, Param, bind_examples

__all__ = ["Opaque", "Traced", "trace", "UNKNOWN", "value_of", "attribute", "is_cache"]


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: The value of a node whose example value could not be computed (or when there were no example inputs).
UNKNOWN: Any = _Unknown()

_HERE = PACKAGE_DIR
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
class Diverged(fx.proxy.TraceError):
    """An op fails on the example values while tracing: the traced code is not the path the source runs."""


class KeepWhole(Exception):
    """Raised inside a traced forward that fx cannot turn into exact layers but that is exact run whole: a
    submodule's forward is kept whole as one layer (``reason`` says why); the model's own forward, which
    cannot be, raises ``error`` instead."""

    def __init__(self, reason: str, error: SeqifyError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


@dataclass(frozen=True)
class _Update:
    """State a traced forward changed that no layer would change again: a Python attribute it set, or in place
    without fx recording it, a buffer, a tensor held outside the module tree or a private generator's state
    (``owner``: the module whose attribute holds it)."""

    owner: str
    name: str
    kind: str  # "attribute" (a Python attribute set or replaced), "buffer", "tensor" or "generator"


@dataclass(frozen=True)
class Opaque:
    """A submodule kept whole as one layer, and why."""

    path: str
    type: str
    reason: str
    untraceable: bool = False  # fx failed inside its forward (not hooks, writes or modes): export may capture it
    diverged: bool = False  # an op in it failed on the example values: the traced code took another path

    def __str__(self) -> str:
        return f"{self.path} ({self.type}): {self.reason}"


@dataclass
class Traced:
    """A traced model: its graph (nodes carry ``meta['val']`` when example inputs were given) and what tracing learnt."""

    model: nn.Module
    graph: fx.Graph
    constants: dict[str, torch.Tensor]
    opaque: list[Opaque]
    inputs: InputSpec
    training: bool
    has_values: bool
    guards: list[Guard] = field(default_factory=list)
    output: Any = None  # the output structure, with nodes as leaves
    flattened: list[tuple[str, nn.Module]] = field(default_factory=list)  # modules whose forward was traced through

    def attribute(self, target: str) -> Any:
        """The object a ``get_attr`` node refers to."""
        if target in self.constants:
            return self.constants[target]
        obj: Any = self.model
        for atom in target.split("."):
            obj = getattr(obj, atom)
        return obj


def attribute(root: nn.Module, target: str) -> Any:
    """The object at dotted ``target`` under ``root``, read from the module tables directly (never through
    ``nn.Module.__getattr__``, which fx patches during tracing to make a proxy of every parameter read)."""
    obj: Any = root
    for atom in target.split("."):
        tables = [obj.__dict__.get(t) for t in ("_parameters", "_buffers", "_modules")] if isinstance(obj, nn.Module) else []
        table = next((t for t in tables if t is not None and atom in t), None)
        obj = table[atom] if table is not None else getattr(obj, atom)
    return obj


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a key/value cache object (transformers' ``DynamicCache`` and kin)."""
    if isinstance(value, (nn.Module, torch.Tensor)):
        return False
    return any(c.__name__.endswith("Cache") and c.__module__ != "builtins" for c in type(value).__mro__)


def value_of(node: fx.Node) -> Any:
    """The example value of ``node``, or :data:`UNKNOWN`."""
    return node.meta.get("val", UNKNOWN)


def _user_frame() -> str:
    frame = inspect.currentframe()
    while frame is not None:
        file = os.path.abspath(frame.f_code.co_filename)
        if not file.startswith(_TORCH) and not file.startswith(_HERE) and not file.startswith("<"):
            line = linecache.getline(file, frame.f_lineno).strip()
            return f"{os.path.basename(file)}:{frame.f_lineno} ({line})" if line else f"{os.path.basename(file)}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown location>"


def _error_site(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    for fs in reversed(frames):
        file = os.path.abspath(fs.filename)
        if not file.startswith(_TORCH) and not file.startswith(_HERE) and not file.startswith("<"):
            code = f" ({fs.line.strip()})" if fs.line else ""
            return f"{os.path.basename(file)}:{fs.lineno} in {fs.name}{code}"
    return ""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


_SYMBOLS = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.eq: "==", operator.ne: "!=",
    operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=",
    operator.and_: "&", operator.or_: "|",
}


def _expr(a: Any, depth: int = 0) -> str:
    if not isinstance(a, fx.Node):
        return repr(a)
    if depth > 6:
        return a.name
    if a.op == "placeholder":
        return a.name
    if a.op == "call_function":
        if a.target is getattr:
            return f"{_expr(a.args[0], depth + 1)}.{a.args[1]}"
        if a.target is operator.getitem:
            return f"{_expr(a.args[0], depth + 1)}[{_expr(a.args[1], depth + 1)}]"
        if a.target in _SYMBOLS and len(a.args) == 2:
            return f"({_expr(a.args[0], depth + 1)} {_SYMBOLS[a.target]} {_expr(a.args[1], depth + 1)})"
        if a.target is len:
            return f"len({_expr(a.args[0], depth + 1)})"
    if a.op == "call_method" and a.target in ("size", "dim", "numel") and not a.kwargs:
        rest = ", ".join(_expr(x, depth + 1) for x in a.args[1:])
        return f"{_expr(a.args[0], depth + 1)}.{a.target}({rest})"
    return a.name


def _fake_limit(error: BaseException) -> bool:
    """Whether ``error`` is a limit of fake tensors (no data: data-dependent shapes, ``.item()``), not a
    failure the real op would have too."""
    from torch._subclasses import fake_tensor as ft

    limits = (
        ft.DynamicOutputShapeException, ft.DataDependentOutputException, ft.UnsupportedOperatorException,
        ft.UnsupportedFakeTensorException, NotImplementedError,
    )
    return isinstance(error, limits) or "FakeTensor" in str(error) or "data pointer" in str(error)


def _call_text(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))
    args = ", ".join([*(_expr(a) for a in node.args), *(f"{k}={_expr(v)}" for k, v in node.kwargs.items())])
    return f"{target}({args})" if node.op == "call_function" else f"{_expr(node.args[0])}.{target}({args.split(', ', 1)[1] if ', ' in args else ''})"


def _unregistered(root: nn.Module, held: Held | None, obj: Any) -> KeepWhole:
    """A traced forward uses a module, or a tensor requiring grad, held outside the module tree."""
    where = what_is(root, held, obj)
    return KeepWhole(f"its forward uses {where}, held outside the module tree (a plain list, dict or helper "
                     "object); kept whole so it computes with it as the source does",
                     unregistered_error(root, held, obj, frontend="fx"))


def _generator(root: nn.Module, gen: torch.Generator) -> KeepWhole:
    """A traced forward draws from a private generator."""
    held = find(root, gen)
    where = held.path(root) if held is not None else "a torch.Generator made in forward"
    return KeepWhole(f"its forward draws from its own torch.Generator ({where}); kept whole so it draws as the source does",
                     generator_error(root, held, gen))


def _reseeded(root: nn.Module, record: Reseed, tracer: _Tracer) -> None:
    """While fx traces (not while a leaf runs whole), a reseed stops the forward: fx would run it once, at
    conversion, and no layer would repeat it."""
    if not tracer.plain:
        raise KeepWhole(
            f"its forward reseeds torch's random number generator ({record.call} at {record.site}); kept whole so "
            "it reseeds on every call",
            StatefulForwardError(
                f"{type(root).__name__}.forward reseeds torch's random number generator ({record.call} at "
                f"{record.site}) while it runs: torch.fx runs that call once, while tracing, and no converted layer "
                "would repeat it, so every random draw after it (dropout, sampling) would differ from the source's. "
                "What to do: seed before calling the model instead of inside forward, or move the seeding into a "
                "submodule, which seqify keeps whole as one layer (it then reseeds on every call)"
            ),
        )


class _Proxy(fx.Proxy):
    """A proxy that asks the tracer for concrete values where Python needs them."""

    tracer: _Tracer

    def __getattr__(self, k: str) -> _Attribute:
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
            self.tracer.autograd.use(Use(kind, what, _user_frame()))
        return self.tracer.create_proxy("call_method", self.attr, (self.root,) + args, kwargs)


class _Tracer(fx.Tracer):
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

    def create_proxy(  # type: ignore[override]
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
                self.autograd.note(Use(GRAD, what, _user_frame()))
        if kind == "placeholder":
            planned = next(self.placeholder_plan, ("baked", None))
            node.meta["seqify_baked"] = planned[0] == "baked"
            if planned[0] == "value" and planned[1] is not UNKNOWN:
                node.meta["val"] = planned[1]
        elif kind not in ("output", "get_attr") and self.fake_mode is not None:
            self._infer(node)
        return proxy

    def create_node(self, kind: str, target: Any, args: Any, kwargs: Any, name: str | None = None, type_expr: Any = None) -> fx.Node:
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
            raise _generator(self.root, a)
        outside_tree = isinstance(a, torch.Tensor) and id(a) not in self._registered()
        if outside_tree and a.requires_grad:
            # trained where no optimizer sees it: a layer can neither bake it nor hold it as the source does (a
            # tensor made in forward is made afresh each call, and stays a constant)
            held = find(self.root, a, self._outside())
            if held is not None or isinstance(a, nn.Parameter):
                raise _unregistered(self.root, held, a)
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
                obj = self.constants[node.target] if node.target in self.constants else self._attr(node.target)
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
                if node.op == "call_function":
                    result = node.target(*args, **kwargs)
                else:
                    result = getattr(args[0], node.target)(*args[1:], **kwargs)
            node.meta["val"] = result
        except Exception as e:  # unknown value: later steps fall back to rules
            node.meta["val_error"] = _first_line(e)
            if not unknown and node.target is torch._assert:
                # The model checks its input (ViT's image size, say) and the example fails that check.
                raise ExampleInputError(
                    f"{type(self.root).__name__}'s own check fails on example_inputs: "
                    f"{_readable(_first_line(e), node.graph)} (at {self._where()}). Pass example inputs the "
                    "model accepts (the shape its check asks for)"
                ) from e
            if not unknown and node.op in ("call_function", "call_method") and not _fake_limit(e):
                # The source would fail here too: tracing took a path the source does not take on this
                # example (e.g. `torch.is_tensor(x)` is False for fx's stand-in). Never bake it into a layer.
                raise Diverged(
                    f"`{_expr(node)}` = {_call_text(node)} fails on the example values ({_first_line(e)}), so "
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
                f"Python control flow ({what}) on the traced value `{_expr(node)}` needs a concrete value; {hint}"
            )
        if isinstance(v, torch.Tensor):
            raise fx.proxy.TraceError(
                f"Python control flow ({what}) on tensor `{_expr(node)}` depends on the tensor's data, not "
                "its shape (data-dependent control flow)"
            )
        return v

    def _where(self) -> str:
        path = next(reversed(self.module_stack.values()))[0] if self.module_stack else ""
        return f"{path or '<model>'}: {_user_frame()}"

    def to_bool(self, obj: fx.Proxy) -> bool:
        result = bool(self._value(obj, "bool()"))
        self.create_proxy("call_function", check_bool, (obj, result, _expr(obj.node), self._where()), {})
        return result

    def concrete(self, obj: fx.Proxy, kind: type) -> Any:
        value = self._value(obj, f"{kind.__name__}()")
        self.create_proxy("call_function", check_equal, (obj, value, _expr(obj.node), self._where()), {})
        return kind(value)

    def concrete_len(self, obj: fx.Proxy) -> int:
        value = self._value(obj, "len()") if not isinstance(obj.node.meta.get("val"), torch.Tensor) else obj.node.meta["val"]
        n = len(value)
        length = self.create_proxy("call_function", len, (obj,), {})
        self.create_proxy("call_function", check_equal, (length, n, _expr(length.node), self._where()), {})
        return n

    def iter(self, obj: fx.Proxy) -> Iterator[Any]:
        n = self.concrete_len(obj)
        return iter([obj[i] for i in range(n)])

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
            raise _unregistered(self.root, find(self.root, m, self._outside()), m) from None
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
                    site = _error_site(e)
                    reason = f"{_first_line(e)} at {site}" if site else _first_line(e)
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


def _readable(text: str, graph: fx.Graph) -> str:
    """``text`` with fx's ``Proxy(name)`` stand-ins replaced by the example value of that node."""
    values = {n.name: n.meta.get("val") for n in graph.nodes}

    def value(m: re.Match[str]) -> str:
        v = values.get(m.group(1))
        return str(v) if isinstance(v, (int, float, bool, torch.SymInt)) else "a traced value"

    return re.sub(r"Proxy\((\w+)\)", value, text)


def _has_tensor(x: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(x))


def _bind_examples(
    model: nn.Module, example_inputs: Any
) -> tuple[list[Param], dict[str, Any], list[tuple[str, Any]]]:
    """Decide which forward parameters carry tensors; return params, fx concrete_args and the placeholder plan."""
    name = type(model).__name__
    sig = inspect.signature(model.forward)
    given = bind_examples(model.forward, name, example_inputs) if example_inputs is not None else {}
    params: list[Param] = []
    concrete: dict[str, Any] = {}
    plan: list[tuple[str, Any]] = []
    for p in sig.parameters.values():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if p.name in given and given[p.name]:
                star = "*" if p.kind == inspect.Parameter.VAR_POSITIONAL else "**"
                error = KeywordArgumentsError if star == "**" else ExampleInputError
                raise error(
                    f"{name}.forward takes {star}{p.name}; the fx frontend converts forwards with named "
                    "parameters: wrap the model in a module whose forward names its inputs"
                    + (", or convert with frontend='export' (or 'auto'), which bakes non-tensor values passed "
                       f"through **{p.name} (output_hidden_states=True)" if star == "**" else "")
                )
            continue
        default = EMPTY if p.default is inspect.Parameter.empty else p.default
        if p.name in given:
            value = given[p.name]
        elif default is EMPTY:
            if example_inputs is not None:
                raise ExampleInputError(f"example_inputs miss the required argument {p.name!r} of {name}.forward")
            params.append(Param(p.name, int(p.kind), default, dynamic=True))
            plan.append(("value", UNKNOWN))
            continue
        else:
            value = default
        if isinstance(value, torch.Tensor):
            params.append(Param(p.name, int(p.kind), default, dynamic=True))
            plan.append(("value", value))
        elif _has_tensor(value):
            leaves, spec = pytree.tree_flatten(value)
            if not all(isinstance(x, torch.Tensor) for x in leaves):
                raise ExampleInputError(
                    f"argument {p.name!r} of {name}.forward mixes tensors with other values; pass "
                    "the non-tensor values as separate arguments"
                )
            params.append(
                Param(p.name, int(p.kind), default, dynamic=True, spec=spec,
                      baked=tuple(None for _ in leaves), tensor_leaves=tuple(True for _ in leaves))
            )
            concrete[p.name] = pytree.tree_unflatten([PH] * len(leaves), spec)
            plan.extend(("value", x) for x in leaves)
        else:
            params.append(Param(p.name, int(p.kind), default, dynamic=False, baked=(value,)))
            concrete[p.name] = value
            plan.append(("baked", None))
    return params, concrete, plan


def _caller(model: nn.Module, example_inputs: Any) -> Any:
    """A function that calls ``model`` on the (real) example inputs."""
    if isinstance(example_inputs, dict):
        return lambda: model(**example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return lambda: model(example_inputs)
    return lambda: model(*example_inputs)


def _strip_baked(graph: fx.Graph) -> None:
    """Remove the placeholders fx makes for baked arguments, and the checks on them (the binder checks)."""
    for ph in [n for n in graph.nodes if n.op == "placeholder" and n.meta.get("seqify_baked")]:
        doomed: list[fx.Node] = []
        frontier = [ph]
        while frontier:
            n = frontier.pop()
            if n not in doomed:
                doomed.append(n)
                frontier.extend(n.users)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for n in sorted(doomed, key=order.__getitem__, reverse=True):
            graph.erase_node(n)


def _output_structure(graph: fx.Graph, raw: Any) -> Any:
    """The source's own output structure, nodes as leaves (fx's node args turn dicts into immutable dicts)."""
    out = next(n for n in graph.nodes if n.op == "output")
    info = getattr(graph._codegen, "pytree_info", None)
    if info is not None:
        graph._codegen = fx.graph.CodeGen()
        if info.out_spec is not None:
            structure = pytree.tree_unflatten(list(out.args[0]), info.out_spec)
            out.args = (structure,)
            return structure
        return out.args[0]
    leaves, spec = pytree.tree_flatten(raw)
    if any(isinstance(x, (dict, list, tuple)) for x in leaves):
        return out.args[0]
    return pytree.tree_unflatten([x.node if isinstance(x, fx.Proxy) else x for x in leaves], spec)


def trace(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    leaf_types: Sequence[type] = (),
    leaf_paths: Sequence[str] = (),
    depth: int | None = None,
) -> Traced:
    """Trace ``model`` into a torch.fx graph without changing it.

    Leaves are torch.nn modules, ``leaf_types``, ``leaf_paths`` and modules deeper than ``depth``. A
    submodule whose forward cannot be traced is kept whole (opaque). With ``example_inputs`` every node
    carries its example value in ``meta['val']`` (fake tensors: no data, no compute), Python control flow
    on shapes is resolved, and each decision becomes a run-time guard node.
    """
    name = type(model).__name__
    hooked = [h for h in HOOK_DICTS if getattr(model, h, None)]
    if hooked:
        raise HookError(
            f"{name} itself has {', '.join(h.strip('_').replace('_', ' ') for h in hooked)}; a converted "
            "model cannot run hooks of the module it flattens. Remove them before converting (hooks on "
            "submodules are fine: those submodules are kept whole so their hooks still run)."
        )
    params, concrete, plan = _bind_examples(model, example_inputs)
    kept: dict[str, Opaque] = {}  # submodules kept whole because their forward writes attributes
    # fx traces type(model).forward: under decorators that pass these inputs through unchanged, it traces
    # the function they wrap (the class's own forward is put back before anything runs the model)
    inner = passthrough(model, example_inputs)
    cls, wrapped = type(model), type(model).__dict__.get("forward")
    if inner is not None:
        cls.forward = inner  # type: ignore[method-assign]
    try:
        for _ in range(64):
            try:
                tracer, graph, writes = _trace_once(model, example_inputs, concrete, plan, kept, leaf_types, leaf_paths,
                                                    depth)
            except UntraceableError as e:
                check_decorated(model, e)  # a (self, *args, **kwargs) decorator is the cause: say so
                raise
            if not writes and not tracer.autograd.uses:
                break
            _keep_users(model, tracer.autograd.uses, kept)
            if writes:
                _keep_writers(model, writes, kept, tracer)
        else:  # pragma: no cover - every round keeps a module whole or raises at the root
            raise StatefulForwardError(f"{name}: attribute writes could not be isolated; convert with depth=1")
    finally:
        if inner is not None:
            if wrapped is None:
                del cls.forward
            else:
                cls.forward = wrapped  # type: ignore[method-assign]
    for ph in graph.nodes:
        if ph.op == "placeholder" and str(ph.target).startswith("*") and ph.users:
            raise UntraceableError(
                f"{name}.forward reads {ph.target}: seqify converts forwards whose inputs are named parameters. "
                f"What to do: wrap the model in a module whose forward names each input (def forward(self, x, "
                f"mask): return model(x, mask=mask)) and convert that."
            )
    _strip_baked(graph)
    output = _output_structure(graph, tracer.raw_output)
    used = {n.target for n in graph.nodes if n.op == "get_attr"}
    constants = {k: v for k, v in tracer.constants.items() if k in used}
    called = {n.target for n in graph.nodes if n.op == "call_module"}
    opaque = [o for p, o in tracer.opaque.items() if p in called]
    guards = [
        Guard(n.args[2], n.args[1], n.args[3])
        for n in graph.nodes
        if n.op == "call_function" and n.target in (check_bool, check_equal)
    ]
    return Traced(
        model=model,
        graph=graph,
        constants=constants,
        opaque=opaque,
        inputs=InputSpec(name, params),
        training=model.training,
        has_values=example_inputs is not None,
        guards=guards,
        output=output,
        flattened=[("", model), *((p, m) for p, m in tracer.flattened.items() if p)],
    )


def _trace_once(
    model: nn.Module,
    example_inputs: Any,
    concrete: dict[str, Any],
    plan: list[tuple[str, Any]],
    kept: dict[str, Opaque],
    leaf_types: Sequence[type],
    leaf_paths: Sequence[str],
    depth: int | None,
) -> tuple[_Tracer, fx.Graph, list[_Update]]:
    """One fx trace; returns the tracer, the graph, and the attributes a traced forward wrote and the state it
    changed in place without fx recording it."""
    name = type(model).__name__
    fake_mode = real = None
    if example_inputs is not None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        plan = [(kind, fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for kind, v in plan]
        real = RealRun(model, _caller(model, example_inputs), lambda: preserved(model))
    tracer = _Tracer(
        leaf_types=tuple(leaf_types),
        leaf_paths=frozenset(leaf_paths),
        depth=depth,
        fake_mode=fake_mode,
        placeholders=plan,
        real=real,
    )
    tracer.opaque.update(kept)
    with preserved(model) as held_changed, buffers_kept(model) as buffers_changed, \
            torch.random.fork_rng(devices=[]), recording_shape_ops(), \
            torch.set_grad_enabled(torch.is_grad_enabled()):  # a forward may leave grad mode changed
        before = attributes(model)
        try:
            with reseeds(model, lambda record: _reseeded(model, record, tracer)):
                graph = tracer.trace(model, concrete_args=concrete or None)
            tracer.autograd.left_open(0)
        except SeqifyError:
            raise
        except KeepWhole as e:
            raise e.error from None
        except Exception as e:
            if "" in tracer.autograd.uses:
                raise refusal(name, tracer.autograd.uses[""]) from e
            site = _error_site(e)
            raise UntraceableError(
                f"{name}.forward cannot be traced: {_first_line(e)}\n"
                + (f"  at {site}\n" if site else "")
                + "What to do: pass example_inputs=... to seqify.convert so shape-dependent branches are "
                "resolved from example shapes; move data-dependent code (branches on tensor values, "
                "non-torch calls) into a submodule, which seqify then keeps whole as one opaque layer; "
                "or list that submodule in leaf_paths=[...]."
            ) from e
        writes = [_Update(path, name, "attribute") for path, names in writes_since(model, before).items()
                  for name in names]
        # In-place changes made while tracing that fx did not record (`self.n += 1` on a buffer, a draw from
        # a private generator with fixed sizes): they ran once, at conversion, and no layer repeats them.
        for buffer in buffers_changed():
            owner, _, attr = buffer.rpartition(".")
            writes.append(_Update(owner, attr, "buffer"))
        for held in held_changed():
            writes.append(_Update(held.owner, held.where, "generator" if isinstance(held.obj, torch.Generator) else "tensor"))
    if "" in tracer.autograd.uses:
        raise refusal(name, tracer.autograd.uses[""])
    if real is not None and real.error is not None and source_error(
        model, _caller(model, example_inputs), lambda: preserved(model)) is not None:
        # An opaque submodule's value came from running the source, and the source raised, outside a trace
        # too: the example inputs are wrong, not the trace (a later "value unknown" error would blame the
        # conversion). A source that raises only while traced (transformers builds masks then) is the
        # trace's divergence, which the self-check names.
        raise raises_itself(name, real.error)
    return tracer, graph, writes


def _keep_users(model: nn.Module, uses: dict[str, Use], kept: dict[str, Opaque]) -> None:
    """Keep whole each submodule whose forward uses autograd context a graph cannot hold (a tensor hook it
    registers, autograd it runs): called whole, it does so on every call as the source does."""
    for path, use in uses.items():
        if path and path not in kept:
            module = model.get_submodule(path)
            kept[path] = Opaque(path, type(module).__name__, keep_reason(use))


def _keep_writers(model: nn.Module, writes: list[_Update], kept: dict[str, Opaque], tracer: _Tracer) -> None:
    """Keep whole each module whose attributes a traced forward wrote, or whose state it changed in place
    unrecorded (its own forward, or failing that its parent's), so the source's module changes on every
    call; refuse when that is the model itself."""
    by_owner: dict[str, list[_Update]] = {}
    for w in writes:
        by_owner.setdefault(w.owner, []).append(w)
    for path, changes in by_owner.items():
        owner = path
        while owner and owner not in tracer.flattened:
            owner = owner.rpartition(".")[0]  # not traced through: the write comes from an enclosing forward
        attrs = ", ".join(f"{path}.{c.name}" if path else f"self.{c.name}" for c in changes)
        kinds = {c.kind for c in changes}
        if not owner:
            raise _stateful(model, kinds, attrs, changes)
        module = model.get_submodule(owner)
        what = (f"changes the attribute(s) {attrs}" if kinds == {"attribute"} else
                f"changes {attrs} in place where fx does not record it")
        kept[owner] = Opaque(owner, type(module).__name__, f"its forward {what}; kept whole so the source module changes on every call")


def _stateful(model: nn.Module, kinds: set[str], attrs: str, updates: list[_Update]) -> SeqifyError:
    """The refusal of a model whose own forward changes state a converted model would not change."""
    name = type(model).__name__
    if "generator" in kinds:
        gen = next(u for u in updates if u.kind == "generator")
        held = next((h for h in outside(model) if (h.owner, h.where) == (gen.owner, gen.name)), None)
        return generator_error(model, held, held.obj if held is not None else None)
    if "tensor" in kinds:
        return StatefulForwardError(
            f"{name}.forward changes {attrs} in place, a tensor {name} keeps outside its module tree (a plain "
            "attribute, list, dict or helper object, not a buffer), with values torch.fx does not record: fx runs "
            "the change once, while tracing, and a converted model would never make it. What to do: convert with "
            "frontend='export' (or 'auto'), which records in-place changes; register it as a buffer "
            "(self.register_buffer(...)); or move the change into a submodule, which seqify keeps whole as one layer."
        )
    if "buffer" in kinds:
        return StatefulForwardError(
            f"{name}.forward updates its buffer(s) {attrs} in place with values torch.fx does not record "
            "(`self.n += 1` runs once, while tracing), so a converted model would never update them. What to do: "
            "convert with frontend='export' (or 'auto', which falls back to it), which records the update; or "
            "move the update into a submodule, which seqify keeps whole as one layer (it then updates them on "
            "every call)."
        )
    return StatefulForwardError(
        f"{name}.forward changes the Python attribute(s) {attrs} while it runs (e.g. a step counter, "
        "`self.calls += 1`); a converted model would bake the first value in and be wrong from the "
        "second call on. What to do: move that state change into a submodule (seqify keeps a "
        "submodule that writes its attributes whole, so the change happens on every call), or keep "
        "the state in a buffer updated in place (self.calls.add_(1))."
    )
