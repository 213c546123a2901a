"""DeferredBatchNorm: running statistics updated once per mini-batch, from all its micro-batches."""

from __future__ import annotations

import copy
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from seqify.errors import MicroBatchError
from seqify.pipe.recompute import is_recomputing

__all__ = ["DeferredBatchNorm", "defer_batch_norm", "one_sample"]


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm for micro-batches: normalises each micro-batch with its own statistics (as GPipe does)
    but folds the statistics of all ``chunks`` micro-batches into the running estimates once, as one
    device training on the whole mini-batch would. Shares parameters and buffers with the module it
    replaces. Recomputation (checkpointing) is not counted twice.
    """

    chunks: int
    tracked: int  # micro-batches folded in since the last commit
    count: int  # elements per channel behind ``mean`` and ``m2``
    mean: torch.Tensor | None  # per-channel mean so far (float64); None before the first micro-batch
    m2: torch.Tensor | None  # per-channel sum of squared deviations so far (float64)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _reset_tracking(self) -> None:
        self.tracked = 0
        self.count = 0
        self.mean = None
        self.m2 = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        if not is_recomputing():
            self._accumulate(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _accumulate(self, x: torch.Tensor) -> None:
        dims = [d for d in range(x.dim()) if d != 1]
        n = x.numel() // x.size(1)
        var, mean = torch.var_mean(x.double(), dim=dims, unbiased=False)
        if self.tracked == 0:
            self.count, self.mean, self.m2 = n, mean, var * n
        else:  # Chan et al.: combine two sets' means and sums of squared deviations
            assert self.mean is not None and self.m2 is not None  # set by the first micro-batch
            total = self.count + n
            delta = mean - self.mean
            self.mean = self.mean + delta * (n / total)
            self.m2 = self.m2 + var * n + delta.square() * (self.count * n / total)
            self.count = total
        self.tracked += 1
        if self.tracked >= self.chunks:
            self._commit()

    @torch.no_grad()
    def _commit(self) -> None:
        count, mean, m2 = self.count, self.mean, self.m2
        self._reset_tracking()
        # a tracking BatchNorm has its running statistics; a commit follows at least one micro-batch
        assert self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None
        assert mean is not None and m2 is not None
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = m2 / max(count - 1, 1)
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype), alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype), alpha=momentum)

    @classmethod
    def of(cls, bn: nn.modules.batchnorm._BatchNorm, chunks: int) -> DeferredBatchNorm:
        deferred = cls.__new__(cls)
        deferred.__dict__ = dict(bn.__dict__)
        deferred._parameters = dict(bn._parameters)
        deferred._buffers = dict(bn._buffers)
        deferred._modules = dict(bn._modules)
        deferred.chunks = chunks
        deferred._reset_tracking()
        return deferred


def defer_batch_norm(module: nn.Module, chunks: int) -> nn.Module:
    """A copy of ``module``'s structure with every tracking BatchNorm replaced by a DeferredBatchNorm.

    Containers are copied shallowly; parameters, buffers and other modules are shared, not copied.
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return DeferredBatchNorm.of(module, chunks) if module.track_running_stats else module
    children = {k: defer_batch_norm(v, chunks) if v is not None else None for k, v in module._modules.items()}
    if all(children[k] is v for k, v in module._modules.items()):
        return module
    clone = copy.copy(module)
    clone.__dict__["_modules"] = children
    return clone


def one_sample(error: BaseException, modules: nn.Module, chunks: int, sizes: list[int]) -> MicroBatchError | None:
    """A :class:`MicroBatchError` for torch's refusal of a BatchNorm that got one value per channel from a
    micro-batch of one sample, naming the layer (found where torch raised); None for any other error."""
    if not (isinstance(error, ValueError) and "more than 1 value per channel" in str(error) and min(sizes) == 1):
        return None
    bn = next((f.f_locals.get("self") for f, _ in reversed(list(traceback.walk_tb(error.__traceback__)))
               if isinstance(f.f_locals.get("self"), nn.modules.batchnorm._BatchNorm)), None)
    name = next((n for n, m in modules.named_modules() if m is bn), None) if bn is not None else None
    layer = f"the {type(bn).__name__} layer {name!r}" if bn is not None else "a BatchNorm layer"
    batch = sum(sizes)
    split = f"clamped to {batch} micro-batches" if chunks > batch else f"{len(sizes)} micro-batches"
    split += " of one sample"
    return MicroBatchError(
        f"chunks={chunks} on a batch of {batch} samples ({split}) leaves {layer} one value per channel to compute "
        f"training statistics from, which torch refuses ({error}). Use chunks={max(1, batch // 2)} or fewer "
        "(micro-batches of two samples or more), a larger batch, or eval mode for BatchNorm")
