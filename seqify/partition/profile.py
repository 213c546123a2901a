"""Profile: each layer's measured forward+backward time and memory on a device, the model left as it was."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqify.errors import SeqifyError
from seqify.partition.errors import BalanceError
from seqify.partition.walk import Layers, Skips, apply, fresh, nbytes, roots, saved_bytes
from seqify.progress import progress as bar
from seqify.skip.namespace import SkipKey
from seqify.skip.tracker import SkipTracker, use_tracker

__all__ = ["Profile", "profile", "device_of"]


@dataclass(frozen=True)
class Profile:
    """Per layer on ``device``: forward+backward seconds (the least run), peak, saved and output bytes."""

    device: torch.device
    times: tuple[float, ...]
    peak_bytes: tuple[int, ...]
    saved_bytes: tuple[int, ...]
    output_bytes: tuple[int, ...]
    skip_bytes: Mapping[SkipKey, int]
    host_times: tuple[float, ...] = ()  # CUDA: seconds the host takes to issue each layer's forward+backward


@dataclass
class _Step:
    output: Any
    tracker: SkipTracker
    seconds: float
    queued: float
    peak: int


def device_of(device: str | torch.device | None) -> torch.device:
    """The device to profile on: CPU when ``None``; ``cuda`` means the current CUDA device."""
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BalanceError(
                f"device={str(device)!r} but CUDA is not available here; profile with device='cpu' or balance "
                "by='flops'"
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def profile(
    layers: Layers,
    first: Any,
    device: str | torch.device | None = None,
    *,
    repeats: int = 3,
    progress: bool = False,
) -> Profile:
    """Run each layer's forward and backward on ``device``, in order, with the skips it pops.

    Every layer gets fresh inputs that require grad (non-leaf, so in-place layers work); gradients are
    taken with ``torch.autograd.grad`` so no ``.grad`` is written; buffers (BatchNorm running stats,
    ``num_batches_tracked``) are restored afterwards and the global RNG state is left as it was. Layers
    not on ``device`` run as copies moved there. Time is the least of ``repeats`` runs after one
    measuring run, since an interruption only adds time (on an H200, as a median of two runs, up to 11 of
    ResNet-101's 345 layers per profile took 2 to 93 times their usual time; as the least, none over 1.14). It is
    wall-clock on CPU; on CUDA the GPU time between two events, with the GPU held busy
    (``torch.cuda._sleep``) while the layer's kernels are queued, so that the per-call launch and
    synchronisation overhead a pipeline hides is not counted; the host's seconds to issue the layer are
    kept apart (``host_times``: what an eager pipeline pays per layer call). Peak bytes are the CUDA
    allocator's peak above the layer's start (on CPU, the bytes autograd saves for backward).
    """
    if repeats < 1:
        raise BalanceError(f"repeats={repeats}: profile each layer at least once")
    dev = device_of(device)
    cuda = dev.type == "cuda"
    snapshot = _snapshot(layers.modules)
    skips = Skips()
    times: list[float] = []
    host: list[float] = []
    peaks: list[int] = []
    saved: list[int] = []
    outputs: list[int] = []
    try:
        with torch.random.fork_rng(devices=[dev] if cuda else []), torch.cuda.device(dev) if cuda else nullcontext():
            rate = _cycles_per_second(dev) if cuda else 0.0
            x = apply(lambda t: t.to(dev), first)
            for i, layer in enumerate(bar(layers.modules, len(layers), f"seqify profile ({dev})", progress)):
                module = layer if _on(layer, dev) else copy.deepcopy(layer).to(dev)
                pack, kept = saved_bytes(module)
                try:
                    step = _step(module, layer, x, skips, dev, pack, 0)
                    hold = int(rate * min(max(2 * step.queued, 2e-4), 0.05))  # GPU busy while we queue
                    runs = [_step(module, layer, x, skips, dev, None, hold) for _ in range(repeats)]
                except torch.OutOfMemoryError as e:
                    raise BalanceError(
                        f"{layers.describe(i)} runs out of memory on {dev} while profiling; profile with a "
                        "smaller sample batch or balance by='flops' (no device needed)"
                    ) from e
                except SeqifyError:
                    raise
                except Exception as e:
                    what = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                    raise BalanceError(
                        f"{layers.describe(i)} fails on the sample while profiling ({what}); check that the sample "
                        "fits the model (shape, dtype, batch size: BatchNorm in training needs more than one value "
                        "per channel), or balance by='params' (no sample needed)"
                    ) from e
                times.append(min(r.seconds for r in runs))
                # the host's time to issue it: the held runs' (the GPU spins meanwhile), unless a sync inside
                # the layer made them wait out the spin; the first, unheld run waited for its own work only
                host.append(min(step.queued, *(r.queued for r in runs)))
                peaks.append(step.peak if cuda else sum(kept.values()))
                saved.append(sum(kept.values()))
                outputs.append(nbytes(step.output))
                last = runs[-1]
                skips.keep(layer, last.tracker)
                x = apply(torch.Tensor.detach, last.output)
                del step, runs, last
                if torch.is_autocast_enabled(dev.type):
                    # autocast keeps each weight's cast until the caller's region ends, and the cast's autograd
                    # node keeps the weight: every profiled copy would stay on the device (a 7.2 B model's
                    # second profile ran out of 80 GB), and a later forward in the region would read a cast made
                    # before the weights changed
                    torch.clear_autocast_cache()
    finally:
        _restore(snapshot)
    return Profile(dev, tuple(times), tuple(peaks), tuple(saved), tuple(outputs), dict(skips.bytes),
                   tuple(host) if cuda else ())


def _step(
    module: nn.Module,
    layer: nn.Module,
    x: Any,
    skips: Skips,
    dev: torch.device,
    pack: Callable[[torch.Tensor], torch.Tensor] | None,
    hold: int,
) -> _Step:
    """One forward and backward of ``module`` on fresh inputs; ``pack`` sees what autograd saves.

    On CUDA with ``hold`` > 0 the GPU first spins for ``hold`` cycles, so the layer's kernels are all
    queued before they run and the events between them time the GPU's work alone.
    """
    cuda = dev.type == "cuda"
    inputs, leaves = fresh(x)
    tracker, more = skips.tracker(layer)
    wrt = leaves + more + [p for p in module.parameters() if p.requires_grad]
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if pack is not None else nullcontext()
    base = 0
    events = None
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        if hold > 0:
            torch.cuda._sleep(hold)
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
    start = time.perf_counter()
    with use_tracker(tracker):
        with hooks:
            output = module(inputs)
        outs = roots(output, tracker)
        if outs and wrt:
            torch.autograd.grad(outs, wrt, grad_outputs=[torch.ones_like(t) for t in outs], allow_unused=True)
    queued = time.perf_counter() - start
    if events is not None:
        events[1].record()
    if cuda:
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - start
    if events is not None:
        seconds = events[0].elapsed_time(events[1]) / 1e3
    peak = torch.cuda.max_memory_allocated(dev) - base if cuda else 0
    return _Step(output, tracker, seconds, queued, max(peak, 0))


def _cycles_per_second(dev: torch.device) -> float:
    """How many ``torch.cuda._sleep`` cycles the current GPU spins per second (0 where it cannot spin)."""
    if not hasattr(torch.cuda, "_sleep"):
        return 0.0
    cycles = 1_000_000
    torch.cuda._sleep(cycles)  # warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize(dev)
    seconds = start.elapsed_time(end) / 1e3
    return cycles / seconds if seconds > 0 else 0.0


def _on(module: nn.Module, dev: torch.device) -> bool:
    return all(t.device == dev for t in list(module.parameters()) + list(module.buffers()))


def _snapshot(modules: tuple[nn.Module, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    seen: set[int] = set()
    saved = []
    for module in modules:
        for b in module.buffers():
            if id(b) not in seen:
                seen.add(id(b))
                saved.append((b, b.detach().clone()))
    return saved


def _restore(snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for buffer, value in snapshot:
            buffer.copy_(value)
