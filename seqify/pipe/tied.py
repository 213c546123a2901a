"""Tied weights across partitions: one source parameter, a differentiable copy per later partition, gradients summed.

A parameter that layers of several partitions use (GPT-2's token embedding and its LM head) lives on the
device of the first partition that uses it, and every slot keeps pointing at that one ``nn.Parameter``: the
source model stays tied, ``pipe.parameters()`` lists it once, checkpoints see one tensor. When a layer of a
later partition runs, its slots are filled for the call with ``param.to(device, copy=True)``: a copy on that
partition's device that autograd tracks, so backward sums every partition's gradient into ``param.grad``
(DeepSpeed's TiedLayerSpec keeps a copy per stage and all-reduces their gradients; here autograd does it),
and an optimizer step on the source parameters is exact.

    partition 0 (cuda:0)                  partition 1 (cuda:1)
    wte(idx) ---- param ---- to(cuda:1) ---> lm_head(x) uses the copy
    param.grad  <----------- sum <---------- grad of the copy

What cannot be exact is refused (:class:`~seqify.errors.TiedParameterError`): a tied parameter the forward
changes in place, and ``graphs=True`` where the partitions sharing it sit on different devices (a captured
graph cannot reach the other device's parameter and gradient). Partitions on one device (the first and last
of a V placement, ``zb-h1`` with ``loops=2``: GPT-2's embedding and head both on cuda:0) replay: each
program copies the parameter inside its graph and its gradient comes out with the partition's others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from seqify.errors import TiedParameterError
from seqify.pipe.inplace import written_tensors

__all__ = ["Tie", "find", "across", "crossing", "check", "unplugged", "home", "wrap"]

Slot = tuple[nn.Module, str]  # (module holding the parameter, its name there)


@dataclass
class Tie:
    """One parameter that layers of several partitions use."""

    param: nn.Parameter
    owner: int  # the first partition using it: the parameter lives on its device
    name: str  # where the owner's first layer holds it, for messages
    slots: dict[int, dict[str, list[Slot]]] = field(default_factory=dict)  # later partition -> layer -> slots


def find(parts: Sequence[nn.Sequential]) -> list[Tie]:
    """The parameters that layers of more than one partition use."""
    seen: dict[int, Tie] = {}
    for j, part in enumerate(parts):
        for layer_name, layer in part.named_children():
            for m in layer.modules():
                for pname, p in m._parameters.items():
                    if p is None:
                        continue
                    tie = seen.get(id(p))
                    if tie is None:
                        seen[id(p)] = Tie(p, j, f"{layer_name}.{pname}")
                    elif j != tie.owner:
                        slots = tie.slots.setdefault(j, {}).setdefault(layer_name, [])
                        if (m, pname) not in [(s, n) for s, n in slots]:
                            slots.append((m, pname))
    return [t for t in seen.values() if t.slots]


def crossing(ties: Sequence[Tie], devices: Sequence[Any]) -> list[Tie]:
    """The ties whose partitions (``devices[j]``: partition j's device) are on more than one device."""
    return [t for t in ties if len({str(devices[j]) for j in (t.owner, *t.slots)}) > 1]


def check(ties: Sequence[Tie], parts: Sequence[nn.Sequential], graphs: bool, devices: Sequence[Any]) -> None:
    """Refuse ties that cannot be kept exact (``devices``: each partition's)."""
    written = {id(t) for part in parts for layer in part for t in written_tensors(layer)} if ties else set()
    apart = {id(t) for t in crossing(ties, devices)}
    for tie in ties:
        j, layers = next(iter(tie.slots.items()))
        where = (f"parameter {tie.name} (partition {tie.owner}) is also used by layer {next(iter(layers))!r} "
                 f"(partition {j})")
        if graphs and id(tie) in apart:
            raise TiedParameterError(
                f"{where}, on another device; graphs=True replays captured graphs, which cannot reach a parameter "
                "and its gradient on another device. Use graphs=False, change the balance so both layers land in "
                "one partition, or place both partitions on one device (schedule='zb-h1' with loops=2 puts the "
                "first and last partitions on the first device)."
            )
        if id(tie.param) in written:
            raise TiedParameterError(
                f"{where}, and the forward changes it in place; partitions run each micro-batch at different "
                "times, so a later partition's copy would miss the change. Change the balance so both layers land "
                "in one partition."
            )


@contextmanager
def unplugged(ties: Sequence[Tie]) -> Iterator[None]:
    """Empty the later partitions' slots while partitions move to their devices (moving them would move the
    one shared parameter to the last device); afterwards every slot holds the parameter again."""
    for tie in ties:
        for layers in tie.slots.values():
            for slots in layers.values():
                for m, name in slots:
                    m._parameters[name] = None
    try:
        yield
    finally:
        for tie in ties:
            for layers in tie.slots.values():
                for slots in layers.values():
                    for m, name in slots:
                        m._parameters[name] = tie.param


def home(ties: Sequence[Tie], devices: Sequence[Any]) -> None:
    """Put each tied parameter on its owner partition's device (``devices[j]``: partition j's). Where the
    tie is one module that layers of two partitions call (the cut falls between two calls of it), its
    slot was empty while :func:`unplugged` partitions moved, so the parameter did not move with them."""
    with torch.no_grad():
        for tie in ties:
            device = torch.device(devices[tie.owner])
            if tie.param.device != device:
                tie.param.data = tie.param.data.to(device)
                if tie.param.grad is not None:
                    tie.param.grad = tie.param.grad.to(device)


class _WithCopies:
    """Calls a layer with its tied slots holding a differentiable copy of the parameter on ``device``."""

    def __init__(self, layer: nn.Module, slots: list[tuple[Slot, nn.Parameter]], device: torch.device) -> None:
        self.layer = layer
        self.slots = slots
        self.device = device

    def __call__(self, x: Any) -> Any:
        copies: dict[int, torch.Tensor] = {}
        for (m, name), p in self.slots:
            if id(p) not in copies:
                copies[id(p)] = p.to(self.device, copy=True)
            # torch types the slot as a Parameter, but any tensor in it is used: the copy keeps the call differentiable
            m._parameters[name] = copies[id(p)]  # type: ignore[assignment]
        try:
            return self.layer(x)
        finally:
            for (m, name), p in self.slots:
                m._parameters[name] = p


def wrap(stages: Sequence[Any], ties: Sequence[Tie]) -> None:
    """Let each stage call the layers that hold tied slots through :class:`_WithCopies` (the partitions and
    the user's modules are not changed: only the stage's list of callables)."""
    for stage in stages:
        per_layer: dict[str, list[tuple[Slot, nn.Parameter]]] = {}
        for tie in ties:
            for name, slots in tie.slots.get(stage.index, {}).items():
                per_layer.setdefault(name, []).extend((s, tie.param) for s in slots)
        for i, name in enumerate(stage.names):
            if name in per_layer:
                stage.modules[i] = _WithCopies(stage.modules[i], per_layer[name], stage.device)


def across(model: nn.Sequential, balance: Sequence[int]) -> list[Tie]:
    """The parameters that layers of more than one partition of ``model`` cut by ``balance`` use."""
    layers = list(model._modules.items())
    parts, start = [], 0
    for count in balance:
        parts.append(nn.Sequential(OrderedDict(layers[start:start + count])))
        start += count
    return find(parts)


def refuse_across_processes(
    model: nn.Sequential, balance: Sequence[int], placement: Sequence[int] | None = None
) -> None:
    """One process per pipeline rank (``seqify.distributed``) keeps no copy in step with another process's
    parameter: a weight that layers of partitions on two ranks use is refused there (``placement``: each
    partition's rank, default one partition per rank). Partitions of one rank share it as one module would."""
    ranks = list(placement) if placement is not None else list(range(len(balance)))
    ties = [t for t in across(model, balance) if len({ranks[j] for j in (t.owner, *t.slots)}) > 1]
    if ties:
        tie = ties[0]
        j, names = next(iter(tie.slots.items()))
        raise TiedParameterError(
            f"parameter {tie.name} (partition {tie.owner}, rank {ranks[tie.owner]}) is also used by layer "
            f"{next(iter(names))!r} (partition {j}, rank {ranks[j]}); seqify.distributed runs each rank in its own "
            "process, where the two would train apart. Change the balance so both layers land on one rank "
            "(schedule='zb-h1' with loops=2 puts the first and last partitions on rank 0), or pipeline in one "
            "process over several GPUs (seqify.pipeline(model, gpus=N)), which ties them."
        )


def in_use(stages: Sequence[Any]) -> bool:
    """Whether some stage calls a layer through copies of a parameter that lives on another device
    (executors of fixed programs then run eagerly; a copy on the parameter's own device replays)."""
    return any(isinstance(m, _WithCopies) and any(p.device != m.device for _, p in m.slots)
               for stage in stages for m in stage.modules)
