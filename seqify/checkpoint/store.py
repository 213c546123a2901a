"""A checkpoint folder: tensors through torch.distributed.checkpoint, the rest weights-only, metadata in JSON."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from seqify.errors import CheckpointError

__all__ = ["FORMAT", "META", "STATE", "TENSORS", "LEGACY_INDEX", "write", "begin", "write_tensors", "finish",
           "listing", "plain_bytes", "read_meta", "read_state", "tensor_shapes", "read_tensors"]

FORMAT = "seqify.checkpoint/2"
META = "seqify.json"  # what was saved and by what: read first, written last
STATE = "state.pt"  # everything but the tensors DCP holds: torch.load(weights_only=True) reads it
TENSORS = "tensors"  # a torch.distributed.checkpoint folder
LEGACY_INDEX = "index.json"  # the per-stage files seqify 0.1 wrote (model state only)


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP without a process group saves and loads in this process, and warns so each time: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
        yield


def plain_bytes(state: Mapping[str, Any]) -> bytes:
    """``state`` as torch.save writes it, refused unless ``torch.load(weights_only=True)`` reads it back."""
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"a value to save is not one torch.load(weights_only=True) reads back ({e}); the scheduler's state "
            "and extra= must hold plain values: numbers, strings, None, tensors, and lists, tuples and dicts of them"
        ) from e
    return buffer.getvalue()


def _only_checkpoint(directory: str) -> bool:
    """Whether every entry of ``directory`` is a checkpoint's (this layout's, seqify 0.1's stage files, or the
    ``stage{i}.pt`` files of seqify.distributed.save's own layout)."""
    names = set(os.listdir(directory))
    legacy = {n for n in names if n.startswith("stage_") and n.endswith(".pt")} | {LEGACY_INDEX}
    staged = {n for n in names if re.fullmatch(r"stage\d+\.pt", n)}  # seqify.distributed's stage files
    return names <= {META, STATE, TENSORS} or (LEGACY_INDEX in names and names <= legacy) or names == staged


def write(directory: str | os.PathLike[str], tensors: dict[str, torch.Tensor], state: Mapping[str, Any],
          meta: dict[str, Any]) -> list[str]:
    """Write the checkpoint folder ``directory`` (replacing a checkpoint there); returns the files in it."""
    final = os.path.abspath(os.fspath(directory))
    plain = plain_bytes(state)
    tmp = begin(final)
    try:
        write_tensors(tmp, tensors, together=False)
        finish(tmp, final, plain, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return listing(final)


def begin(final: str) -> str:
    """The empty temporary folder beside ``final`` that a checkpoint is written into before it is renamed."""
    _check_target(final)
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.saving-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def write_tensors(tmp: str, tensors: dict[str, torch.Tensor], together: bool) -> None:
    """Save ``tensors`` into ``tmp``'s DCP folder: this process alone, or ``together`` with every rank of the
    process group (each passing the tensors it writes; all must call)."""
    if together:
        dcp.save(tensors, checkpoint_id=os.path.join(tmp, TENSORS))
        return
    with _one_process():
        dcp.save(tensors, checkpoint_id=os.path.join(tmp, TENSORS), no_dist=True)


def finish(tmp: str, final: str, plain: bytes, meta: dict[str, Any]) -> None:
    """Write the state and metadata into ``tmp`` and rename it to ``final``."""
    with open(os.path.join(tmp, STATE), "wb") as out:
        out.write(plain)
    with open(os.path.join(tmp, META), "w") as f:
        json.dump({"format": FORMAT, **meta}, f, indent=1)
    _swap(tmp, final)


def listing(final: str) -> list[str]:
    """The files of the checkpoint folder ``final``."""
    return sorted(os.path.join(root, f) for root, _, files in os.walk(final) for f in files)


def _check_target(final: str) -> None:
    """Refuse to replace a folder that holds anything but a checkpoint."""
    if os.path.exists(final) and not os.path.isdir(final):
        raise CheckpointError(f"{final} is a file: give seqify.checkpoint.save a folder name")
    if os.path.isdir(final) and not _only_checkpoint(final):
        raise CheckpointError(
            f"{final} holds files that are not a seqify checkpoint's, and saving replaces the whole folder: "
            "save into a new or empty folder (e.g. a subfolder per step)"
        )


def _swap(tmp: str, final: str) -> None:
    """Move the finished folder into place; an older checkpoint there goes only once the new one is in."""
    old = None
    if os.path.isdir(final):
        old = f"{tmp}.old"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_meta(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's metadata (``seqify.json``), checked to be one this seqify reads."""
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{directory} holds no seqify checkpoint ({META} is missing): pass the folder given to "
            "seqify.checkpoint.save(pipe, folder); a folder of stage{i}.pt files loads with "
            "seqify.distributed.load(stage, folder), onto the balance it was saved with"
        )
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{path} is in format {meta.get('format')!r} and this seqify reads {FORMAT!r}: load it with the "
            f"seqify that saved it ({meta.get('seqify', 'unknown version')})"
        )
    return meta


def read_state(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's non-tensor state (optimizer groups, scheduler, RNG, step, extra)."""
    path = os.path.join(directory, STATE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: copy the whole checkpoint folder")
    return dict(torch.load(path, map_location="cpu", weights_only=True))


def tensor_shapes(directory: str | os.PathLike[str]) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Each tensor the DCP folder holds: its full shape and dtype."""
    path = os.path.join(directory, TENSORS)
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} holds no tensors (its .metadata is missing): copy the whole checkpoint folder")
    found = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: (m.size, m.properties.dtype) for k, m in found.items() if isinstance(m, TensorStorageMetadata)}


def read_tensors(directory: str | os.PathLike[str], targets: dict[str, torch.Tensor]) -> None:
    """Fill ``targets`` (name -> a tensor of the saved shape, any device) with the saved values, in place."""
    if targets:
        with _one_process():
            dcp.load(targets, checkpoint_id=os.path.join(directory, TENSORS), no_dist=True)
