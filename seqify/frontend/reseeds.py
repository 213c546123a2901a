"""Reseeds: calls inside a forward that reset torch's random number generators, caught while converting."""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn

from seqify._paths import PACKAGE_DIR
from seqify.frontend.torch_tables import settle_torch_tables

__all__ = ["Reseed", "reseeds"]

_HERE = PACKAGE_DIR
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
#: The functions that set a generator's seed or state. ``torch.manual_seed`` and ``torch.seed`` call
#: ``torch.cuda.manual_seed_all`` inside, so a copy imported before the patch (``from torch import
#: manual_seed``) is caught there.
_NAMES = {
    "torch": ("manual_seed", "seed", "set_rng_state"),
    "torch.random": ("manual_seed", "seed", "set_rng_state"),
    "torch.cuda": ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"),
}


@dataclass(frozen=True)
class Reseed:
    """One reseed a forward made: the function, where the user's code called it, and the innermost module
    of the model whose forward was running (its path; '' for the model itself, None if none was)."""

    call: str
    site: str
    module: str | None

    def where(self, model: nn.Module) -> str:
        """``Model.forward`` or ``submodule 'a.b' (Type)``, for messages."""
        if not self.module:
            return f"{type(model).__name__}.forward"
        return f"submodule {self.module!r} ({type(model.get_submodule(self.module)).__name__})"


_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def _owner(file: str) -> str:
    file = os.path.abspath(file)
    if file.startswith(_TORCH) or file == _CONTEXTLIB:
        return "torch"  # contextlib runs the exit of torch's own context managers (fork_rng)
    return "seqify" if file.startswith(_HERE) else "user"


def _caller(frame: FrameType | None) -> FrameType | None:
    """The first frame outside torch above ``frame``, where it is the user's code (not seqify's own: a
    ``fork_rng`` that seqify opens puts the state back through ``set_rng_state``). A ``fork_rng`` in the
    user's forward is a reseed too: the state it puts back undoes the draws inside it."""
    while frame is not None and _owner(frame.f_code.co_filename) == "torch":
        frame = frame.f_back
    return frame if frame is not None and _owner(frame.f_code.co_filename) == "user" else None


def _module(frame: FrameType | None, paths: dict[int, str]) -> str | None:
    """The path of the innermost module of the model whose method a frame at or above ``frame`` runs."""
    while frame is not None:
        owner = frame.f_locals.get("self")
        if id(owner) in paths:
            return paths[id(owner)]
        frame = frame.f_back
    return None


@contextmanager
def reseeds(model: nn.Module, on_call: Callable[[Reseed], None] | None = None) -> Iterator[list[Reseed]]:
    """Record every call that reseeds torch's generators made by user code while the block runs, into the
    list it yields; ``on_call`` sees each first (it may raise, to stop the forward there)."""
    settle_torch_tables()
    found: list[Reseed] = []
    paths = {id(m): p for p, m in model.named_modules()}
    saved: list[tuple[Any, str, Any]] = []

    def patched(qualified: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def reseed(*args: Any, **kwargs: Any) -> Any:
            frame = _caller(sys._getframe(1))
            if frame is not None:
                line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                site = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" + (f" ({line})" if line else "")
                record = Reseed(qualified, site, _module(frame, paths))
                if on_call is not None:
                    on_call(record)
                found.append(record)
            return original(*args, **kwargs)

        return reseed

    try:
        for owner_name, names in _NAMES.items():
            owner = sys.modules[owner_name]
            for name in names:
                original = getattr(owner, name)
                saved.append((owner, name, original))
                setattr(owner, name, patched(f"{owner_name}.{name}", original))
        yield found
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
