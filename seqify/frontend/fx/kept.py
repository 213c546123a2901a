"""Submodules kept whole: what a traced forward did that fx cannot record as exact layers (state it changed,
tensors or generators held outside the module tree, reseeds), and the refusal when it is the model's own forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqify.errors import SeqifyError, StatefulForwardError
from seqify.frontend.fx.autograd import keep_reason
from seqify.frontend.grad_watch import Use
from seqify.frontend.outside import Held, find, generator_error, outside, unregistered_error, what_is
from seqify.frontend.reseeds import Reseed
from seqify.frontend.traced import Opaque

__all__ = [
    "DRAW", "UnrecordedDraw", "keep_drawer", "KeepWhole", "Update", "keep_unregistered", "keep_generator",
    "keep_reseeding", "keep_users", "keep_writers", "stateful_error",
]


class KeepWhole(Exception):
    """Raised inside a traced forward that fx cannot turn into exact layers but that is exact run whole: a
    submodule's forward is kept whole as one layer (``reason`` says why); the model's own forward, which
    cannot be, raises ``error`` instead."""

    def __init__(self, reason: str, error: SeqifyError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


@dataclass(frozen=True)
class Update:
    """State a traced forward changed that no layer would change again: a Python attribute it set, or in place
    without fx recording it, a buffer, a tensor held outside the module tree or a private generator's state
    (``owner``: the module whose attribute holds it)."""

    owner: str
    name: str
    kind: str  # "attribute" (a Python attribute set or replaced), "buffer", "tensor" or "generator"


def keep_unregistered(root: nn.Module, held: Held | None, obj: Any) -> KeepWhole:
    """A traced forward uses a module, or a tensor requiring grad, held outside the module tree."""
    where = what_is(root, held, obj)
    return KeepWhole(f"its forward uses {where}, held outside the module tree (a plain list, dict or helper "
                     "object); kept whole so it computes with it as the source does",
                     unregistered_error(root, held, obj, frontend="fx"))


def keep_generator(root: nn.Module, gen: torch.Generator) -> KeepWhole:
    """A traced forward draws from a private generator."""
    held = find(root, gen)
    where = held.path(root) if held is not None else "a torch.Generator made in forward"
    return KeepWhole(f"its forward draws from its own torch.Generator ({where}); kept whole so it draws as the "
                     "source does", generator_error(root, held, gen))


def keep_reseeding(root: nn.Module, record: Reseed, plain: int) -> None:
    """While fx traces (not while a leaf runs whole: ``plain`` > 0), a reseed stops the forward: fx would run it
    once, at conversion, and no layer would repeat it."""
    if not plain:
        raise KeepWhole(
            f"its forward reseeds torch's random number generator ({record.call} at {record.site}); kept whole so "
            "it reseeds on every call",
            StatefulForwardError(
                f"{type(root).__name__}.forward reseeds torch's random number generator ({record.call} at "
                f"{record.site}) while it runs: torch.fx runs that call once, while tracing, and no converted layer "
                "would repeat it, so every random draw after it (dropout, sampling) would differ from the source's. "
                "What to do: seed before calling the model instead of inside forward, or move the seeding into a "
                "submodule, which seqify keeps whole as one layer (it then reseeds on every call)"
            ),
        )


def keep_users(model: nn.Module, uses: dict[str, Use], kept: dict[str, Opaque]) -> None:
    """Keep whole each submodule whose forward uses autograd context a graph cannot hold (a tensor hook it
    registers, autograd it runs): called whole, it does so on every call as the source does."""
    for path, use in uses.items():
        if path and path not in kept:
            module = model.get_submodule(path)
            kept[path] = Opaque(path, type(module).__name__, keep_reason(use))


def keep_writers(model: nn.Module, writes: list[Update], kept: dict[str, Opaque],
                 flattened: dict[str, nn.Module]) -> None:
    """Keep whole each module whose attributes a traced forward wrote, or whose state it changed in place
    unrecorded (its own forward, or failing that its parent's), so the source's module changes on every
    call (``flattened``: the modules fx traced through); refuse when that is the model itself."""
    by_owner: dict[str, list[Update]] = {}
    for w in writes:
        by_owner.setdefault(w.owner, []).append(w)
    for path, changes in by_owner.items():
        owner = path
        while owner and owner not in flattened:
            owner = owner.rpartition(".")[0]  # not traced through: the write comes from an enclosing forward
        attrs = ", ".join(f"{path}.{c.name}" if path else f"self.{c.name}" for c in changes)
        kinds = {c.kind for c in changes}
        if not owner:
            raise stateful_error(model, kinds, attrs, changes)
        module = model.get_submodule(owner)
        what = (f"changes the attribute(s) {attrs}" if kinds == {"attribute"} else
                f"changes {attrs} in place where fx does not record it")
        kept[owner] = Opaque(owner, type(module).__name__,
                             f"its forward {what}; kept whole so the source module changes on every call")


def stateful_error(model: nn.Module, kinds: set[str], attrs: str, updates: list[Update]) -> SeqifyError:
    """The refusal of a model whose own forward changes state a converted model would not change."""
    name = type(model).__name__
    if "generator" in kinds:
        gen = next(u for u in updates if u.kind == "generator")
        held = next((h for h in outside(model) if (h.owner, h.where) == (gen.owner, gen.name)), None)
        return generator_error(model, held, held.obj if held is not None else None)
    if "tensor" in kinds:
        return StatefulForwardError(
            f"{name}.forward changes {attrs} in place, a tensor {name} keeps outside its module tree (a plain "
            "attribute, list, dict or helper object, not a buffer), with values torch.fx does not record: fx runs "
            "the change once, while tracing, and a converted model would never make it. What to do: convert with "
            "frontend='export' (or 'auto'), which records in-place changes; register it as a buffer "
            "(self.register_buffer(...)); or move the change into a submodule, which seqify keeps whole as one layer."
        )
    if "buffer" in kinds:
        return StatefulForwardError(
            f"{name}.forward updates its buffer(s) {attrs} in place with values torch.fx does not record "
            "(`self.n += 1` runs once, while tracing), so a converted model would never update them. What to do: "
            "convert with frontend='export' (or 'auto', which falls back to it), which records the update; or "
            "move the update into a submodule, which seqify keeps whole as one layer (it then updates them on "
            "every call)."
        )
    return StatefulForwardError(
        f"{name}.forward changes the Python attribute(s) {attrs} while it runs (e.g. a step counter, "
        "`self.calls += 1`); a converted model would bake the first value in and be wrong from the "
        "second call on. What to do: move that state change into a submodule (seqify keeps a "
        "submodule that writes its attributes whole, so the change happens on every call), or keep "
        "the state in a buffer updated in place (self.calls.add_(1))."
    )


DRAW = "it draws from torch's random generator where fx cannot record it; kept whole so it draws on every call"


class UnrecordedDraw(Exception):
    """Code traced through drew from torch's global generator where fx records nothing (``torch.empty(1)
    .uniform_()`` on a tensor it made itself, as torchvision's random resize choice does): the trace would
    keep one draw for every call. Kept whole, the module or method draws on every call, in the source's order."""


def keep_drawer(module: nn.Module) -> KeepWhole:
    """The KeepWhole of a submodule that drew where fx records nothing (the model itself cannot be kept whole)."""
    error = StatefulForwardError(
        f"{type(module).__name__}.forward draws random numbers on tensors it makes itself (torch.empty(n).uniform_()"
        ", torch.randperm(n) with fixed sizes), which fx cannot record: a converted model would repeat one draw. "
        "What to do: move the draw into a submodule (seqify keeps it whole, so it draws on every call), or "
        "convert with frontend='export'."
    )
    return KeepWhole(DRAW, error)
