"""Shapes: the layers run once on fake tensors, giving each layer's FLOPs and bytes with no compute."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqify.errors import SeqifyError
from seqify.partition.errors import BalanceError
from seqify.partition.walk import Layers, Skips, apply, fresh, nbytes, saved_bytes
from seqify.progress import progress as bar
from seqify.skip.namespace import SkipKey
from seqify.skip.tracker import use_tracker

__all__ = ["Shapes", "propagate"]

_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


@dataclass(frozen=True)
class Shapes:
    """Per layer: forward FLOPs, output bytes and bytes autograd saves for backward; bytes per skip."""

    flops: tuple[int, ...]
    output_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    skip_bytes: Mapping[SkipKey, int]


def propagate(layers: Layers, first: Any, *, progress: bool = False) -> Shapes:
    """Run every layer once on fake tensors (shapes only: no data, no compute, the model untouched).

    Each layer runs on a shallow clone whose parameters and buffers are fake copies, so BatchNorm
    running stats and every other tensor of the model stay as they are. FLOPs are counted with
    ``FlopCounterMode`` (forward only); saved bytes with ``saved_tensors_hooks``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    clones: dict[int, nn.Module] = {}
    skips = Skips()
    flops: list[int] = []
    outputs: list[int] = []
    saved: list[int] = []
    x = apply(mode.from_tensor, first)
    with torch.random.fork_rng(devices=[]):
        for i, layer in enumerate(bar(layers.modules, len(layers), "seqify shapes", progress)):
            fake = _fake_module(layer, mode, clones)
            pack, kept = saved_bytes(fake)
            try:
                with mode:
                    inputs, _ = fresh(x)
                    tracker, _ = skips.tracker(layer)
                    with use_tracker(tracker), FlopCounterMode(display=False) as counter:
                        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                            out = fake(inputs)
            except SeqifyError:
                raise
            except Exception as e:
                raise _failure(layers, i, e) from e
            flops.append(int(counter.get_total_flops()))
            outputs.append(nbytes(out))
            saved.append(sum(kept.values()))
            skips.keep(layer, tracker)
            x = out
    return Shapes(tuple(flops), tuple(outputs), tuple(saved), dict(skips.bytes))


def _fake_module(m: nn.Module, mode: Any, clones: dict[int, nn.Module]) -> nn.Module:
    """A shallow clone of ``m`` whose parameters and buffers (recursively) are fake tensors."""
    clone = clones.get(id(m))
    if clone is not None:
        return clone
    clone = copy.copy(m)
    clone.__dict__["_parameters"] = {
        k: None if v is None else _fake_parameter(v, mode) for k, v in m._parameters.items()
    }
    clone.__dict__["_buffers"] = {k: None if v is None else mode.from_tensor(v) for k, v in m._buffers.items()}
    clone.__dict__["_modules"] = {
        k: None if v is None else _fake_module(v, mode, clones) for k, v in m._modules.items()
    }
    for hooks in _HOOKS:
        if hooks in clone.__dict__:
            clone.__dict__[hooks] = OrderedDict()
    if isinstance(clone, nn.RNNBase):
        clone._init_flat_weights()
    clones[id(m)] = clone
    return clone


def _fake_parameter(p: torch.Tensor, mode: Any) -> torch.Tensor:
    fake: torch.Tensor = mode.from_tensor(p)
    if p.requires_grad and not fake.requires_grad:
        fake.requires_grad_()
    return fake


def _failure(layers: Layers, i: int, e: Exception) -> BalanceError:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    what = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) or "data-dependent" in str(e):
        return BalanceError(
            f"{layers.describe(i)} cannot be costed from shapes: its output depends on the data ({what}); "
            "balance by='time' (measured) or by='params' instead"
        )
    return BalanceError(
        f"{layers.describe(i)} fails on the sample while propagating shapes ({what}); check that the "
        "sample fits the model (shape, dtype, batch size: BatchNorm in training needs more than one value "
        "per channel), as it would have to in model(sample)"
    )
