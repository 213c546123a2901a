"""torchgpipe 0.0.7's API (GPipe, balance_by_time, balance_by_size, verify_skippables) backed by seqify."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from seqify.errors import BalanceError, CompatDeviceError, CompatError, CompatSkipError, DeviceError, SkipError
from seqify.partition import split
from seqify.partition.cost import LayerCosts, memory_costs
from seqify.partition.walk import layers as walk_layers
from seqify.pipe.pipeline import Pipeline, resolve_devices
from seqify.skip.layout import verify

__all__ = ["GPipe", "balance_by_time", "balance_by_size", "verify_skippables"]

Device = torch.device | int | str
TensorOrTensors = torch.Tensor | tuple[torch.Tensor, ...]

_CUDA = torch.device("cuda")  # the default device of the balance helpers (torch.device is immutable)

_AUTO = (
    "let seqify pick one: balance_by_time(partitions, module, sample) or "
    "seqify.pipeline(module, devices=[...], balance='time', sample=sample)"
)


def _sequential(module: nn.Module) -> nn.Sequential:
    """``module`` itself when it is an ``nn.Sequential``; any other module is converted by seqify first
    (torchgpipe refuses it: this is what seqify adds), so ``balance`` counts the converted layers."""
    if isinstance(module, nn.Sequential):
        return module
    from seqify.convert import convert

    return convert(module)


class GPipe(Pipeline):
    """torchgpipe's ``GPipe``: ``GPipe(module, balance, devices=..., chunks=..., checkpoint=...)``.

    The same signature and attributes (``balance``, ``devices``, ``chunks``, ``checkpoint``,
    ``partitions``; ``len``, indexing and iterating over the layers), run by :class:`seqify.Pipeline`.
    Bad arguments raise what torchgpipe raises (``ValueError``, ``IndexError``), as subclasses of
    :class:`seqify.SeqifyError`. Skip connections use :mod:`seqify.skip` (``@skippable``, ``stash``,
    ``pop``: the same decorator API as ``torchgpipe.skip``). A module that is not an ``nn.Sequential`` is
    converted with :func:`seqify.convert` first.
    """

    def __init__(
        self,
        module: nn.Module,
        balance: Iterable[int] | None = None,
        *,
        devices: Iterable[Device] | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
    ) -> None:
        if balance is None:
            raise CompatError(f"GPipe needs balance=[layers per partition]; {_AUTO}")
        model = _sequential(module)
        try:
            counts = [int(b) for b in balance]
        except (TypeError, ValueError):
            raise CompatError(f"balance={balance!r}: give a list of layer counts, one per partition") from None
        try:
            placed = resolve_devices(None, list(devices) if devices is not None else None, len(counts))
        except DeviceError as e:
            raise CompatDeviceError(str(e)) from None
        if len(placed) < len(counts):
            raise CompatDeviceError(
                f"too few devices to hold given partitions (devices: {len(placed)}, partitions: {len(counts)}); "
                "give one device per partition (repeat a device to put several partitions on it)"
            )
        try:
            super().__init__(model, counts, placed[: len(counts)], chunks=chunks, checkpoint=checkpoint,
                             deferred_batch_norm=deferred_batch_norm)
        except BalanceError as e:
            raise CompatError(f"{e}; or {_AUTO}" if str(e).startswith("balance") else str(e)) from None

    def _sequentials(self) -> list[nn.Sequential]:
        """The partitions, as the nn.Sequential each is (nn.ModuleList types its items as plain modules)."""
        return [cast(nn.Sequential, p) for p in self.partitions]

    def __len__(self) -> int:
        return sum(len(p) for p in self._sequentials())

    def __getitem__(self, index: int) -> nn.Module:
        layers = list(self)
        try:
            return layers[index]
        except IndexError:
            raise IndexError(f"layer index {index} out of range for {len(layers)} layers") from None

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self._sequentials():
            yield from partition


def _check_partitions(partitions: Any, module: nn.Sequential) -> int:
    if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions <= len(module):
        raise CompatError(
            f"partitions={partitions!r}: ask for a whole number of partitions between 1 and the {len(module)} "
            "layers of the module"
        )
    return partitions


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: TensorOrTensors,
    *,
    timeout: float = 1.0,
    device: Device = _CUDA,
) -> list[int]:
    """torchgpipe's ``balance_by_time``: layers per partition, from each layer's measured forward+backward
    time on ``device`` for ``sample`` (a mini-batch). seqify times every layer as the median of runs and
    splits optimally (torchgpipe splits greedily), so balances can differ where costs are close.

    ``timeout`` bounds the measuring: layers are timed ``max(1, round(timeout / 0.33))`` times each (3 at
    the default 1.0). Like torchgpipe, parameters that already hold a gradient are refused, and the module
    is left as it was (no ``.grad`` written, running statistics restored).
    """
    module = _sequential(module)
    partitions = _check_partitions(partitions, module)
    if not timeout > 0:
        raise CompatError(f"timeout={timeout!r}: give the seconds to spend measuring (> 0)")
    if any(p.grad is not None for p in module.parameters()):
        raise CompatError("some parameter already has gradient; call module.zero_grad(set_to_none=True) first")
    from seqify.partition.cost import time_costs

    repeats = max(1, round(timeout / 0.33))
    measured = time_costs(module, sample, torch.device(device), repeats=repeats)
    lays = walk_layers(module)
    return list(split(measured, partitions, lays.names, lays.routes).balance)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: TensorOrTensors,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device = _CUDA,
) -> list[int]:
    """torchgpipe's ``balance_by_size``: layers per partition, from each layer's memory: its activations
    for one micro-batch of ``input`` (a mini-batch split in ``chunks``) plus ``param_scale`` times its
    parameter and buffer bytes (2 for SGD, 4 to 5 for Adam: gradients and optimizer state). Unlike
    torchgpipe it also works on CPU, where activations are the bytes autograd saves for backward.
    """
    module = _sequential(module)
    partitions = _check_partitions(partitions, module)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise CompatError(f"chunks={chunks!r}: give the number of micro-batches you will train with (>= 1)")
    if not param_scale >= 0:
        raise CompatError(f"param_scale={param_scale!r}: give how many copies of the parameters training holds (>= 0)")
    first = input if isinstance(input, torch.Tensor) else input[0]
    rows = first.size(0)
    one = input[:1] if isinstance(input, torch.Tensor) else tuple(t[:1] for t in input)
    measured = memory_costs(module, one, torch.device(device))
    scale = rows / chunks
    cost = tuple(
        (total - state) * scale + state * param_scale
        for total, state in zip(measured.cost, measured.state_bytes)
    )
    scaled = LayerCosts("memory", cost, measured.state_bytes, measured.activation_bytes, measured.output_bytes,
                        measured.skip_bytes)
    lays = walk_layers(module)
    return list(split(scaled, partitions, lays.names, lays.routes).balance)


def verify_skippables(module: nn.Sequential) -> None:
    """torchgpipe's ``verify_skippables``: raise if a skip is not stashed once and popped once by a later
    layer. Raises :class:`seqify.CompatSkipError`: a :class:`seqify.SkipError` and a ``TypeError``, as
    torchgpipe raises."""
    if not isinstance(module, nn.Sequential):
        raise CompatSkipError(
            f"verify_skippables checks an nn.Sequential, not {type(module).__name__}; convert it first "
            "(seqify.convert(model)), which checks its skips itself"
        )
    try:
        verify(module)
    except SkipError as e:
        raise CompatSkipError(str(e)) from None

