"""Layer: one generated step of a converted model, compiled from a small program of ops."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from seqify.skip.namespace import SkipKey
from seqify.skip.skippable import Skippable
from seqify.skip.tracker import current_tracker

__all__ = ["Ref", "Attr", "Op", "Program", "Layer", "grad_mode"]


class Ref(NamedTuple):
    """A value computed or received inside the layer."""

    name: str


class Attr(NamedTuple):
    """A parameter, buffer or constant the layer holds."""

    name: str


@dataclass(frozen=True)
class Op:
    """``out = target(*args, **kwargs)``; ``kind`` is ``call_function``, ``call_method`` or ``call_module``;
    ``grad``: the ``(grad enabled, inference mode or None)`` it runs under, where the source ran it inside a
    grad-mode region (``torch.no_grad()``, ``enable_grad``, ``set_grad_enabled``, ``inference_mode``); None:
    the caller's mode."""

    out: str
    kind: str
    target: Any
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    grad: tuple[bool, bool | None] | None = None


class Program(NamedTuple):
    """What a layer runs: its input names, ops, output names, and the skips it pops and stashes."""

    inputs: tuple[str, ...]
    ops: tuple[Op, ...]
    outputs: tuple[str, ...]
    pops: tuple[tuple[SkipKey, str], ...]
    stashes: tuple[tuple[SkipKey, str], ...]


@contextmanager
def grad_mode(enabled: bool, inference: bool | None) -> Iterator[None]:
    """Run an op under the grad mode (and inference mode, unless None) it ran under in the source."""
    if inference is None:
        with torch.set_grad_enabled(enabled):
            yield
        return
    with torch.inference_mode(inference), torch.set_grad_enabled(enabled):
        yield


class Layer(Skippable):
    """A step of a converted model.

    It takes the value the previous layer carries (a tensor, or a tuple of tensors), pops the skips it
    needs, runs its ops, stashes what later layers need, and returns what the next layer reads. Its
    ``forward`` is generated Python, compiled once per distinct program shape. A layer of a model whose ops
    differ between train and eval mode holds a second program, ``other``, run in ``other_training`` mode.
    """

    def __init__(
        self,
        *,
        inputs: Sequence[str],
        ops: Sequence[Op],
        outputs: Sequence[str],
        pops: Sequence[tuple[SkipKey, str]] = (),
        stashes: Sequence[tuple[SkipKey, str]] = (),
        modules: Mapping[str, nn.Module] | None = None,
        parameters: Mapping[str, nn.Parameter] | None = None,
        buffers: Mapping[str, tuple[torch.Tensor, bool]] | None = None,
    ) -> None:
        super().__init__()
        self.inputs = tuple(inputs)
        self.ops = tuple(ops)
        self.outputs = tuple(outputs)
        self.pops = tuple(pops)
        self.stashes = tuple(stashes)
        for name, module in (modules or {}).items():
            self.add_module(name, module)
        for name, param in (parameters or {}).items():
            self.register_parameter(name, param)
        for name, (tensor, persistent) in (buffers or {}).items():
            self.register_buffer(name, tensor, persistent=persistent)
        self.other: Program | None = None
        self.other_training = not self.training
        self._fn = _compile(self)
        self._other_fn: Callable[[Layer, Any], Any] | None = None

    def program(self) -> Program:
        """The program this layer runs in the mode it was converted in."""
        return Program(self.inputs, self.ops, self.outputs, self.pops, self.stashes)

    def programs(self) -> tuple[Program, ...]:
        """Every program this layer runs: its own, and the other mode's where it holds one."""
        return (self.program(),) if self.other is None else (self.program(), self.other)

    def run_in_other_mode(self, program: Program, training: bool) -> None:
        """Run ``program`` whenever this layer's ``training`` is ``training``, and its own program otherwise."""
        self.other, self.other_training = program, training
        self._other_fn = _compile(program)

    def forget_other_mode(self) -> None:
        """Run only this layer's own program again."""
        self.other, self._other_fn = None, None

    def stash_keys(self) -> tuple[SkipKey, ...]:
        return tuple(key for key, _ in self.stashes)

    def pop_keys(self) -> tuple[SkipKey, ...]:
        return tuple(key for key, _ in self.pops)

    def forward(self, input: Any) -> Any:
        if self._other_fn is not None and self.training == self.other_training:
            return self._other_fn(self, input)
        return self._fn(self, input)

    @property
    def code(self) -> str:
        """The generated source of this layer's forward (and of its program for the other mode, if any)."""
        if self.other is None:
            return _generate(self)[0]
        mode = "train" if self.other_training else "eval"
        return _generate(self)[0] + f"\n# in {mode} mode:\n" + _generate(self.other)[0]

    def extra_repr(self) -> str:
        parts = []
        if self.pops:
            parts.append("pop=[" + ", ".join(k[1] for k, _ in self.pops) + "]")
        parts.append(" ; ".join(_describe(op) for op in self.ops) or "pass")
        if self.stashes:
            parts.append("stash=[" + ", ".join(k[1] for k, _ in self.stashes) + "]")
        if self.other is not None:
            parts.append(f"(other ops in {'train' if self.other_training else 'eval'} mode)")
        return "  ".join(parts)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_fn", None)
        state.pop("_other_fn", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("other", None)  # layers saved before layers held a program per mode
        state.setdefault("other_training", not state.get("training", True))
        self.__dict__.update(state)
        self._fn = _compile(self)
        self._other_fn = None if self.other is None else _compile(self.other)


def _describe(op: Op) -> str:
    def show(a: Any) -> str:
        if isinstance(a, (Ref, Attr)):
            return a.name
        if isinstance(a, (tuple, list)) and not hasattr(a, "_fields"):
            inner = ", ".join(show(x) for x in a)
            return f"({inner})" if isinstance(a, tuple) else f"[{inner}]"
        return repr(a) if not callable(a) else getattr(a, "__name__", "f")

    args = [show(a) for a in op.args] + [f"{k}={show(v)}" for k, v in op.kwargs.items()]
    if op.kind == "call_method":
        return f"{op.out} = {args[0]}.{op.target}({', '.join(args[1:])})" + _mode(op)
    name = op.target if op.kind == "call_module" else getattr(op.target, "__name__", str(op.target))
    return f"{op.out} = {name}({', '.join(args)})" + _mode(op)


def _mode(op: Op) -> str:
    """The grad mode an op runs under, where it is not the caller's: `` [no grad]``, `` [grad]``, `` [inference]``."""
    grad = getattr(op, "grad", None)
    if grad is None:
        return ""
    return " [inference]" if grad[1] else " [grad]" if grad[0] else " [no grad]"


_SIMPLE = (bool, int, str, type(None))
_cache: dict[str, Callable[..., Callable[[Layer, Any], Any]]] = {}


def _generate(layer: Layer | Program) -> tuple[str, list[Any]]:
    bindings: list[Any] = [current_tracker]
    names: dict[int, str] = {}

    def bind(obj: Any) -> str:
        key = id(obj)
        if key not in names:
            names[key] = f"__b{len(bindings)}"
            bindings.append(obj)
        return names[key]

    def render(a: Any) -> str:
        if isinstance(a, Ref):
            return a.name
        if isinstance(a, Attr):
            return f"self.{a.name}"
        if type(a) in _SIMPLE:
            return repr(a)
        if type(a) is float and math.isfinite(a):
            return repr(a)
        if a is Ellipsis:
            return "..."
        if type(a) is tuple:
            inner = ", ".join(render(x) for x in a)
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        if type(a) is list:
            return "[" + ", ".join(render(x) for x in a) + "]"
        if type(a) is dict:
            return "{" + ", ".join(f"{render(k)}: {render(v)}" for k, v in a.items()) + "}"
        if type(a) is slice:
            return f"slice({render(a.start)}, {render(a.stop)}, {render(a.step)})"
        if isinstance(a, tuple) and hasattr(a, "_fields"):
            return f"{bind(type(a))}(" + ", ".join(render(x) for x in a) + ")"
        return bind(a)

    def call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        return ", ".join([render(a) for a in args] + [f"{k}={render(v)}" for k, v in kwargs.items()])

    body: list[str] = []
    if len(layer.inputs) == 1:
        body.append(f"{layer.inputs[0]} = input")
    elif layer.inputs:
        body.append(", ".join(layer.inputs) + ", = input")
    if layer.pops or layer.stashes:
        body.append("__t = __b0()")
    for key, name in layer.pops:
        body.append(f"{name} = __t.pop({bind(key)})")
    for op in layer.ops:
        if op.kind == "call_module":
            line = f"{op.out} = self.{op.target}({call(op.args, op.kwargs)})"
        elif op.kind == "call_method":
            line = f"{op.out} = {render(op.args[0])}.{op.target}({call(op.args[1:], op.kwargs)})"
        elif op.target is operator.getitem and not op.kwargs:
            line = f"{op.out} = {render(op.args[0])}[{render(op.args[1])}]"
        else:
            line = f"{op.out} = {bind(op.target)}({call(op.args, op.kwargs)})"
        grad = getattr(op, "grad", None)  # layers saved before ops carried a grad mode have none
        if grad is None:
            body.append(line)
        else:
            body += [f"with {bind(grad_mode)}({grad[0]!r}, {grad[1]!r}):", f"    {line}"]
    for key, name in layer.stashes:
        body.append(f"__t.stash({bind(key)}, {name})")
    if len(layer.outputs) == 1:
        body.append(f"return {layer.outputs[0]}")
    else:
        body.append("return (" + "".join(f"{o}, " for o in layer.outputs) + ")")
    params = ", ".join(f"__b{i}" for i in range(len(bindings)))
    source = "\n".join(
        [f"def __make({params}):", "    def forward(self, input):"]
        + [f"        {line}" for line in body]
        + ["    return forward"]
    )
    return source, bindings


def _compile(layer: Layer | Program) -> Callable[[Layer, Any], Any]:
    source, bindings = _generate(layer)
    make = _cache.get(source)
    if make is None:
        scope: dict[str, Any] = {}
        exec(compile(source, "<seqify layer>", "exec"), scope)
        make = _cache[source] = scope["__make"]
    return make(*bindings)
