"""Pipeline: a GPipe executor that runs a Sequential's partitions on their devices over micro-batches."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import operator
import traceback
import warnings

import torch
from torch import nn

from ..errors import SeqifyError, BalanceError, BoundaryError, DeviceError, EmptyModelError, MetaDeviceError, SharedParameterError
from ..sequential import Sequential, meta_tensor
from ..skip.layout import routes
from ..skip.namespace import SkipKey
from .batchnorm import DeferredBatchNorm, defer_batch_norm
from .checkpoint import checkpointed, norms_of
from .inplace import INPUT, mutated_roots, written_tensors
from .microbatch import gather, is_tensors, scatter
from .replay import run
from .schedule import clock_cycles
from . import tied
from .stage import Stage
from .transfer import Transfer

__all__ = ["Pipeline", "pipeline", "resolve_devices", "GraphWarning"]


class GraphWarning(UserWarning):
    """CUDA graphs were asked for but could not be captured; the pipeline runs eagerly."""

CHECKPOINT = ("always", "except_last", "never")
STRATEGIES = ("time", "memory", "flops", "params")


def resolve_devices(gpus: int | None, devices: Sequence[Any] | None, partitions: int | None) -> list[torch.device]:
    """The device of every partition, from ``devices``, ``gpus`` or what the machine has."""
    if devices is not None and gpus is not None:
        raise DeviceError("pass either gpus=N or devices=[...], not both")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int)):
        raise DeviceError(f"gpus={gpus!r}: give a number of GPUs, or devices=[...]")
    if devices is not None:
        if isinstance(devices, (str, torch.device, int)):
            raise DeviceError(
                f"devices={devices!r}: give a list with one device per partition, e.g. devices=['cuda:0', "
                "'cuda:1'] or devices=['cpu', 'cpu']"
            )
        devices = list(devices)
        if not devices:
            raise DeviceError("devices=[] names no device; give one device per partition")
        out = []
        for d in devices:
            try:
                device = torch.device(f"cuda:{d}" if isinstance(d, int) else d)
            except (RuntimeError, TypeError, ValueError) as e:
                raise DeviceError(
                    f"{d!r} in devices is not a device ({(str(e).splitlines() or [''])[0]}); name devices like "
                    "'cuda:0', 'cuda:1' or 'cpu'"
                ) from None
            if device.type == "cuda":
                if not torch.cuda.is_available():
                    raise DeviceError(f"device {device} does not exist: CUDA is not available here; use devices=['cpu', ...]")
                index = device.index if device.index is not None else torch.cuda.current_device()
                if index >= torch.cuda.device_count():
                    raise DeviceError(
                        f"device {device} does not exist: this machine has {torch.cuda.device_count()} GPUs "
                        f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})"
                    )
                device = torch.device("cuda", index)
            elif device.type not in ("cpu",):
                raise DeviceError(f"device {device} is not supported: use CUDA devices or 'cpu'")
            out.append(device)
        return out
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus is not None:
        if gpus < 1:
            raise DeviceError(f"gpus={gpus}: ask for at least one GPU")
        if gpus > available:
            raise DeviceError(
                f"gpus={gpus} but this machine has {available} GPU{'s' if available != 1 else ''}; "
                "use fewer, or devices=['cpu', 'cpu'] to pipeline on the CPU"
            )
        return [torch.device("cuda", i) for i in range(gpus)]
    if available:
        return [torch.device("cuda", i) for i in range(partitions or available)][:available]
    if partitions:
        return [torch.device("cpu")] * partitions
    raise DeviceError("no GPU here: pass devices=['cpu', 'cpu'] (or a balance list) to pipeline on the CPU")


def _layer_names(model: nn.Sequential) -> list[str]:
    return list(model._modules)


def _counts(balance: Any, layers: int) -> list[int]:
    """``balance`` as a list of whole numbers (the counts are checked by :func:`_check_balance`)."""
    if isinstance(balance, (int, float, torch.Tensor)) or not hasattr(balance, "__iter__"):
        half = layers // 2
        raise BalanceError(
            f"balance={balance!r}: give a list of layer counts, one per partition (e.g. balance=[{layers - half}, "
            f"{half}] for this model's {layers} layers), or a strategy: one of {STRATEGIES}"
        )
    counts = []
    for b in balance:
        try:
            if isinstance(b, bool):
                raise TypeError
            counts.append(operator.index(b))
        except TypeError:
            raise BalanceError(f"balance={list(balance)!r}: every entry must be a whole number of layers, not {b!r}") from None
    return counts


def _check_chunks(chunks: Any) -> int:
    try:
        if isinstance(chunks, bool):
            raise TypeError
        value = operator.index(chunks)
    except TypeError:
        raise BalanceError(f"chunks={chunks!r}: give a whole number of micro-batches (>= 1)") from None
    if value < 1:
        raise BalanceError(f"chunks={chunks}: need at least one micro-batch")
    return value


def _check_balance(balance: Sequence[int], layers: int) -> list[int]:
    balance = _counts(balance, layers)
    if any(b < 1 for b in balance):
        raise BalanceError(f"balance {balance} has an empty partition; every partition needs at least one layer")
    if sum(balance) != layers:
        raise BalanceError(
            f"balance {balance} sums to {sum(balance)} but the model has {layers} layers; "
            "make the counts add up to the number of layers (or pass a strategy such as balance='params')"
        )
    return balance


def _check_meta(parts: list[nn.Sequential]) -> None:
    for j, part in enumerate(parts):
        name = meta_tensor(part)
        if name is not None:
            raise MetaDeviceError(
                f"layer {name.split('.')[0]!r} (partition {j}) holds {name} on the meta device (shapes, no data); a "
                "pipeline moves its layers to their devices, which needs data. Materialise the weights first: "
                "model.to_empty(device='cpu'), then initialise them or load a checkpoint "
                "(seq.load_original_state_dict(torch.load(path))), then pipeline the model."
            )


def _place(parts: list[nn.Sequential], devices: Sequence[torch.device]) -> None:
    """Move each partition to its device. A tensor several layers share stays one tensor per device; a
    read-only buffer that partitions on different devices read (a constant of the source's forward) gets a
    copy on each. A buffer that changes as the model runs (BatchNorm statistics, ``self.count += 1``) and
    that layers of different partitions use is refused, like a shared parameter: partitions run a
    micro-batch at different times (partition 0 is a micro-batch ahead), so a later partition would read
    it changed by later micro-batches, and on another device it would be a stale copy."""
    from ..convert.build import Tensors

    written = {id(t) for part in parts for layer in part for t in written_tensors(layer)}
    slots: dict[int, list[tuple[int, str, nn.Module, str, str]]] = {}
    for j, part in enumerate(parts):
        seen: set[tuple[int, str, str]] = set()
        for layer_name, layer in part.named_children():
            for m in layer.modules():
                for kind in ("_parameters", "_buffers"):
                    for name, t in getattr(m, kind).items():
                        if t is not None and (id(m), kind, name) not in seen:
                            seen.add((id(m), kind, name))
                            slots.setdefault(id(t), []).append((j, layer_name, m, kind, name))
    for tid, entries in slots.items():
        if len({j for j, *_ in entries}) < 2:
            continue
        changes = tid in written or any(not isinstance(m, Tensors) for _, _, m, _, _ in entries)
        if changes:
            a = entries[0]
            b = next(e for e in entries if e[0] != a[0])
            raise SharedParameterError(
                f"buffer {a[4]!r} is used by layer {a[1]!r} (partition {a[0]}, {devices[a[0]]}) and layer {b[1]!r} "
                f"(partition {b[0]}, {devices[b[0]]}) and may change as the model runs; partitions run each "
                "micro-batch at different times (and may sit on different devices), so such a buffer must stay in "
                "one partition. Change the balance so both layers land in one partition."
            )
    for part, device in zip(parts, devices):
        part.to(device)
    for entries in slots.values():
        if len(entries) < 2:
            continue
        first: dict[torch.device, torch.Tensor] = {}
        for j, _, m, kind, name in entries:
            getattr(m, kind)[name] = first.setdefault(devices[j], getattr(m, kind)[name])


class Pipeline(nn.Module):
    """A model split into partitions on devices, run as a GPipe pipeline over micro-batches.

    Call it like the model: inputs go to the first device (moved there if needed), outputs come back
    on the last device with the structure the source model returns. Training uses autograd as usual:
    ``loss = f(pipe(x)); loss.backward()``.
    """

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
    ) -> None:
        super().__init__()
        if checkpoint not in CHECKPOINT:
            raise BalanceError(f"checkpoint={checkpoint!r}: choose one of {CHECKPOINT}")
        if graphs and (checkpoint != "never" or deferred_batch_norm):
            raise BalanceError(
                "graphs=True replays captured CUDA graphs, which keep every micro-batch's activations and run "
                "no Python per micro-batch: use it with checkpoint='never' and deferred_batch_norm=False"
            )
        if graphs and any(torch.device(d).type != "cuda" for d in devices):
            raise DeviceError("graphs=True needs every partition on a CUDA device")
        chunks = _check_chunks(chunks)
        names = _layer_names(model)
        balance = _check_balance(balance, len(names))
        if len(devices) != len(balance):
            raise DeviceError(
                f"{len(balance)} partitions but {len(devices)} devices {list(map(str, devices))}; "
                "give one device per partition (repeat a device to put several partitions on it)"
            )
        found = routes(model)
        layers = list(model._modules.values())
        parts: list[nn.Sequential] = []
        start = 0
        for count in balance:
            parts.append(nn.Sequential(OrderedDict(zip(names[start:start + count], layers[start:start + count]))))
            start += count
        ties = tied.find(parts)  # parameters used across partitions: a copy per later partition (tied.py)
        tied.check(ties, parts, graphs)
        _check_meta(parts)
        part_of = [j for j, count in enumerate(balance) for _ in range(count)]
        with tied.unplugged(ties):
            _place(parts, devices)
        if deferred_batch_norm:
            parts = [defer_batch_norm(p, chunks) for p in parts]  # type: ignore[misc]
        pops: list[list[SkipKey]] = [[] for _ in parts]
        stashes: list[list[SkipKey]] = [[] for _ in parts]
        self.skip_partitions: dict[SkipKey, tuple[int, int]] = {}
        for r in found:
            a, b = part_of[r.stash], part_of[r.pop]
            if a != b:
                stashes[a].append(r.key)
                pops[b].append(r.key)
                self.skip_partitions[r.key] = (a, b)
        self.partitions = nn.ModuleList(parts)
        object.__setattr__(self, "model", model)
        self.devices = list(devices)
        self.balance = balance
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.plan = plan
        self.stages = [Stage(j, p, d, tuple(pops[j]), tuple(stashes[j])) for j, (p, d) in enumerate(zip(parts, devices))]
        tied.wrap(self.stages, ties)
        self.ties = ties
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
        self.graphs = graphs
        self._graphed: tuple[Any, Any] | None = None
        self.graph_error: str | None = None
        self._replay_eager = False  # tests: drive the step as graphs would, with eager programs (any device)
        self.training = model.training
        # A model that may modify its input in place gets micro-batches that are copies: views of one
        # tensor share autograd's version counter, so one micro-batch's change would invalidate what
        # another saved for backward (and the caller's tensor stays as it was).
        self._copy_input = INPUT in mutated_roots(layers)

    @property
    def chunks(self) -> int:
        """Micro-batches per mini-batch."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: int) -> None:
        self._chunks = _check_chunks(value)

    @property
    def input_device(self) -> torch.device:
        return self.devices[0]

    @property
    def output_device(self) -> torch.device:
        return self.devices[-1]

    def __repr__(self) -> str:
        parts = ", ".join(f"{b} on {d}" for b, d in zip(self.balance, self.devices))
        return f"Pipeline([{parts}], chunks={self.chunks}, checkpoint={self.checkpoint!r})"

    def train(self, mode: bool = True) -> Pipeline:
        super().train(mode)
        self.model.train(mode)
        return self

    def _checkpoint_stop(self, micro_batches: int) -> int:
        if not torch.is_grad_enabled():
            return 0
        return {"always": micro_batches, "except_last": micro_batches - 1, "never": 0}[self.checkpoint]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.model
        if isinstance(model, Sequential):
            carried = model.flatten_inputs(*args, **kwargs)
        elif len(args) == 1 and not kwargs:
            carried = args[0]
        else:
            raise BoundaryError("a plain nn.Sequential pipeline takes one argument: a tensor or a tuple of tensors")
        carried = self._transfer(carried, self.devices[0])
        batches = scatter(carried, self.chunks)
        if self._copy_input:
            batches = [b.clone() if isinstance(b, torch.Tensor) else tuple(t.clone() for t in b) for b in batches]
        saved = self._save_statistics() if self._statistics else None
        try:
            replay = self._replay(batches)
            if replay is not None:
                out = run(replay, [(b,) if isinstance(b, torch.Tensor) else tuple(b) for b in batches])
            else:
                out = gather(self._run(batches))
        except BaseException:
            if saved:
                self._restore_statistics(saved)
            raise
        return model.unflatten_outputs(out) if isinstance(model, Sequential) else out

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

    def _replay(self, batches: list[Any]) -> Any:
        """The step's programs for these micro-batches (built, and captured as CUDA graphs, on first use)."""
        if not ((self.graphs or self._replay_eager) and self.training and torch.is_grad_enabled()):
            return None
        from .replay import Unreplayable, build

        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda") if autocast else None
        key = (
            tuple(
                tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in ((v,) if isinstance(v, torch.Tensor) else v))
                for v in batches
            ),
            autocast,
            dtype,
            # programs read parameters at fixed addresses: .to(), .half() or new Parameters rebuild them
            tuple(p.data_ptr() for p in self.partitions.parameters()),
            # which inputs are one tensor (one buffer behind two slots)
            tuple(tuple(map(id, v)).index(id(t)) for v in batches if not isinstance(v, torch.Tensor) for t in v),
        )
        if self._graphed is None or self._graphed[0] != key:
            self._graphed = None  # let the old graphs' memory go first
            carried = None if isinstance(batches[0], torch.Tensor) else len(batches[0])
            flat = [(b,) if isinstance(b, torch.Tensor) else tuple(b) for b in batches]
            try:
                if self.ties:
                    raise Unreplayable("weights tied across partitions are copied per call; the step runs eagerly")
                with torch.autocast("cuda", dtype=dtype, cache_enabled=False, enabled=autocast):
                    replay = build(self.stages, flat, carried, self.graphs, self._transfer)
            except SeqifyError:
                raise
            except Exception as e:
                if not (self.graphs or isinstance(e, Unreplayable)):
                    raise
                self._fall_back(e)
                return None
            self._graphed = (key, replay)
        return self._graphed[1]

    def _fall_back(self, error: Exception) -> None:
        """Run eagerly from now on: some layers cannot be captured (host syncs, CPU tensors,
        data-dependent shapes) or the step cannot be fixed programs (non-tensor outputs, aliasing
        values changed in place). With graphs=True say so, once."""
        self.graph_error = traceback.format_exc()
        if self.graphs:
            self.graphs = False
            warnings.warn(
                f"seqify.pipeline(graphs=True): capturing CUDA graphs failed ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); running eagerly instead (pipe.graph_error has "
                "the trace)",
                GraphWarning,
                stacklevel=4,
            )
            for d in self.devices:
                torch.cuda.synchronize(d)
        self._replay_eager = False

    def _run(self, values: list[Any]) -> list[Any]:
        m, n = len(values), len(self.stages)
        stop = self._checkpoint_stop(m)
        for bn in self._deferred:
            bn.chunks = m
            bn._reset_tracking()
        pending: list[dict[SkipKey, tuple[Any, Any]]] = [{} for _ in range(m)]  # skip -> (value, ready)
        ready: list[Any] = [None] * m  # when micro-batch i's carried value is ready to copy
        transfer = self._transfer
        observe = self.on_transfer
        try:
            for cycle in clock_cycles(m, n):
                for i, j in cycle:
                    stage = self.stages[j]
                    x = values[i]
                    memo: dict[int, Any] | None = {} if stage.pops or type(x) is tuple else None
                    if j > 0:
                        if not is_tensors(x):
                            prev = self.stages[j - 1]
                            raise BoundaryError(
                                f"layer {prev.names[-1]!r}, the last of partition {j - 1}, returns "
                                f"{type(x).__name__}; only a tensor or a tuple of tensors can cross to partition {j}. "
                                "Move the cut (balance) so this value stays inside one partition, or convert with "
                                "example_inputs so seqify knows which values are tensors."
                            )
                        x = transfer(x, stage.device, ready[i], memo)
                        if observe is not None:
                            observe("carry", "", j - 1, j, i)
                    skips = {}
                    for key in stage.pops:
                        value, when = pending[i].pop(key)
                        skips[key] = transfer(value, stage.device, when, memo)
                        if observe is not None:
                            observe("skip", key[1], self.skip_partitions[key][0], j, i)
                    if i < stop:
                        y, out = checkpointed(stage.fresh, x, skips, norms=self._norms[j])
                    else:
                        y, out = stage(x, skips)
                    values[i] = y
                    ready[i] = transfer.mark(stage.device)
                    for key, value in out.items():
                        pending[i][key] = (value, ready[i])
        except BaseException:
            for bn in self._deferred:
                bn._reset_tracking()
            raise
        left = [k[1] for p in pending for k in p]
        if left:
            raise BoundaryError(f"skips {sorted(set(left))} were stashed but no later partition popped them")
        return values


def pipeline(
    model: nn.Module,
    *,
    gpus: int | None = None,
    devices: Sequence[Any] | None = None,
    chunks: int = 1,
    balance: Sequence[int] | str | None = None,
    checkpoint: str = "except_last",
    deferred_batch_norm: bool = False,
    graphs: bool = False,
    loops: int = 1,
    example_inputs: Any = None,
    sample: Any = None,
    **convert_options: Any,
) -> Pipeline:
    """Run ``model`` as a GPipe pipeline over GPUs (or CPU devices).

    Args:
        model: a seqify.Sequential, any nn.Sequential (hand-written skippable layers included), or any
            other module, which is converted first (``example_inputs`` and ``convert_options`` are passed
            to :func:`seqify.convert`).
        gpus / devices: ``gpus=N`` takes cuda:0..N-1; ``devices=[...]`` names one device per partition
            (CUDA or CPU; repeat a device to put several partitions on it). Default: every GPU, else
            one CPU device per partition of a ``balance`` list.
        chunks: micro-batches per mini-batch. A batch that does not divide evenly gets micro-batches
            whose sizes differ by one; more chunks than samples are clamped to the batch size.
        balance: layers per partition, or a strategy: 'time', 'memory', 'flops' or 'params' (see
            :func:`seqify.balance`). Default 'params'.
        checkpoint: 'except_last' (default), 'always' or 'never': which micro-batches recompute their
            activations in backward instead of keeping them. Only while gradients are enabled.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch, from all of its
            micro-batches, as training on one device would.
        graphs: on CUDA, capture each stage's forward and backward per micro-batch as CUDA graphs on the
            first training step of a given input shape, then replay them: no per-op launch overhead.
            Needs checkpoint='never'; inference and eval mode run eagerly. The whole step is then driven
            as fixed programs (no autograd per micro-batch); gradients reach ``.grad`` (not
            ``torch.autograd.grad``), and each forward's backward must come before the next forward.
        loops: partitions per device, placed round-robin: ``gpus=2, loops=2`` puts four partitions on
            cuda:0, cuda:1, cuda:0, cuda:1. With ``graphs=True`` each device runs all micro-batches of its
            first partition, then of its second (breadth-first), which shrinks the pipeline's idle time
            from one of ``chunks + 1`` slots to one of ``loops * chunks + 1``, at the cost of more
            transfers. A ``balance`` list then has ``loops`` entries per device.
        sample: an input batch (or micro-batch) for the 'time', 'memory' and 'flops' strategies;
            defaults to ``example_inputs``.

    Note: the pipeline moves the model's layers to their devices. Converted layers share modules with
    the source model, so its parameters move too; pipeline a ``copy.deepcopy`` to keep the source.
    """
    if not isinstance(model, nn.Sequential):
        from ..convert import convert

        model = convert(model, example_inputs, **convert_options)
    elif convert_options:
        raise BalanceError(f"options {sorted(convert_options)} apply to conversion, but the model is already a Sequential")
    layers = len(model)
    if layers == 0:
        raise EmptyModelError(f"the {type(model).__name__} has no layers; there is nothing to pipeline")
    _check_meta([model])
    chunks = _check_chunks(chunks)
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise BalanceError(f"loops={loops!r}: give the number of partitions per device, a whole number >= 1")
    if isinstance(balance, str) or balance is None:
        strategy = balance or "params"
        if strategy not in STRATEGIES:
            raise BalanceError(f"balance={strategy!r}: use a list of layer counts or one of {STRATEGIES}")
        placed = resolve_devices(gpus, devices, None) * loops
        if len(placed) > layers:
            raise BalanceError(f"{len(placed)} partitions but the model has only {layers} layers; use fewer devices")
        from ..partition import balance as make_plan

        probe = sample if sample is not None else example_inputs
        plan = make_plan(model, len(placed), sample=probe, by=strategy, device=placed[0])
        return Pipeline(model, plan.balance, placed, chunks=chunks, checkpoint=checkpoint,
                        deferred_batch_norm=deferred_batch_norm, graphs=graphs, plan=plan)
    counts = _counts(balance, layers)
    if len(counts) > layers:
        raise BalanceError(f"balance has {len(counts)} partitions but the model has only {layers} layers")
    if len(counts) % loops:
        raise BalanceError(
            f"balance has {len(counts)} partitions, not a multiple of loops={loops}: give loops partitions per device"
        )
    placed = resolve_devices(gpus, devices, len(counts) // loops) * loops
    return Pipeline(model, counts, placed, chunks=chunks, checkpoint=checkpoint,
                    deferred_batch_norm=deferred_batch_norm, graphs=graphs)
