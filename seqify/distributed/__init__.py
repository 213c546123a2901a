"""seqify.distributed: a pipeline over torchrun's processes, one or several partitions per rank, shared schedules."""

from seqify.distributed.checkpoint import load, merge, save
from seqify.distributed.stage import SCHEDULES, DistributedStage, init, placement_for, stage

__all__ = ["DistributedStage", "stage", "init", "save", "load", "merge", "SCHEDULES", "placement_for"]
