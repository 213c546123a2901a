"""transformers' causal-mask skip under export: no padding mask, so SDPA keeps is_causal (and flash attention)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["causal_skip"]

# The helpers in transformers.masking_utils that decide whether a mask can be left to SDPA's is_causal.
_SKIPS = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")


# How transformers versions ask whether they are being captured (5.17: compiling; 5.23: exporting).
_TRACING = ("is_torchdynamo_exporting", "is_torchdynamo_compiling", "is_tracing")


def _no(*args: Any, **kwargs: Any) -> bool:
    return False


def _unexported(skip: Callable[..., bool], masking: Any) -> Callable[..., bool]:
    """``skip`` as it decides outside export, where the caller passed no padding mask."""

    @functools.wraps(skip)
    def decide(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        if padding_mask is not None:  # its values would decide: keep the mask, as under export
            return False
        saved = {name: getattr(masking, name) for name in _TRACING if hasattr(masking, name)}
        for name in saved:
            setattr(masking, name, _no)
        try:
            return bool(skip(padding_mask, *args, **kwargs))
        finally:
            for name, check in saved.items():
                setattr(masking, name, check)

    return decide


def _single_sequence(find: Callable[..., Any]) -> Callable[..., Any]:
    """``find_packed_sequence_indices`` for position ids the model made itself (an arange per row: one
    sequence per row, which outside export it finds from their values)."""

    @functools.wraps(find)
    def single(position_ids: Any, *args: Any, **kwargs: Any) -> None:
        return None

    return single


@contextmanager
def causal_skip(inputs: dict[str, Any] | None = None) -> Iterator[None]:
    """While capturing, let transformers skip building a causal mask that no padding changes, as it does
    outside export. Under export it always builds one, so SDPA gets an explicit mask and can never use the
    flash kernel (a converted Llama trained at 0.86x its source under bf16 on an H200). Leaving the mask to
    ``is_causal`` is what the source computes for a call without ``attention_mask``; the captured graph
    keeps the example's sequence length (guarded), so ``is_causal`` stays right for every call it accepts.
    A call that passes ``attention_mask`` keeps its explicit mask; where the caller passes no
    ``position_ids`` (in ``inputs``), the model makes them one sequence per row, which is what transformers
    checks their values for before it skips (packed sequences), so that check is answered as outside export."""
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not any(hasattr(masking, name) for name in _TRACING):
        yield
        return
    saved = {name: getattr(masking, name) for name in _SKIPS if hasattr(masking, name)}
    wrapped = {name: _unexported(skip, masking) for name, skip in saved.items()}
    if "position_ids" not in (inputs or {}) and hasattr(masking, "find_packed_sequence_indices"):
        saved["find_packed_sequence_indices"] = masking.find_packed_sequence_indices
        wrapped["find_packed_sequence_indices"] = _single_sequence(masking.find_packed_sequence_indices)
    for name, replacement in wrapped.items():
        setattr(masking, name, replacement)
    try:
        yield
    finally:
        for name, skip in saved.items():
            setattr(masking, name, skip)
