"""tuning: pick a pipeline's chunks, loops, balance, checkpointing, graphs and schedule from measured costs (seqify.tune).

::

    cfg = seqify.tune(seq, x, gpus=2)             # measure, predict every candidate, time the best few
    print(cfg)                                    # the choice, with predicted and measured step times
    pipe = seqify.pipeline(seq, config=cfg)       # or config="cfg.json" after cfg.save("cfg.json")
    pipe = seqify.pipeline(seq, gpus=2, sample=x) # the same: chunks="auto" when chunks is not given

The method: profile every layer's forward+backward at two batch sizes (a line per layer), calibrate the
executor's per-task and per-launch overhead and the copy cost between the devices, predict each
candidate's step time by simulating its schedule (:mod:`seqify.tuning.predict`), then confirm the ``top`` best
predictions with a few timed training steps and keep the fastest. Choices are cached on disk per (model
fingerprint, input shapes and dtypes, devices, options) in ``$SEQIFY_CACHE_DIR/tune.json`` (default
``~/.cache/seqify``).
"""

from __future__ import annotations

import itertools
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import MemoryCapError, ScheduleError, SeqifyError, TuneError
from seqify.partition.balancer import split
from seqify.partition.cost import LayerCosts, default_transfer_cost, flop_costs, param_costs, time_costs
from seqify.partition.graph import dataflow, live_bytes
from seqify.partition.walk import layers as walk_layers
from seqify.pipe import tied
from seqify.pipe.config import PipeConfig, Trial
from seqify.pipe.memory import weighted
from seqify.pipe.microbatch import split_like
from seqify.pipe.pipeline import CHECKPOINT, Pipeline, build, resolve_devices
from seqify.pipe.split_backward import input_grads, weight_values
from seqify.progress import progress
from seqify.schedule.actions import SCHEDULES, SPLIT, round_robin, v_shape
from seqify.tuning import cache as tune_cache
from seqify.tuning.cache import cache_path, fingerprint
from seqify.tuning.predict import Calibration, Candidate, LayerModel, Prediction, predict, schedule_of

__all__ = ["tune", "PipeConfig", "Trial", "cache_path", "fingerprint", "calibrate", "layer_model", "step_seconds",
           "fit_host"]

CHUNKS = (1, 2, 4, 8, 16, 32, 64)
LOOPS = (1, 2, 4)
STRATEGIES = ("time", "flops", "memory")
# -- measuring ---------------------------------------------------------------------------------------------


def _batch(sample: Any) -> int:
    for t in pytree.tree_leaves(sample):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise TuneError("the sample holds no batched tensor; pass an input batch (a tensor, or a tuple or dict of "
                    "them) as you would pass it to the model")


def _head(sample: Any, n: int) -> Any:
    return pytree.tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, sample)


def _call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, tuple):
        return model(*sample)
    return model(sample)


def _loss(out: Any) -> torch.Tensor:
    parts = [t.float().square().mean() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not parts:
        raise TuneError("the model returns no floating-point tensor, so a training step cannot be timed")
    return torch.stack([p.to(parts[0].device) for p in parts]).sum()


def _sync(devices: Sequence[torch.device]) -> None:
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _scored(out: Any, _target: Any) -> torch.Tensor:
    return _loss(out)


def step_seconds(model: nn.Module, sample: Any, devices: Sequence[torch.device], *, steps: int = 2, warm: int = 1) -> float:
    """Median seconds of ``steps`` training steps (forward, a loss over every output, backward) after
    ``warm`` untimed ones; ``.grad`` is cleared after each. A :class:`Pipeline` whose schedule is not
    GPipe runs its steps as ``pipe.step`` (the only path that follows its schedule)."""
    scheduled = isinstance(model, Pipeline) and model.schedule != "gpipe"
    times = []
    for k in range(warm + steps):
        _sync(devices)
        start = time.perf_counter()
        if scheduled:
            model.step(sample, None, _scored, reduction="mean")
        else:
            _loss(_call(model, sample)).backward()
        _sync(devices)
        if k >= warm:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


@contextmanager
def _kept(model: nn.Module) -> Iterator[None]:
    """Leave ``model`` as it was: parameters' data, device and ``.grad``, buffers' objects and values,
    training flags and the RNG (trial pipelines move layers and update BatchNorm statistics)."""
    modules = list(model.modules())
    slots = [(m, dict(m._parameters), dict(m._buffers), m.training) for m in modules]
    params = {id(p): (p, p.data, p.grad) for m in modules for p in m._parameters.values() if p is not None}
    values = {id(b): (b, b.detach().clone()) for m in modules for b in m._buffers.values() if b is not None}
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, ps, bs, training in slots:
            m._parameters.update(ps)
            m._buffers.update(bs)
            m.training = training
        with torch.no_grad():
            for p, data, grad in params.values():
                p.data = data
                p.grad = grad
            for b, value in values.values():
                b.copy_(value)


def calibrate(devices: Sequence[torch.device], *, split: bool = True, replayed: bool = True) -> Calibration:
    """Measure the executor's overhead per (micro-batch, partition) task, the host time to issue one
    layer call on CUDA, the copy latency and bandwidth between the first two distinct devices, and
    (``split``) what a backward split for zero-bubble schedules costs over a whole one, eagerly and
    (``replayed``, CUDA) as captured graphs split it, on a chain of linear layers (:func:`tune` measures
    the captured split on the model itself and asks for the chain's only where it cannot)."""
    devices = list(devices)
    host_serial = all(d.type == "cpu" for d in devices)
    m = 8
    tiny = nn.Sequential(*[nn.Linear(4, 4) for _ in devices])
    x = torch.randn(2 * m, 4).to(devices[0])  # where the candidates' samples start (tune moves them there)
    with torch.random.fork_rng(devices=[]):
        pipe = Pipeline(tiny, [1] * len(devices), devices, chunks=m, checkpoint="never")
        task = step_seconds(pipe, x, devices, steps=3) / (m * len(devices))
    launch = 0.0
    first = devices[0]
    if first.type == "cuda":
        chain = nn.Sequential(*[nn.Linear(8, 8) for _ in range(32)]).to(first)
        y = torch.randn(2, 8, device=first)
        launch = step_seconds(chain, y, [first], steps=3) / len(chain)
    latency, bandwidth = 0.0, float("inf")
    pair = next(((a, b) for a, b in zip(devices, devices[1:]) if a != b), None)
    if pair is not None:
        small = torch.zeros(1, device=pair[0])
        big = torch.zeros(16 << 20, device=pair[0])  # 64 MB
        latency = _copy_seconds(small, pair)
        bandwidth = big.numel() * big.element_size() / max(_copy_seconds(big, pair) - latency, 1e-9)
    chain = replayed and split and first.type == "cuda"
    return Calibration(task_s=task, launch_s=launch, copy_latency_s=latency, copy_bytes_per_s=bandwidth,
                       host_serial=host_serial, split_backward=split_backward(first) if split else 1.0,
                       split_replayed=chain_split(first) if chain else 1.0)


def chain_split(device: torch.device) -> float:
    """:func:`split_backward` as captured graphs split it, on a chain wide enough to keep a GPU busy."""
    return split_backward(device, width=2048, batch=2048, boundary=True)


def split_backward(device: torch.device, *, width: int = 128, depth: int = 6, batch: int = 32,
                   boundary: bool = False) -> float:
    """Seconds of a backward split as ``pipe.step`` splits it for zero-bubble schedules (input gradients
    with ``torch.autograd.grad``, then weight gradients with ``backward(inputs=weights)``, walking the
    graph again) over those of one whole backward, on a chain of ``depth`` linear layers on ``device``.
    ``boundary``: split as captured graphs split it (B keeps the gradients where each weight joins the
    inputs' path and W starts there, :mod:`seqify.pipe.split_backward`); at a size that keeps the GPU busy,
    this is the GPU work a replayed B and W add, since replay has no host cost to weigh."""
    with torch.random.fork_rng(devices=[]):
        chain = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]).to(device)
        x = torch.randn(batch, width, device=device, requires_grad=True)
    return _split_ratio(lambda: chain(x).sum(), x, list(chain.parameters()), device, boundary=boundary)


def model_split(model: nn.Module, sample: Any, device: torch.device, *, rounds: int = 2) -> float | None:
    """:func:`split_backward` with ``boundary=True`` measured on ``model`` itself, its input made to want
    a gradient so B walks the whole model (what W runs again differs by model: a linear chain's W is its
    weight GEMMs, a CNN's its convolutions' weight kernels beside B taking its normalisations' weights).
    None where the sample is not one floating-point tensor or the model does not fit ``device``. The
    model is left as it was."""
    if not (isinstance(sample, torch.Tensor) and sample.is_floating_point()):
        return None
    weights = [p for p in model.parameters() if p.requires_grad]
    try:
        with _kept(model):  # its device, gradients and BatchNorm statistics as they were
            model.to(device).train()
            x = sample.to(device).detach().requires_grad_(True)
            return _split_ratio(lambda: _loss(model(x)), x, weights, device, boundary=True, rounds=rounds)
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _split_ratio(run: Any, x: torch.Tensor, weights: list[torch.Tensor], device: torch.device, *,
                 boundary: bool, rounds: int = 4) -> float:
    """(split backward) / (whole backward) seconds of the scalar ``run()`` returns, forward subtracted."""

    def whole() -> None:
        run().backward()

    def split() -> None:
        y = run()
        if boundary:
            one = torch.ones_like(y)
            _, _, later = input_grads([y], [one], [x], weights)
            weight_values([y], [one], weights, later, retain_graph=False)
            return
        torch.autograd.grad(y, [x], retain_graph=True)
        torch.autograd.backward(y, inputs=weights)

    def forward() -> None:
        with torch.enable_grad():
            run()

    kinds = (("forward", forward), ("whole", whole), ("split", split))
    for _, fn in kinds * 2:  # warm: allocations and kernels' first runs
        fn()
    times = {name: float("inf") for name, _ in kinds}
    for _ in range(rounds):  # rounds of all three, the fastest of each: noise from a shared machine only adds
        for name, fn in kinds:
            _sync([device])
            start = time.perf_counter()
            fn()
            _sync([device])
            times[name] = min(times[name], time.perf_counter() - start)
    back = times["whole"] - times["forward"]
    # at least one backward's work, at most two (W walks the whole graph again): outside, it was noise
    return min(max(1.0, (times["split"] - times["forward"]) / back), 2.0) if back > 0 else 1.0


def _copy_seconds(t: torch.Tensor, pair: tuple[torch.device, torch.device]) -> float:
    times = []
    for _ in range(4):
        _sync(pair)
        start = time.perf_counter()
        t.to(pair[1])
        _sync(pair)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def layer_model(model: nn.Module, sample: Any, device: torch.device, *, lo: int, sizes: Sequence[int] = (),
                show: bool = True, repeats: int = 2) -> tuple[LayerModel, LayerCosts]:
    """Profile every layer at the sample's batch, at ``lo`` samples and at each of ``sizes`` (the
    micro-batches the candidates run); per layer, those times with straight lines between them
    (:class:`~seqify.tuning.predict.LayerModel`), and the full batch's costs (for balancing by time and memory)."""
    batch = _batch(sample)
    hi = time_costs(model, sample, device, repeats=repeats, progress=show)
    points = [(batch, hi.cost)]
    host = [hi.host]
    for size in sorted({min(lo, batch), *(s for s in sizes if 1 <= s < batch)} - {batch}):
        costs = time_costs(model, _head(sample, size), device, repeats=repeats, progress=show)
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


def _anchor(model: nn.Module, sample: Any, device: torch.device, layers: LayerModel, cal: Calibration, batch: int,
            *, steps: int, warm: int) -> tuple[LayerModel, tuple[int, int] | None]:
    """Scale the layer times so the model on one device predicts its measured step: profiling a layer
    alone adds or hides per-call costs a whole step does not have (on CPU, an autograd call per layer).
    On a GPU the GPU's work and the host's issue are scaled apart: the layer times so that the whole model
    replayed as captured graphs (GPU work only) predicts its measured step, then the host's issue times so
    that the eager step does too (:func:`fit_host`); where the model cannot be replayed, both by one factor
    so that the eager step does. Also the peak bytes the eager step allocated and reserved on a GPU
    (the bounds of :func:`_lean`; ``None`` on the CPU). Where the batch does not fit one device whole, the
    bounds are those of one device accumulating it in the fewest micro-batches that fit
    (:func:`_accumulated`), and the steps that anchor the times are of one such micro-batch (weak scaling's
    batches: until 2026-11-26 their times stayed as profiled)."""
    model = model.to(device).train()  # the sample is on ``device`` already (tune puts it there)
    with _peaks([device]) as got:
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
    part = _head(sample, batch // k)
    measured = _fitting(model, part, device, steps=steps, warm=warm)
    model.zero_grad(set_to_none=True)
    if measured is None:
        return layers, bounds
    return _scale(model, part, device, layers, cal, batch // k, measured, steps=steps, warm=warm), bounds


def _fitting(model: nn.Module, sample: Any, device: torch.device, *, steps: int, warm: int) -> float | None:
    """:func:`step_seconds` of ``model`` alone on ``device``, or ``None`` where it runs out of memory (returning
    from the handler drops its traceback, which holds the failed step's activations)."""
    try:
        return step_seconds(model, sample, [device], steps=steps, warm=warm)
    except torch.OutOfMemoryError:
        return None


def _scale(model: nn.Module, sample: Any, device: torch.device, layers: LayerModel, cal: Calibration, batch: int,
           measured: float, *, steps: int, warm: int) -> LayerModel:
    """``layers`` scaled so that ``sample`` (``batch`` samples) on ``device`` alone predicts its steps:
    ``measured`` eager seconds and, on a GPU, the replayed step (:func:`_anchor`)."""
    alone = Candidate((len(layers),), (str(device),), 1, "never")
    replayed = _replayed(model, sample, device, steps=steps, warm=warm) if layers.host_s else None
    if replayed is None:  # one factor for both: the prediction scales with it whichever of them binds
        predicted = predict(alone, layers, cal, batch).seconds
        factor = measured / predicted if predicted > 0 else 1.0
        return layers.scaled(factor).host_scaled(factor)
    work = predict(replace(alone, graphs=True), layers, cal, batch).seconds
    layers = layers.scaled(replayed / work) if work > 0 else layers
    return fit_host(layers, alone, cal, batch, measured)


def _replayed(model: nn.Module, sample: Any, device: torch.device, *, steps: int, warm: int) -> float | None:
    """Seconds of a training step of the whole model on ``device`` replayed as captured CUDA graphs: the
    GPU's work with no host issue in it. ``None`` where it cannot be captured or does not fit."""
    pipe = None
    seconds: float | None = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a model that cannot be captured falls back: no anchor, no warning
            pipe = build(model, devices=[device], balance=[len(model)], chunks=1, checkpoint="never",
                            graphs=True).train()
            seconds = step_seconds(pipe, sample, [device], steps=steps, warm=warm + 1)
            if pipe.graph_error is not None:
                seconds = None
    except (torch.OutOfMemoryError, SeqifyError):
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
    step than alone (measurements: docs/design/cost-model.md). The times are found by bisection (the prediction grows with them); a step the GPU's
    work alone already explains keeps them at most as profiled, down to where the host stops binding."""
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


def _accumulated(model: nn.Module, sample: Any, device: torch.device,
                 batch: int) -> tuple[int, tuple[int, int] | None] | None:
    """The smallest k = 2, 4, ... such that ``device`` trains ``sample`` as k accumulated micro-batches, and
    the peak bytes it allocated and reserved doing so (``None`` on the CPU: no peaks): what one device holds
    training a batch it cannot take whole, as a user without a pipeline would (weak scaling's batches). A
    pipeline holding more than that on some GPU is no gain in memory, so it bounds :func:`_lean` as the
    whole-batch step does. ``None`` where no micro-batch fits."""
    k = 2
    while k <= batch:
        try:
            with _peaks([device]) as got:
                for part in split_like(sample, [batch // k + (i < batch % k) for i in range(k)]):
                    _loss(_call(model, part)).backward()
                _sync([device])
            fits = True
        except torch.OutOfMemoryError:
            fits = False
        model.zero_grad(set_to_none=True)
        if fits:
            allocated, reserved = got()
            return k, ((allocated[0], reserved[0]) if allocated else None)
        k *= 2
    return None


def _on_cuda(devices: Sequence[torch.device]) -> list[torch.device]:
    """The distinct CUDA devices among ``devices``, in order."""
    return list(dict.fromkeys(d for d in devices if d.type == "cuda"))


@contextmanager
def _peaks(devices: Sequence[torch.device]) -> Iterator[Callable[[], tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Measure the peak allocated and reserved bytes per CUDA device of the block, from an emptied cache;
    the value yielded returns them once the block is done (empty on the CPU)."""
    cuda = _on_cuda(devices)
    for d in cuda:
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d)
    yield lambda: (tuple(torch.cuda.max_memory_allocated(d) for d in cuda),
                   tuple(torch.cuda.max_memory_reserved(d) for d in cuda))


def _lean(confirmed: list[Trial], allocated: int | None, reserved: int | None) -> list[Trial]:
    """The confirmed candidates whose timed steps allocated at most ``allocated`` and reserved at most
    ``reserved`` bytes on every device (the model training on one device; the allocated bound also the
    user's memory cap): a pipeline that holds more on some GPU than one GPU training the whole model is no
    gain (people pipeline because a model does not fit). A bound that is ``None``, or a candidate not
    measured (the CPU), passes."""
    def within(peaks: tuple[int, ...], bound: int | None) -> bool:
        return bound is None or not peaks or max(peaks) <= bound

    return [t for t in confirmed if within(t.measured_peak, allocated) and within(t.measured_reserved, reserved)]


# -- candidates --------------------------------------------------------------------------------------------


def _schedules(loops: int, sample: Any) -> tuple[str, ...]:
    """The schedules that apply with ``loops`` partitions per device: GPipe always; 1F1B, ZB-H1 and ZB-H2
    with one partition per device; interleaved 1F1B with several; ZB-H1 also with two in a V. Only GPipe
    for a sample of keyword arguments (``pipe.step``, which runs the others, takes positional inputs)."""
    if isinstance(sample, dict):
        return ("gpipe",)
    if loops == 1:
        return ("gpipe", "1f1b", "zb-h1", "zb-h2")
    return ("gpipe", "interleaved", "zb-h1") if loops == 2 else ("gpipe", "interleaved")


def _layout(schedule: str, devices: Sequence[torch.device], loops: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Each partition's device and pipeline device number, as :func:`seqify.pipeline` places them: ZB-H1
    with two partitions per device in a V, everything else round-robin."""
    names = [str(d) for d in devices]
    if schedule == "zb-h1" and loops == 2:
        order, placement = tuple(names + names[::-1]), v_shape(len(names))
    else:
        order, placement = tuple(names * loops), round_robin(len(names), loops)
    # One number per GPU: a GPU listed twice (devices=["cuda:0", "cuda:0"]) runs its partitions one after
    # another, and predicting it as two devices halved the step. (CPU partitions share the host anyway:
    # the model runs them in turn whatever their numbers.)
    first: dict[str, int] = {}
    merged = tuple(first.setdefault(n, len(first)) for n in order)
    gpus = all(torch.device(n).type == "cuda" for n in names)
    return order, merged if gpus and len(first) < len(names) else placement


def _plans(model: nn.Module, sample: Any, hi: LayerCosts, parts: int, by: Sequence[str],
           bandwidth: float) -> dict[str, tuple[int, ...]]:
    """The optimal balance of each strategy for ``parts`` partitions."""
    lays = walk_layers(model)
    out: dict[str, tuple[int, ...]] = {}
    for strategy in by:
        if strategy not in ("time", "memory", "flops", "params"):
            raise TuneError(f"balance={strategy!r}: give a list of layer counts, one of ('time', 'memory', 'flops', "
                            "'params'), or None to let the tuner choose")
        if strategy == "time":
            costs = hi
        elif strategy == "params":
            costs = param_costs(model, sample)
        elif strategy == "memory":
            costs = replace(hi, by="memory", cost=tuple(float(c) for c in hi.memory))
        else:
            try:
                costs = flop_costs(model, sample)
            except SeqifyError:
                continue  # a model fake tensors cannot run: the other strategies stand
        transfer = default_transfer_cost(strategy, bandwidth=bandwidth) if strategy == "time" and bandwidth < float("inf") else \
            (default_transfer_cost(strategy) if strategy == "flops" else 0.0)
        plan = split(costs, parts, lays.names, lays.routes, transfer_cost=transfer)
        out[strategy] = tuple(plan.balance)
    return out


def _at(hi: LayerCosts, layers: LayerModel, batch: int, m: int) -> LayerCosts:
    """``hi`` with each layer's time where the step runs ``m`` micro-batches: its seconds at ``batch / m``
    samples, ``m`` times (the bytes stay those of the whole batch, so a cut's transfer weighs as before)."""
    b = batch / m
    return replace(hi, cost=tuple(m * layers.seconds(i, i + 1, b) for i in range(len(hi))))


def _candidates(model: nn.Module, sample: Any, hi: LayerCosts, devices: list[torch.device], fixed: dict[str, Any],
                bandwidth: float, layers: LayerModel | None = None) -> list[tuple[Candidate, str, int]]:
    """Every configuration to predict: per loops and micro-batch count, each balance strategy's plan (by
    time at that micro-batch size where ``layers`` has it: ResNet-101's batch-256 times cut it at [92, 253],
    its micro-batches of 64 at [101, 244], 1.62x and 1.64x one GPU under ZB-H2 on two H200s) with every
    checkpointing, graphs and schedule choice that applies."""
    batch = _batch(sample)
    n = len(hi)
    cuda = all(d.type == "cuda" for d in devices)
    chunk_set = [fixed["chunks"]] if fixed.get("chunks") else [c for c in CHUNKS if c <= batch]
    loop_set = [fixed["loops"]] if fixed.get("loops") else [v for v in LOOPS if v == 1 or len(devices) > 1]
    ckpt_set = [fixed["checkpoint"]] if fixed.get("checkpoint") else list(CHECKPOINT)
    graph_set = [fixed["graphs"]] if fixed.get("graphs") is not None else ([False, True] if cuda else [False])
    balance = fixed.get("balance")
    given = isinstance(balance, (list, tuple))
    strategies = [] if given else [balance] if balance else list(STRATEGIES)
    # each micro-batch count's layer times, for the time strategy's cuts (the same for every loops)
    timed = {m: _at(hi, layers, batch, m) for m in chunk_set} if "time" in strategies and layers is not None else {}
    out: list[tuple[Candidate, str, int]] = []
    for loops in loop_set:
        parts = len(devices) * loops
        if parts > n:
            continue
        valid = _schedules(loops, sample)
        sched_set = ([fixed["schedule"]] if fixed["schedule"] in valid else []) if fixed.get("schedule") else list(valid)
        if given:
            if len(balance) != parts:
                continue
            fixed_plans: dict[str, tuple[int, ...]] = {"given": tuple(balance)}
        else:  # the strategies whose costs do not depend on the micro-batch size, once per loops
            fixed_plans = _plans(model, sample, hi, parts, [s for s in strategies if s != "time" or layers is None],
                                 bandwidth)
        layouts = {sched: _layout(sched, devices, loops) for sched in sched_set}
        apart_of: dict[tuple[int, ...], dict[str, bool]] = {}  # per balance: schedules whose layout splits a tie
        for m in chunk_set:
            plans = dict(fixed_plans)
            if m in timed:
                plans.update(_plans(model, sample, timed[m], parts, ["time"], bandwidth))
            seen: dict[tuple[int, ...], str] = {}
            for strategy in [s for s in (*strategies, "given") if s in plans]:
                seen.setdefault(plans[strategy], strategy)  # two strategies that agree are one candidate
            for bal, strategy in seen.items():
                if bal not in apart_of:  # weights several partitions use (GPT-2's embedding and head)
                    ties = tied.across(model, bal)
                    apart_of[bal] = {sched: bool(tied.crossing(ties, names)) for sched, (names, _) in layouts.items()}
                apart = apart_of[bal]
                for ckpt, graphs, sched in itertools.product(ckpt_set, graph_set, sched_set):
                    if m == 1 and ckpt == "except_last" and not fixed.get("checkpoint"):
                        continue  # one micro-batch, the last: the same run as checkpoint='never'
                    if m == 1 and sched != "gpipe" and not fixed.get("schedule"):
                        continue  # one micro-batch has no bubble to fill: every schedule is GPipe's order
                    names, slots = layouts[sched]
                    if graphs and apart[sched]:
                        continue  # captured graphs cannot replay a weight copied to another device per call
                    out.append((Candidate(bal, names, m, ckpt, graphs, sched, slots, bool(fixed.get("overlap"))),
                                strategy, loops))
    return out


# -- the tuner ---------------------------------------------------------------------------------------------


def tune(
    model: nn.Module,
    sample: Any,
    *,
    gpus: int | None = None,
    devices: Sequence[Any] | None = None,
    memory_cap: float | None = None,
    chunks: int | None = None,
    loops: int | None = None,
    balance: Sequence[int] | str | None = None,
    checkpoint: str | None = None,
    graphs: bool | None = None,
    schedule: str | None = None,
    overlap: bool | None = None,
    top: int = 3,
    steps: int = 2,
    warm: int = 1,
    cache: bool = True,
    show: bool = True,
    example_inputs: Any = None,
    **convert_options: Any,
) -> PipeConfig:
    """The fastest pipeline configuration of ``model`` for mini-batches like ``sample`` on these devices.

    Args:
        model: a seqify.Sequential or nn.Sequential, or any module (converted first, with
            ``example_inputs`` and ``convert_options``). It is left as it was (devices, values, gradients).
        sample: a training mini-batch, as you pass it to the model.
        gpus / devices: as for :func:`seqify.pipeline`: ``gpus=N`` or one device per pipeline stage
            (``devices=['cpu', 'cpu']`` pipelines on the CPU).
        memory_cap: bytes a device may hold (parameters, gradients and the activations the schedule
            keeps in flight, predicted; optimizer state not counted): candidates predicted over it are
            rejected, and :class:`MemoryCapError` names the smallest cap that works when none fits.
            On GPUs the timed candidates' allocated peaks are read too: one that held more than the cap
            on some device, or (cap or not) more than the model training on one device (allocated against
            allocated, reserved against reserved; a batch one device cannot take whole counts as the fewest
            accumulated micro-batches that fit), is chosen only when none of the timed ones stays under
            (the next best predicted are timed first).
        chunks, loops, balance, checkpoint, graphs, schedule: fix that choice (``balance``: a strategy
            or a list of layer counts; ``schedule``: one of 'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-h2');
            ``None`` searches it. Schedules other than GPipe are timed, and later run, by ``pipe.step``.
        overlap: two streams per GPU for ``pipe.step``'s graphs (see :func:`seqify.pipeline`). ``None``:
            the fastest timed candidate with graphs and a schedule other than GPipe is timed once more with
            it, and kept that way where it ran faster within the same memory bounds (its time is not
            predicted; its memory is, one micro-batch more in flight); ``True``: every candidate has it
            (graphs only); ``False``: none.
        top: how many of the best predicted candidates to confirm with timed steps (0: trust the
            prediction; from 2, the best eager or replayed candidate is timed too where the ``top`` are
            all of the other kind, and the best of each other schedule predicted within ``BAND`` (5%) of
            the best);
            ``steps`` timed steps each after ``warm`` untimed ones.
        cache: read and write the on-disk cache (:func:`cache_path`).
        show: progress bars on stderr (on a terminal, or with ``SEQIFY_PROGRESS=1``).

    Returns:
        A :class:`PipeConfig`: ``seqify.pipeline(model, config=cfg)`` builds it; ``print(cfg)`` shows the
        candidates with predicted and measured milliseconds per step.
    """
    if sample is None:
        raise TuneError("seqify.tune needs sample=... (a training mini-batch) to measure the model; or pass "
                        "chunks=N and balance= to seqify.pipeline to choose by hand")
    if not isinstance(model, nn.Sequential):
        from seqify.convert import convert

        model = convert(model, example_inputs, **convert_options)
    placed = resolve_devices(gpus, devices, None if gpus is not None or devices is not None else 1)
    if schedule is not None and schedule not in SCHEDULES:
        raise TuneError(f"schedule={schedule!r}: choose one of {SCHEDULES}, or None to let the tuner choose")
    if checkpoint is not None and checkpoint not in CHECKPOINT:
        raise TuneError(f"checkpoint={checkpoint!r}: choose one of {CHECKPOINT}, or None to let the tuner choose")
    if memory_cap is not None and not memory_cap > 0:
        raise TuneError(f"memory_cap={memory_cap!r}: give the bytes one device may hold (> 0), or None for no cap")
    if overlap and graphs is False:
        raise TuneError("overlap=True runs captured graphs on two streams per GPU: it needs graphs (pass graphs=None "
                        "or True)")
    fixed = dict(chunks=chunks, loops=loops, balance=list(balance) if isinstance(balance, (list, tuple)) else balance,
                 checkpoint=checkpoint, graphs=True if overlap else graphs, schedule=schedule, memory_cap=memory_cap,
                 top=top, overlap=overlap)
    key = tune_cache.key(model, sample, placed, fixed)
    if cache:
        hit = tune_cache.read().get(key)
        if hit is not None:
            try:
                cfg = PipeConfig.from_dict(hit)
                if sum(cfg.balance) == len(model):
                    return cfg
            except (SeqifyError, TypeError, KeyError):
                pass  # an entry from another version: measure again
    batch = _batch(sample)
    # every candidate, and the one-device anchor, is timed from the batch on the first device: a batch left
    # elsewhere would add its copy to the candidates' times and to no prediction
    sample = pytree.tree_map(lambda t: t.to(placed[0]) if isinstance(t, torch.Tensor) else t, sample)
    with _kept(model):
        splits = schedule is None or schedule in SPLIT  # some candidate splits its backward (zero bubble)
        own_split = splits and placed[0].type == "cuda"  # the captured split, measured on the model below
        cal = calibrate(placed, split=splits and not isinstance(sample, dict), replayed=not own_split)
        counts = [chunks] if chunks else [c for c in CHUNKS if c <= batch]
        lo = max(2 if batch >= 2 else 1, batch // max(counts))
        micro = [batch // c for c in counts if batch // c >= lo]  # the sizes the candidates' micro-batches have
        layers, hi = layer_model(model, sample, placed[0], lo=lo, sizes=micro, show=show)
        layers, alone = _anchor(model, sample, placed[0], layers, cal, batch, steps=steps, warm=warm)
        # no timed candidate may hold more on some GPU than the model training on one (or than the cap)
        limits = [b for b in (alone[0] if alone else None, memory_cap) if b is not None]
        bound = (int(min(limits)) if limits else None, alone[1] if alone else None)
        if own_split:  # a replayed split, as this model splits; where it cannot be measured, as a chain does
            own = model_split(model, sample, placed[0])
            if own is None and not isinstance(sample, dict):
                own = chain_split(placed[0])
            cal = replace(cal, split_replayed=own) if own is not None else cal
        found = _candidates(model, sample, hi, placed, fixed, cal.copy_bytes_per_s, layers)
        if not found:
            given = {k: v for k, v in fixed.items() if v is not None}
            if schedule is not None and schedule != "gpipe":
                raise TuneError(f"no candidate configuration with the fixed options {given}: schedule={schedule!r} "
                                "applies to loops=1 ('1f1b', 'zb-h2'), loops > 1 ('interleaved') or loops 1 and 2 "
                                "('zb-h1'), "
                                "with positional inputs; fix loops to match, or let the tuner choose (schedule=None)")
            ties = tied.across(model, [1] * len(model)) if fixed.get("graphs") else []
            if ties:
                raise TuneError(f"graphs=True: parameter {ties[0].name} is used by layers that land on different "
                                "devices under every balance and layout tried, and captured graphs cannot replay a "
                                "weight copied to another device per call; let the tuner choose (graphs=None), use "
                                "graphs=False, or allow schedule='zb-h1' with loops=2 (its V puts the first and last "
                                "partitions on one device)")
            raise TuneError(f"no candidate configuration: {len(model)} layers cannot make {len(placed)} partitions "
                            f"with the fixed options {given}")
        trials = []
        same: set[tuple[Any, ...]] = set()  # one trial per distinct run: zb-h2 with few micro-batches is zb-h1
        for c, s, v in found:
            try:
                run = schedule_of(c.schedule, c.slots(), max(1, min(c.chunks, batch))).actions
                key_of = (c.balance, c.devices, c.checkpoint, c.graphs, c.chunks, run, c.schedule == "gpipe")
                if key_of in same:
                    continue
                same.add(key_of)
                trials.append(_trial(c, s, v, predict(c, layers, cal, batch)))
            except ScheduleError:
                continue  # a schedule that does not apply to this layout
        if not trials:
            raise TuneError(f"no schedule applies with the fixed options "
                            f"{({k: v for k, v in fixed.items() if v is not None})}; let the tuner choose schedule "
                            "or loops (schedule=None, loops=None)")
        fits = [t for t in trials if memory_cap is None or t.memory_bytes <= memory_cap]
        if not fits:
            least = min(trials, key=lambda t: (t.memory_bytes, t.predicted_s))
            raise MemoryCapError(
                f"no configuration fits memory_cap={memory_cap:.0f} bytes ({memory_cap / 2**20:.2f} MiB) per device: "
                f"the smallest cap that works is {least.memory_bytes} bytes ({least.memory_bytes / 2**20:.2f} MiB, "
                f"{least.label()}); raise memory_cap to at least that, use more devices, or a smaller mini-batch"
            )
        fits.sort(key=lambda t: t.predicted_s)
        timed = _to_time(fits, top)
        confirmed = _confirm(model, sample, placed, timed, steps=steps, warm=warm, show=show)
        if confirmed and not _lean(confirmed, *bound):  # each held more than the bound: time the next best too
            more = [t for t in fits if not any(t is u for u in timed)][:max(top, 1)]
            confirmed += _confirm(model, sample, placed, more, steps=steps, warm=warm, show=show)
            timed += more
        if top > 0 and not confirmed:
            raise MemoryCapError(f"each of the {len(timed)} best candidates ran out of memory in a timed "
                                 "step; pass a memory_cap below the devices' memory, use more devices, or a smaller "
                                 "mini-batch")
        best = min(_lean(confirmed, *bound) or confirmed, key=lambda t: t.measured_s or 0.0) if confirmed else fits[0]
        if overlap is None and best.measured_s is not None and best.graphs and (best.schedule or "gpipe") != "gpipe":
            twin = _twin(best, placed, layers, cal, batch)
            if memory_cap is None or twin.memory_bytes <= memory_cap:
                more = _confirm(model, sample, placed, [twin], steps=steps, warm=warm, show=show)
                confirmed += more
                timed.append(twin)
                if more and more[0].measured_s < best.measured_s and (_lean(more, *bound) or not _lean([best], *bound)):
                    best = more[0]
    shown = confirmed + [t for t in fits if not any(t is u for u in timed)][:8]
    cfg = PipeConfig(chunks=best.chunks, loops=best.loops, balance=best.balance, by=best.by,
                     checkpoint=best.checkpoint, graphs=best.graphs, devices=tuple(str(d) for d in placed),
                     batch=batch, predicted_s=best.predicted_s, measured_s=best.measured_s,
                     schedule=best.schedule, memory_per_device=best.memory_per_device, overlap=best.overlap,
                     trials=tuple(shown), key=key)
    if cache:
        tune_cache.write(key, cfg)
    return cfg


def _confirm(model: nn.Module, sample: Any, placed: list[torch.device], timed: list[Trial], *, steps: int, warm: int,
             show: bool) -> list[Trial]:
    """``timed`` with measured step seconds and, on GPUs, the peak bytes each device allocated while the
    pipeline was built, captured and ran its steps (from an emptied cache); a candidate that runs out of
    memory is left out."""
    confirmed = []
    for t in progress(timed, len(timed), "seqify tune: timing the best candidates", show):
        pipe = None
        try:
            with _peaks(placed) as got:
                pipe = build(model, **_options(t, placed)).train()
                seconds = step_seconds(pipe, sample, placed, steps=steps, warm=warm + (1 if t.graphs else 0))
        except torch.OutOfMemoryError:  # predicted to fit but did not: the next candidate
            continue
        finally:
            del pipe
        allocated, reserved = got()
        confirmed.append(replace(t, measured_s=seconds, measured_peak=allocated, measured_reserved=reserved))
    return confirmed


#: How far over the best prediction each other schedule's best candidate is still timed (with ``top >= 2``):
#: on GPUs the predictions err by more than schedules differ (docs/design/cost-model.md, "What is timed").
BAND = 0.05


def _to_time(fits: list[Trial], top: int) -> list[Trial]:
    """The candidates to time: the ``top`` best predicted (``fits`` is sorted), and with ``top >= 2`` also the
    best of the other kind (eager or replayed) when none of them is: the two kinds are predicted from different
    costs (the host's issue time against the GPU's work), and an error in one must not keep the other untimed.
    Then the best of each schedule not yet among them, predicted within :data:`BAND` of the best."""
    best = fits[:top]
    if top < 2:
        return best
    if len({t.graphs for t in best}) == 1:
        other = next((t for t in fits[top:] if t.graphs != best[0].graphs), None)
        best += [other] if other is not None else []
    schedules = {t.schedule for t in best}
    for t in fits[top:]:
        if t.predicted_s > fits[0].predicted_s * (1 + BAND):
            break
        if t.schedule not in schedules and not any(t is u for u in best):
            best.append(t)
            schedules.add(t.schedule)
    return best


def _trial(c: Candidate, by: str, loops: int, p: Prediction) -> Trial:
    return Trial(chunks=c.chunks, loops=loops, by=by, checkpoint=c.checkpoint, graphs=c.graphs,
                 schedule=c.schedule, balance=c.balance, predicted_s=p.seconds, memory_bytes=p.memory_bytes,
                 memory_per_device=p.per_device, overlap=c.overlap)


def _twin(t: Trial, devices: Sequence[torch.device], layers: LayerModel, cal: Calibration, batch: int) -> Trial:
    """Trial ``t`` with two lanes per GPU, not yet timed: its memory predicted as they hold it."""
    names, slots = _layout(t.schedule or "gpipe", devices, t.loops)
    c = Candidate(t.balance, names, t.chunks, t.checkpoint, t.graphs, t.schedule or "gpipe", slots, overlap=True)
    return _trial(c, t.by, t.loops, predict(c, layers, cal, batch))


def _options(t: Trial, devices: Sequence[torch.device]) -> dict[str, Any]:
    """Keyword arguments of :func:`seqify.pipeline` that build trial ``t`` on ``devices``."""
    return dict(devices=list(devices), loops=t.loops, balance=list(t.balance), chunks=t.chunks,
                checkpoint=t.checkpoint, graphs=t.graphs, schedule=t.schedule or "gpipe", overlap=t.overlap)
