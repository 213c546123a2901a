"""Models built on the meta device: each rank gives only its own layers memory and fills them from a checkpoint."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqify.errors import CheckpointError, MetaDeviceError, StateDictError
from seqify.model.sequential import Sequential, meta_tensor

__all__ = ["converted", "materialize", "read_weights", "BufferInit"]

#: Sets the non-persistent buffers of one source module (on its device, in place), as its ``__init__`` does.
BufferInit = Callable[[nn.Module], None]


@dataclass
class _Slot:
    """One place of this rank's layers that holds a tensor: where it is, and what fills it."""

    path: str  # for messages: the layer path and tensor name in the converted model
    tensor: torch.Tensor  # the tensor there when the layers were handed over (on meta: shape and dtype only)
    key: str | None  # its source key in checkpoints; None for a non-persistent buffer
    owner: tuple[str, nn.Module, str] | None = None  # (path, module, name) of the source's buffer it is


def converted(model: nn.Module, example_inputs: Any) -> tuple[nn.Module | None, nn.Sequential]:
    """``(source, converted)``: ``model`` itself when it is an ``nn.Sequential`` already (no source), else
    its conversion. A model on the meta device holds no values, so its conversion cannot be self-checked
    against the source's outputs: it is converted with ``verify=False``."""
    if isinstance(model, nn.Sequential):
        return None, model
    from seqify.convert import convert

    return model, convert(model, example_inputs, verify=meta_tensor(model) is None)


def materialize(model: nn.Sequential, balance: Sequence[int], owned: Sequence[int], device: torch.device,
                weights: str | os.PathLike[str] | None, *, source: nn.Module | None = None,
                buffers: BufferInit | None = None) -> None:
    """Give partitions ``owned`` of ``model`` (split by ``balance``) memory on ``device`` where they are on
    the meta device, and fill them: parameters and buffers by source key from ``weights`` (a
    ``seqify.checkpoint`` folder, a safetensors file, or a folder of them with an index), non-persistent
    buffers (checkpoints do not hold them) by ``buffers(module)`` on the source module that registers
    them, transformers' ``_init_weights`` by default. Other partitions stay as they are (on meta: no
    memory). Raises :class:`MetaDeviceError` for any tensor left without values."""
    names = list(model._modules)
    starts = [sum(balance[:j]) for j in range(len(balance))]
    layers = [(n, model._modules[n]) for p in owned for n in names[starts[p]:starts[p] + balance[p]]]
    if isinstance(model, Sequential) and 0 in owned:
        layers.append(("<unused>", model._unused))  # state forward never reads: the first partition keeps it
    slots = _slots(model, layers, source)
    if weights is None:
        if any(s.tensor.is_meta for s in slots):
            raise MetaDeviceError(
                f"{slots[0].path} and this rank's other layers are on the meta device (shapes, no data): pass "
                "weights= (a seqify.checkpoint folder or a safetensors file) to seqify.distributed.stage so each "
                "rank loads its own layers' parameters and buffers")
        return
    fresh = _allocate(layers, device)
    _fill_buffers([s for s in slots if s.key is None], fresh, source, buffers, device)
    read_weights(weights, {s.key: fresh[id(s.tensor)] for s in slots if s.key is not None})
    left = next((f"{path}.{name}" for path, m in layers for name, t in _own(m) if t.is_meta), None)
    if left is not None:
        raise MetaDeviceError(f"{left} is still on the meta device after loading this rank's weights; report this "
                              "as a seqify bug, and meanwhile build the model on a real device")


def _own(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer under ``module``, each place once, by qualified name."""
    return [(f"{p}.{n}" if p else n, t) for p, m in module.named_modules() for kind in ("_parameters", "_buffers")
            for n, t in getattr(m, kind).items() if t is not None]


def _slots(model: nn.Sequential, layers: list[tuple[str, nn.Module]], source: nn.Module | None) -> list[_Slot]:
    """Each distinct tensor of ``layers`` with its source key, or, for a non-persistent buffer, the source
    module that registers it."""
    keys: dict[int, str] = {}
    if isinstance(model, Sequential):
        for key in model.original_keys():
            for t in model._tensors(key):
                keys.setdefault(id(t), key)
    else:
        keys = {id(t): k for k, t in reversed(model.state_dict(keep_vars=True).items())}
        source = model if source is None else source
    owners = {id(b): (f"{p}.{n}" if p else n, m, n) for p, m in (source.named_modules() if source else [])
              for n, b in m._buffers.items() if b is not None and n in m._non_persistent_buffers_set}
    found: OrderedDict[int, _Slot] = OrderedDict()
    for path, layer in layers:
        for name, t in _own(layer):
            if id(t) not in found:
                found[id(t)] = _Slot(f"{path}.{name}", t, keys.get(id(t)), owners.get(id(t)))
    return list(found.values())


def _allocate(layers: list[tuple[str, nn.Module]], device: torch.device) -> dict[int, torch.Tensor]:
    """Replace every tensor on the meta device in ``layers`` by uninitialised memory on ``device`` (a tensor
    held in several places stays one tensor); id of each tensor there before -> the tensor there now."""
    fresh: dict[int, torch.Tensor] = {}
    for _, layer in layers:
        for m in layer.modules():
            for kind in ("_parameters", "_buffers"):
                slots = getattr(m, kind)
                for name, t in list(slots.items()):
                    if t is not None:
                        if id(t) not in fresh:
                            fresh[id(t)] = _empty(t, device)
                        slots[name] = fresh[id(t)]
    return fresh


def _empty(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised memory on ``device`` for a tensor on the meta device (a parameter stays one), else ``t``."""
    if not t.is_meta:
        return t
    new = torch.empty_like(t, device=device)
    return nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new


def _fill_buffers(slots: list[_Slot], fresh: dict[int, torch.Tensor], source: nn.Module | None,
                  buffers: BufferInit | None, device: torch.device) -> None:
    """Set the non-persistent buffers of this rank's layers as the source module that registers each one
    sets them (``buffers(module)``)."""
    wanted = [s for s in slots if s.tensor.is_meta]
    orphan = next((s for s in wanted if s.owner is None), None)
    if orphan is not None:
        raise MetaDeviceError(
            f"{orphan.path} is on the meta device, and no checkpoint key names it nor does a source module register "
            "it as a buffer (a tensor the source's forward makes, or a plain attribute): its values cannot be "
            "recovered. Pass the source model itself to seqify.distributed.stage (not a converted one), or build "
            "that tensor as a registered buffer")
    init: BufferInit | None = buffers if buffers is not None else getattr(source, "_init_weights", None)
    if not wanted:
        return
    if init is None:
        raise MetaDeviceError(
            f"{wanted[0].owner[0] if wanted[0].owner else wanted[0].path} is a non-persistent buffer (checkpoints "
            "do not hold it) and is on the meta device: pass buffers=fn to seqify.distributed.stage, where "
            "fn(module) sets that module's non-persistent buffers in place as its __init__ does (a transformers "
            "model needs none: its _init_weights is used) "
            f"({len(wanted)} such buffer(s) in this rank's layers)")
    done: dict[int, nn.Module] = {}
    for slot in wanted:
        assert slot.owner is not None
        path, module, name = slot.owner
        if id(module) not in done:
            _init_module(module, fresh, init, device)
            done[id(module)] = module
        value = module._buffers[name]
        target = fresh[id(slot.tensor)]
        if value is None or value.is_meta or _unset(value):
            raise MetaDeviceError(f"buffers= left the non-persistent buffer {path} without values (at "
                                  f"{slot.path}): make it set every non-persistent buffer of the module it is given")
        if value is not target:
            with torch.no_grad():
                target.copy_(value)


def _init_module(module: nn.Module, fresh: dict[int, torch.Tensor], init: BufferInit, device: torch.device) -> None:
    """Give ``module``'s own non-persistent buffers memory (the layers' new tensor where they share it; NaN
    until set, so what ``init`` leaves unset shows) and run ``init(module)`` without touching the RNG."""
    for name in module._non_persistent_buffers_set:
        b = module._buffers.get(name)
        if b is not None and b.is_meta:
            module._buffers[name] = fresh.get(id(b), torch.empty_like(b, device=device))
        b = module._buffers.get(name)
        if b is not None and b.is_floating_point():
            b.fill_(float("nan"))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        init(module)


def _unset(t: torch.Tensor) -> bool:
    return t.is_floating_point() and t.numel() > 0 and bool(torch.isnan(t).all())


def read_weights(weights: str | os.PathLike[str], targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` (source key -> tensor, any device) in place from ``weights``, reading only those keys:
    a ``seqify.checkpoint`` folder, a safetensors file (``seqify.checkpoint.export``'s or any), or a
    folder with ``model.safetensors`` or a ``model.safetensors.index.json`` (Hugging Face's layout)."""
    from seqify.checkpoint import store  # torch.distributed.checkpoint: loaded where used

    path = os.fspath(weights)
    if os.path.isfile(os.path.join(path, store.META)):
        _from_checkpoint(path, targets)
    elif os.path.isfile(path) or os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(
            os.path.join(path, "model.safetensors.index.json")):
        _from_safetensors(path, targets)
    else:
        raise CheckpointError(
            f"weights={path!r} is neither a seqify.checkpoint folder (no {store.META}) nor a safetensors file or "
            "folder: pass the folder seqify.checkpoint.save wrote or the file seqify.checkpoint.export wrote")


def _check(where: str, targets: dict[str, torch.Tensor], saved: dict[str, torch.Size]) -> None:
    missing = sorted(set(targets) - set(saved))
    if missing:
        raise StateDictError(f"{where} lacks keys this rank's layers need: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}; pass the checkpoint of this model")
    wrong = [f"{k}: saved {tuple(saved[k])} vs model {tuple(t.shape)}" for k, t in targets.items()
             if tuple(saved[k]) != tuple(t.shape)]
    if wrong:
        raise StateDictError(f"{where} holds tensors of other shapes than this model's: {'; '.join(wrong[:8])}; "
                             "build the model with the configuration it was saved from")


def _from_checkpoint(path: str, targets: dict[str, torch.Tensor]) -> None:
    from seqify.checkpoint import MODEL, store

    shapes = store.tensor_shapes(path)
    _check(path, targets, {k[len(MODEL):]: s for k, (s, _) in shapes.items() if k.startswith(MODEL)})
    direct = {MODEL + k: t for k, t in targets.items() if t.dtype == shapes[MODEL + k][1] and t.is_contiguous()}
    staged = {MODEL + k: torch.empty(t.shape, dtype=shapes[MODEL + k][1]) for k, t in targets.items()
              if MODEL + k not in direct}
    store.read_tensors(path, {**direct, **staged})
    with torch.no_grad():
        for name, t in staged.items():
            targets[name[len(MODEL):]].copy_(t)


def _files(path: str) -> dict[str, str]:
    """Where each key is: every key of one safetensors file, or a sharded folder's index."""
    from safetensors import safe_open

    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "model.safetensors")):
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    file = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
    with safe_open(file, framework="pt") as f:
        header = f.metadata() or {}
        where = dict.fromkeys(f.keys(), file)
    tied = json.loads(header.get("tied", "{}")) if header.get("format") == "seqify.export/1" else {}
    return {**where, **{k: f"{file}#{v}" for k, v in tied.items()}}  # a tied key reads its first key's tensor


def _from_safetensors(path: str, targets: dict[str, torch.Tensor]) -> None:
    from seqify.checkpoint.exported import _safetensors

    _safetensors()
    from safetensors import safe_open

    where = _files(path)
    by_file: dict[str, dict[str, str]] = {}
    for key in targets:
        if key in where:
            file, _, stored = where[key].partition("#")
            by_file.setdefault(file, {})[key] = stored or key
    shapes: dict[str, torch.Size] = {}
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            for key, stored in keys.items():
                shapes[key] = torch.Size(f.get_slice(stored).get_shape())
    _check(path, targets, shapes)
    with torch.no_grad():
        for file, keys in by_file.items():
            with safe_open(file, framework="pt") as f:
                for key, stored in keys.items():
                    targets[key].copy_(f.get_tensor(stored))
