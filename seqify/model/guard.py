"""Guards: run-time checks that an input takes the branches the conversion was traced with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from seqify.errors import SpecializationError

__all__ = ["Guard", "check_bool", "check_equal"]


@dataclass(frozen=True)
class Guard:
    """A decision the tracer made from an example input's shape, re-checked on every call."""

    expr: str
    expected: Any
    where: str

    def __str__(self) -> str:
        return f"{self.expr} == {self.expected!r}  ({self.where})"


def _fail(guard: Guard, got: Any) -> SpecializationError:
    return SpecializationError(
        f"this input is outside the shapes the converted model is valid for: while tracing, "
        f"`{guard.expr}` was {guard.expected!r} at {guard.where}, so the conversion took that branch; "
        f"this input gives {got!r}. Convert again with example_inputs shaped like this input "
        "(seq.guards lists every such condition)."
    )


def check_bool(value: Any, expected: bool, expr: str, where: str) -> None:
    """Raise SpecializationError unless ``bool(value)`` is what the trace saw."""
    if bool(value) is not expected:
        raise _fail(Guard(expr, expected, where), bool(value))


def check_equal(value: Any, expected: Any, expr: str, where: str) -> None:
    """Raise SpecializationError unless ``value`` equals what the trace saw."""
    if value != expected:
        raise _fail(Guard(expr, expected, where), value)
