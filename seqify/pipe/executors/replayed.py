"""Replay executor: builds a step's programs (CUDA graphs on GPUs), keeps them per input signature, else runs eager."""

from __future__ import annotations

import logging
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from seqify.errors import SeqifyError
from seqify.pipe import tied
from seqify.pipe.executors.build import build
from seqify.pipe.executors.layer_settings import named
from seqify.pipe.executors.options import ReplayOptions
from seqify.pipe.executors.programs import Unreplayable
from seqify.pipe.executors.replay import Replay
from seqify.pipe.executors.user_hooks import built_for
from seqify.pipe.executors.wiring import slots
from seqify.pipe.stage import Stage
from seqify.pipe.transfer import Transfer
from seqify.schedule.actions import Schedule, gpipe

__all__ = ["GraphWarning", "Replayer"]

log = logging.getLogger("seqify.pipe")


class GraphWarning(UserWarning):
    """CUDA graphs were asked for but could not be captured; the pipeline runs eagerly."""


class Replayer:
    """The replay side of a pipeline: whether it replays (``graphs`` on CUDA, ``eager`` to drive the
    step as graphs would with eager programs on any device), the programs built for the last input
    signature (``built``), and why capturing failed (``error``); ``options`` (:class:`~.options.ReplayOptions`)
    go to every build."""

    def __init__(self, stages: Sequence[Stage], devices: Sequence[torch.device], transfer: Transfer,
                 parameters: Callable[[], Any], graphs: bool, placement: Sequence[int] | None = None,
                 overlap: bool = False, options: ReplayOptions | None = None) -> None:
        self.stages = stages
        self.devices = devices
        self.transfer = transfer
        self.parameters = parameters
        self.graphs = graphs
        self.overlap = overlap  # pipe.step's graphs on two lanes per GPU (see .lanes)
        self.options = options or ReplayOptions()  # buffer sharing, casting once (see .options)
        self.placement = tuple(placement) if placement is not None else slots(devices)
        self.layers = [m for s in stages for m in s.layers.modules()]  # every module the programs call
        self.settings = named(self.layers)  # their plain attributes (a dropout's p), read each step
        self.eager = False
        self.built: tuple[Any, Replay] | None = None
        self.error: str | None = None
        # Set while a caller runs the programs it has just had built for these very micro-batches (a replicated
        # step): programs() then returns them without checking their key again (a walk over every parameter).
        self.pinned = False

    def wanted(self, training: bool) -> bool:
        """Whether a forward now replays (graphs, or eager replay, on): a training step with gradients,
        or inference under ``torch.no_grad()`` (train or eval mode; forward programs only)."""
        if not (self.graphs or self.eager):
            return False
        return not torch.is_grad_enabled() or training

    def _key(self, batches: list[Any], autocast: bool, dtype: torch.dtype | None) -> tuple[Any, ...]:
        return (
            tuple(
                tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in ((v,) if isinstance(v, torch.Tensor) else v))
                for v in batches
            ),
            autocast,
            dtype,
            # programs read parameters at fixed addresses: .to(), .half() or new Parameters rebuild them
            tuple(p.data_ptr() for p in self.parameters()),
            # so does a parameter frozen or unfrozen, a layer put in another mode (a BatchNorm frozen with .eval()
            # while the rest trains), a hook added (refused where programs would not run it) or a layer's setting
            # changed (a dropout's p: captured graphs keep the value they were captured with)
            built_for(self.parameters(), self.layers, self.settings),
            # which inputs are one tensor (one buffer behind two slots)
            tuple(tuple(map(id, v)).index(id(t)) for v in batches if not isinstance(v, torch.Tensor) for t in v),
        )

    def programs(self, batches: list[Any], training: bool, schedule: Schedule | None = None,
                 stop: int = 0) -> Replay | None:
        """The step's programs for these micro-batches (built, and captured as CUDA graphs, on first
        use), or None when this forward runs eagerly. ``schedule`` (default fill-drain) is the order the
        step will issue them in: graphs are captured in that order, so programs are kept per schedule.
        Micro-batches below ``stop`` are checkpointed (recomputed inside their backward programs)."""
        if not self.wanted(training):
            return None
        if self.pinned and self.built is not None:
            return self.built[1]
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda") if autocast else None
        schedule = schedule or gpipe(self.placement, len(batches))
        stop = stop if torch.is_grad_enabled() else 0  # inference keeps no activations to recompute
        key = (self._key(batches, autocast, dtype), torch.is_grad_enabled(), schedule.name, schedule.placement,
               schedule.microbatches, stop)
        if self.built is None or self.built[0] != key:
            self.built = None  # let the old graphs' memory go first
            carried = None if isinstance(batches[0], torch.Tensor) else len(batches[0])
            flat = [(b,) if isinstance(b, torch.Tensor) else tuple(b) for b in batches]
            try:
                if tied.in_use(self.stages):
                    raise Unreplayable("weights tied across partitions on different devices are copied per call; "
                                       "the step runs eagerly")
                with torch.autocast("cuda", dtype=dtype, cache_enabled=False, enabled=autocast):
                    replay = build(self.stages, flat, carried, self.graphs, self.transfer, schedule=schedule, stop=stop,
                                   overlap=self.overlap, options=self.options)
            except SeqifyError:
                raise
            except Exception as e:
                if not (self.graphs or isinstance(e, Unreplayable)):
                    raise
                self.fall_back(e)
                return None
            if self.graphs:  # what building held eagerly (every micro-batch's activations) goes back
                torch.cuda.empty_cache()
            self.built = (key, replay)
        return self.built[1]

    def fall_back(self, error: Exception) -> None:
        """Run eagerly from now on: some layers cannot be captured (host syncs, CPU tensors,
        data-dependent shapes) or the step cannot be fixed programs (non-tensor outputs, aliasing
        values changed in place). With graphs=True say so, once."""
        self.error = traceback.format_exc()
        why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if self.graphs:
            log.warning("capturing CUDA graphs failed (%s); the pipeline runs eagerly from now on", why)
        else:
            log.info("the step cannot run as fixed programs (%s); it runs eagerly from now on", why)
        if self.graphs:
            self.graphs = False
            warnings.warn(
                f"seqify.pipeline(graphs=True): capturing CUDA graphs failed ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); running eagerly instead (pipe.graph_error has "
                "the trace)",
                GraphWarning,
                stacklevel=4,
            )
            for d in self.devices:
                torch.cuda.synchronize(d)
        self.eager = False

