"""seqify: any PyTorch net becomes an exact, pipeline-ready nn.Sequential that runs across GPUs."""

import logging
from typing import Any

from seqify import skip
from seqify._version import __version__ as __version__
from seqify.api import pipeline
from seqify.convert import convert
from seqify.errors import *  # noqa: F403
from seqify.errors import __all__ as _errors
from seqify.model.guard import Guard
from seqify.model.layer import Layer
from seqify.model.sequential import OpaqueInfo, Sequential, SkipInfo
from seqify.partition import NoPlanFitsError, PartitionPlan, balance
from seqify.pipe import DeferredBatchNorm, Pipeline, ReplicatedPipeline, is_checkpointing, is_recomputing
from seqify.pipe.config import PipeConfig
from seqify.tools.run_file import Config, pipeline_from_config
from seqify.tuning import tune

# The library logs to "seqify" and its children (seqify.frontend, seqify.tuning, seqify.pipe, seqify.distributed);
# what is shown, and where, is the application's choice (logging.basicConfig(level=logging.INFO)).
logging.getLogger(__name__).addHandler(logging.NullHandler())

# Submodules imported on first use (module __getattr__ below): they build on everything else.
_LAZY = ("zoo", "measure", "plot", "checkpoint", "compat")
# Functions imported on first use, by the module that holds them (it imports seqify.distributed).
_LAZY_FUNCTIONS = {"clip_grad_norm_": "seqify.distributed.clip"}

__all__ = [
    "convert", "balance", "PartitionPlan", "NoPlanFitsError", "pipeline", "Pipeline", "ReplicatedPipeline",
    "DeferredBatchNorm",
    "is_checkpointing", "is_recomputing", "Sequential", "Layer", "SkipInfo", "OpaqueInfo", "Guard", "skip",
    "tune", "PipeConfig", "Config", "pipeline_from_config", *_LAZY_FUNCTIONS, *_LAZY, *_errors,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_FUNCTIONS:
        import importlib

        return getattr(importlib.import_module(_LAZY_FUNCTIONS[name]), name)
    raise AttributeError(f"module 'seqify' has no attribute {name!r}")
