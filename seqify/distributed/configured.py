"""A tuned configuration as the options of ``seqify.distributed.stage``: the same layout under torchrun."""

from __future__ import annotations

import os
import warnings
from typing import Any

from seqify.errors import ConfigError, DeviceError
from seqify.pipe.config import PipeConfig

__all__ = ["stage_options"]

#: ``seqify.distributed.stage``'s options a configuration names, at their defaults.
DEFAULTS: dict[str, Any] = dict(balance=None, chunks=1, checkpoint="never", schedule="gpipe", loops=1, graphs=False)


def stage_options(config: PipeConfig | str | os.PathLike[str], world: int, given: dict[str, Any]) -> dict[str, Any]:
    """The options of ``stage`` that ``config`` (a :class:`~seqify.PipeConfig`, or a file it was saved to)
    describes for a job of ``world`` processes, one per device of the configuration (``stages x replicas``).
    ``given``: the options the caller passed beside it, each of which must be left at its default."""
    cfg = config if isinstance(config, PipeConfig) else PipeConfig.load(config)
    if not cfg.fixed:
        raise ConfigError(f"{cfg} leaves chunks, balance or devices open (or sets a memory cap): tune it first, "
                          "seqify.tune(model, sample, gpus=N), and pass the configuration it returns")
    overridden = sorted(k for k, v in given.items() if v != DEFAULTS[k])
    if overridden:
        raise ConfigError(f"config= names the layout, and {', '.join(overridden)} would change it: pass config= "
                          "alone, or the options without it")
    if cfg.deferred_batch_norm:
        raise ConfigError("the configuration sets deferred_batch_norm, which seqify.distributed does not run: "
                          "tune without it")
    stages = len(cfg.devices) // cfg.replicas
    if world != len(cfg.devices):
        raise DeviceError(f"the configuration is for {len(cfg.devices)} devices ({stages} pipeline ranks x "
                          f"{cfg.replicas} replicas) but this job has {world} processes: launch "
                          f"{len(cfg.devices)} (torchrun --nproc-per-node over the nodes), or tune for {world} "
                          "devices")
    if cfg.overlap:
        warnings.warn("the configuration runs pipe.step on two streams per GPU (overlap), which seqify.distributed "
                      "does not: each rank issues its programs on one stream", stacklevel=3)
    return dict(balance=list(cfg.balance), chunks=int(cfg.chunks), checkpoint=cfg.checkpoint,
                schedule=cfg.schedule or "gpipe", loops=cfg.loops, graphs=cfg.graphs)
