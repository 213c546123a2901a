"""Loss weights: each micro-batch's loss weighed by its share of what the whole batch's loss divides by."""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.nn import _reduction

from seqify.errors import LossError, ScheduleError
from seqify.pipe.microbatch import split_like

__all__ = ["Reduction", "reduction_of", "Probes", "Weigher", "scalar", "scale_of", "scaled"]

LossFn = Callable[[Any, Any], torch.Tensor]
#: a micro-batch's target -> what ``loss_fn`` divides by on it (a number or a one-element tensor)
Count = Callable[[Any], Any]

# Losses that divide by the class weights of their targets other than ignore_index (their count without
# class weights), label smoothing included: the one data-dependent divisor among torch's losses.
_COUNTED_MODULES: tuple[type, ...] = tuple(
    c for c in (nn.CrossEntropyLoss, nn.NLLLoss, getattr(nn, "LinearCrossEntropyLoss", None)) if c is not None)
_COUNTED_FUNCTIONS = (F.cross_entropy, F.nll_loss)
# Every other torch loss divides by its samples or its elements ('batchmean': by the batch), and micro-batches
# share every dimension but the first, so a micro-batch's share of either is its share of the samples.
_SAMPLE_FUNCTIONS = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
                     F.binary_cross_entropy_with_logits, F.kl_div, F.poisson_nll_loss, F.gaussian_nll_loss,
                     F.soft_margin_loss, F.multilabel_soft_margin_loss, F.multilabel_margin_loss,
                     F.multi_margin_loss, F.hinge_embedding_loss, F.cosine_embedding_loss, F.margin_ranking_loss,
                     F.triplet_margin_loss, F.triplet_margin_with_distance_loss)
# CTC reads its batch along dimension 1 and takes lengths besides the target: pipe.step cannot call it as given.
_CTC = "CTCLoss takes log_probs (T, N, C), with the batch second, and input and target lengths besides the target"
#: pieces the probe cuts a lone micro-batch into (more pieces see more of the data, at more calls)
PIECES = 8


@dataclass(frozen=True)
class Reduction:
    """How ``loss_fn`` reduces a micro-batch: 'sum'; 'mean' over ``count(target)`` (None: over its samples); or
    'probe': declared nowhere, so :class:`Probes` finds 'sum' or 'mean' on the step's first output."""

    kind: str
    count: Count | None = None
    #: whether ``count`` is torch's own loss's, read on the device (no host sync); a user's denominator is read
    #: to the host, so that a micro-batch dividing by 0 never calls ``loss_fn`` (its gradient would be 0/0)
    own: bool = False


def scalar(loss: Any) -> torch.Tensor:
    """``loss`` if it is a scalar tensor, else a :class:`ScheduleError` saying what pipe.step needs."""
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise ScheduleError(f"loss_fn returned {type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}; "
                            "pipe.step needs a scalar loss per micro-batch (a 'mean' or 'sum' reduction)")
    return loss


def name_of(loss_fn: Any) -> str:
    """``loss_fn`` as messages name it."""
    if isinstance(loss_fn, functools.partial):
        return f"functools.partial({name_of(loss_fn.func)}, ...)"
    if isinstance(loss_fn, nn.Module):
        return f"{type(loss_fn).__name__}(reduction={getattr(loss_fn, 'reduction', None)!r})"
    return getattr(loss_fn, "__qualname__", type(loss_fn).__name__)


def reduction_of(loss_fn: LossFn, reduction: str | None = None, denominator: Count | None = None) -> Reduction:
    """How ``loss_fn`` reduces a micro-batch, from ``denominator``, torch's own losses (their settings decide),
    ``reduction`` or a ``.reduction`` attribute (trusted as said), else 'probe'."""
    if reduction not in (None, "mean", "sum"):
        raise ScheduleError(f"reduction={reduction!r}: pipe.step weighs micro-batch losses for 'mean' or 'sum'; pass "
                            "reduction='mean' or 'sum' matching what loss_fn returns")
    if getattr(loss_fn, "func", loss_fn) is F.ctc_loss or isinstance(loss_fn, nn.CTCLoss):
        raise LossError(f"{_CTC}: pass loss_fn=lambda out, t: ctc(out.transpose(0, 1), *t) with the batch first in "
                        "out and t = (targets, input_lengths, target_lengths)")
    if denominator is not None:
        if not callable(denominator):
            raise LossError(f"denominator={denominator!r}: pass a function of a micro-batch's target returning what "
                            "loss_fn divides by on it, e.g. denominator=lambda t: (t != -100).sum()")
        if reduction == "sum":
            raise LossError("denominator= says loss_fn divides by a count and reduction='sum' says it sums: pass one "
                            "of them")
        return Reduction("mean", denominator)
    known = _known(loss_fn)
    if known is not None:
        return _torch_reduction(loss_fn, reduction, *known)
    declared = reduction or getattr(loss_fn, "reduction", None)
    if declared is None:
        return Reduction("probe")
    if declared not in ("mean", "sum"):
        raise ScheduleError(f"reduction={declared!r}: pipe.step weighs micro-batch losses for 'mean' or 'sum'; pass "
                            "reduction='mean' or 'sum' matching what loss_fn returns")
    return Reduction(declared)


def _torch_reduction(loss_fn: Any, reduction: str | None, own: str, count: Count | None) -> Reduction:
    """A torch loss's reduction: its own (``own``, counting by ``count``), which ``reduction`` may only repeat
    (or name for a loss built with 'none', whose non-scalar output pipe.step then refuses)."""
    if reduction is not None and own in ("mean", "sum") and reduction != own:
        raise LossError(f"reduction={reduction!r} but {name_of(loss_fn)} reduces by {own!r}: leave reduction= out "
                        "(torch's losses say how they reduce) or build the loss with the reduction you mean")
    kind = reduction or own
    if kind not in ("mean", "sum"):
        raise ScheduleError(f"{name_of(loss_fn)}: pipe.step weighs micro-batch losses for 'mean' or 'sum'; build "
                            "the loss with reduction='mean' or 'sum'")
    return Reduction(kind, count if kind == "mean" else None, own=True)


def _known(loss_fn: Any) -> tuple[str, Count | None] | None:
    """(reduction, count) of a torch loss (module, function, or ``functools.partial`` of one by keywords); None
    for anything else. Count None: the loss divides by samples or elements."""
    if isinstance(loss_fn, _COUNTED_MODULES):
        counted: Any = loss_fn
        return counted.reduction, _class_count(counted.weight, counted.ignore_index)
    if isinstance(loss_fn, nn.modules.loss._Loss) and type(loss_fn).__module__ == nn.modules.loss.__name__:
        return ("mean" if loss_fn.reduction == "batchmean" else loss_fn.reduction), None
    func, keywords = loss_fn, {}
    if isinstance(loss_fn, functools.partial):
        if loss_fn.args:  # the output or the target bound: not a loss of (output, target) seqify knows
            return None
        func, keywords = loss_fn.func, loss_fn.keywords
    counted = any(func is f for f in _COUNTED_FUNCTIONS)
    if not (counted or any(func is f for f in _SAMPLE_FUNCTIONS)):
        return None
    if "size_average" in keywords or "reduce" in keywords:
        own = _reduction.legacy_get_string(keywords.get("size_average"), keywords.get("reduce"), emit_warning=False)
    else:
        own = keywords.get("reduction", "mean")
    own = "mean" if own == "batchmean" else own
    return own, _class_count(keywords.get("weight"), keywords.get("ignore_index", -100)) if counted else None


def _class_count(weight: torch.Tensor | None, ignore_index: int | None) -> Count:
    """What a cross entropy or NLL loss divides by on ``target``: the class weights of its targets other than
    ``ignore_index`` (their number without weights), as torch's mean does with or without label smoothing;
    None for class probabilities (a mean over samples)."""
    ignore = -100 if ignore_index is None else ignore_index

    def count(target: Any) -> Any:
        if not isinstance(target, torch.Tensor) or target.is_floating_point():
            return None
        kept = target != ignore
        if weight is None:
            return kept.sum()
        w = weight.to(target.device)
        # indices outside the classes are left for the loss itself to refuse (clamped: no index error here)
        return (w[target.clamp(0, w.numel() - 1)] * kept).sum()

    return count


# -- the probe: how an undeclared loss reduces ------------------------------------------------------------


class Probes:
    """How undeclared losses reduce, found once per loss and per output and target layout (shapes without the
    batch dimension, dtypes) and kept while the loss lives."""

    def __init__(self) -> None:
        self._found: weakref.WeakKeyDictionary[Any, dict[Any, str]] = weakref.WeakKeyDictionary()

    def kind(self, loss_fn: LossFn, out: Any, n: int, targets: Sequence[Any], sizes: Sequence[int],
             unflatten: Callable[[Any], Any]) -> str:
        """'sum' or 'mean' (over samples) for ``loss_fn``, from ``out`` (a micro-batch's flat output of ``n``
        samples) and the step's micro-batch ``targets``; a :class:`LossError` when it is neither."""
        owner, func = (loss_fn.__self__, loss_fn.__func__) if inspect.ismethod(loss_fn) else (loss_fn, None)
        key = (func, _layout(out), _layout(targets[0]))
        try:
            found = self._found.setdefault(owner, {})
        except TypeError:  # not weakly referable or not hashable: probed on every step
            found = {}
        if key not in found:
            found[key] = probe(loss_fn, out, n, targets, sizes, unflatten)
        return found[key]


def _layout(value: Any) -> tuple[Any, ...]:
    return tuple((tuple(t.shape[1:]), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                 for t in pytree.tree_leaves(value))


def probe(loss_fn: LossFn, out: Any, n: int, targets: Sequence[Any], sizes: Sequence[int],
          unflatten: Callable[[Any], Any]) -> str:
    """'sum' if ``loss_fn`` over pieces put together equals the sum of its values on the pieces, 'mean' if it
    equals their mean weighed by samples, else a :class:`LossError`. The pieces pair the first samples of
    ``out`` with the first of each micro-batch's target (so the step's targets are seen across the batch), or
    cut a lone micro-batch; detached, without gradients, with the RNG and the loss module's buffers put back:
    the step sees no trace of it."""
    flat = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    if len(targets) > 1:  # together about one micro-batch: the probe holds no more than the step does
        k = max(1, n // len(targets))
        device = next((t.device for t in pytree.tree_leaves(flat) if isinstance(t, torch.Tensor)), None)
        near = (lambda v: v) if device is None else (  # replicas' targets are on their own devices
            lambda v: pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, v))
        pieces = [(_head(flat, min(k, size)), near(_head(t, min(k, size)))) for size, t in zip(sizes, targets)]
    elif n > 1:
        cut = [len(c) for c in torch.arange(n).tensor_split(min(n, PIECES))]
        pieces = list(zip(_split(flat, cut), split_like(targets[0], cut)))
    else:  # one sample: it and a copy of it
        pieces = [(flat, targets[0])] * 2
    counts = [_batch(o, n) for o, _ in pieces]
    whole = (_cat([o for o, _ in pieces]), _cat([t for _, t in pieces]))
    devices = sorted({t.device.index or 0 for t in pytree.tree_leaves(flat)
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    with torch.no_grad(), _kept(loss_fn), torch.random.fork_rng(devices=devices):
        try:
            parts = [scalar(loss_fn(unflatten(o), t)) for o, t in pieces]
            full = scalar(loss_fn(unflatten(whole[0]), whole[1]))
        except ScheduleError:
            raise
        except Exception as e:
            raise LossError(f"{name_of(loss_fn)} declares no reduction, and probing it to tell whether it sums or "
                            f"averages failed on pieces of the step's first output ({type(e).__name__}: {e}); pass "
                            "reduction='sum' or 'mean' (or denominator=)") from e
    return _verdict(loss_fn, float(full), [float(p) for p in parts], counts, full.dtype)


def _verdict(loss_fn: LossFn, full: float, parts: list[float], counts: list[int], dtype: torch.dtype) -> str:
    """'sum' or 'mean' by which of the two ``full`` equals, within the loss dtype's rounding."""
    summed = sum(parts)
    averaged = sum(c * p for c, p in zip(counts, parts)) / sum(counts)
    tell = "pass reduction='sum' or 'mean' to say how it reduces"
    if not all(math.isfinite(v) for v in (full, *parts)):
        raise LossError(f"{name_of(loss_fn)} declares no reduction and is not finite on the step's first output "
                        f"({full}), so seqify cannot tell whether it sums or averages: {tell}")
    scale = max(abs(full), sum(abs(p) for p in parts))
    tol = math.sqrt(torch.finfo(dtype).eps if dtype.is_floating_point else 2.0 ** -52) * scale
    is_sum, is_mean = abs(full - summed) <= tol, abs(full - averaged) <= tol
    if is_sum != is_mean:
        return "sum" if is_sum else "mean"
    if is_sum:
        raise LossError(f"{name_of(loss_fn)} declares no reduction and its sum and its mean over the step's first "
                        f"output agree ({full:.6g}: a zero loss), so seqify cannot tell which it is: {tell}")
    raise LossError(
        f"{name_of(loss_fn)} declares no reduction and is neither a sum nor a mean over samples: over micro-batch "
        f"pieces put together it gives {full:.6g}, not their sum {summed:.6g} nor their mean by samples "
        f"{averaged:.6g}. It divides by a count the data decides (a mask's, the non-ignored tokens') or mixes "
        "samples, so no weights by samples make the micro-batch losses add up to one device's. Pass "
        "denominator=lambda target: <what loss_fn divides by on that target> (e.g. (target != -100).sum()), or "
        "a loss_fn that sums and divides by the whole batch's count, with reduction='sum'; or compute the loss "
        "on the whole output: loss_fn(pipe(x), target).backward()")


def _batch(value: Any, n: int) -> int:
    """The samples in a piece: the first dimension of its first tensor that has one."""
    return next((t.size(0) for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.dim()), n)


def _head(value: Any, k: int) -> Any:
    """The first ``k`` samples of every batched tensor in ``value``."""
    return pytree.tree_map(lambda t: t[:k] if isinstance(t, torch.Tensor) and t.dim() else t, value)


def _split(value: Any, sizes: list[int]) -> list[Any]:
    """``value`` (a flat output: a tensor or a tuple) cut into pieces of ``sizes`` samples."""
    if isinstance(value, torch.Tensor):
        return list(value.split(sizes))
    parts = [list(t.split(sizes)) if isinstance(t, torch.Tensor) and t.dim() else [t] * len(sizes) for t in value]
    return [tuple(p[i] for p in parts) for i in range(len(sizes))]


def _cat(values: list[Any]) -> Any:
    """Pieces put back together along the batch dimension (tensors of one; anything else taken from the first)."""
    leaves, spec = zip(*(pytree.tree_flatten(v) for v in values))
    joined = [torch.cat(ts) if isinstance(ts[0], torch.Tensor) and ts[0].dim() else ts[0] for ts in zip(*leaves)]
    return pytree.tree_unflatten(joined, spec[0])


@contextlib.contextmanager
def _kept(loss_fn: Any) -> Iterator[None]:
    """The buffers of a loss that is (or is bound to) a module, put back as they were (its BatchNorm statistics)."""
    owner = loss_fn.func if isinstance(loss_fn, functools.partial) else getattr(loss_fn, "__self__", loss_fn)
    buffers = list({id(b): b for m in (loss_fn, owner) if isinstance(m, nn.Module) for b in m.buffers()}.values())
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        for b, s in zip(buffers, saved):
            b.copy_(s)


# -- a loss scale ------------------------------------------------------------------------------------------

#: what pipe.step's backward multiplies each micro-batch's loss by: a number or a one-element tensor
Scale = float | torch.Tensor


def scale_of(loss_scale: Any, device: torch.device) -> Scale | None:
    """``pipe.step``'s ``loss_scale`` as a factor: a number, a one-element tensor, or a GradScaler's current
    scale (``scaler.scale`` of a one on ``device``, the last partition's: 1 when the scaler is disabled)."""
    if loss_scale is None:
        return None
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        factor: Scale = float(loss_scale)
    elif isinstance(loss_scale, torch.Tensor) and loss_scale.numel() == 1:
        factor = loss_scale.detach().reshape(())
    elif callable(getattr(loss_scale, "scale", None)):
        factor = loss_scale.scale(torch.ones((), device=device))
    else:
        raise ScheduleError(f"loss_scale={loss_scale!r}: pass a number (1 / k to average gradients over k "
                            "accumulated steps), a one-element tensor or a torch.amp.GradScaler")
    if isinstance(factor, float) and not (math.isfinite(factor) and factor > 0):  # a tensor is not read (no sync)
        raise ScheduleError(f"loss_scale={factor}: the loss returned is divided back by it, so it must be a finite "
                            "number > 0")
    return factor


def scaled(loss: torch.Tensor, scale: Scale, inverse: bool = False) -> torch.Tensor:
    """``loss * scale`` (``loss / scale`` with ``inverse``), a tensor scale read on the loss's device."""
    factor = scale.to(loss.device) if isinstance(scale, torch.Tensor) else scale
    return loss / factor if inverse else loss * factor


# -- one step's weights ------------------------------------------------------------------------------------


class Weigher:
    """One step's micro-batch losses, ``loss(out, i)``: ``loss_fn`` on micro-batch ``i`` times its share of what
    the whole batch's loss divides by, so that they add up to the loss one device computes on the batch.

    Over data-parallel replicas whose gradients are averaged, ``total`` adds a replica's divisor to the others'
    and each weight is ``replicas`` times the share of the global batch; :attr:`report` turns the summed
    weighted losses back into this replica's own loss. ``scale`` (a loss scale: a number or a tensor) multiplies each
    weighed loss, and so the gradients, as ``(scale * loss).backward()`` does on one device."""

    def __init__(self, loss_fn: LossFn, how: Reduction, targets: list[Any], sizes: list[int], probes: Probes, *,
                 unflatten: Callable[[Any], Any] = lambda y: y, total: Callable[[Any], Any] | None = None,
                 replicas: int = 1, scale: Scale | None = None) -> None:
        self.loss_fn, self.targets, self.sizes, self.probes, self.unflatten = loss_fn, targets, sizes, probes, unflatten
        self.replicas = replicas
        self.scale = scale  # what each weighed loss is multiplied by before its backward (a loss scale)
        # One micro-batch of one replica needs no weights: its loss is the batch's, however loss_fn reduces.
        self.kind = "sum" if how.kind == "probe" and len(sizes) == 1 and replicas == 1 else how.kind
        self.counts: list[float] | torch.Tensor = _counts(how, targets, sizes) if self.kind != "sum" else []
        self.local = self.counts.sum() if isinstance(self.counts, torch.Tensor) else sum(self.counts)
        self.total = total(self.local) if total is not None and self.kind != "sum" else self.local
        # torch's own counts stay on the device: every micro-batch's weight and whether it keeps a target, once
        self.weights: torch.Tensor | list[torch.Tensor] | None = (
            self.counts * (replicas / self.total) if isinstance(self.counts, torch.Tensor) else None)
        self.kept: torch.Tensor | list[torch.Tensor] | None = (
            self.counts > 0 if isinstance(self.counts, torch.Tensor) else None)

    def place(self, devices: list[torch.device]) -> None:
        """Copy each micro-batch's weight to ``devices[i]``, where its loss will be, now: a copy between two GPUs
        made while a step runs makes the one wait for all the work queued on the other (replicas' pipelines
        would run one after another)."""
        if self.weights is not None and self.kept is not None:
            self.weights = [self.weights[i].to(d) for i, d in enumerate(devices)]
            self.kept = [self.kept[i].to(d) for i, d in enumerate(devices)]

    @property
    def report(self) -> Any:
        """What the summed weighted losses are multiplied by to give this replica's own loss (1 for one)."""
        if self.kind == "sum":
            return 1.0 / self.replicas
        if isinstance(self.local, torch.Tensor):
            return self.total / (self.replicas * self.local)
        if not self.local:  # this replica's own mean is 0/0
            return 1.0 if not self.total else math.nan
        return self.total / (self.replicas * self.local)

    def weight(self, i: int) -> float | torch.Tensor | None:
        """Micro-batch ``i``'s weight; None where it has nothing to divide (it adds nothing, as on one device)."""
        if self.kind == "sum":
            return float(self.replicas)
        if self.weights is not None:
            return self.weights[i]
        if not self.total:  # nothing to divide by in the whole batch: each micro-batch's own mean, as undefined
            return 1.0
        return self.counts[i] / self.total * self.replicas if self.counts[i] else None

    def __call__(self, out: Any, i: int) -> torch.Tensor:
        loss = self._weighed(out, i)
        return loss if self.scale is None else scaled(loss, self.scale)

    def _weighed(self, out: Any, i: int) -> torch.Tensor:
        if self.kind == "probe":
            self.kind = self.probes.kind(self.loss_fn, out, self.sizes[i], self.targets, self.sizes, self.unflatten)
        w = self.weight(i)
        if w is None:
            return _nothing(out)
        loss = scalar(self.loss_fn(self.unflatten(out), self.targets[i]))
        if self.kept is None:
            return loss * w
        # torch's own count, on the device: a micro-batch that keeps no target (its own mean 0/0) adds nothing
        return torch.where(self.kept[i], loss * torch.as_tensor(w).to(loss.dtype), 0.0)


def _counts(how: Reduction, targets: list[Any], sizes: list[int]) -> list[float] | torch.Tensor:
    """What ``loss_fn`` divides by on each micro-batch (its samples where ``how`` names no count): torch's own
    counts as one float64 tensor on the targets' device, a user's denominator read to the host in one copy."""
    if how.count is None:
        return [float(n) for n in sizes]
    got = [how.count(t) for t in targets]
    if any(g is None for g in got):  # class probabilities: a mean over samples
        return [float(n) for n in sizes]
    for g in got:
        if not (isinstance(g, (int, float)) or (isinstance(g, torch.Tensor) and g.numel() == 1)):
            raise LossError(f"denominator returned {type(g).__name__} {tuple(getattr(g, 'shape', ()))}; it must "
                            "return one number per micro-batch: what loss_fn divides by on that target")
    if not any(isinstance(g, torch.Tensor) for g in got):
        values = [float(g) for g in got]
    else:
        device = next(g.device for g in got if isinstance(g, torch.Tensor))
        stacked = torch.stack([torch.as_tensor(g).detach().reshape(()).to(device, torch.float64) for g in got])
        if how.own:
            return stacked
        values = stacked.tolist()
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise LossError(f"denominator gave {values} for the micro-batches; what loss_fn divides by must be a finite "
                        "number >= 0 per micro-batch")
    return values


def _nothing(out: Any) -> torch.Tensor:
    """A zero loss that reaches every output tensor (their gradients zeros, whatever their values), for a
    micro-batch with nothing to divide: on one device its samples add nothing."""
    floats = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        return torch.zeros(())
    return sum((t.flatten()[:0].sum() for t in floats[1:]), floats[0].flatten()[:0].sum())
