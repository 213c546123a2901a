"""ReplicatedPipeline: identical pipelines on groups of devices, each training on its share of the batch."""

from __future__ import annotations

import contextlib
import copy
import functools
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import BalanceError, DeviceError, MicroBatchError
from seqify.model.sequential import Sequential
from seqify.pipe.assemble import build
from seqify.pipe.config import PipeConfig
from seqify.pipe.executors.replay import Replay
from seqify.pipe.losses import Count, Weigher, reduction_of, scale_of, scaled
from seqify.pipe.microbatch import gather, scatter, sizes_of, split_like
from seqify.pipe.partition_copies import PartitionCopies
from seqify.pipe.partition_sums import PartitionSums
from seqify.pipe.pipeline import Pipeline, resolve_devices
from seqify.pipe.replica_layers import ReplicaLayers
from seqify.pipe.replica_optimizers import OptimizerFactory, ReplicaOptimizers, built_on
from seqify.pipe.replica_state import Statistics, copy_state, flattened_by_partition, share_gradients, sum_gradients
from seqify.pipe.side_streams import SideStreams
from seqify.pipe.transfer import refuse_meta

__all__ = ["ReplicatedPipeline", "replicated"]


class _Share:
    """Replica ``r``'s view of one step's weighed losses: its micro-batch ``i`` is the step's ``start + i``."""

    def __init__(self, weigh: Callable[[Any, int], torch.Tensor], start: int) -> None:
        self.weigh, self.start = weigh, start

    def __call__(self, out: Any, i: int) -> torch.Tensor:
        return self.weigh(out, self.start + i)


class ReplicatedPipeline(nn.Module):
    """A layout of ``stages x replicas`` devices: ``replicas`` identical pipelines (data parallelism over
    pipelines; one stage each is plain data parallelism), each on its own group of devices.

    A batch is split into one share per replica (by samples; sizes differ by at most one), each replica runs its
    share through its own pipeline and schedule, and every micro-batch's loss is weighed by its share of what the
    whole batch's loss divides by. The replicas' gradients are then summed into the first replica, so its
    ``.grad`` is what ``loss_fn(model(x), target).backward()`` on one device leaves (within float rounding: the
    sums run in another order), and BatchNorm running statistics are combined as one pipeline running all the
    micro-batches in turn would leave them.

    The first replica is the model: :meth:`parameters`, ``state_dict`` and ``pipe.model`` are its (clipping and
    checkpoints count each parameter once). The other replicas hold copies that take the first's parameters and
    buffers before their next step or forward, whenever they changed (an optimizer step, a loaded checkpoint).
    :meth:`step` and calling the pipeline work as on a :class:`Pipeline`; after ``pipe(x)`` in training, the
    gradients are summed when ``backward`` ends.

    Two ways to step: an optimizer built on ``pipe.parameters()`` updates the first replica, whose new state
    reaches the others before their next forward; ``pipe.optimizer(factory)`` (faster, DDP's way) builds one
    optimizer per replica, every replica receives the summed gradients and updates its own copy, and nothing is
    copied between steps. The second holds the optimizer's state on every replica's devices, as DDP does.
    """

    _others: list[Pipeline]  # a plain attribute (set with object.__setattr__): parameters() are the first's

    def __init__(self, replicas: Sequence[Pipeline]) -> None:
        super().__init__()
        if len(replicas) < 2:
            raise BalanceError("a replicated pipeline needs at least two replicas; use the Pipeline itself for one")
        self.pipeline = replicas[0]
        object.__setattr__(self, "_others", list(replicas[1:]))
        self._params = [list(p.partitions.parameters()) for p in replicas]
        # each replica's parameters and buffers as views of a few flat tensors per partition: copied between GPUs
        # in one call per partition
        self._parts = [flattened_by_partition(list(p.partitions)) for p in replicas]
        self._addresses = self._held()
        self._statistics = Statistics(self._statistics_modules())
        self._layers = ReplicaLayers([p.model for p in replicas])  # the others follow the first's modes
        streams = SideStreams()
        self._sums = PartitionSums(streams)
        self._copies = PartitionCopies(streams)
        self._versions: tuple[int, ...] | None = None
        # the optimizers that step every replica (pipe.optimizer): while one lives, every replica gets the sums
        self._stepping: weakref.WeakSet[ReplicaOptimizers] = weakref.WeakSet()
        # the first replica's .grad (and versions) as every replica received them; None: the others' may differ
        self._shared: list[tuple[torch.Tensor, int] | None] | None = None
        self._threads = all(p.devices[0].type == "cuda" for p in replicas)
        self._pool: ThreadPoolExecutor | None = None
        #: the PipeConfig seqify.tune chose or config= gave; None when built by hand
        self.config: PipeConfig | None = None
        self.training = replicas[0].training

    def _statistics_modules(self) -> list[list[nn.modules.batchnorm._NormBase]]:
        """Each replica's modules that keep running statistics, in the same order."""
        return [[m for m in p.partitions.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
                 and m.track_running_stats and m.running_mean is not None] for p in self.replicas]

    @property
    def replicas(self) -> list[Pipeline]:
        """Every replica's pipeline; the first holds the model."""
        return [self.pipeline, *self._others]

    @property
    def model(self) -> nn.Sequential:
        """The model: the first replica's layers."""
        return self.pipeline.model

    @property
    def devices(self) -> list[torch.device]:
        """Every replica's devices, the first replica's first."""
        return [d for p in self.replicas for d in p.devices]

    @property
    def input_device(self) -> torch.device:
        """Where a batch is best given: the first replica's first device (each share moves to its replica)."""
        return self.pipeline.input_device

    @property
    def output_device(self) -> torch.device:
        """Where the outputs and the step's loss are: the first replica's last device (targets may be anywhere)."""
        return self.pipeline.output_device

    @property
    def balance(self) -> list[int]:
        return list(self.pipeline.balance)

    @property
    def chunks(self) -> int:
        """Micro-batches per replica's share of a mini-batch."""
        return self.pipeline.chunks

    @property
    def schedule(self) -> Any:
        return self.pipeline.schedule

    @property
    def graphs(self) -> bool:
        return self.pipeline.graphs

    def __repr__(self) -> str:
        first = self.pipeline
        return (f"ReplicatedPipeline({len(self.replicas)} replicas x {max(first.placement) + 1} devices, "
                f"balance={list(first.balance)}, chunks={first.chunks}, schedule={first.schedule!r})")

    def train(self, mode: bool = True) -> ReplicatedPipeline:
        super().train(mode)
        for other in self._others:
            other.train(mode)
        return self

    def _sync(self) -> None:
        """Give the other replicas the first's parameters and buffers where they changed since the last time
        (running statistics a training forward left uncombined, with no backward after it, combined first)."""
        if self._changed():
            self._copy_state()

    def _changed(self) -> bool:
        """Whether the first replica's parameters or buffers changed since the others last took them (running
        statistics left uncombined are combined first); refuses a tensor replaced rather than updated."""
        self._statistics.combine()
        self._refuse_replaced()
        mine = [*self._params[0], *self.pipeline.partitions.buffers()]
        return tuple(t._version for t in mine) != self._versions

    def _refuse_replaced(self) -> None:
        """Refuse a tensor of the first replica replaced rather than updated in place."""
        if self._held() != self._addresses:
            raise DeviceError("a tensor of the replicated pipeline's model was replaced, not updated in place "
                              "(p.data = ..., a cast or a move of pipe.model): the other replicas would no longer "
                              "follow it. Update parameters in place (optimizers and load_state_dict do), or "
                              "build the pipeline again from the changed model")

    def _copy_state(self) -> None:
        """Every partition's state copied from the first replica into the others now."""
        copy_state([f for part in self._parts[0] for f in part], [[f for part in parts for f in part]
                                                                   for parts in self._parts[1:]])
        self._taken()

    def _taken(self) -> None:
        """The other replicas have (or will have before they read it) the first's state as it is now."""
        self._versions = tuple(t._version for t in [*self._params[0], *self.pipeline.partitions.buffers()])

    def _held(self) -> tuple[int, ...]:
        """Where the first replica's parameters and buffers are: inside its flat tensors while it holds them."""
        return tuple(t.data_ptr() for t in [*self._params[0], *self.pipeline.partitions.buffers()])

    def optimizer(self, factory: OptimizerFactory) -> ReplicaOptimizers:
        """An optimizer that steps every replica's copy on its own devices, as DDP's processes do: ``factory``
        (``lambda params: torch.optim.AdamW(params, lr=3e-4)``, or the optimizer's class) is called once per
        replica on that replica's parameters. Use it as the optimizer of ``pipe.parameters()``: schedulers,
        clipping, gradient scalers and checkpoints see the first replica's (the model's) groups and state.

        While it lives, each step leaves the whole batch's gradients in every replica's ``.grad`` (one all-reduce
        per partition beside the backward, where DDP reduces its buckets), and no state is copied between the
        replicas before the next step. Its state sits on every replica's devices (DDP's memory), where an
        optimizer of ``pipe.parameters()`` keeps it on the first replica's alone."""
        built = [built_on(factory, params, "the first replica's" if r == 0 else f"replica {r}'s")
                 for r, params in enumerate(self._params)]
        made = ReplicaOptimizers(self, built)
        self._stepping.add(made)
        return made

    def _forget_gradients(self) -> None:
        """The other replicas' ``.grad`` no longer follow the first's (its gradients were zeroed or replaced)."""
        self._shared = None

    def _step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Step each replica's optimizer (``optimizers[r]``: replica ``r``'s) from the same parameters and
        gradients: where the first's parameters changed since the others took them, they are copied first, and
        where its ``.grad`` is no longer what every replica received, it is copied to the others."""
        self._refuse_replaced()
        params = self._params[0]
        if self._versions is None or tuple(p._version for p in params) != self._versions[:len(params)]:
            self._copy_state()
        if not self._gradients_shared():
            share_gradients(self._params)
        work = [opt.step for opt in optimizers]
        try:
            self._run(work) if self._threads else [w() for w in work]
        except BaseException:
            self._versions = None  # some replicas may have stepped: all take the first's state again
            raise
        finally:
            self._shared = None
        assert self._versions is not None
        self._versions = tuple(p._version for p in params) + self._versions[len(params):]

    def _gradients_shared(self) -> bool:
        """Whether every replica's ``.grad`` still holds what the first's holds (as the step's all-reduce left)."""
        shared = self._shared
        if shared is None:
            return False
        for p, kept in zip(self._params[0], shared):
            if (p.grad is None) != (kept is None):
                return False
            if kept is not None and (p.grad is not kept[0] or kept[0]._version != kept[1]):
                return False
        return True

    def _received(self) -> None:
        """Every replica's ``.grad`` now holds the sums: remember the first's as they are."""
        self._shared = [None if p.grad is None else (p.grad, p.grad._version) for p in self._params[0]]

    def _apply(self, fn: Any, recurse: bool = True) -> ReplicatedPipeline:
        raise DeviceError("a replicated pipeline keeps the devices and dtype it was built with (.to(), .cuda(), "
                          ".half() would reach the first replica only): cast or move the model before "
                          "seqify.pipeline(..., replicas=...)")

    def _shares(self, carried: Any) -> list[Any]:
        """``carried`` cut into one share per replica, each on its replica's first device."""
        model = self.model
        names = model.input_names if isinstance(model, Sequential) else None
        shares = scatter(carried, len(self.replicas), names)
        if len(shares) < len(self.replicas):
            raise MicroBatchError(f"the batch has {len(shares)} samples but the pipeline has {len(self.replicas)} "
                                  "replicas, each needing at least one: use a larger batch or fewer replicas")
        return shares

    def _run(self, work: Sequence[Callable[[], Any]]) -> list[Any]:
        """Each replica's part of a step in a thread of its own (one host thread issuing every replica's kernels
        in turn would make the second GPU wait for the first's issue), with the caller's gradient and autocast
        modes; the first error raised once all have ended. Programs to capture are built before (a capture
        must not run beside another thread's CUDA work)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(work), thread_name_prefix="seqify-replica")
        modes = _modes()
        futures = [self._pool.submit(_in_modes, modes, p.devices[0], w) for p, w in zip(self.replicas, work)]
        wait(futures)
        return [f.result() for f in futures]

    def _after_training(self, summed: bool = False) -> None:
        """Sum the gradients into the first replica, unless ``summed`` already, and combine running statistics
        (after every replica ran)."""
        self._statistics.combine()
        if not summed:
            sum_gradients(self._params)

    def _summed_by_partition(self, replays: list[Replay | None], run: Callable[[], list[torch.Tensor]],
                             scaler: bool = False) -> tuple[list[torch.Tensor], bool]:
        """``run()``'s losses, with the gradients summed partition by partition beside the backward where every
        replica replays programs with flat sums (:class:`~seqify.pipe.partition_sums.PartitionSums`); whether
        they were (else they are summed after the step). Into every replica's ``.grad`` where replica optimizers
        step them, unless a gradient ``scaler`` will unscale the first's: torch's unscaling kernel leaves no new
        version on the gradients it rewrites, so the others take the first's at ``opt.step()`` instead."""
        ready = [r for r in replays if r is not None]
        if len(ready) < len(replays) or not PartitionSums.possible(ready):
            return run(), False
        everyone = bool(self._stepping) and not scaler and PartitionSums.everyone_possible(ready)
        self._sums.begin(ready, everyone=everyone)
        try:
            totals = run()
        except BaseException:
            self._sums.finish(hand=False)
            raise
        summed = self._sums.finish()
        if summed and everyone:
            self._received()
        return totals, summed

    def step(self, x: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
             reduction: str | None = None, denominator: Count | None = None,
             loss_scale: float | torch.Tensor | torch.amp.GradScaler | None = None) -> torch.Tensor:
        """One training step over every replica (see :meth:`Pipeline.step`, whose arguments these are): the
        loss of the whole batch, detached; the first replica's ``.grad`` holds the whole batch's gradients."""
        first = self.pipeline
        first._check_training()
        self._layers.follow()
        how = reduction_of(loss_fn, reduction, denominator)
        factor = scale_of(loss_scale, first.devices[-1])
        refuse_meta(target, "target", first.devices[-1])
        changed = self._changed()
        self._shared = None
        shares = self._shares(first._carried(x))
        share_targets = split_like(target, sizes_of(shares))
        whole = first._whole_step
        # every share moves to its replica now: a copy between GPUs made later would wait for the work queued before
        batches = [[p._transfer(s, p.devices[0])] if whole else p._micro_batches(s, stacklevel=3)
                   for p, s in zip(self.replicas, shares)]
        targets = [split_like(p._transfer(t, p.devices[-1]), sizes_of(b))
                   for p, t, b in zip(self.replicas, share_targets, batches)]
        weigh = Weigher(loss_fn, how, [t for ts in targets for t in ts], [n for b in batches for n in sizes_of(b)],
                        first._probes, unflatten=(lambda y: y) if whole else first._unflatten, scale=factor)
        weigh.place([p.devices[-1] for p, b in zip(self.replicas, batches) for _ in b])
        self._statistics.keep()
        starts = [sum(len(b) for b in batches[:r]) for r in range(len(batches))]
        work = [functools.partial(_whole_step, p, b[0], _Share(weigh, k)) if whole else
                functools.partial(p._train, b, t, _Share(weigh, k))
                for p, b, t, k in zip(self.replicas, batches, targets, starts)]
        # a loss probed on its first output decides its kind once: the replicas run in turn until it has
        threads = self._threads and weigh.kind != "probe"
        # built (and captured) before any replica runs: a capture must not run beside another thread's CUDA work
        replays = [p._prepare(p._micro_batches(b[0], stacklevel=3) if whole else b, step=not whole)
                   for p, b in zip(self.replicas, batches)]
        # the first's state reaches each other replica partition by partition, before its first forward there,
        # where every replica replays programs; else all of it now
        by_partition = changed and PartitionCopies.possible(replays, self._parts)
        if changed and not by_partition:
            self._copy_state()
        try:
            for p, replay in zip(self.replicas, replays):
                p._replayer.pinned = replay is not None
            if by_partition:
                self._copies.begin(self._parts, [r for r in replays if r is not None])
                self._taken()
            totals, summed = self._summed_by_partition(replays, lambda: self._run(work) if threads else
                                                       [w() for w in work],
                                                       scaler=isinstance(loss_scale, torch.amp.GradScaler))
        except BaseException:
            self._versions = None  # a step that failed may have left some partitions uncopied: all again
            raise
        finally:
            if by_partition:
                self._copies.finish()
            for p in self.replicas:
                p._replayer.pinned = False
        self._after_training(summed)
        total = sum(t.to(first.devices[-1]) for t in totals)
        assert isinstance(total, torch.Tensor)
        return total if factor is None else scaled(total, factor, inverse=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = self.pipeline
        model = self.model
        carried = model.flatten_inputs(*args, **kwargs) if isinstance(model, Sequential) else args[0]
        self._layers.follow()
        self._sync()
        if self.training and torch.is_grad_enabled():  # a backward may follow: the gradients are summed anew
            self._shared = None
        if self.training:  # BatchNorm updates its statistics in training mode, with gradients or without
            self._statistics.keep()
        shares = [p._transfer(s, p.devices[0]) for p, s in zip(self.replicas, self._shares(carried))]
        outs = [p._forward(s, stacklevel=6) for p, s in zip(self.replicas, shares)]
        last = first.devices[-1]
        moved = [o.to(last) if isinstance(o, torch.Tensor) else tuple(t.to(last) for t in o) for o in outs]
        out = gather(moved, model.output_spec.names if isinstance(model, Sequential) else None)
        if self.training:
            # BatchNorm's backward reads the running statistics its forward saw: they are combined, and the
            # gradients summed, when backward ends (at once where there is no backward to wait for)
            attached = _after_backward(out, self._after_training)
            if attached is None:
                self._statistics.combine()
            else:
                out = attached
        return first._unflatten(out)


_Modes = tuple[bool, list[tuple[str, bool, torch.dtype, bool]]]


def _modes() -> _Modes:
    """The caller's gradient mode and autocast state per device type (both are per thread)."""
    return torch.is_grad_enabled(), [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                                      torch.is_autocast_cache_enabled()) for kind in ("cuda", "cpu")]


def _in_modes(modes: _Modes, device: torch.device, fn: Callable[[], Any]) -> Any:
    """``fn()`` under the caller's ``modes``, with ``device`` current."""
    grad, casts = modes
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(grad))
        for kind, enabled, dtype, cache in casts:
            stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=cache))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        return fn()


def _whole_step(pipe: Pipeline, share: Any, loss_of: _Share) -> torch.Tensor:
    """Replica ``pipe``'s fill-drain step on its whole share (graphs replay its backward in order anyway)."""
    out = pipe._forward(share, stacklevel=4)
    loss = loss_of(pipe._unflatten(out), 0)
    loss.backward()
    return loss.detach()


class _SumAfterBackward(torch.autograd.Function):
    """The identity on the outputs; its backward asks autograd to call ``done`` when the whole backward ends."""

    @staticmethod
    def forward(ctx: Any, done: Callable[[], None], *outputs: torch.Tensor) -> Any:
        ctx.done = done
        return tuple(o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        torch.autograd.Variable._execution_engine.queue_callback(ctx.done)
        return (None, *grads)


def _after_backward(out: Any, done: Callable[[], None]) -> Any:
    """``out`` (a tensor or a tuple of them) with ``done`` called once the backward through it ends; None where
    no backward can run through it."""
    single = isinstance(out, torch.Tensor)
    tensors = (out,) if single else tuple(out)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    passed = _SumAfterBackward.apply(done, *tensors)
    return passed[0] if single else type(out)(passed) if not hasattr(out, "_fields") else type(out)(*passed)


def replicated(model: nn.Sequential, replicas: int, *, gpus: int | None = None, devices: Sequence[Any] | None = None,
               sample: Any = None, balance: Sequence[int] | str | None = None,
               **options: Any) -> ReplicatedPipeline:
    """``replicas`` pipelines of ``model`` over the devices ``gpus`` or ``devices`` name, cut into as many
    consecutive groups: what :func:`seqify.pipeline` builds with ``replicas > 1`` (the other options are
    :func:`~seqify.pipe.assemble.build`'s, for each replica; ``sample``, the whole batch, is cut into shares).
    The first replica is balanced as asked and the others get its balance, schedule and checkpointing."""
    placed = resolve_devices(gpus, devices, None)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise BalanceError(f"replicas={replicas!r}: give the number of data-parallel copies of the pipeline, a whole "
                           "number >= 1")
    if replicas == 1:
        raise BalanceError("replicas=1 is one pipeline: build it without replicas")
    if len(placed) % replicas:
        raise BalanceError(f"replicas={replicas} does not divide the {len(placed)} devices "
                           f"({', '.join(map(str, placed))}): each replica takes an equal group of them")
    if options.get("deferred_batch_norm"):
        raise BalanceError("deferred_batch_norm folds statistics over one pipeline's micro-batches; with replicas "
                           "use deferred_batch_norm=False (their running statistics are combined as one pipeline "
                           "running every micro-batch would leave them)")
    per = len(placed) // replicas
    groups = [placed[r * per:(r + 1) * per] for r in range(replicas)]
    share = _share(sample, replicas)
    copies = [copy.deepcopy(model) for _ in groups[1:]]
    first = build(model, devices=groups[0], balance=balance, sample=share, **options)
    same = {**options, "memory_cap": None, "schedule": first.schedule, "checkpoint": first.checkpoint}
    rest = [build(c, devices=g, balance=list(first.balance), sample=share, **same) for c, g in zip(copies, groups[1:])]
    return ReplicatedPipeline([first, *rest])


def _share(sample: Any, replicas: int) -> Any:
    """The first replica's share of ``sample``: every tensor's first ``1 / replicas`` samples."""
    if sample is None:
        return None
    return pytree.tree_map(lambda t: t[:max(1, t.size(0) // replicas)] if isinstance(t, torch.Tensor) and t.dim()
                           else t, sample)
