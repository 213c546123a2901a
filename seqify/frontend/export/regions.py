"""Regions in export graphs: autocast-off regions whatever the caller's autocast, grad-mode regions exception-safe."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["neutral_autocast", "autocast_region", "grad_region", "graphs", "prepare_regions"]

_WRAP = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
_GRAD = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def _all_float32(model: nn.Module, example: Any) -> bool:
    inputs = [x for x in pytree.tree_leaves(example) if isinstance(x, torch.Tensor)]
    tensors = [*model.parameters(), *model.buffers(), *inputs]
    return all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())


@contextmanager
def neutral_autocast(model: nn.Module, example: Any) -> Iterator[None]:
    """Capture with autocast on at float32 for the example's devices, where the caller's autocast is off.

    Forwards ask ``torch.is_autocast_enabled()`` and enter their autocast-off regions only when it is on
    (transformers' ``maybe_autocast``: Llama's rotary embedding in transformers 5.17, GPT-2's upcast
    attention): captured with autocast off, such a region is not in the graph at all, and a converted
    model run under bf16 autocast computes it in bf16 where the source computes it in float32. At float32
    autocast changes no value of a float32 model, so the graph is the one autocast off gives, plus those
    regions (``wrap_with_autocast``), which replay as the source's under any autocast and as no-ops
    without. Models with other floating dtypes are captured as they are.
    """
    kinds = {x.device.type for x in pytree.tree_leaves(example) if isinstance(x, torch.Tensor)}
    devices = sorted(kinds & {"cpu", "cuda"})
    devices = [d for d in devices if not torch.is_autocast_enabled(d)]
    if not devices or not _all_float32(model, example):
        yield
        return
    with ExitStack() as stack:
        for device in devices:
            saved = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            torch.set_autocast_enabled(device, True)
            torch.set_autocast_dtype(device, torch.float32)
            stack.callback(torch.set_autocast_dtype, device, saved[1])
            stack.callback(torch.set_autocast_enabled, device, saved[0])
        yield


def autocast_region(captured_on: str | None, device_type: str, dtype: torch.dtype | None, enabled: bool,
                    cache_enabled: bool | None, body: Any, *args: Any) -> Any:
    """Run an autocast region of a captured graph. A region made for the device the capture ran on
    (``maybe_autocast(x.device.type)``) follows its tensors to the device they are on now: a model converted
    on the CPU and moved to a GPU must turn CUDA autocast off there; a region that names another device
    type stays as written. A region that turns autocast on at the capture's neutral float32 takes the
    caller's dtype, as the source's ``torch.autocast(device, enabled=True)`` without a dtype would."""
    here = device_type
    if device_type == captured_on:
        here = next((a.device.type for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)), device_type)
    if enabled and dtype == torch.float32:
        dtype = torch.get_autocast_dtype(here)
    with torch.autocast(here, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
        return body(*args)


def grad_region(enabled: bool, body: Any, *args: Any) -> Any:
    """Run a grad-mode region of a captured graph (a ``@torch.no_grad()`` forward such as a rotary
    embedding's). torch's ``wrap_with_set_grad_enabled`` does not restore grad mode when the region raises,
    which left gradients off for the rest of the process after one failing call."""
    with torch.set_grad_enabled(enabled):
        return body(*args)


def graphs(root: fx.Graph, constants: dict[str, Any]) -> Iterator[fx.Graph]:
    """``root`` and the graphs of the regions (GraphModules) among ``constants``, nested ones too."""
    yield root
    for value in constants.values():
        if isinstance(value, fx.GraphModule):
            for module in value.modules():
                if isinstance(module, fx.GraphModule):
                    yield module.graph


def prepare_regions(root: fx.Graph, constants: dict[str, Any], captured_on: str | None) -> None:
    """Point every ``wrap_with_autocast`` node (in the graph and in the regions it calls, such as a
    ``no_grad`` forward) at :func:`autocast_region` (``captured_on``: the example's device type) and every
    ``wrap_with_set_grad_enabled`` node at :func:`grad_region`; drop export's dtype and device asserts
    inside those regions (the graph's own are dropped already): they fix the capture's dtypes, which
    autocast changes."""
    for graph in graphs(root, constants):
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if _WRAP is not None and node.target is _WRAP:
                node.target = autocast_region
                node.args = (captured_on, *node.args)
                changed = True
            elif _GRAD is not None and node.target is _GRAD and not node.kwargs:
                node.target = grad_region
                changed = True
            elif graph is not root and node.target is _ASSERT and not node.users:
                graph.erase_node(node)
                changed = True
        if changed and graph is not root and isinstance(graph.owning_module, fx.GraphModule):
            graph.owning_module.recompile()
