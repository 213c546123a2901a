"""Placement: split a Sequential into partitions, check the balance, and put each partition on its device."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from seqify.errors import BalanceError, DeviceError, MetaDeviceError, SharedParameterError
from seqify.model.sequential import meta_tensor
from seqify.pipe import tied
from seqify.pipe.batchnorm import defer_batch_norm
from seqify.pipe.inplace import written_tensors
from seqify.pipe.stage import Stage
from seqify.skip.layout import routes
from seqify.skip.namespace import SkipKey

__all__ = ["CHECKPOINT", "STRATEGIES", "Placement", "place", "resolve_devices"]

CHECKPOINT = ("always", "except_last", "never")
STRATEGIES = ("time", "memory", "flops", "params")


def resolve_devices(gpus: int | None, devices: Sequence[Any] | None, partitions: int | None) -> list[torch.device]:
    """The device of every partition, from ``devices``, ``gpus`` or what the machine has."""
    if devices is not None and gpus is not None:
        raise DeviceError("pass either gpus=N or devices=[...], not both")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int)):
        raise DeviceError(f"gpus={gpus!r}: give a number of GPUs, or devices=[...]")
    if devices is not None:
        if isinstance(devices, (str, torch.device, int)):
            raise DeviceError(
                f"devices={devices!r}: give a list with one device per partition, e.g. devices=['cuda:0', "
                "'cuda:1'] or devices=['cpu', 'cpu']"
            )
        devices = list(devices)
        if not devices:
            raise DeviceError("devices=[] names no device; give one device per partition")
        out = []
        for d in devices:
            try:
                device = torch.device(f"cuda:{d}" if isinstance(d, int) else d)
            except (RuntimeError, TypeError, ValueError) as e:
                raise DeviceError(
                    f"{d!r} in devices is not a device ({(str(e).splitlines() or [''])[0]}); name devices like "
                    "'cuda:0', 'cuda:1' or 'cpu'"
                ) from None
            if device.type == "cuda":
                if not torch.cuda.is_available():
                    raise DeviceError(
                        f"device {device} does not exist: CUDA is not available here; use devices=['cpu', ...]"
                    )
                index = device.index if device.index is not None else torch.cuda.current_device()
                if index >= torch.cuda.device_count():
                    raise DeviceError(
                        f"device {device} does not exist: this machine has {torch.cuda.device_count()} GPUs "
                        f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
                    )
                device = torch.device("cuda", index)
            elif device.type not in ("cpu",):
                raise DeviceError(f"device {device} is not supported: use CUDA devices or 'cpu'")
            out.append(device)
        return out
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus is not None:
        if gpus < 1:
            raise DeviceError(f"gpus={gpus}: ask for at least one GPU")
        if gpus > available:
            raise DeviceError(
                f"gpus={gpus} but this machine has {available} GPU{'s' if available != 1 else ''}; "
                "use fewer, or devices=['cpu', 'cpu'] to pipeline on the CPU"
            )
        return [torch.device("cuda", i) for i in range(gpus)]
    if available:
        return [torch.device("cuda", i) for i in range(partitions or available)][:available]
    if partitions:
        return [torch.device("cpu")] * partitions
    raise DeviceError("no GPU here: pass devices=['cpu', 'cpu'] (or a balance list) to pipeline on the CPU")


def _layer_names(model: nn.Sequential) -> list[str]:
    return list(model._modules)


def _counts(balance: Any, layers: int) -> list[int]:
    """``balance`` as a list of whole numbers (the counts are checked by :func:`_check_balance`)."""
    if isinstance(balance, (int, float, torch.Tensor)) or not hasattr(balance, "__iter__"):
        half = layers // 2
        raise BalanceError(
            f"balance={balance!r}: give a list of layer counts, one per partition (e.g. balance=[{layers - half}, "
            f"{half}] for this model's {layers} layers), or a strategy: one of {STRATEGIES}"
        )
    counts = []
    for b in balance:
        try:
            if isinstance(b, bool):
                raise TypeError
            counts.append(operator.index(b))
        except TypeError:
            raise BalanceError(
                f"balance={list(balance)!r}: every entry must be a whole number of layers, not {b!r}"
            ) from None
    return counts


def _check_chunks(chunks: Any) -> int:
    try:
        if isinstance(chunks, bool):
            raise TypeError
        value = operator.index(chunks)
    except TypeError:
        raise BalanceError(f"chunks={chunks!r}: give a whole number of micro-batches (>= 1)") from None
    if value < 1:
        raise BalanceError(f"chunks={chunks}: need at least one micro-batch")
    return value


def _check_balance(balance: Sequence[int], layers: int) -> list[int]:
    balance = _counts(balance, layers)
    if any(b < 1 for b in balance):
        raise BalanceError(f"balance {balance} has an empty partition; every partition needs at least one layer")
    if sum(balance) != layers:
        raise BalanceError(
            f"balance {balance} sums to {sum(balance)} but the model has {layers} layers; "
            "make the counts add up to the number of layers (or pass a strategy such as balance='params')"
        )
    return balance


def _check_meta(parts: list[nn.Sequential]) -> None:
    for j, part in enumerate(parts):
        name = meta_tensor(part)
        if name is not None:
            raise MetaDeviceError(
                f"layer {name.split('.')[0]!r} (partition {j}) holds {name} on the meta device (shapes, no data); a "
                "pipeline moves its layers to their devices, which needs data. Materialise the weights first: "
                "model.to_empty(device='cpu'), then initialise them or load a checkpoint "
                "(seq.load_original_state_dict(torch.load(path))), then pipeline the model."
            )


def _place(parts: list[nn.Sequential], devices: Sequence[torch.device]) -> None:
    """Move each partition to its device. A tensor several layers share stays one tensor per device; a
    read-only buffer that partitions on different devices read (a constant of the source's forward) gets a
    copy on each. A buffer that changes as the model runs (BatchNorm statistics, ``self.count += 1``) and
    that layers of different partitions use is refused, like a shared parameter: partitions run a
    micro-batch at different times (partition 0 is a micro-batch ahead), so a later partition would read
    it changed by later micro-batches, and on another device it would be a stale copy."""
    from seqify.convert.build import Tensors

    written = {id(t) for part in parts for layer in part for t in written_tensors(layer)}
    slots: dict[int, list[tuple[int, str, nn.Module, str, str]]] = {}
    for j, part in enumerate(parts):
        seen: set[tuple[int, str, str]] = set()
        for layer_name, layer in part.named_children():
            for m in layer.modules():
                for kind in ("_parameters", "_buffers"):
                    for name, t in getattr(m, kind).items():
                        if t is not None and (id(m), kind, name) not in seen:
                            seen.add((id(m), kind, name))
                            slots.setdefault(id(t), []).append((j, layer_name, m, kind, name))
    for tid, entries in slots.items():
        if len({j for j, *_ in entries}) < 2:
            continue
        changes = tid in written or any(not isinstance(m, Tensors) for _, _, m, _, _ in entries)
        if changes:
            a = entries[0]
            b = next(e for e in entries if e[0] != a[0])
            what = "parameter" if a[3] == "_parameters" else "buffer"
            raise SharedParameterError(
                f"{what} {a[4]!r} is used by layer {a[1]!r} (partition {a[0]}, {devices[a[0]]}) and layer {b[1]!r} "
                f"(partition {b[0]}, {devices[b[0]]}) and may change as the model runs; partitions run each "
                f"micro-batch at different times (and may sit on different devices), so such a {what} must stay in "
                "one partition. Change the balance so both layers land in one partition."
            )
    for part, device in zip(parts, devices):
        part.to(device)
    # autocast caches the cast of each parameter until its outermost region ends, keyed by the tensor: a cast
    # made before the move (the tuner places candidates one after another inside the caller's autocast region)
    # would be read on the parameter's old device
    torch.clear_autocast_cache()
    for entries in slots.values():
        if len(entries) < 2:
            continue
        first: dict[torch.device, torch.Tensor] = {}
        for j, _, m, kind, name in entries:
            getattr(m, kind)[name] = first.setdefault(devices[j], getattr(m, kind)[name])


@dataclass
class Placement:
    """Where a pipeline's work lives: its partitions (moved to their devices), one :class:`Stage` per
    partition, and which partitions each cross-partition skip leaves and enters."""

    partitions: list[nn.Sequential]
    devices: list[torch.device]
    balance: list[int]
    stages: list[Stage]
    skip_partitions: dict[SkipKey, tuple[int, int]] = field(default_factory=dict)
    ties: list[tied.Tie] = field(default_factory=list)  # parameters several partitions use (tied.py)


def place(model: nn.Sequential, balance: Sequence[int], devices: Sequence[torch.device], *, chunks: int = 1,
          deferred_batch_norm: bool = False, graphs: bool = False) -> Placement:
    """Split ``model`` by ``balance``, check the split (shared parameters, meta tensors, buffers that
    change across partitions), move each partition to its device and route the skips between them."""
    names = _layer_names(model)
    balance = _check_balance(balance, len(names))
    if len(devices) != len(balance):
        raise DeviceError(
            f"{len(balance)} partitions but {len(devices)} devices {list(map(str, devices))}; "
            "give one device per partition (repeat a device to put several partitions on it)"
        )
    found = routes(model)
    layers = list(model._modules.values())
    parts: list[nn.Sequential] = []
    start = 0
    for count in balance:
        parts.append(nn.Sequential(OrderedDict(zip(names[start:start + count], layers[start:start + count]))))
        start += count
    ties = tied.find(parts)  # parameters used across partitions: a copy per later partition (tied.py)
    tied.check(ties, parts, graphs, devices)
    _check_meta(parts)
    part_of = [j for j, count in enumerate(balance) for _ in range(count)]
    with tied.unplugged(ties):
        _place(parts, devices)
    tied.home(ties, devices)
    if deferred_batch_norm:
        parts = [cast(nn.Sequential, defer_batch_norm(p, chunks)) for p in parts]  # a copy of the same type
    pops: list[list[SkipKey]] = [[] for _ in parts]
    stashes: list[list[SkipKey]] = [[] for _ in parts]
    skip_partitions: dict[SkipKey, tuple[int, int]] = {}
    for r in found:
        a, b = part_of[r.stash], part_of[r.pop]
        if a != b:
            stashes[a].append(r.key)
            pops[b].append(r.key)
            skip_partitions[r.key] = (a, b)
    stages = [Stage(j, p, d, tuple(pops[j]), tuple(stashes[j])) for j, (p, d) in enumerate(zip(parts, devices))]
    tied.wrap(stages, ties)
    return Placement(parts, list(devices), balance, stages, skip_partitions, ties)
