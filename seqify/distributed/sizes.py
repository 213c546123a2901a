"""Size values (Python ints, floats, bools and ``torch.Size``) as the int64 words a message header carries, and back."""

from __future__ import annotations

import struct
from typing import Any

import torch

__all__ = ["KINDS", "is_size", "encode", "decode"]

_INT, _FLOAT, _BOOL, _SIZE = 3, 4, 5, 6  # message kinds after tensor (0), tuple (1) and None (2)
KINDS = (_INT, _FLOAT, _BOOL, _SIZE)


def is_size(value: Any) -> bool:
    """Whether ``value`` is a size-like Python value (what a size skip holds: a number or a ``torch.Size``)."""
    return isinstance(value, (int, float, torch.Size))


def encode(value: Any) -> tuple[int, list[int]]:
    """``value`` (see :func:`is_size`) as a message kind and int64 words; a float travels as its bits."""
    if isinstance(value, torch.Size):
        return _SIZE, [int(d) for d in value]
    if isinstance(value, bool):
        return _BOOL, [int(value)]
    if isinstance(value, int):
        return _INT, [value]
    return _FLOAT, [struct.unpack("<q", struct.pack("<d", float(value)))[0]]


def decode(kind: int, words: list[int]) -> Any:
    """The value :func:`encode` made ``kind`` and ``words`` from, exactly."""
    if kind == _SIZE:
        return torch.Size(words)
    if kind == _BOOL:
        return bool(words[0])
    if kind == _INT:
        return int(words[0])
    return struct.unpack("<d", struct.pack("<q", words[0]))[0]
