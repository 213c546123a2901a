"""The source model's state as one safetensors file, tied weights stored once and restored on reading."""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

import torch

from seqify.checkpoint.keys import holder, model_state
from seqify.errors import CheckpointError

__all__ = ["export", "load_exported", "untie"]

FORMAT = "seqify.export/1"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:
        raise CheckpointError(
            "exporting to safetensors needs the safetensors package: pip install safetensors (or seqify[safetensors])"
        ) from e
    return safetensors.torch


def untie(state: OrderedDict[str, torch.Tensor]) -> tuple[OrderedDict[str, torch.Tensor], dict[str, str]]:
    """Each tensor once: a key whose tensor is another key's (a tied weight) is dropped and mapped to that
    key; a tensor that only overlaps another's storage is copied (safetensors refuses shared storage)."""
    kept: OrderedDict[str, torch.Tensor] = OrderedDict()
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    storages: set[tuple[torch.device, int]] = set()
    for key, t in state.items():
        ptr = (t.device, t.untyped_storage().data_ptr())
        ident = (*ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in seen:
            tied[key] = seen[ident]
            continue
        t = t.detach().cpu()
        kept[key] = t.clone() if t.numel() and ptr in storages else t.contiguous()
        if t.numel():
            seen[ident] = key
            storages.add(ptr)
    return kept, tied


def export(model: Any, path: str | os.PathLike[str], metadata: dict[str, str] | None = None) -> str:
    """Write the state of ``model`` (a pipeline, a converted model or any module) under the source model's keys
    to the safetensors file ``path``: a tied weight is stored once under its first key, and
    :func:`load_exported` (or ``safetensors.torch.load_model(source, path)``) restores it. ``metadata``:
    strings stored in the file's header. Written under a temporary name and renamed. Returns the path."""
    st = _safetensors()
    module = holder(model)
    state = model_state(module)
    kept, tied = untie(state)
    header = dict(metadata or {}, format=FORMAT, source=str(getattr(module, "source", type(module).__name__)),
                  keys=json.dumps(list(state)), tied=json.dumps(tied))
    final = os.fspath(path)
    tmp = f"{final}.saving-{os.getpid()}"
    try:
        st.save_file(kept, tmp, metadata=header)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return final


def load_exported(path: str | os.PathLike[str], device: str = "cpu") -> OrderedDict[str, torch.Tensor]:
    """The state dict :func:`export` wrote, every key back in the source's order (a tied key shares its
    tensor): ``source.load_state_dict(...)`` or ``seq.load_original_state_dict(...)`` takes it."""
    st = _safetensors()
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: pass the file seqify.checkpoint.export(model, path) wrote")
    with safe_open(os.fspath(path), framework="pt") as f:
        header = f.metadata() or {}
    tensors = st.load_file(os.fspath(path), device=device)
    if header.get("format") != FORMAT:  # a safetensors file of someone else's: its tensors as they are
        return OrderedDict(tensors)
    tied = json.loads(header["tied"])
    return OrderedDict((k, tensors[tied.get(k, k)]) for k in json.loads(header["keys"]))
