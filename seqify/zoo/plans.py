"""Partition hints: the by-FLOPs plan of a zoo model on its default input, per GPU count, computed and cached.

Hints are computed, never typed in: the model is built on the meta device (no memory, no weights),
converted, costed by ``seqify.balance``'s FLOPs model on a batch-1 sample of the entry's default
side (fake tensors: no compute) and split by the exact solver. Costs are cached per process; the
plans for 2, 4 and 8 GPUs of every default configuration also ship in ``hints.json``, written by
``python -m seqify.zoo --write`` and used only when the installed torch and torchvision are the
versions that wrote it and the conversion still makes the same layers (a fingerprint of layer names
and skips, checked on a meta-device conversion).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from seqify.errors import MetaDeviceError
from seqify.partition import BalanceError, PartitionPlan, costs, default_transfer_cost, split
from seqify.partition.cost import LayerCosts
from seqify.partition.walk import layers
from seqify.zoo.catalog import build, entry, sample

__all__ = [
    "Facts", "facts", "plan", "hints", "block_cuts", "signature", "HINTS_FILE", "GPUS", "cached_table", "versions",
]

HINTS_FILE = Path(__file__).with_name("hints.json")
#: The GPU counts whose plans ship in hints.json.
GPUS = (2, 4, 8)


@dataclass(frozen=True)
class Facts:
    """What the zoo table shows about one configuration, measured on its conversion."""

    name: str
    params: int
    layers: int
    skips: int
    opaque: int
    size: int
    batch: int = 1
    signature: str = ""


def versions() -> dict[str, str]:
    import torchvision

    return {"torch": torch.__version__.split("+")[0], "torchvision": torchvision.__version__.split("+")[0]}


def _key(kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(kwargs.items()))


@contextmanager
def _no_init() -> Iterator[None]:
    """Skip torch.nn.init's functions (FLOPs and layer counts need shapes, not values)."""
    import torch.nn.init as init

    saved = {n: getattr(init, n) for n in dir(init) if n.endswith("_") and not n.startswith("_")}
    for n in saved:
        setattr(init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(init, n, fn)


def _skeleton(name: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    """Model ``name`` with the right shapes but no meaningful values: on the meta device (no memory),
    or, for builders that compute with tensors (RegNet's widths), on the CPU without initialisation."""
    try:
        with torch.device("meta"):
            return build(name, **kwargs)
    except (NotImplementedError, RuntimeError):
        with _no_init():
            return build(name, **kwargs)


@functools.lru_cache(maxsize=8)
def _converted(
    name: str, key: tuple[tuple[str, Any], ...], meta: bool = True, length: int | None = None
) -> tuple[torch.nn.Module, Any]:
    """The source (meta or uninitialised) and its conversion; token models on ids of ``length`` (default:
    the entry's), since export fixes the sequence length."""
    from seqify.convert import convert

    if meta:
        source = _skeleton(name, dict(key))
    else:
        with _no_init():
            source = build(name, **dict(key))
    e = entry(name)
    if not e.tokens:
        return source, convert(source)
    # Token models convert through torch.export, which needs example ids (fake on meta: no compute).
    device = next(iter(source.parameters())).device
    ids = sample(name, 2, length, device=device, **dict(key))
    return source, convert(source, {"input_ids": ids}, frontend=e.frontend, verify=False, check_modes=False)


def _signature(seq: Any) -> str:
    """A fingerprint of a conversion's layer sequence and skips: a cached plan is only valid for it."""
    text = "\n".join([*seq._modules, *(f"{s.stash}->{s.pop}" for s in seq.skips)])
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def signature(name: str, **kwargs: Any) -> str:
    """The fingerprint of zoo model ``name``'s conversion (built on meta, so in a fraction of a second for
    most models): hints.json's plans are used only where it matches."""
    return _signature(_converted(name, _key(kwargs))[1])


@functools.lru_cache(maxsize=32)
def _measure(name: str, by: str, size: int | None, key: tuple[tuple[str, Any], ...]) -> tuple[Facts, LayerCosts, Any]:
    kwargs = dict(key)
    length = size if entry(name).tokens else None
    source, seq = _converted(name, key, True, length)
    try:
        x, measured = _cost(name, seq, by, size, kwargs)
    except MetaDeviceError:  # FLOPs come from fake tensors, but should costing ever refuse meta weights
        source, seq = _converted(name, key, False, length)
        x, measured = _cost(name, seq, by, size, kwargs)
    lays = layers(seq)
    info = Facts(
        name=name,
        params=sum(p.numel() for p in source.parameters()),
        layers=len(seq),
        skips=len(seq.skips),
        opaque=len(seq.opaque),
        size=x.shape[-1],
        batch=x.shape[0],
        signature=_signature(seq),
    )
    return info, measured, lays


def _cost(name: str, seq: Any, by: str, size: int | None, kwargs: dict[str, Any]) -> tuple[torch.Tensor, LayerCosts]:
    device = next(iter(seq.parameters())).device
    x = sample(name, 1, size, device=device, **kwargs)
    try:
        return x, costs(seq, by, x if by != "params" else None)
    except BalanceError:
        # BatchNorm in training needs two values per channel (DeepLabV3's image pooling at batch 1):
        # batch 2 doubles every cost, which leaves the optimal plan as it is.
        x = sample(name, 2, size, device=device, **kwargs)
        return x, costs(seq, by, x)


def facts(name: str, **kwargs: Any) -> Facts:
    """Parameters, layers, skips and opaque layers of zoo model ``name`` built with ``kwargs`` (on meta)."""
    return _measure(name, "flops", None, _key(kwargs))[0]


def block_cuts(names: list[str], pattern: str) -> list[int]:
    """Cut positions at block boundaries: the index of the first layer of every block (layer names matching
    ``pattern``, group 1 the block's index) after the first, and of the first layer after the last block."""
    rx = re.compile(pattern)
    seen: dict[str, int] = {}
    last = -1
    for i, layer in enumerate(names):
        m = rx.match(layer)
        if m:
            seen.setdefault(m.group(1), i)
            last = i
    cuts = sorted(seen.values())[1:]
    if 0 <= last < len(names) - 1:
        cuts.append(last + 1)
    return cuts


def plan(name: str, gpus: int, by: str = "flops", size: int | None = None, **kwargs: Any) -> PartitionPlan:
    """The optimal ``gpus``-stage plan of zoo model ``name`` (``by='flops'`` or ``'params'``) for a batch-1
    input of side ``size`` (default: the entry's). Feed ``plan.balance`` to ``seqify.pipeline``.

    For models with repeated blocks (``llama``, ``gpt2``: decoder layers), stages start only at block
    boundaries (the way hand-cut pipelines split transformers), where the model has enough of them."""
    if by not in ("flops", "params"):
        raise ValueError(
            f"hints are static: by='flops' or by='params'; for by={by!r} call seqify.balance on your device"
        )
    e = entry(name)
    _, measured, lays = _measure(name, by, size, _key(kwargs))
    cuts = block_cuts(list(lays.names), e.blocks) if e.blocks else None
    if cuts is not None and len(cuts) < gpus - 1:
        cuts = None  # fewer boundaries than cuts needed: any layer boundary
    return split(measured, gpus, lays.names, lays.routes, transfer_cost=default_transfer_cost(by), cuts=cuts)


@functools.lru_cache(maxsize=1)
def cached_table() -> dict[str, Any]:
    """hints.json when it was written by the installed torch and torchvision, else an empty table."""
    try:
        table = json.loads(HINTS_FILE.read_text())
    except (OSError, ValueError):
        return {}
    if {k: table.get(k) for k in ("torch", "torchvision")} != versions():
        return {}
    return table


def hints(name: str, gpus: int, by: str = "flops", size: int | None = None, **kwargs: Any) -> list[int]:
    """Recommended ``balance`` (layers per stage) for zoo model ``name`` over ``gpus`` devices.

    The by-FLOPs plan on a batch-1 input of the entry's default side: a good start on any GPU. For the
    best split on your hardware, balance by measured time: ``seqify.balance(seq, gpus, sample, by='time',
    device='cuda:0')``. The model must be built with the same ``kwargs`` (layer counts depend on them).
    """
    if by == "flops" and size is None and not kwargs:
        row = cached_table().get("models", {}).get(name, {})
        cached = row.get("balance", {}).get(str(gpus))
        if cached is not None and row.get("signature") == signature(name):
            return list(cached)
    return plan(name, gpus, by, size, **kwargs).balance
