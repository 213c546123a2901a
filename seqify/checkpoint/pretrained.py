"""A Hugging Face folder of a trained pipeline: its weights put into the transformers model, saved by it."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from seqify.checkpoint.keys import holder, model_state
from seqify.errors import CheckpointError

__all__ = ["save_pretrained"]


def save_pretrained(pipe: Any, source: nn.Module, directory: str | os.PathLike[str], **kwargs: Any) -> str:
    """Copy the current weights of ``pipe`` (a pipeline or a converted model), by source key, into ``source``
    (the transformers model it was converted from, or another instance of it), then write the folder
    ``directory`` with ``source.save_pretrained(directory, **kwargs)``:
    ``AutoModelForCausalLM.from_pretrained(directory)`` (or the model's class) loads it. Returns the folder."""
    save = getattr(source, "save_pretrained", None)
    if not callable(save):
        raise CheckpointError(
            f"{type(source).__name__} has no save_pretrained (it is not a transformers model): write its weights "
            "with seqify.checkpoint.export(pipe, 'model.safetensors') or seqify.checkpoint.save(pipe, folder)")
    state = model_state(holder(pipe))
    meta = next((k for k, t in state.items() if t.is_meta), None)
    if meta is not None:
        raise CheckpointError(
            f"{meta} is on the meta device in {type(pipe).__name__} (shapes, no values): save a distributed stage "
            "with seqify.distributed.save on every rank, and merge the stages' files into the source model")
    mine = source.state_dict()
    missing = sorted(set(mine) - set(state))
    if missing:
        raise CheckpointError(f"{type(source).__name__} has keys the pipeline does not hold: {missing[:8]}; pass the "
                              "model the pipeline was converted from (or one built from the same configuration)")
    with torch.no_grad():
        for key, t in mine.items():
            if t is not state[key]:
                t.copy_(state[key])
    save(os.fspath(directory), **kwargs)
    return os.fspath(directory)
