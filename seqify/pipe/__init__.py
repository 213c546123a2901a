"""Pipeline: micro-batched GPipe execution of a Sequential's partitions across devices."""

from seqify.pipe.batchnorm import DeferredBatchNorm
from seqify.pipe.pipeline import Pipeline
from seqify.pipe.recompute import is_checkpointing, is_recomputing
from seqify.pipe.replicated import ReplicatedPipeline
from seqify.pipe.stage import Stage

__all__ = ["Pipeline", "ReplicatedPipeline", "Stage", "DeferredBatchNorm", "is_checkpointing", "is_recomputing"]
