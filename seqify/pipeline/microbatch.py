"""Micro-batches: split a mini-batch along dim 0 and concatenate the micro-batch outputs back."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import BoundaryError

__all__ = ["scatter", "gather", "is_tensors"]


def is_tensors(value: Any) -> bool:
    """Whether ``value`` may cross a partition boundary: a tensor or a tuple of tensors."""
    return isinstance(value, torch.Tensor) or (
        type(value) is tuple and all(isinstance(t, torch.Tensor) for t in value)
    )


def scatter(value: Any, chunks: int) -> list[Any]:
    """Split a tensor or tuple of tensors into at most ``chunks`` micro-batches along dim 0.

    Sizes differ by at most one (``tensor_split``), so an uneven last micro-batch is fine; ``chunks``
    larger than the batch is clamped to the batch size.
    """
    single = isinstance(value, torch.Tensor)
    tensors = (value,) if single else value
    if not is_tensors(value) or not tensors:
        raise BoundaryError(
            f"the pipeline's input must be a tensor or a tuple of tensors to split into micro-batches, "
            f"got {type(value).__name__}"
        )
    sizes = {t.size(0) if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        raise BoundaryError(
            "every input tensor needs the same batch size along dim 0 to be split into micro-batches; "
            f"got sizes {[tuple(t.shape) for t in tensors]}"
        )
    batch = sizes.pop()
    chunks = max(1, min(chunks, batch))
    if chunks == 1:
        return [value]
    parts = [t.tensor_split(chunks) for t in tensors]
    return [p[0] if single else tuple(p) for p in zip(*parts)]


def gather(outputs: list[Any]) -> Any:
    """Concatenate micro-batch outputs (tensors or tuples of tensors) along dim 0."""
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
        scalar = any(isinstance(t, torch.Tensor) and t.dim() == 0 for t in tensors)
        hint = (
            ". A 0-dimensional output is a loss the model computes itself (a transformers model called with "
            "labels=...): losses of micro-batches do not join into the batch's. Compute the loss outside the "
            "model: drop labels= and use pipe.step(inputs, target, loss_fn), or loss_fn(pipe(inputs), target)"
            if scalar else ""
        )
        raise BoundaryError(
            f"micro-batch outputs cannot be concatenated along dim 0 (output shapes {shapes}): every "
            f"output of a pipelined model needs a batch dimension first{hint}"
        ) from e
