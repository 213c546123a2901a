"""Pipeline: micro-batched GPipe execution of a Sequential's partitions across devices."""

from .batchnorm import DeferredBatchNorm
from .checkpoint import is_checkpointing, is_recomputing
from .pipe import Pipeline, pipeline
from .stage import Stage

__all__ = ["Pipeline", "pipeline", "Stage", "DeferredBatchNorm", "is_checkpointing", "is_recomputing"]
