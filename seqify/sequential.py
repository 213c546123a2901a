"""seqify.Sequential: the converted model, an nn.Sequential that computes exactly what its source did."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .errors import ModeError, StateDictError
from .guard import Guard
from .signature import InputSpec, OutputSpec
from .skip.namespace import Namespace
from .skip.tracker import SkipTracker, use_tracker

__all__ = ["Sequential", "SkipInfo", "OpaqueInfo"]


@dataclass(frozen=True)
class SkipInfo:
    """A value that skips ahead: stashed by layer ``stash``, popped by layer ``pop``."""

    name: str
    stash: str
    pop: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    kind: str = "tensor"

    def __str__(self) -> str:
        what = f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}" if self.shape is not None else self.kind
        return f"{self.name}: {self.stash} -> {self.pop} [{what}]"


@dataclass(frozen=True)
class OpaqueInfo:
    """A submodule kept whole as one layer, and why."""

    layer: str
    path: str
    type: str
    reason: str

    def __str__(self) -> str:
        return f"{self.layer} <- {self.path} ({self.type}): {self.reason}"


class _Unused(nn.Module):
    """Parameters and buffers of the source that its forward never reads (kept for checkpoints)."""


class Sequential(nn.Sequential):
    """A converted model: layers that each take and return a tensor or a tuple of tensors.

    Calling it binds the arguments like the source's ``forward``, runs the layers in order with a
    fresh skip tracker, and rebuilds the source's output structure. ``skips``, ``opaque`` and ``guards``
    describe the conversion; ``original_state_dict`` and ``load_original_state_dict`` speak the source's
    checkpoint keys.
    """

    def __init__(
        self,
        layers: OrderedDict[str, nn.Module],
        *,
        inputs: InputSpec,
        entry: list[int],
        outputs: OutputSpec,
        namespace: Namespace,
        skips: list[SkipInfo],
        opaque: list[OpaqueInfo],
        guards: list[Guard],
        state_map: OrderedDict[str, tuple[str, str]],
        unused: _Unused,
        training: bool,
        mode_dependent: bool,
        source: str,
    ) -> None:
        super().__init__(layers)
        self.input_spec = inputs
        self.entry = entry
        self.output_spec = outputs
        self.namespace = namespace
        self.skips = skips
        self.opaque = opaque
        self.guards = guards
        self._state_map = state_map
        object.__setattr__(self, "_unused", unused)
        self.converted_training = training
        self.mode_dependent = mode_dependent
        self.source = source
        self.training = training

    # -- running -------------------------------------------------------------------------------------

    def flatten_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """What the first layer receives for ``self(*args, **kwargs)``: a tensor or a tuple of tensors."""
        self._check_mode()
        flat = self.input_spec.flatten(args, kwargs)
        if len(self.entry) == 1:
            return flat[self.entry[0]]
        return tuple(flat[i] for i in self.entry)

    def unflatten_outputs(self, carried: Any) -> Any:
        """The source's output structure from what the last layer returns."""
        return self.output_spec.unflatten(carried)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        x = self.flatten_inputs(*args, **kwargs)
        with use_tracker(SkipTracker()):
            for layer in self._modules.values():
                x = layer(x)
        return self.output_spec.unflatten(x)

    def _check_mode(self) -> None:
        if self.mode_dependent and self.training != self.converted_training:
            now, then = ("train", "eval") if self.training else ("eval", "train")
            raise ModeError(
                f"{self.source}'s forward computes different ops in train and eval mode (it reads "
                f"self.training in traced code), and this conversion was made in {then} mode but runs in "
                f"{now} mode. Convert a second time with the source in {now} mode: both conversions share "
                "the same parameters."
            )

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Sequential:  # type: ignore[override]
        super()._apply(fn, recurse)
        self._unused._apply(fn)
        return self

    # -- checkpoints -----------------------------------------------------------------------------------

    def _locate(self, key: str) -> tuple[nn.Module, str]:
        path, name = self._state_map[key]
        module: nn.Module = self._unused if path == "<unused>" else self.get_submodule(path)
        return module, name

    def _tensor(self, key: str) -> torch.Tensor:
        module, name = self._locate(key)
        t = module._parameters.get(name)
        return module._buffers[name] if t is None else t

    def original_state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The state under the source model's key names, as ``source.state_dict()`` would give it."""
        return OrderedDict((k, self._tensor(k).detach()) for k in self._state_map)

    def original_keys(self) -> list[str]:
        return list(self._state_map)

    def load_original_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a checkpoint written for the source model (e.g. torchvision weights)."""
        expected = set(self._state_map)
        given = set(state_dict)
        missing = sorted(expected - given)
        unexpected = sorted(given - expected)
        if strict and (missing or unexpected):
            raise StateDictError(
                f"checkpoint does not match {self.source}: "
                + (f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}; " if missing else "")
                + (f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; " if unexpected else "")
                + "pass strict=False to load the keys that match"
            )
        shapes = [
            f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(self._tensor(k).shape)}"
            for k in sorted(expected & given)
            if self._tensor(k).shape != state_dict[k].shape
        ]
        if shapes:
            raise StateDictError("checkpoint shapes do not match the model: " + "; ".join(shapes[:8]))
        with torch.no_grad():
            for k in expected & given:
                self._tensor(k).copy_(state_dict[k])

    # -- description -------------------------------------------------------------------------------------

    def summary(self) -> str:
        """A readable account of the conversion: layers, skips, opaque parts and guards."""
        params = sum(p.numel() for p in self.parameters())
        lines = [
            f"seqify.Sequential from {self.source}: {len(self)} layers, {len(self.skips)} skips, "
            f"{len(self.opaque)} opaque, {params:,} parameters"
        ]
        if self.opaque:
            lines.append("opaque layers (kept whole):")
            lines += [f"  {o}" for o in self.opaque]
        if self.guards:
            lines.append("valid for inputs where:")
            lines += [f"  {g}" for g in self.guards]
        if self.mode_dependent:
            mode = "train" if self.converted_training else "eval"
            lines.append(f"mode-dependent: converted in {mode} mode, runs only in {mode} mode")
        return "\n".join(lines)

    def named_layers(self) -> Iterator[tuple[str, nn.Module]]:
        return iter(self._modules.items())  # type: ignore[arg-type]
