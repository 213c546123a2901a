"""Traced values as the user's code wrote them (``x.size(0) + 1``), for the tracer's error messages."""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx as fx

__all__ = ["expr", "call_text", "readable"]


_SYMBOLS = {
    operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
    operator.floordiv: "//", operator.mod: "%", operator.eq: "==", operator.ne: "!=",
    operator.lt: "<", operator.le: "<=", operator.gt: ">", operator.ge: ">=",
    operator.and_: "&", operator.or_: "|",
}


def expr(a: Any, depth: int = 0) -> str:
    if not isinstance(a, fx.Node):
        return repr(a)
    if depth > 6:
        return a.name
    if a.op == "placeholder":
        return a.name
    if a.op == "call_function":
        if a.target is getattr:
            return f"{expr(a.args[0], depth + 1)}.{a.args[1]}"
        if a.target is operator.getitem:
            return f"{expr(a.args[0], depth + 1)}[{expr(a.args[1], depth + 1)}]"
        if a.target in _SYMBOLS and len(a.args) == 2:
            return f"({expr(a.args[0], depth + 1)} {_SYMBOLS[a.target]} {expr(a.args[1], depth + 1)})"
        if a.target is len:
            return f"len({expr(a.args[0], depth + 1)})"
    if a.op == "call_method" and a.target in ("size", "dim", "numel") and not a.kwargs:
        rest = ", ".join(expr(x, depth + 1) for x in a.args[1:])
        return f"{expr(a.args[0], depth + 1)}.{a.target}({rest})"
    return a.name


def call_text(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))
    args = ", ".join([*(expr(a) for a in node.args), *(f"{k}={expr(v)}" for k, v in node.kwargs.items())])
    if node.op == "call_function":
        return f"{target}({args})"
    return f"{expr(node.args[0])}.{target}({args.split(', ', 1)[1] if ', ' in args else ''})"


def readable(text: str, graph: fx.Graph) -> str:
    """``text`` with fx's ``Proxy(name)`` stand-ins replaced by the example value of that node."""
    values = {n.name: n.meta.get("val") for n in graph.nodes}

    def value(m: re.Match[str]) -> str:
        v = values.get(m.group(1))
        return str(v) if isinstance(v, (int, float, bool, torch.SymInt)) else "a traced value"

    return re.sub(r"Proxy\((\w+)\)", value, text)
