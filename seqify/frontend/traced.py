"""The traced form every frontend hands to convert (Traced, Opaque, example values on nodes), and where in the
user's code an error arose."""

from __future__ import annotations

import inspect
import linecache
import os
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from seqify._paths import PACKAGE_DIR
from seqify.model.guard import Guard
from seqify.model.signature import InputSpec

__all__ = [
    "UNKNOWN", "Opaque", "Traced", "attribute", "is_cache", "value_of", "caller", "error_site", "first_line",
    "user_frame",
]


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


#: The value of a node whose example value could not be computed (or when there were no example inputs).
UNKNOWN: Any = _Unknown()

_HERE = os.path.join(PACKAGE_DIR, "")  # trailing separators: torchvision's folder is not torch's
_TORCH = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "")


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
    """A traced model: its graph (nodes carry ``meta['val']`` when example inputs were given) and what tracing
    learnt."""

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
        is_module = isinstance(obj, nn.Module)
        tables = [obj.__dict__.get(t) for t in ("_parameters", "_buffers", "_modules")] if is_module else []
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


def user_frame() -> str:
    """Where the running code is in the user's source (file:line and the line), skipping torch and seqify."""
    frame = inspect.currentframe()
    while frame is not None:
        file = os.path.abspath(frame.f_code.co_filename)
        if not file.startswith(_TORCH) and not file.startswith(_HERE) and not file.startswith("<"):
            line = linecache.getline(file, frame.f_lineno).strip()
            where = f"{os.path.basename(file)}:{frame.f_lineno}"
            return f"{where} ({line})" if line else where
        frame = frame.f_back
    return "<unknown location>"


def error_site(error: BaseException) -> str:
    """Where ``error`` was raised in the user's source (file:line in function), or "" if only torch and seqify."""
    frames = traceback.extract_tb(error.__traceback__)
    for fs in reversed(frames):
        file = os.path.abspath(fs.filename)
        if not file.startswith(_TORCH) and not file.startswith(_HERE) and not file.startswith("<"):
            code = f" ({fs.line.strip()})" if fs.line else ""
            return f"{os.path.basename(file)}:{fs.lineno} in {fs.name}{code}"
    return ""


def first_line(error: BaseException) -> str:
    """``error`` as one line: its type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def caller(model: nn.Module, example_inputs: Any) -> Any:
    """A function that calls ``model`` on the (real) example inputs."""
    if isinstance(example_inputs, dict):
        return lambda: model(**example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return lambda: model(example_inputs)
    return lambda: model(*example_inputs)
