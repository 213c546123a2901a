"""Skip layout: which layer stashes and which pops each skip, checked once, used to route skips."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from seqify.errors import SkipError
from seqify.skip.namespace import SkipKey
from seqify.skip.skippable import pop_keys, stash_keys

__all__ = ["SkipRoute", "verify", "routes"]


@dataclass(frozen=True)
class SkipRoute:
    """One skip: stashed by layer ``stash`` and popped by layer ``pop`` (indices into the Sequential)."""

    key: SkipKey
    stash: int
    pop: int

    @property
    def name(self) -> str:
        return self.key[1]


def routes(layers: Sequence[nn.Module] | nn.Sequential, names: Sequence[str] | None = None) -> list[SkipRoute]:
    """Check that every skip is stashed once and popped once by a later layer; return the routes.

    Raises :class:`~seqify.errors.SkipError` naming the layers involved otherwise.
    """
    if isinstance(layers, nn.Sequential):
        names = list(layers._modules.keys()) if names is None else names
        layers = list(layers._modules.values())
    names = [str(i) for i in range(len(layers))] if names is None else list(names)
    stashed: dict[SkipKey, int] = {}
    found: list[SkipRoute] = []
    for i, layer in enumerate(layers):
        for key in pop_keys(layer):
            if key not in stashed:
                raise SkipError(
                    f"layer {names[i]!r} pops skip {key[1]!r} but no earlier layer stashes it "
                    "(in its namespace); move the stashing layer before it or isolate both in one Namespace"
                )
            found.append(SkipRoute(key, stashed.pop(key), i))
        for key in stash_keys(layer):
            if key in stashed or any(r.key == key for r in found):
                raise SkipError(
                    f"layer {names[i]!r} stashes skip {key[1]!r}, which another layer already stashes; "
                    "isolate repeated layers with skippable.isolate(Namespace())"
                )
            stashed[key] = i
    if stashed:
        left = ", ".join(f"{k[1]!r} (stashed by {names[i]!r})" for k, i in stashed.items())
        raise SkipError(f"skips stashed but never popped: {left}; every stash needs one pop after it")
    return found


def verify(layers: Iterable[nn.Module] | nn.Sequential) -> None:
    """Raise :class:`~seqify.errors.SkipError` if the layers' skips are not each stashed and popped once."""
    routes(layers if isinstance(layers, nn.Sequential) else list(layers))
