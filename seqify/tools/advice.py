"""Error texts for the command line: no tracer internals, hints in CLI syntax, advice that fits the cause."""

from __future__ import annotations

import re

__all__ = ["for_cli", "DATA_DEPENDENT", "data_dependent_advice", "costs_depend_on_data"]

# Tracer internals that leak into messages: fx proxies formatted into an f-string at trace time
# ("Expected 224 but got Proxy(getitem_2)"), graph expressions over node names ("`(sum_1 > 0)`"), and the
# fake-tensor exceptions behind "cannot be costed from shapes".
_INTERNALS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"Proxy\([\w.]+\)"), "<a value known only when the model runs>"),
    (re.compile(r"on (?:the traced value|tensor) `[^`]*`"), "on a traced tensor"),
    (re.compile(r"\s*\((?:DataDependentOutputException|DynamicOutputShapeException): [^)]*\)"), ""),
]

# Python-API hints that have a command-line spelling.
_CLI_SYNTAX: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bby='(\w+)'"), r"--by \1"),
    (re.compile(r"\bdevice='([\w:]+)'"), r"--device \1"),
    (re.compile(r"\bpass example_inputs=\.\.\. to seqify\.convert\b"), "add --example (with --shape or --size)"),
    (re.compile(r"\bpass example_inputs to seqify\.convert so shape-dependent code can be resolved"),
     "if it depends on shapes only, not on values, --example (with --shape or --size) resolves it"),
]

DATA_DEPENDENT = "depends on the tensor's data"


def for_cli(text: str) -> str:
    """``text`` with tracer internals removed and Python-API hints spelled as command-line options."""
    for pattern, repl in _INTERNALS + _CLI_SYNTAX:
        text = pattern.sub(repl, text)
    return text


def data_dependent_advice(text: str) -> str:
    """Replace the "What to do" of an untraceable-model message with advice for a branch on tensor values,
    which no example input can resolve."""
    head = text.split("What to do:")[0].rstrip()
    return (
        f"{head}\nWhat to do: this branch depends on the values in a tensor, so no example input (--example) can "
        "resolve it. Move the data-dependent code into a submodule: seqify keeps that submodule whole as one "
        "opaque layer and converts the rest (in Python, seqify.convert(model, leaf_paths=['that.submodule']) "
        "does the same for an existing submodule)."
    )


def costs_depend_on_data(text: str) -> bool:
    """Whether a balance error says a layer's FLOPs cannot be computed from shapes alone."""
    return "cannot be costed from shapes" in text
