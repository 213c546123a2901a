"""seqify.partition: balance a model's layers into pipeline stages by time, memory, FLOPs or parameters."""

from seqify.partition.balancer import balance, split
from seqify.partition.cost import (
    BY,
    FLOPS_PER_BYTE,
    LINK_BANDWIDTH,
    LayerCosts,
    costs,
    default_transfer_cost,
    flop_costs,
    memory_costs,
    param_costs,
    time_costs,
)
from seqify.partition.errors import BalanceError, NoPlanFitsError
from seqify.partition.plan import PartitionPlan, Stage
from seqify.partition.solve import Solution, solve

__all__ = [
    "balance",
    "split",
    "PartitionPlan",
    "Stage",
    "BalanceError",
    "NoPlanFitsError",
    "LayerCosts",
    "costs",
    "param_costs",
    "flop_costs",
    "time_costs",
    "memory_costs",
    "default_transfer_cost",
    "BY",
    "LINK_BANDWIDTH",
    "FLOPS_PER_BYTE",
    "solve",
    "Solution",
]
