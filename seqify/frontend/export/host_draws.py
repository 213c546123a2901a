"""Random draws a forward makes outside torch (numpy, Python's random) while exported: the graph keeps their result."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from seqify.errors import StatefulForwardError

__all__ = ["HostDraws", "host_draws", "refuse_host_draws", "random_train_steps"]


def _states() -> dict[str, Any]:
    states: dict[str, Any] = {"random": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy"] = np.random.get_state()
    return states


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy's key array
        return bool((a == b).all())
    return bool(a == b)


def _restore(states: dict[str, Any]) -> None:
    random.setstate(states["random"])
    if "numpy" in states:
        sys.modules["numpy"].random.set_state(states["numpy"])


class HostDraws:
    """The state of the generators outside torch when watching began, and which of them have drawn since."""

    def __init__(self) -> None:
        self.before = _states()

    def drawn(self) -> list[str]:
        now = _states()
        return [k for k in self.before if k in now and not _same(self.before[k], now[k])]


@contextmanager
def host_draws() -> Iterator[HostDraws]:
    """Watch the generators outside torch (``numpy``, ``random``) over the block; on exit they are as they were
    before it (capturing draws none of the caller's numbers)."""
    watch = HostDraws()
    try:
        yield watch
    finally:
        _restore(watch.before)


def random_train_steps(model: nn.Module) -> list[tuple[str, str]]:
    """The train-mode steps a transformers config turns on that draw at random, with the setting that turns
    each off: LayerDrop, and SpecAugment's time and feature masks (audio models)."""
    config: Any = getattr(model, "config", None)
    steps = []
    drop = getattr(config, "layerdrop", 0) or 0
    if drop > 0:
        steps.append((f"LayerDrop (config.layerdrop = {drop})", "config.layerdrop = 0.0"))
    masks = [k for k in ("mask_time_prob", "mask_feature_prob") if (getattr(config, k, 0) or 0) > 0]
    if getattr(config, "apply_spec_augment", False) and masks:
        steps.append((f"SpecAugment's masks ({', '.join(f'config.{k} = {getattr(config, k)}' for k in masks)})",
                      "config.apply_spec_augment = False"))
    return steps


def refuse_host_draws(model: nn.Module, drawn: list[str], first: torch.export.ExportedProgram,
                      again: Callable[[], torch.export.ExportedProgram]) -> None:
    """A forward that drew from ``drawn`` while captured (``first``) has that draw's result in the graph (a
    constant mask, a branch taken once): a converted model would repeat it on every call. Refused where the
    model's config turns on a step that draws (naming it and the setting that turns it off), or where a capture
    from other draws (``again``, run after the generators moved on) records another program."""
    if not drawn:
        return
    name = type(model).__name__
    steps = random_train_steps(model) if model.training else []
    if steps:
        what, fix = " and ".join(s for s, _ in steps), " and ".join(o for _, o in steps)
        raise StatefulForwardError(
            f"{name}.forward draws random numbers with {' and '.join(drawn)} in train mode for {what}: torch.export "
            "runs those draws once, while capturing, and the graph keeps their result, so a converted model would "
            f"repeat one draw on every call. What to do: to train the converted model set {fix} before converting; "
            "to evaluate it, convert in eval mode"
        )
    _move_on(drawn)
    if _same_program(first, again()):
        return
    raise StatefulForwardError(
        f"{name}.forward draws random numbers with {' and '.join(drawn)} while it runs, and what it draws changes "
        "the captured graph: torch.export runs those draws once and the graph keeps their result, so a converted "
        "model would repeat one draw on every call. What to do: draw with torch (torch.rand, torch.randint: the "
        "graph records those and replays them in the source's order), or keep that code in a submodule and "
        "convert with frontend='fx', which keeps it whole as one layer"
    )


def _move_on(drawn: list[str]) -> None:
    if "random" in drawn:
        random.random()
    if "numpy" in drawn:
        sys.modules["numpy"].random.random()


def _same_program(a: torch.export.ExportedProgram, b: torch.export.ExportedProgram) -> bool:
    if str(a.graph) != str(b.graph) or a.constants.keys() != b.constants.keys():
        return False
    for key, value in a.constants.items():
        other = b.constants[key]
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor):
            if value.shape != other.shape or value.dtype != other.dtype or not torch.equal(value, other):
                return False
        elif value is not other:
            return False
    return True
