"""Where the model's own forward runs, and the real value of a node it branches on (``if
degenerate_boxes.any():``): the graph traced so far, run on the real example, so the branch it takes
becomes a guard."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from seqify._paths import PACKAGE_DIR

__all__ = ["INTERNAL", "Site", "forward_site", "called_from", "caller_outside", "checks_input", "evaluate"]

Site = tuple[str, int]  # (file, first line) of a function

#: torch's and seqify's own code (a trailing separator: torchvision's folder is not torch's)
INTERNAL = tuple(os.path.join(d, "") for d in (os.path.dirname(os.path.abspath(torch.__file__)), PACKAGE_DIR))


def forward_site(root: nn.Module) -> Site | None:
    """Where ``type(root).forward`` is defined (fx may run a copy of its code: same file and first line)."""
    code = getattr(type(root).forward, "__code__", None)
    return None if code is None else (code.co_filename, code.co_firstlineno)


def called_from(site: Site | None, frame: FrameType | None) -> bool:
    """Whether ``frame`` runs the function defined at ``site``."""
    return site is not None and frame is not None and (frame.f_code.co_filename, frame.f_code.co_firstlineno) == site


def caller_outside(internal: tuple[str, ...]) -> FrameType | None:
    """The innermost frame of code outside the ``internal`` folders (the model's own code)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame = frame.f_back  # type: ignore[assignment]
    return frame


def checks_input(node: fx.Node, root: Site | None) -> bool:
    """Whether the root's own forward (not a submodule's or a method's, which are kept whole instead) asks for
    the truth of ``x.any()`` or ``x.all()``: a check of its input (torchvision's ``if degenerate_boxes.any():
    raise``), which a guard on the example's value keeps. A branch on other values (``if y.sum() > 0``) still
    refuses: a guard there would refuse inputs at random while training."""
    name = getattr(node.target, "__name__", node.target)
    return (node.op in ("call_method", "call_function") and name in ("any", "all")
            and isinstance(node.meta.get("val"), torch.Tensor) and called_from(root, caller_outside(INTERNAL)))


def evaluate(graph: fx.Graph, node: fx.Node, inputs: dict[fx.Node, Any], attribute: Callable[[str], Any],
             root: nn.Module) -> Any:
    """``node``'s value when the nodes before it run on the real ``inputs`` (placeholders), without grad; the
    caller keeps the model's state (attributes, buffers, random generators) as it was."""
    env: dict[fx.Node, Any] = {}
    for n in graph.nodes:
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        with torch.no_grad():
            if n.op == "placeholder":
                env[n] = inputs.get(n)
            elif n.op == "get_attr":
                env[n] = attribute(str(n.target))
            elif n.op == "call_module":
                env[n] = root.get_submodule(str(n.target))(*args, **kwargs)
            elif n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
        if n is node:
            return env[n]
    raise LookupError(f"{node.name} is not in the graph")
