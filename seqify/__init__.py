"""seqify: any PyTorch net becomes an exact, pipeline-ready nn.Sequential that runs across GPUs."""

from typing import Any

from . import skip
from ._version import __version__
from .config import Config, pipeline_from_config
from .convert import convert
from .errors import *  # noqa: F403
from .errors import __all__ as _errors
from .guard import Guard
from .layer import Layer
from .partition import NoPlanFitsError, PartitionPlan, balance
from .pipeline import DeferredBatchNorm, Pipeline, is_checkpointing, is_recomputing, pipeline
from .sequential import OpaqueInfo, Sequential, SkipInfo
from .pipeline.config import PipeConfig
from .tuning import tune

__all__ = ["convert", "balance", "PartitionPlan", "NoPlanFitsError", "pipeline", "Pipeline", "DeferredBatchNorm", "is_checkpointing", "is_recomputing", "Sequential", "Layer", "SkipInfo", "OpaqueInfo", "Guard", "skip", "zoo", "measure", "plot", "tune", "PipeConfig", "Config", "pipeline_from_config", "checkpoint", "compat", *_errors]


def __getattr__(name: str) -> Any:
    if name in ("zoo", "measure", "plot", "checkpoint", "compat"):  # imported on first use: they build on everything else
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'seqify' has no attribute {name!r}")
