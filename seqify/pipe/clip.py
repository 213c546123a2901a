"""Global-norm gradient clipping over a pipeline's partitions, computed as torch computes it on the source model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from seqify.errors import OptionError

__all__ = ["grad_norms", "total_norm", "clip_grad_norm_", "norm_order"]


def norm_order(norm_type: float | str) -> float:
    """``norm_type`` as a float (``'inf'`` and ``float('inf')`` for the largest absolute value)."""
    try:
        return float(norm_type)
    except (TypeError, ValueError):
        raise OptionError(f"norm_type={norm_type!r}: give the order of the norm, a number such as 2.0, or "
                          "'inf' for the largest absolute gradient") from None


def grad_norms(params: Sequence[torch.Tensor], norm_type: float) -> list[torch.Tensor | None]:
    """Each parameter's gradient norm, in the order given (None where it has no gradient): one
    ``torch._foreach_norm`` per device and dtype, the kernels ``torch.nn.utils.clip_grad_norm_`` runs."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, p in enumerate(params):
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(k)
    norms: list[torch.Tensor | None] = [None] * len(params)
    for ks in groups.values():
        grads = [g for g in (params[k].grad for k in ks) if g is not None]
        for k, n in zip(ks, torch._foreach_norm(grads, norm_type)):
            norms[k] = n
    return norms


def total_norm(norms: Sequence[torch.Tensor], norm_type: float, device: torch.device | None) -> torch.Tensor:
    """The norm of the per-parameter ``norms`` taken as one vector, on ``device`` (torch's zero without any)."""
    if not norms:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float | str = 2.0) -> torch.Tensor:
    """Scale the gradients of ``model`` (a :class:`~seqify.Pipeline` or any module in this process) in place so
    that their global norm is at most ``max_norm``; returns the norm before clipping.

    The per-parameter norms of every partition, on whichever devices they sit, are moved to the first
    gradient's device and combined in the model's parameter order: the same kernels, the same order and so the
    same bits as ``torch.nn.utils.clip_grad_norm_(source.parameters(), ...)`` on one device, given the same
    gradients."""
    if not isinstance(model, nn.Module):
        raise OptionError(f"clip_grad_norm_ got {type(model).__name__}: pass the Pipeline (or the DistributedStage "
                          "under torchrun); for a list of parameters use torch.nn.utils.clip_grad_norm_")
    order = norm_order(norm_type)
    params = list(model.parameters())
    norms = [n for n in grad_norms(params, order) if n is not None]
    total = total_norm(norms, order, norms[0].device if norms else None)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
