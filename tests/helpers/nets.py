"""Random DAG nets for property tests: a program of ops over NCHW tensors, interpreted by a module.

A :class:`Program` is plain data (its ``repr`` is valid Python), so a failing example that hypothesis
shrinks can be pasted back as an ``@example(...)`` regression test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

__all__ = ["Program", "ProgramNet", "PipeCase", "build", "programs", "pipe_cases", "example_inputs", "KINDS", "features"]

MAX_C = 8
SIDE = 4

#: Every op kind a program can hold (``test_fuzz`` checks that the strategy reaches each one).
KINDS = (
    "conv", "reuse", "bn", "inorm", "linear", "relu_", "act", "add", "mul", "iadd", "alias_iadd", "alias_imul", "setitem",
    "cat", "chunk", "reshape", "index", "dropout", "mutate", "mean",
)


@dataclass(frozen=True)
class Program:
    """Inputs' channel counts, ops (each reads earlier values by index), and which values to return.

    ``reuse`` ops call an earlier conv a second time; ``alias_*`` ops apply ``x += y`` / ``x *= y`` to an
    earlier value itself, so every later read of that value (an alias) sees the change.
    """

    inputs: tuple[int, ...]
    ops: tuple[tuple[Any, ...], ...]
    outputs: tuple[int, ...]
    as_dict: bool = False
    channels: tuple[int, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.channels:
            channels = list(self.inputs)
            for op in self.ops:
                channels.append(_channels(op, channels))
            object.__setattr__(self, "channels", tuple(channels))

    def __repr__(self) -> str:
        return f"Program(inputs={self.inputs}, ops={self.ops}, outputs={self.outputs}, as_dict={self.as_dict})"


class ProgramNet(nn.Module):
    """Runs a :class:`Program`; modules are created once, so 'reuse' ops call a module twice."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        self.convs = nn.ModuleList()
        self.norms = nn.ModuleList()
        self.linears = nn.ModuleList()
        self.inorms = nn.ModuleList()  # InstanceNorm with running statistics
        self.relu_inplace = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.25)
        channels = list(program.inputs)
        for op in program.ops:
            kind = op[0]
            if kind == "conv":
                _, a, cout, k = op
                self.convs.append(nn.Conv2d(channels[a], cout, k, padding=k // 2))
            elif kind == "bn":
                self.norms.append(nn.BatchNorm2d(channels[op[1]]))
            elif kind == "linear":
                self.linears.append(nn.Linear(SIDE, SIDE))
            elif kind == "inorm":
                self.inorms.append(nn.InstanceNorm2d(channels[op[1]], affine=True, track_running_stats=True))
            channels.append(_channels(op, channels))

    def run(self, *xs: torch.Tensor) -> Any:
        values = list(xs)
        convs = iter(self.convs)
        norms = iter(self.norms)
        linears = iter(self.linears)
        inorms = iter(self.inorms)
        for op in self.program.ops:
            kind = op[0]
            if kind == "conv":
                y = next(convs)(values[op[1]])
            elif kind == "reuse":
                y = self.convs[op[2]](values[op[1]])
            elif kind == "bn":
                y = next(norms)(values[op[1]])
            elif kind == "linear":
                y = next(linears)(values[op[1]])
            elif kind == "inorm":
                y = next(inorms)(values[op[1]])
            elif kind == "relu_":
                y = self.relu_inplace(values[op[1]] * 1.0)
            elif kind == "act":
                y = (torch.relu, torch.sigmoid, F.gelu, torch.tanh)[op[2]](values[op[1]])
            elif kind in ("add", "mul"):
                a, b = values[op[1]], values[op[2]]
                c = min(self.program.channels[op[1]], self.program.channels[op[2]])
                y = a[:, :c] + b[:, :c] if kind == "add" else a[:, :c] * b[:, :c]
            elif kind == "iadd":
                y = values[op[1]] * 1.0
                y += values[op[2]].sum(1, keepdim=True)
            elif kind == "alias_iadd":  # x += y on the value itself: values[op[1]] is y, modified
                y = values[op[1]]
                y += values[op[2]].sum(1, keepdim=True)
            elif kind == "alias_imul":
                y = values[op[1]]
                y *= torch.sigmoid(values[op[2]].mean(1, keepdim=True))
            elif kind == "setitem":  # an indexed assignment into the value itself
                y = values[op[1]]
                y[:, :1] = 0.25 if op[2] < 0 else values[op[2]][:, :1] * 0.5
            elif kind == "cat":
                y = torch.cat([values[op[1]], values[op[2]]], dim=1)
            elif kind == "chunk":
                y = values[op[1]].chunk(2, dim=1)[op[2]]
            elif kind == "reshape":
                a = values[op[1]]
                y = a.flatten(2).transpose(1, 2).reshape(a.size(0), a.size(2), a.size(3), -1).permute(0, 3, 1, 2)
            elif kind == "index":
                y = values[op[1]][:, list(op[2])]
            elif kind == "dropout":
                y = self.drop(values[op[1]]) if op[2] else F.dropout(values[op[1]], 0.5, training=True)
            elif kind == "mutate":  # in place on a value that may be read before and after
                y = values[op[1]].mul_(0.5)
            elif kind == "mean":
                y = values[op[1]] - values[op[1]].mean(dim=(2, 3), keepdim=True)
            else:
                raise ValueError(kind)
            values.append(y)
        outs = [values[i] for i in self.program.outputs]
        if self.program.as_dict:
            return {f"out{k}": v for k, v in enumerate(outs)}
        return tuple(outs) if len(outs) > 1 else outs[0]


class Net1(ProgramNet):
    def forward(self, x0: torch.Tensor) -> Any:
        return self.run(x0)


class Net2(ProgramNet):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> Any:
        return self.run(x0, x1)


class Net3(ProgramNet):
    def forward(self, x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor) -> Any:
        return self.run(x0, x1, x2)


def build(program: Program) -> ProgramNet:
    """The net for ``program``, with a forward taking exactly its inputs."""
    return (Net1, Net2, Net3)[len(program.inputs) - 1](program)


def _channels(op: tuple[Any, ...], channels: list[int]) -> int:
    kind = op[0]
    if kind == "conv":
        return op[2]
    if kind == "reuse":
        return op[3][1]
    if kind in ("add", "mul"):
        return min(channels[op[1]], channels[op[2]])
    if kind == "cat":
        return channels[op[1]] + channels[op[2]]
    if kind == "chunk":
        c = channels[op[1]]
        return (c + 1) // 2 if op[2] == 0 else c // 2
    if kind == "index":
        return len(op[2])
    return channels[op[1]]


@st.composite
def programs(draw: st.DrawFn, max_ops: int = 12, random_ops: bool = True, min_ops: int = 1) -> Program:
    """Random programs.

    ``random_ops=False`` makes programs a pipeline must reproduce: no dropout (a pipeline draws random
    numbers in clock-cycle order, not micro-batch by micro-batch), and no in-place op on a tensor that
    views of it share (a pipeline copies values between partitions, and a copy is no longer a view).
    """
    inputs = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    channels = list(inputs)
    obj = list(range(len(inputs)))  # which tensor object each value is
    family = list(range(len(inputs)))  # which storage each value views
    convs: list[tuple[int, int, int]] = []  # (in channels, out channels, kernel)
    ops: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(min_ops, max_ops))):
        n = len(channels)
        # Prefer recent values (chains), sometimes reach far back (long skips).
        pick = st.one_of(st.integers(max(0, n - 2), n - 1), st.integers(0, n - 1))
        a = draw(pick)
        kinds = [k for k in KINDS if k not in ("chunk", "reuse") and (random_ops or k != "dropout")]
        if channels[a] >= 2:
            kinds.append("chunk")
        if any(c[0] == channels[a] for c in convs):
            kinds += ["reuse", "reuse"]  # modules called twice: also how partitions come to share parameters
        kind = draw(st.sampled_from(kinds))
        if not random_ops and kind in ("mutate", "alias_iadd", "alias_imul", "setitem"):
            if {obj[i] for i in range(n) if family[i] == family[a]} != {obj[a]}:
                continue
        if kind == "conv":
            op: tuple[Any, ...] = ("conv", a, draw(st.integers(1, 4)), draw(st.sampled_from([1, 3])))
            convs.append((channels[a], op[2], op[3]))
        elif kind == "reuse":
            index = draw(st.sampled_from([i for i, c in enumerate(convs) if c[0] == channels[a]]))
            op = ("reuse", a, index, convs[index])
        elif kind in ("bn", "inorm", "relu_", "reshape", "mean", "linear", "mutate"):
            op = (kind, a)
        elif kind == "act":
            op = ("act", a, draw(st.integers(0, 3)))
        elif kind == "setitem":  # assign a value computed just before, or a constant (-1)
            op = (kind, a, draw(st.one_of(st.just(-1), pick)))
        elif kind in ("add", "mul", "iadd", "alias_iadd", "alias_imul"):
            op = (kind, a, draw(pick))
        elif kind == "cat":
            b = draw(pick)
            if channels[a] + channels[b] > MAX_C:
                continue
            op = ("cat", a, b)
        elif kind == "chunk":
            op = ("chunk", a, draw(st.integers(0, 1)) if channels[a] >= 2 else 0)
        elif kind == "index":
            idx = draw(st.lists(st.integers(0, channels[a] - 1), min_size=1, max_size=4))
            op = ("index", a, tuple(idx))
        else:
            op = ("dropout", a, draw(st.booleans()))
        ops.append(op)
        channels.append(_channels(op, channels))
        same = kind in ("mutate", "alias_iadd", "alias_imul", "setitem")
        obj.append(obj[a] if same else n)
        family.append(family[a] if same or kind in ("chunk", "reshape") else n)
    if not ops:
        ops.append(("conv", 0, 2, 1))
        channels.append(2)
    first = len(inputs)
    outputs = tuple(draw(st.lists(st.integers(first, len(channels) - 1), min_size=1, max_size=3, unique=True)))
    if (len(channels) - 1) not in outputs:
        outputs = outputs + (len(channels) - 1,)
    return Program(inputs, tuple(ops), outputs, draw(st.booleans()), tuple(channels))


@dataclass(frozen=True)
class PipeCase:
    """A program and how to pipeline it: cut points (taken modulo the converted layer count), micro-batches
    and checkpointing. Plain data, so a shrunk failure pastes back as an ``@example``."""

    program: Program
    cuts: tuple[int, ...]
    chunks: int
    checkpoint: str

    def balance(self, layers: int) -> list[int]:
        """Layers per partition: 2 or 3 non-empty partitions (fewer when cuts coincide)."""
        points = sorted({1 + c % (layers - 1) for c in self.cuts})
        return [b - a for a, b in zip([0, *points], [*points, layers])]


@st.composite
def pipe_cases(draw: st.DrawFn, max_ops: int = 12) -> PipeCase:
    program = draw(programs(max_ops=max_ops, random_ops=False, min_ops=3))
    cuts = tuple(draw(st.lists(st.integers(0, 1000), min_size=1, max_size=2)))
    return PipeCase(program, cuts, draw(st.integers(1, 4)), draw(st.sampled_from(["never", "always", "except_last"])))


def features(program: Program) -> set[str]:
    """What a program exercises: op kinds and the structures the fuzz tests must reach."""
    found = {op[0] for op in program.ops}
    reads: dict[int, int] = {}
    for i, op in enumerate(program.ops):
        at = len(program.inputs) + i
        for a in op[1:3] if op[0] in ("add", "mul", "iadd", "alias_iadd", "alias_imul", "setitem", "cat") else op[1:2]:
            if a < 0:
                continue
            reads[a] = reads.get(a, 0) + 1
            if at - a >= 4:
                found.add("long skip")
    if any(r >= 3 for r in reads.values()):
        found.add("multi-use value")
    if program.as_dict:
        found.add("dict output")
    if len(program.outputs) > 1:
        found.add("several outputs")
    if len(program.inputs) > 1:
        found.add("several inputs")
    if any(op[0] in ("mutate", "alias_iadd", "alias_imul", "setitem") and op[1] < len(program.inputs) for op in program.ops):
        found.add("input mutated")
    return found


def example_inputs(program: Program, batch: int = 3, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, c, SIDE, SIDE, generator=g) for c in program.inputs)


class Shares(nn.Module):
    """Tensors several converted layers hold: tied weights, a weight read directly, BatchNorm's running mean
    read by a later layer, a buffer read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("offset", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.a(x) + self.offset)
        h = self.b(torch.relu(h + self.norm.running_mean)) + self.a.weight.sum(0)
        return h * self.offset
