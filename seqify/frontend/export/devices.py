"""Devices export baked into factory ops made relative: a layer makes its tensors where it runs."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

__all__ = ["on_device_of", "at_device_of", "rewrite_devices"]


def on_device_of(like: torch.Tensor, op: Any, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` creating its result on ``like``'s device: export bakes the example's device
    into factory ops (``arange``, ``ones``, ``to``); a layer on another device must make them where it runs."""
    return op(*args, **kwargs, device=like.device)


def at_device_of(like: torch.Tensor, op: Any, at: int, *args: Any, **kwargs: Any) -> Any:
    """``op(*args, **kwargs)`` with its ``at``-th argument (a device export baked in) replaced by ``like``'s device."""
    return op(*args[:at], like.device, *args[at + 1:], **kwargs)


def rewrite_devices(graph: fx.Graph, device: torch.device) -> bool:
    """Rewrite ops that name the example's device to take the device of a tensor they travel with;
    whether any did."""
    previous: fx.Node | None = None
    changed = False
    for node in list(graph.nodes):
        here = node.kwargs.get("device") if node.op == "call_function" else None
        at = None
        if node.op == "call_function" and here is None:
            at = next((i for i, a in enumerate(node.args) if isinstance(a, torch.device) and a == device), None)
        if isinstance(here, (torch.device, str)) and torch.device(here) == device:
            tensors = [a for a in node.args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
            like = tensors[0] if tensors else previous
            if like is not None:
                kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}
                node.args = (like, node.target, *node.args)
                node.kwargs = kwargs
                node.target = on_device_of
                changed = True
        elif at is not None and previous is not None:
            # t.to(x.device) (aten.to.device): the device of the value computed last, as x is in the source
            node.args = (previous, node.target, at, *node.args)
            node.target = at_device_of
            changed = True
        makes_tensor = node.op in ("placeholder", "call_function", "call_module")
        if makes_tensor and isinstance(node.meta.get("val"), torch.Tensor):
            previous = node
    return changed
