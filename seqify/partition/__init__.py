"""seqify.partition: balance a model's layers into pipeline stages by time, memory, FLOPs or parameters."""

from .balancer import balance, split
from .cost import (
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
from .errors import BalanceError, NoPlanFitsError
from .plan import PartitionPlan, Stage
from .solve import Solution, solve

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
