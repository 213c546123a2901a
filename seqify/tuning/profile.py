"""The layer model: each layer's profiled times as lines in the micro-batch size, anchored to the measured
step of the whole model on one device."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from seqify.errors import SeqifyError
from seqify.partition.cost import LayerCosts, time_costs
from seqify.partition.graph import dataflow, live_bytes
from seqify.partition.walk import layers as walk_layers
from seqify.pipe.assemble import build
from seqify.pipe.memory import weighted
from seqify.pipe.microbatch import split_like
from seqify.tuning import measure
from seqify.tuning.predict import Calibration, Candidate, LayerModel, predict

__all__ = ["layer_model", "anchor", "fit_host"]


def layer_model(model: nn.Sequential, sample: Any, device: torch.device, *, lo: int, sizes: Sequence[int] = (),
                show: bool = True, repeats: int = 2) -> tuple[LayerModel, LayerCosts]:
    """Profile every layer at the sample's batch, at ``lo`` samples and at each of ``sizes`` (the
    micro-batches the candidates run); per layer, those times with straight lines between them
    (:class:`~seqify.tuning.predict.LayerModel`), and the full batch's costs (for balancing by time and memory)."""
    batch = measure.batch_size(sample)
    hi = time_costs(model, sample, device, repeats=repeats, progress=show)
    points = [(batch, hi.cost)]
    host = [hi.host]
    for size in sorted({min(lo, batch), *(s for s in sizes if 1 <= s < batch)} - {batch}):
        costs = time_costs(model, measure.head(sample, size), device, repeats=repeats, progress=show)
        points.append((size, costs.cost))
        host.append(costs.host)
    lays = walk_layers(model)
    live = live_bytes(dataflow(len(lays), lays.routes, hi.output_bytes, hi.skip_bytes))
    # A layer's issue cost hardly depends on the batch: the least of its runs, the least disturbed.
    issue = [min(h) for h in zip(*host)] if all(host) else []
    fitted = LayerModel.through(points, hi.activation_bytes, hi.state_bytes, live[: len(lays)], batch, issue)
    # What a split backward's B keeps for W: the gradient at each weighted layer's output, shaped like it
    # (benchmarks/zb_kept/: for FCN, RegNet and VGG partitions, the bytes dist_backward.input_grads kept).
    kept = tuple(o / batch if weighted(m) else 0.0 for o, m in zip(hi.output_bytes, lays.modules))
    return replace(fitted, kept_per_sample=kept), hi


def anchor(model: nn.Sequential, sample: Any, device: torch.device, layers: LayerModel, cal: Calibration, batch: int,
            *, steps: int, warm: int) -> tuple[LayerModel, tuple[int, int] | None]:
    """Scale the layer times so the model on one device predicts its measured step: profiling a layer
    alone adds or hides per-call costs a whole step does not have (on CPU, an autograd call per layer).
    On a GPU the GPU's work and the host's issue are scaled apart: the layer times so that the whole model
    replayed as captured graphs (GPU work only) predicts its measured step, then the host's issue times so
    that the eager step does too (:func:`fit_host`); where the model cannot be replayed, both by one factor
    so that the eager step does. Also the peak bytes the eager step allocated and reserved on a GPU
    (the bounds of :func:`~seqify.tuning.choice.lean`; ``None`` on the CPU). Where the batch does not fit one
    device whole, the bounds are those of one device accumulating it in the fewest micro-batches that fit
    (:func:`_accumulated`), and the steps that anchor the times are of one such micro-batch (weak scaling's
    batches are anchored too, not left as profiled)."""
    model = model.to(device).train()  # the sample is on ``device`` already (tune puts it there)
    with measure.peaks([device]) as got:
        measured = _fitting(model, sample, device, steps=steps, warm=warm)
    if measured is not None:
        allocated, reserved = got()
        return _scale(model, sample, device, layers, cal, batch, measured, steps=steps, warm=warm), (
            (allocated[0], reserved[0]) if allocated else None)
    model.zero_grad(set_to_none=True)
    fits = _accumulated(model, sample, device, batch)
    if fits is None:
        return layers, None
    k, bounds = fits
    part = measure.head(sample, batch // k)
    measured = _fitting(model, part, device, steps=steps, warm=warm)
    model.zero_grad(set_to_none=True)
    if measured is None:
        return layers, bounds
    return _scale(model, part, device, layers, cal, batch // k, measured, steps=steps, warm=warm), bounds


def _fitting(model: nn.Sequential, sample: Any, device: torch.device, *, steps: int, warm: int) -> float | None:
    """:func:`step_seconds` of ``model`` alone on ``device``, or ``None`` where it runs out of memory (returning
    from the handler drops its traceback, which holds the failed step's activations)."""
    try:
        return measure.step_seconds(model, sample, [device], steps=steps, warm=warm)
    except Exception as e:
        if not measure.out_of_memory(e):
            raise
        return None


def _scale(model: nn.Sequential, sample: Any, device: torch.device, layers: LayerModel, cal: Calibration, batch: int,
           measured: float, *, steps: int, warm: int) -> LayerModel:
    """``layers`` scaled so that ``sample`` (``batch`` samples) on ``device`` alone predicts its steps:
    ``measured`` eager seconds and, on a GPU, the replayed step (:func:`anchor`)."""
    alone = Candidate((len(layers),), (str(device),), 1, "never")
    replayed = _replayed(model, sample, device, steps=steps, warm=warm) if layers.host_s else None
    if replayed is None:  # one factor for both: the prediction scales with it whichever of them binds
        predicted = predict(alone, layers, cal, batch).seconds
        factor = measured / predicted if predicted > 0 else 1.0
        return layers.scaled(factor).host_scaled(factor)
    work = predict(replace(alone, graphs=True), layers, cal, batch).seconds
    layers = layers.scaled(replayed / work) if work > 0 else layers
    return fit_host(layers, alone, cal, batch, measured)


def _replayed(model: nn.Sequential, sample: Any, device: torch.device, *, steps: int, warm: int) -> float | None:
    """Seconds of a training step of the whole model on ``device`` replayed as captured CUDA graphs: the
    GPU's work with no host issue in it. ``None`` where it cannot be captured or does not fit."""
    pipe = None
    seconds: float | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a model that cannot be captured falls back: no anchor, no warning
            pipe = build(model, devices=[device], balance=[len(model)], chunks=1, checkpoint="never",
                            graphs=True).train()
            seconds = measure.step_seconds(pipe, sample, [device], steps=steps, warm=warm + 1)
            if pipe.graph_error is not None:
                seconds = None
    except Exception as e:  # out of memory (a library's allocation too), or a model graphs cannot replay
        if not (measure.out_of_memory(e) or isinstance(e, SeqifyError)):
            raise
        seconds = None
    finally:
        del pipe
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    return seconds


def fit_host(layers: LayerModel, alone: Candidate, cal: Calibration, batch: int, measured: float) -> LayerModel:
    """``layers`` with the host's issue times (``host_s``) scaled so that ``alone`` (the model eagerly on one
    device) predicts ``measured`` seconds: profiling issues each layer's backward as an autograd call of its
    own, which a whole step does not pay per layer, while small kernels can take longer to issue in a full
    step than alone (measurements: docs/design/cost-model.md). The times are found by bisection (the
    prediction grows with them); a step the GPU's work alone already explains keeps them at most as
    profiled, down to where the host stops binding."""
    if not layers.host_s:
        return layers

    def at(h: float) -> float:
        return predict(alone, layers.host_scaled(h), cal, batch).seconds

    target = max(measured, at(0.0))  # no host time makes the GPU's work faster than profiled
    now = at(1.0)
    if target * (1 - 1e-3) <= now <= target * (1 + 1e-3):
        return layers
    lo, hi = (0.0, 1.0) if now > target else (1.0, 64.0)
    for _ in range(40):
        mid = (lo + hi) / 2
        if at(mid) > target * (1 + 1e-6):
            hi = mid
        else:
            lo = mid
    return layers.host_scaled(lo)


def _accumulated(model: nn.Sequential, sample: Any, device: torch.device,
                 batch: int) -> tuple[int, tuple[int, int] | None] | None:
    """The smallest k = 2, 4, ... such that ``device`` trains ``sample`` as k accumulated micro-batches, and
    the peak bytes it allocated and reserved doing so (``None`` on the CPU: no peaks): what one device holds
    training a batch it cannot take whole, as a user without a pipeline would (weak scaling's batches). A
    pipeline holding more than that on some GPU is no gain in memory, so it bounds
    :func:`~seqify.tuning.choice.lean` as the whole-batch step does. ``None`` where no micro-batch fits."""
    k = 2
    while k <= batch:
        try:
            with measure.peaks([device]) as got:
                for part in split_like(sample, [batch // k + (i < batch % k) for i in range(k)]):
                    measure.loss(measure.call(model, part)).backward()
                measure.sync([device])
            fits = True
        except Exception as e:
            if not measure.out_of_memory(e):
                raise
            fits = False
        model.zero_grad(set_to_none=True)
        if fits:
            allocated, reserved = got()
            return k, ((allocated[0], reserved[0]) if allocated else None)
        k *= 2
    return None
