"""Global-norm gradient clipping over the ranks of a distributed pipeline, and seqify.clip_grad_norm_ for both kinds."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from seqify.distributed.link import peer
from seqify.distributed.stage import DistributedStage
from seqify.errors import DeviceError, OptionError
from seqify.pipe import clip

__all__ = ["clip_grad_norm_", "grad_norms"]

#: dtypes a gradient norm can have, by code (0 in the second row: no gradient)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def grad_norms(stage: DistributedStage, norm_type: float) -> list[torch.Tensor]:
    """The norm of every gradient of the whole pipeline, in the source model's parameter order, the same list
    on every rank of the job.

    A rank holds only its partitions' gradients. Each puts the norm of each of its parameters in that
    parameter's slot (its place in the source model's ``parameters()``) of one small vector, a second row
    saying which slots hold a norm and in what dtype; one all-reduce (a sum: each slot has one writer, and
    adding zeros is exact) gives every rank every norm.

    Data-parallel replicas: once ``stage.step`` has averaged their gradients, a pipeline rank's replicas hold
    the same gradients. Only replica 0 writes its norms, so each parameter counts once (adding the replicas'
    copies would count it once per replica), and every replica gets the same norms."""
    order = {id(p): k for k, p in enumerate(stage.model.parameters())}
    mine = list(stage.partition.parameters())
    table = torch.zeros(2, len(order), dtype=torch.float64, device=stage.device)
    found = [(order[id(p)], n) for p, n in zip(mine, clip.grad_norms(mine, norm_type)) if n is not None]
    if found and stage.replica == 0:
        slots = torch.tensor([k for k, _ in found], device=stage.device)
        table[0, slots] = torch.stack([n.to(stage.device, torch.float64) for _, n in found])
        table[1, slots] = torch.tensor([_code(n.dtype) for _, n in found], dtype=torch.float64, device=stage.device)
    world = stage.stages * stage.replicas
    if world > 1:
        _refuse_other_world(stage, world)
        others = [r for r in range(world) if r != stage.global_rank]
        with peer(stage.me, others, "adding the gradient norms of every rank for clip_grad_norm_"):
            dist.all_reduce(table)
    codes = [int(c) for c in table[1].tolist()]
    return [table[0, k].to(_DTYPES[c - 1]) for k, c in enumerate(codes) if c]


def _code(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise OptionError(f"a gradient norm of dtype {dtype}: clip_grad_norm_ over ranks handles {list(_DTYPES)}; "
                          "clip this model's gradients with torch.nn.utils.clip_grad_norm_ on one process")
    return _DTYPES.index(dtype) + 1


def _refuse_other_world(stage: DistributedStage, world: int) -> None:
    """The job must be this pipeline's ranks times its replicas, all of them clipping together."""
    if not dist.is_initialized() or dist.get_world_size() != world:
        size = dist.get_world_size() if dist.is_initialized() else "no process group"
        raise DeviceError(f"{stage.me}: clip_grad_norm_ adds gradient norms over the job's processes, which must be "
                          f"this pipeline's {stage.stages} ranks x {stage.replicas} replicas = {world} (found {size}); "
                          "build the stage with seqify.distributed.stage() under torchrun and call clip_grad_norm_ "
                          "on every rank")


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float | str = 2.0) -> torch.Tensor:
    """Clip the gradients of a :class:`~seqify.Pipeline` or of a :class:`~seqify.distributed.DistributedStage`
    by their global norm, in place: ``grad *= min(1, max_norm / (total + 1e-6))`` as
    ``torch.nn.utils.clip_grad_norm_`` does, where ``total`` is the ``norm_type`` norm (``'inf'``: the largest
    absolute value) of every gradient of the whole model. Returns ``total``, before clipping.

    In one process the partitions' norms are gathered from their devices; under torchrun every rank of the job
    must call it (it all-reduces one vector of norms), and each data-parallel replica's identical gradients are
    counted once. The total is what ``torch.nn.utils.clip_grad_norm_(source.parameters(), ...)`` returns on one
    device for the same gradients, bit for bit (per-parameter norms by the same kernels, combined in the source
    model's parameter order). Call it after ``scaler.unscale_(optimizer)`` when a GradScaler scales the loss."""
    if isinstance(model, DistributedStage):
        order = clip.norm_order(norm_type)
        total = clip.total_norm(grad_norms(model, order), order, model.device)
        torch.nn.utils.clip_grads_with_norm_(list(model.partition.parameters()), max_norm, total)
        return total
    return clip.clip_grad_norm_(model, max_norm, norm_type)
