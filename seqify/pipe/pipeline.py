"""Pipeline: a Sequential's partitions on their devices, run over micro-batches by the executor a schedule needs."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from seqify.errors import BalanceError, BoundaryError, DeviceError, MemoryCapError, ScheduleError
from seqify.model.sequential import Sequential
from seqify.pipe.batchnorm import DeferredBatchNorm, one_sample
from seqify.pipe.config import PipeConfig
from seqify.pipe.executors.eager import Eager, checkpoint_stop
from seqify.pipe.executors.options import ReplayOptions
from seqify.pipe.executors.replay import Replay, run
from seqify.pipe.executors.replayed import GraphWarning, Replayer
from seqify.pipe.executors.scheduled import ScheduledStep
from seqify.pipe.inplace import INPUT, mutated_roots
from seqify.pipe.losses import Count, Probes, Weigher, reduction_of, scale_of, scaled
from seqify.pipe.memory import MemoryPlan, PartitionMemory, measure, parse_bytes, predict
from seqify.pipe.microbatch import gather, scatter, sizes_of, split_like
from seqify.pipe.moves import Placed
from seqify.pipe.placement import (
    CHECKPOINT,
    _check_chunks,
    place,
    resolve_devices,
)
from seqify.pipe.recompute import norms_of
from seqify.pipe.replica_optimizers import OptimizerFactory, built_on
from seqify.pipe.transfer import Transfer, refuse_meta
from seqify.schedule.actions import SCHEDULES, Schedule, ahead, make, v_shape

__all__ = ["Pipeline", "resolve_devices", "GraphWarning", "CHECKPOINT"]


class Pipeline(Placed):
    """A model split into partitions on devices, run as a GPipe pipeline over micro-batches.

    Call it like the model: inputs go to the first device (moved there if needed), outputs come back
    on the last device with the structure the source model returns. Training uses autograd as usual:
    ``loss = f(pipe(x)); loss.backward()`` (fill-drain), or lets the pipeline own the loss and follow
    its schedule (1F1B, interleaved, zero bubble): ``loss = pipe.step(x, target, f)``.

    Behind it: :func:`~.placement.place` (partitions on devices, skip routes), the eager executor
    (:class:`~.eager.Eager`), the replay executor (:class:`~.replayed.Replayer`, CUDA graphs) and the
    scheduled step (:class:`~.scheduled.ScheduledStep`), all reading one
    :class:`~.schedule.Schedule`.
    """

    model: nn.Sequential  # a plain attribute (set with object.__setattr__): the partitions register the layers

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        devices: Sequence[torch.device],
        *,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        graphs: bool = False,
        plan: Any = None,
        schedule: str | Schedule = "gpipe",
        placement: Sequence[int] | None = None,
        overlap: bool = False,
        replay_options: ReplayOptions | None = None,
    ) -> None:
        super().__init__()
        if checkpoint not in CHECKPOINT:
            raise BalanceError(f"checkpoint={checkpoint!r}: choose one of {CHECKPOINT}")
        if graphs and deferred_batch_norm:
            raise BalanceError(
                "graphs=True replays captured CUDA graphs, which run no Python per micro-batch, and deferred "
                "BatchNorm folds statistics in Python after the last micro-batch: use deferred_batch_norm=False"
            )
        if graphs and any(torch.device(d).type != "cuda" for d in devices):
            raise DeviceError("graphs=True needs every partition on a CUDA device")
        if overlap and not graphs:
            raise BalanceError("overlap=True replays a step's captured CUDA graphs on two streams per GPU: pass "
                               "graphs=True with it (or leave overlap off)")
        chunks = _check_chunks(chunks)
        placed = place(model, balance, devices, chunks=chunks, deferred_batch_norm=deferred_batch_norm, graphs=graphs)
        parts = placed.partitions
        self.skip_partitions = placed.skip_partitions
        self.partitions = nn.ModuleList(parts)
        object.__setattr__(self, "model", model)
        self.devices = list(devices)
        self.balance = placed.balance
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.plan = plan
        self.stages = placed.stages
        self.ties = placed.ties
        self._norms = [norms_of(p) for p in parts]
        self._snapshot: tuple[tuple[int, ...], list[tuple[list[torch.Tensor], list[torch.Tensor]]]] | None = None
        # Modules whose running statistics a training forward updates: restored when a step raises.
        self._statistics = list({
            id(m): m for p in parts for m in p.modules()
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
        }.values())
        self._deferred = [m for p in parts for m in p.modules() if isinstance(m, DeferredBatchNorm)]
        self._transfer = Transfer()
        self.on_transfer: Callable[[str, str, int, int, int], None] | None = None
        self._eager = Eager(self.stages, self._transfer, self.skip_partitions, self._norms, self._deferred)
        self.placement = _placement(placement, self.devices)
        self._replayer = Replayer(self.stages, self.devices, self._transfer, self.partitions.parameters, graphs,
                                  self.placement, overlap, replay_options)
        self._stepper = ScheduledStep(self.stages, self._transfer, self._norms, self._deferred)
        if not isinstance(schedule, Schedule) and schedule not in SCHEDULES:
            raise ScheduleError(f"schedule={schedule!r}: choose one of {SCHEDULES} or pass a Schedule")
        if isinstance(schedule, str):
            make(schedule, self.placement, 1)  # refuse a layout the schedule cannot run now, not at the first step
        self.schedule = schedule
        self._schedules: dict[int, Schedule] = {}
        self._memory: tuple[Any, list[PartitionMemory]] | None = None
        self.training = model.training
        # A model that may modify its input in place gets micro-batches that are copies: views of one
        # tensor share autograd's version counter, so one micro-batch's change would invalidate what
        # another saved for backward (and the caller's tensor stays as it was).
        self._copy_input = INPUT in mutated_roots(list(model._modules.values()))
        #: the PipeConfig seqify.tune chose (chunks="auto") or config= gave; None when chosen by hand
        self.config: PipeConfig | None = None
        self._probes = Probes()  # how undeclared losses given to step reduce, found once per loss and layout
        self._said_clamped = False

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        self._chunks = _check_chunks(value)

    @property
    def overlap(self) -> bool:
        """Whether ``pipe.step``'s captured graphs run forwards and backwards on two streams per GPU."""
        return self._replayer.overlap

    @property
    def input_device(self) -> torch.device:
        return self.devices[0]

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1]

    def __repr__(self) -> str:
        parts = ", ".join(f"{b} on {d}" for b, d in zip(self.balance, self.devices))
        schedule = self.schedule if isinstance(self.schedule, str) else self.schedule.name
        more = "" if schedule == "gpipe" else f", schedule={schedule!r} (pipe.step)"
        more += ", graphs=True" + (", overlap=True" if self.overlap else "") if self.graphs else ""
        text = f"Pipeline([{parts}], chunks={self.chunks}, checkpoint={self.checkpoint!r}{more})"
        config = getattr(self, "config", None)
        if config is None:
            return text
        return f"{text}\n{'tuned' if config.batch else 'configured'}: {config}"

    def train(self, mode: bool = True) -> Pipeline:
        super().train(mode)
        self.model.train(mode)
        return self

    def optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """``factory(pipe.parameters())``, checked: the optimizer every layout builds the same way (a replicated
        pipeline builds one per replica, see :meth:`seqify.ReplicatedPipeline.optimizer`). ``factory``: a function
        that builds the optimizer on the parameters it is given, or the optimizer's class."""
        return built_on(factory, list(self.parameters()), "the pipeline's")

    # A placed pipeline does not move (moves.Placed): its balance, transfers and streams are per device.
    def _placed(self) -> list[torch.device]:
        return list(map(torch.device, self.devices))

    def _applied(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The source's unused state converted too, and the caches of the old tensors dropped."""
        if isinstance(self.model, Sequential):
            self.model._unused._apply(fn)
        self._snapshot, self._memory = None, None
        self._replayer.built = None

    # The replay executor's state, under the names it has always had.
    @property
    def graphs(self) -> bool:
        """Whether training steps replay captured CUDA graphs (False once capturing failed)."""
        return self._replayer.graphs

    @graphs.setter
    def graphs(self, value: bool) -> None:
        self._replayer.graphs = value

    @property
    def graph_error(self) -> str | None:
        """Why capturing CUDA graphs failed (a traceback), or None."""
        return self._replayer.error

    @property
    def _replay_eager(self) -> bool:  # tests: drive the step as graphs would, with eager programs (any device)
        return self._replayer.eager

    @_replay_eager.setter
    def _replay_eager(self, value: bool) -> None:
        self._replayer.eager = value

    @property
    def _graphed(self) -> tuple[Any, Replay] | None:
        return self._replayer.built

    def _checkpoint_stop(self, micro_batches: int) -> int:
        return checkpoint_stop(self.checkpoint, micro_batches)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if isinstance(model, Sequential):
            carried = model.flatten_inputs(*args, **kwargs)
        elif len(args) == 1 and not kwargs:
            carried = args[0]
        else:
            raise BoundaryError("a plain nn.Sequential pipeline takes one argument: a tensor or a tuple of tensors")
        return self._unflatten(self._forward(carried, stacklevel=6))  # under nn.Module.__call__ and _call_impl

    def _forward(self, carried: Any, stacklevel: int) -> Any:
        """The flat outputs of the flat inputs ``carried``, on the last device."""
        model = self.model
        batches = self._micro_batches(carried, stacklevel=stacklevel)
        sizes = sizes_of(batches)  # the executor reuses the list
        saved = self._save_statistics() if self._statistics else None
        try:
            replay = self._replayer.programs(batches, self.training, stop=self._checkpoint_stop(len(batches)))
            if replay is not None:
                return run(replay, [(b,) if isinstance(b, torch.Tensor) else tuple(b) for b in batches])
            return gather(self._run(batches), model.output_spec.names if isinstance(model, Sequential) else None)
        except BaseException as e:
            if saved:
                self._restore_statistics(saved)
            self._refuse_one_sample(e, sizes)
            raise

    def _micro_batches(self, carried: Any, stacklevel: int) -> list[Any]:
        """The flat input on the first device, split into micro-batches (copies where the model changes its
        input in place); a meta tensor refused first, and a batch below ``chunks`` said once (a warning
        ``stacklevel`` frames up: the caller's line)."""
        model = self.model
        names = model.input_names if isinstance(model, Sequential) else None
        refuse_meta(carried, "the pipeline's input", self.devices[0], names() if names is not None else None)
        batches = scatter(self._transfer(carried, self.devices[0]), self.chunks, names)
        if len(batches) < self.chunks and not self._said_clamped:
            self._said_clamped = True
            warnings.warn(f"chunks={self.chunks} but the batch has {len(batches)} samples: the pipeline runs "
                          f"{len(batches)} micro-batches of one sample (chunks above the batch size are clamped)",
                          stacklevel=stacklevel)
        if self._copy_input:
            batches = [b.clone() if isinstance(b, torch.Tensor) else tuple(t.clone() for t in b) for b in batches]
        return batches

    def _refuse_one_sample(self, error: BaseException, sizes: list[int]) -> None:
        """Raise a :class:`MicroBatchError` from torch's refusal of a one-sample micro-batch in BatchNorm."""
        better = one_sample(error, self.model, self.chunks, sizes)
        if better is not None:
            raise better from error

    def schedule_for(self, micro_batches: int) -> Schedule:
        """The pipeline's schedule for this many micro-batches (built once per count)."""
        got = self._schedules.get(micro_batches)
        if got is None:
            got = self._schedules[micro_batches] = make(self.schedule, self.placement, micro_batches)
        return got

    def step(self, x: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
             reduction: str | None = None, denominator: Count | None = None,
             loss_scale: float | torch.Tensor | torch.amp.GradScaler | None = None) -> torch.Tensor:
        """One training step that owns the loss: forward, ``loss_fn(output, target)`` per micro-batch and
        backward, in the order of the pipeline's schedule. Gradients accumulate in ``.grad`` as
        ``loss_fn(model(x), target).backward()`` on one device would leave them; returns that loss, detached.

        Each micro-batch's loss is weighed by its share of what ``loss_fn`` divides by over the whole batch,
        so the weighed losses add up to one device's loss:

        - torch's losses say it themselves: cross entropy and NLL (modules, ``F.cross_entropy``,
          ``functools.partial`` of it) divide by the class weights of the targets other than
          ``ignore_index`` (their count without ``weight=``), label smoothing included; the others by
          samples or elements; ``reduction='sum'`` adds.
        - ``denominator``: a function of a micro-batch's target returning what ``loss_fn`` divides by on it
          (a number or a one-element tensor), for a loss whose divisor the data decides, such as a masked
          mean: ``denominator=lambda t: (t != pad).sum()``. A micro-batch whose denominator is 0 adds
          nothing (``loss_fn`` is not called on it).
        - ``reduction`` ('mean' over samples or 'sum'), or a ``.reduction`` attribute, is trusted as said.
        - Otherwise (a plain function) ``loss_fn`` is probed once per loss and output and target layout, on
          the first micro-batch's detached output without gradients, the RNG kept: pieces of it paired with
          the step's targets, put together, must give the sum of their losses or their mean by samples.
          A loss that is neither (a divisor the data decides, a loss that mixes samples) raises
          :class:`~seqify.LossError`, which says to pass ``denominator=`` or ``reduction=``.

        ``loss_scale`` makes backward run on the loss times a factor, as ``(loss * s).backward()`` would: a
        number (``1 / k`` to average gradients accumulated over ``k`` steps) or a ``torch.amp.GradScaler``
        (its current scale, as ``scaler.scale(loss).backward()``; then ``scaler.unscale_``, ``scaler.step`` and
        ``scaler.update`` as usual). The loss returned is the unscaled one.
        """
        self._check_training()
        how = reduction_of(loss_fn, reduction, denominator)
        factor = scale_of(loss_scale, self.devices[-1])
        carried = self._carried(x)
        refuse_meta(target, "target", self.devices[-1])
        if self._whole_step:
            out = self(*x) if isinstance(x, tuple) and isinstance(self.model, Sequential) else self(x)
            loss = loss_fn(out, self._transfer(target, self.devices[-1]))
            (loss if factor is None else scaled(loss, factor)).backward()
            return loss.detach()
        batches = self._micro_batches(carried, stacklevel=3)
        targets = split_like(self._transfer(target, self.devices[-1]), sizes_of(batches))
        weigh = Weigher(loss_fn, how, targets, sizes_of(batches), self._probes, unflatten=self._unflatten,
                        scale=factor)
        total = self._train(batches, targets, weigh)
        return total if factor is None else scaled(total, factor, inverse=True)

    def _check_training(self) -> None:
        if not (self.training and torch.is_grad_enabled()):
            raise ScheduleError("pipe.step trains: call pipe.train() and run it with gradients enabled (not under "
                                "torch.no_grad()); for inference call pipe(x)")

    def _carried(self, x: Any) -> Any:
        """``x`` as the flat values the pipeline carries (a plain nn.Sequential's one value as it is)."""
        model = self.model
        if not isinstance(model, Sequential):
            return x
        return model.flatten_inputs(*x) if isinstance(x, tuple) else model.flatten_inputs(x)

    def _unflatten(self, y: Any) -> Any:
        model = self.model
        return model.unflatten_outputs(y) if isinstance(model, Sequential) else y

    @property
    def _whole_step(self) -> bool:
        """Whether ``step`` runs the forward whole and ``loss.backward()`` (fill-drain with graphs, whose
        replayed backward follows the forward's order anyway)."""
        return self.schedule == "gpipe" and (self.graphs or self._replay_eager)

    def _prepare(self, batches: list[Any], step: bool) -> Replay | None:
        """Build now, and capture where graphs are on, the programs a step (``step``) or a forward of these
        micro-batches replays (a capture must not run beside another thread's CUDA work); None where it runs
        eagerly."""
        if step and _input_grads(batches):
            return None
        schedule = self.schedule_for(len(batches)) if step else None
        return self._replayer.programs(batches, self.training, schedule, self._checkpoint_stop(len(batches)))

    def _train(self, batches: list[Any], targets: list[Any], loss_of: Callable[[Any, int], torch.Tensor]
               ) -> torch.Tensor:
        """Forward and backward of ``batches`` in the schedule's order, ``loss_of(output, i)`` on each last output;
        the sum of those losses. Running statistics are left as they were when it raises."""
        sizes = sizes_of(batches)
        schedule = self.schedule_for(len(batches))
        saved = self._save_statistics() if self._statistics else None
        try:
            replay = None if _input_grads(batches) else self._replayer.programs(
                batches, self.training, schedule, self._checkpoint_stop(len(batches)))
            if replay is not None:
                flat = [(b,) if isinstance(b, torch.Tensor) else tuple(b) for b in batches]
                return replay.train(flat, targets, loss_of)
            return self._stepper(schedule, batches, loss_of, self._checkpoint_stop(len(batches)))
        except BaseException as e:
            if saved:
                self._restore_statistics(saved)
            self._refuse_one_sample(e, sizes)
            raise

    def plan_memory(self, sample: Any, *, schedule: str | Schedule | None = None,
                    checkpoint: str | None = None) -> MemoryPlan:
        """Predicted peak bytes per device (the schedule's device numbers) for training on the mini-batch
        ``sample`` with ``schedule`` and ``checkpoint`` (default: the pipeline's own), from the bytes
        one micro-batch keeps for backward in each partition (measured once, running statistics left as
        they were) times what the schedule keeps in flight, and the gradients once (after a replayed step
        ``.grad`` views the sums its programs add into). Optimizer state is not included."""
        checkpoint = checkpoint or self.checkpoint
        if checkpoint not in CHECKPOINT:
            raise BalanceError(f"checkpoint={checkpoint!r}: choose one of {CHECKPOINT}")
        model = self.model
        carried = model.flatten_inputs(*sample) if isinstance(model, Sequential) and isinstance(sample, tuple) else (
            model.flatten_inputs(sample) if isinstance(model, Sequential) else sample)
        batches = scatter(self._transfer(carried, self.devices[0]), self.chunks,
                          model.input_names if isinstance(model, Sequential) else None)
        key = tuple((tuple(t.shape), t.dtype) for t in ((batches[0],) if isinstance(batches[0], torch.Tensor)
                                                          else batches[0]))
        if self._memory is None or self._memory[0] != key:
            self._memory = (key, measure(self.stages, batches[0]))
        built = make(schedule if schedule is not None else self.schedule, self.placement, len(batches))
        if self.overlap and self.graphs:  # two lanes issue each forward a run earlier (one more in flight)
            built = ahead(built)
        return predict(self._memory[1], built, checkpoint)

    def fit_memory(self, cap: int | float | str, sample: Any) -> MemoryPlan:
        """Pick the fastest schedule and checkpointing whose predicted peak fits ``cap`` on every device
        and switch to them; raise :class:`MemoryCapError` naming the smallest cap any choice fits."""
        limit = parse_bytes(cap)
        loops = len(self.placement) // (max(self.placement) + 1)
        names: list[str | Schedule]
        if self.placement == v_shape(max(self.placement) + 1) and loops == 2:
            names = ["zb-h1"]
        elif loops > 1:
            names = ["interleaved", "gpipe"]
        else:
            names = ["zb-h2", "zb-h1", "1f1b", "gpipe"]
        if isinstance(self.schedule, Schedule) or self.schedule in names:  # the caller's choice first
            names = [self.schedule] + [n for n in names if n != self.schedule]
        plans = [self.plan_memory(sample, schedule=n, checkpoint=c)
                 for c in ("never", "except_last", "always") for n in names]
        for plan, name in zip(plans, names * 3):
            if plan.peak <= limit:
                self.schedule, self.checkpoint = name, plan.checkpoint
                self._schedules.clear()
                return plan
        best = min(plans, key=lambda p: p.peak)
        raise MemoryCapError(
            f"memory_cap={cap!r} ({limit} bytes) is below every predicted peak; the smallest cap that works is "
            f"{best.peak} bytes ({best}). Raise memory_cap to at least that, add devices or use more chunks "
            "(optimizer state is not counted)"
        )

    def _save_statistics(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]] | None:
        """Copy the running statistics this forward may update, once per mini-batch (not per micro-batch),
        into copies kept from step to step: one fused copy per device and dtype."""
        live = [t for m in self._statistics if m.training for t in m._buffers.values() if t is not None]
        if not live:
            return None
        key = tuple(map(id, live))
        if self._snapshot is None or self._snapshot[0] != key:
            groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for t in live:
                group = groups.setdefault((t.device, t.dtype), ([], []))
                group[0].append(t)
                group[1].append(torch.empty_like(t))
            self._snapshot = (key, list(groups.values()))
        with torch.no_grad():
            for tensors, copies in self._snapshot[1]:
                torch._foreach_copy_(copies, tensors)
        return self._snapshot[1]

    @staticmethod
    def _restore_statistics(saved: list[tuple[list[torch.Tensor], list[torch.Tensor]]]) -> None:
        """A step that raised leaves running statistics as they were before it (partitions that already ran
        some micro-batches had updated theirs)."""
        with torch.no_grad():
            for tensors, copies in saved:
                torch._foreach_copy_(tensors, copies)

    def _fall_back(self, error: Exception) -> None:
        """Run eagerly from now on (see :meth:`Replayer.fall_back`)."""
        self._replayer.fall_back(error)

    def _run(self, values: list[Any]) -> list[Any]:
        return self._eager.forward(values, self._checkpoint_stop(len(values)), self.on_transfer)


def _input_grads(batches: list[Any]) -> bool:
    """Whether an input of a step wants its gradient (adversarial training, input attributions): a step's fixed
    programs copy their inputs into buffers of their own, so such a step runs eagerly, where it reaches them."""
    values = (v for b in batches for v in ((b,) if isinstance(b, torch.Tensor) else b))
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _placement(placement: Sequence[int] | None, devices: Sequence[torch.device]) -> tuple[int, ...]:
    """Which pipeline device (0..d-1) each partition runs on: given, or one partition per device."""
    if placement is None:
        return tuple(range(len(devices)))
    placement = tuple(placement)
    if len(placement) != len(devices) or set(placement) != set(range(max(placement, default=-1) + 1)):
        raise ScheduleError(f"placement {placement}: give each of the {len(devices)} partitions a device number "
                            "0..d-1, every number used")
    return placement
