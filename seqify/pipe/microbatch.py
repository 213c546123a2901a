"""Micro-batches: split a mini-batch along dim 0 and concatenate the micro-batch outputs back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from seqify.errors import BoundaryError

__all__ = ["scatter", "gather", "is_tensors", "split_like", "sizes_of"]


def is_tensors(value: Any) -> bool:
    """Whether ``value`` may cross a partition boundary: a tensor or a tuple of tensors."""
    return isinstance(value, torch.Tensor) or (
        type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value)
    )


def scatter(value: Any, chunks: int, names: Callable[[], list[str] | None] | None = None) -> list[Any]:
    """Split a tensor or tuple of tensors into at most ``chunks`` micro-batches along dim 0.

    Sizes differ by at most one (``tensor_split``), so an uneven last micro-batch is fine; ``chunks``
    larger than the batch is clamped to the batch size; with one chunk nothing is split, and inputs need no
    common batch size. ``names`` returns the model's name of each tensor;
    it is called only to name, in the error, an input without the batch dimension.
    """
    single = isinstance(value, torch.Tensor)
    tensors = (value,) if single else value
    if not is_tensors(value) or not tensors:
        raise BoundaryError(
            f"the pipeline's input must be a tensor or a tuple of tensors to split into micro-batches, "
            f"got {type(value).__name__}"
        )
    if chunks == 1:  # nothing is split: inputs without a common batch size (an image list, its targets) pass
        return [value]
    sizes = {t.size(0) if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        hint = ""
        known = names() if names is not None else None
        if known and len(known) == len(tensors):
            firsts = [t.size(0) if t.dim() else None for t in tensors]
            batch = max(dict.fromkeys(f for f in firsts if f is not None), key=firsts.count, default=None)
            odd = [f"{n} {tuple(t.shape)}" for n, t, f in zip(known, tensors, firsts) if f != batch]
            hint = (f". Without the batch size {batch} first: {', '.join(odd)}; an input shared by every sample "
                    "cannot be split: pass it with a batch dimension if the model accepts one (x.expand(batch, "
                    "...)), or convert a wrapper module that holds it and takes only batched inputs")
        raise BoundaryError(
            "every input tensor needs the same batch size along dim 0 to be split into micro-batches; "
            f"got sizes {[tuple(t.shape) for t in tensors]}{hint}"
        )
    batch = sizes.pop()
    assert batch is not None  # refused above: every tensor has a batch dimension
    chunks = max(1, min(chunks, batch))
    if chunks == 1:
        return [value]
    parts = [t.tensor_split(chunks) for t in tensors]
    return [p[0] if single else tuple(p) for p in zip(*parts)]


def gather(outputs: list[Any], names: Callable[[], list[str] | None] | None = None) -> Any:
    """Concatenate micro-batch outputs (tensors or tuples of tensors) along dim 0 (``names``: each output's
    place in the model's output, for the error)."""
    first = outputs[0]
    if len(outputs) == 1:
        return first
    try:
        if isinstance(first, torch.Tensor):
            return torch.cat(outputs)
        return tuple(torch.cat(parts) for parts in zip(*outputs))
    except (RuntimeError, IndexError) as e:
        tensors = first if isinstance(first, tuple) else (first,)
        shapes = [tuple(t.shape) for t in tensors]
        scalar = next((i for i, t in enumerate(tensors) if t.dim() == 0), None)
        hint = ""
        if scalar is not None:
            known = names() if names is not None else None
            at = f"at position {scalar}" if len(tensors) > 1 else ""
            where = known[scalar] if known and scalar < len(known) else at
            hint = (f". The output{' ' + where if where else ''} is a scalar, such as a loss reduced over the whole "
                    "batch, which micro-batches cannot make: leave out what asks for it (labels=...) or convert a "
                    "wrapper whose forward returns only batched outputs, and compute the loss on the pipeline's "
                    "output (or train with pipe.step(x, target, loss_fn))")
        raise BoundaryError(
            f"micro-batch outputs cannot be concatenated along dim 0 (output shapes {shapes}): every "
            f"output of a pipelined model needs a batch dimension first{hint}"
        ) from e


def split_like(target: Any, sizes: list[int]) -> list[Any]:
    """``target`` cut along the batch dimension into micro-batches of ``sizes`` (tensors, or tuples,
    lists and dicts of them; anything else is given to every micro-batch whole)."""
    if isinstance(target, torch.Tensor):
        if target.dim() == 0 or target.size(0) != sum(sizes):
            raise BoundaryError(f"target has shape {tuple(target.shape)} but the batch has {sum(sizes)} samples; "
                                "pipe.step splits the target along its first dimension like the input")
        return list(target.split(sizes))
    if isinstance(target, (tuple, list)):
        parts = [split_like(t, sizes) for t in target]
        return [type(target)(p[i] for p in parts) for i in range(len(sizes))]
    if isinstance(target, dict):
        parts_d = {k: split_like(v, sizes) for k, v in target.items()}
        return [{k: v[i] for k, v in parts_d.items()} for i in range(len(sizes))]
    return [target] * len(sizes)


def sizes_of(batches: list[Any]) -> list[int]:
    """The number of samples in each micro-batch (a tensor, or a tuple led by one)."""
    return [(b if isinstance(b, torch.Tensor) else b[0]).size(0) for b in batches]
