"""Layer settings: the plain attributes a layer's Python reads (a dropout's ``p``, a BatchNorm's ``momentum``).

A captured CUDA graph replays the kernels its layers launched while it was captured, with the values these
attributes had then: a dropout's probability, a BatchNorm's momentum and epsilon, a drop-path rate. So programs
are kept for the settings they were built with and built again when one changes. The names are taken once, when
the pipeline is built; each step reads only their values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

__all__ = ["Settings", "named", "values"]

#: What a plain setting holds: a number, a flag, a string or None (a BatchNorm's ``momentum=None``).
PLAIN = (bool, int, float, str, type(None))

#: Each layer with plain settings, and their names.
Settings = Sequence[tuple[nn.Module, tuple[str, ...]]]


def named(layers: Iterable[nn.Module]) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """The layers that have plain settings, with their names: public attributes of their own holding a plain
    value (``training``, the layer's mode, is left to the caller, which keeps modes apart)."""
    out = []
    for m in layers:
        names = tuple(k for k, v in vars(m).items()
                      if not k.startswith("_") and k != "training" and isinstance(v, PLAIN))
        if names:
            out.append((m, names))
    return out


def values(settings: Settings) -> tuple[object, ...]:
    """The settings' values now, in the order of :func:`named` (a setting deleted since reads as None)."""
    return tuple(getattr(m, n, None) for m, names in settings for n in names)
