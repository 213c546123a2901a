"""Measuring for the tuner: timed training steps, the executor's overheads and copy costs, split backwards,
and the peak memory a block of work holds."""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import TuneError
from seqify.pipe.pipeline import Pipeline
from seqify.pipe.replicated import ReplicatedPipeline
from seqify.pipe.split_backward import input_grads, weight_values
from seqify.tuning.predict import Calibration

__all__ = ["batch_size", "head", "call", "loss", "sync", "step_seconds", "kept", "calibrate", "chain_split",
           "split_backward", "model_split", "peaks", "release", "out_of_memory"]


def batch_size(sample: Any) -> int:
    """The batch size of ``sample``: dim 0 of its first batched tensor."""
    for t in pytree.tree_leaves(sample):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise TuneError("the sample holds no batched tensor; pass an input batch (a tensor, or a tuple or dict of "
                    "them) as you would pass it to the model")


def head(sample: Any, n: int) -> Any:
    """``sample`` cut to its first ``n`` samples."""
    return pytree.tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, sample)


def call(model: nn.Module, sample: Any) -> Any:
    """``model`` run on ``sample`` as the user passes it (keywords, positional arguments or one input)."""
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, tuple):
        return model(*sample)
    return model(sample)


def loss(out: Any) -> torch.Tensor:
    """A scalar over every floating-point output, for timing a training step."""
    floats = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    parts = [t.float().square().mean() for t in floats]
    if not parts:
        raise TuneError("the model returns no floating-point tensor, so a training step cannot be timed")
    return torch.stack([p.to(parts[0].device) for p in parts]).sum()


def sync(devices: Sequence[torch.device]) -> None:
    """Wait for the CUDA devices among ``devices``."""
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _scored(out: Any, _target: Any) -> torch.Tensor:
    return loss(out)


def step_seconds(model: nn.Module, sample: Any, devices: Sequence[torch.device], *, steps: int = 2,
                 warm: int = 1, update: bool = False) -> float:
    """Median seconds of ``steps`` training steps (forward, a loss over every output, backward) after
    ``warm`` untimed ones; ``.grad`` is cleared after each. A :class:`Pipeline` whose schedule is not
    GPipe runs its steps as ``pipe.step`` (the only path that follows its schedule). With ``update``, each
    step ends with a pass over the trainable parameters in place, as an optimizer's step makes (see
    :func:`updated`); replicas each make it on their own copy, as ``pipe.optimizer`` steps them."""
    scheduled = isinstance(model, ReplicatedPipeline) or isinstance(model, Pipeline) and model.schedule != "gpipe"
    update_step = _update_of(model) if update else None
    times = []
    for k in range(warm + steps):
        sync(devices)
        start = time.perf_counter()
        if scheduled:
            cast(Pipeline, model).step(sample, None, _scored, reduction="mean")  # or a ReplicatedPipeline's
        else:
            loss(call(model, sample)).backward()
        if update_step is not None:
            update_step()
        sync(devices)
        if k >= warm:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def updated(model: nn.Module) -> None:
    """Rewrite every trainable parameter in place with its own value (times 1.0, exact for every float), one
    pass per device and dtype: the memory traffic of the lightest optimizer step, on the devices that hold
    the parameters, and a new version of each, so that replicas take the first's state before the next step as
    they do after an optimizer of ``pipe.parameters()``. Timed steps without it would leave out the update and,
    for replicas of a model without buffers to change, the broadcast."""
    _rewritten(list(model.parameters()))


def _rewritten(params: list[torch.Tensor]) -> None:
    """:func:`updated` on ``params``."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.requires_grad:
            groups.setdefault((p.device, p.dtype), []).append(p)
    with torch.no_grad():
        for group in groups.values():
            torch._foreach_mul_(group, 1.0)


class _Rewrite(torch.optim.Optimizer):
    """The lightest optimizer: its step rewrites each parameter with its own value (:func:`updated`)."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        _rewritten([p for group in self.param_groups for p in group["params"]])


def _update_of(model: nn.Module) -> Callable[[], None]:
    """What ends a timed step of ``model``: :func:`updated`, or, for replicas, each rewriting its own copy
    (``pipe.optimizer``), with nothing to broadcast before the next step."""
    if isinstance(model, ReplicatedPipeline):
        return model.optimizer(_Rewrite).step
    return functools.partial(updated, model)


@contextmanager
def kept(model: nn.Module) -> Iterator[None]:
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
    chained = replayed and split and first.type == "cuda"
    return Calibration(task_s=task, launch_s=launch, copy_latency_s=latency, copy_bytes_per_s=bandwidth,
                       host_serial=host_serial, split_backward=split_backward(first) if split else 1.0,
                       split_replayed=chain_split(first) if chained else 1.0)


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
        with kept(model):  # its device, gradients and BatchNorm statistics as they were
            model.to(device).train()
            x = sample.to(device).detach().requires_grad_(True)
            return _split_ratio(lambda: loss(model(x)), x, weights, device, boundary=True, rounds=rounds)
    except Exception as e:
        if not out_of_memory(e):
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _split_ratio(run: Any, x: torch.Tensor, weights: Sequence[torch.Tensor], device: torch.device, *,
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
            sync([device])
            start = time.perf_counter()
            fn()
            sync([device])
            times[name] = min(times[name], time.perf_counter() - start)
    back = times["whole"] - times["forward"]
    # at least one backward's work, at most two (W walks the whole graph again): outside, it was noise
    return min(max(1.0, (times["split"] - times["forward"]) / back), 2.0) if back > 0 else 1.0


def _copy_seconds(t: torch.Tensor, pair: tuple[torch.device, torch.device]) -> float:
    times = []
    for _ in range(4):
        sync(pair)
        start = time.perf_counter()
        t.to(pair[1])
        sync(pair)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _on_cuda(devices: Sequence[torch.device]) -> list[torch.device]:
    """The distinct CUDA devices among ``devices``, in order."""
    return list(dict.fromkeys(d for d in devices if d.type == "cuda"))


@contextmanager
def peaks(devices: Sequence[torch.device]) -> Iterator[Callable[[], tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Measure the peak allocated and reserved bytes per CUDA device of the block, from a collected heap and an
    emptied cache (:func:`release`); the value yielded returns them once the block is done (empty on the CPU)."""
    cuda = _on_cuda(devices)
    release(cuda)
    for d in cuda:
        torch.cuda.reset_peak_memory_stats(d)
    yield lambda: (tuple(torch.cuda.max_memory_allocated(d) for d in cuda),
                   tuple(torch.cuda.max_memory_reserved(d) for d in cuda))


def release(devices: Sequence[torch.device]) -> None:
    """Give back what pipelines no longer referenced hold on ``devices``' GPUs: collect Python's cyclic garbage
    (a pipeline's captured graphs and their memory pools live as long as the pipeline object, which a reference
    cycle can keep until the collector runs), then empty the caching allocator's cache. Nothing on the CPU."""
    cuda = _on_cuda(devices)
    if cuda:
        gc.collect()
    for d in cuda:
        with torch.cuda.device(d):
            torch.cuda.empty_cache()


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says a GPU ran out of memory: PyTorch's error, or a library's (cuBLAS, cuDNN) failing to
    allocate its handle or workspace, which surfaces as a plain ``RuntimeError``."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("ALLOC_FAILED" in text or "out of memory" in text.lower())
