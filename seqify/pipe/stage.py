"""Stage: how one partition runs one micro-batch, behind one small interface."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from seqify.errors import StageError
from seqify.skip.namespace import SkipKey
from seqify.skip.tracker import SkipTracker, use_tracker

__all__ = ["Stage", "annotate"]


def annotate(error: BaseException, where: str) -> BaseException | None:
    """Say where a stage failed: a note on the original exception (Python >= 3.11; returns None, so
    the caller re-raises it unchanged), else a StageError to raise from it."""
    if hasattr(error, "add_note"):
        error.add_note(where)
        return None
    return StageError(f"{where}: {type(error).__name__}: {error}")


class Stage:
    """Runs a partition's layers on one micro-batch: ``stage(x, skips) -> (y, skips_out)``.

    ``skips`` are the values this partition pops that earlier partitions stashed, already on this
    stage's device; ``skips_out`` are the values it stashes for later partitions. Skips that stay
    inside the partition never leave it. Anything with this call signature (a captured CUDA graph, a
    compiled callable) can stand in for the eager loop.
    """

    def __init__(
        self,
        index: int,
        layers: nn.Sequential,
        device: torch.device,
        pops: tuple[SkipKey, ...],
        stashes: tuple[SkipKey, ...],
    ) -> None:
        self.index = index
        self.layers = layers
        self.device = device
        self.pops = pops
        self.stashes = stashes
        self.names = list(layers._modules)
        self.modules = list(layers._modules.values())
        self.mutates_input, self.mutated_skips = _mutations(self.modules, set(pops))

    def __repr__(self) -> str:
        return f"Stage({self.index}, {self.device}, {len(self.modules)} layers)"

    def __call__(self, x: Any, skips: dict[SkipKey, Any]) -> tuple[Any, dict[SkipKey, Any]]:
        tracker = SkipTracker()
        tracker.values.update(skips)
        i = 0  # the layer running, for the error below
        try:
            with use_tracker(tracker):
                for i, layer in enumerate(self.modules):  # noqa: B007  (i: read where a layer fails)
                    x = layer(x)
        except Exception as e:
            wrapped = annotate(e, f"in pipeline partition {self.index} ({self.device}), layer {self.names[i]!r}")
            if wrapped is None:
                raise
            raise wrapped from e
        values = tracker.values
        return x, {key: values.pop(key) for key in self.stashes}

    def fresh(self, x: Any, skips: dict[SkipKey, Any]) -> tuple[Any, dict[SkipKey, Any]]:
        """Run on copies of the inputs that a layer modifies in place (``ReLU(inplace=True)`` first,
        ``out += identity`` on a popped skip): checkpointing recomputes from the inputs, and a captured
        graph's inputs are leaves autograd must not see modified. A tensor received twice (carried and
        popped, say) is copied once, so both names still refer to one tensor, as in the source."""
        if not (self.mutates_input or self.mutated_skips):
            return self(x, skips)
        copies: dict[int, torch.Tensor] = {}

        def copy(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            c = copies.get(id(t))
            if c is None:
                c = copies[id(t)] = t.clone()
            return c

        if self.mutates_input:
            x = copy(x) if isinstance(x, torch.Tensor) else tuple(copy(t) for t in x)
        for k in self.mutated_skips:
            if k in skips:
                copy(skips[k])

        def same(t: Any) -> Any:
            return copies.get(id(t), t) if isinstance(t, torch.Tensor) else t

        x = same(x) if isinstance(x, torch.Tensor) else tuple(same(t) for t in x)
        return self(x, {k: same(v) for k, v in skips.items()})


def _mutations(modules: list[nn.Module], pops: set[SkipKey]) -> tuple[bool, set[SkipKey]]:
    """Whether some layer may modify the stage's input in place, and which of the skips the stage
    receives some layer may modify in place (directly, or through a view or a value passed on)."""
    from seqify.pipe.inplace import INPUT, mutated_roots

    mutated = mutated_roots(modules, tuple(pops))
    return INPUT in mutated, {key for key in pops if key in mutated}
