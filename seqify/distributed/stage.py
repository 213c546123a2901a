"""DistributedStage: the partitions one torchrun rank holds of a pipeline, and stage() that builds it."""

from __future__ import annotations

import datetime
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from seqify.distributed.configured import stage_options
from seqify.distributed.eager import RankRun
from seqify.distributed.layout import layout_of, placement_for
from seqify.distributed.link import Books, Link, directions, leaves, peer
from seqify.distributed.materialize import BufferInit, converted, materialize
from seqify.distributed.rank import Route, crossing_routes
from seqify.distributed.replay import RankPrograms, program_step
from seqify.errors import BalanceError, BoundaryError, DeviceError
from seqify.model.sequential import Sequential
from seqify.model.stash_sizes import size_skips
from seqify.pipe import tied
from seqify.pipe.config import PipeConfig
from seqify.pipe.executors.options import ReplayOptions
from seqify.pipe.losses import Count, Probes, Weigher, reduction_of
from seqify.pipe.microbatch import gather, scatter
from seqify.pipe.moves import Placed
from seqify.pipe.placement import CHECKPOINT, _place
from seqify.pipe.recompute import norms_of
from seqify.pipe.replica_optimizers import OptimizerFactory, built_on
from seqify.pipe.stage import Stage
from seqify.pipe.transfer import refuse_meta
from seqify.schedule.actions import SCHEDULES, Action, Schedule, gpipe, make
from seqify.skip.namespace import SkipKey

if TYPE_CHECKING:
    from seqify.checkpoint.ranks import Share

__all__ = ["DistributedStage", "stage", "init", "SCHEDULES", "placement_for"]


def init(backend: str | None = None, timeout_s: float = 300.0) -> None:
    """``init_process_group`` from torchrun's environment: NCCL when CUDA is here, else gloo.

    The timeout bounds how long a rank waits for a peer that died, so no job hangs forever.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def _place_owned(model: nn.Sequential, balance: Sequence[int], owned: list[int],
                 device: torch.device) -> dict[int, nn.Sequential]:
    """This rank's partitions on ``device``, like ``.to(device)`` but keeping tensors layers share: a weight
    two of them share (a V's first and last: GPT-2's embedding and head) stays one parameter, used by both
    as the source uses it."""
    names, layers = list(model._modules), list(model._modules.values())
    starts = [sum(balance[:j]) for j in range(len(balance))]
    parts = {p: nn.Sequential(OrderedDict(zip(names[starts[p]:starts[p] + balance[p]],
                                              layers[starts[p]:starts[p] + balance[p]])))
             for p in owned}
    ties = tied.find(list(parts.values()))
    with tied.unplugged(ties):
        _place(list(parts.values()), [device] * len(parts))
    tied.home(ties, [device] * len(parts))
    return parts


class DistributedStage(Placed):
    """This process's partitions of a pipeline that spans processes.

    The pipeline's partitions are placed on its ranks by ``placement`` (one per rank by default;
    ``loops`` per rank round-robin, or in a V for 'zb-h1'). ``step(inputs, target, loss_fn)`` runs one
    mini-batch as this rank's share of a shared schedule (``seqify.schedule.actions``: 'gpipe', every
    forward then every backward; '1f1b', a backward after each forward once the pipeline is full, which
    bounds the activations kept; 'interleaved', 1F1B over several partitions per rank; 'zb-h1', backward
    split into input gradients, sent on at once, and weight gradients, run later in the bubbles; or a
    ``Schedule``). Values between partitions of one rank are handed over directly; between ranks they
    go point-to-point, skips straight from the stashing partition's rank to the popping one's. It
    returns the mini-batch loss on the rank holding the last partition and ``None`` elsewhere;
    gradients are left in this rank's parameters (and averaged over data-parallel replicas), ready for
    ``optimizer.step()``. ``replay_options`` (:class:`~seqify.pipe.executors.options.ReplayOptions`) go to
    the fixed programs of ``graphs=True``.
    """

    model: nn.Sequential  # a plain attribute (set with object.__setattr__): this rank registers only its layers
    _rebuild = "seqify.distributed.stage(model, device=...) in each process"

    def _placed(self) -> list[torch.device]:
        return [self.device]

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int],
        *,
        index: int,
        replica: int = 0,
        replicas: int = 1,
        device: torch.device,
        chunks: int = 1,
        checkpoint: str = "never",
        schedule: str | Schedule = "gpipe",
        graphs: bool = False,
        loops: int = 1,
        replay_options: ReplayOptions | None = None,
    ) -> None:
        super().__init__()
        names = list(model._modules)
        balance, placement = layout_of(balance, len(names), schedule, loops)
        ranks = max(placement) + 1
        if not 0 <= index < ranks:
            raise DeviceError(f"index={index}: this pipeline has ranks 0..{ranks - 1}")
        if checkpoint not in CHECKPOINT:
            raise BalanceError(f"checkpoint={checkpoint!r}: choose one of {CHECKPOINT}")
        tied.refuse_across_processes(model, balance, placement)
        self.placement = placement
        self.owned = [p for p, r in enumerate(placement) if r == index]
        parts = _place_owned(model, balance, self.owned, device)
        starts = [sum(balance[:j]) for j in range(len(balance))]
        layers = list(model._modules.values())
        # every layer of this rank, in model order: parameters(), state_dict() and checkpoints read it
        mine = sorted((starts[p] + k, names[starts[p] + k]) for p in self.owned for k in range(balance[p]))
        self.partition = nn.Sequential(OrderedDict((n, layers[k]) for k, n in mine))
        self.routes, self._key = crossing_routes(model, balance)
        # skips whose values are sizes (ints made from shapes): fixed programs hold them per micro-batch
        self.sized = frozenset(size_skips(layers))
        object.__setattr__(self, "model", model)
        self.balance = list(balance)
        self.index = index
        self.stages = ranks
        self.partitions = len(balance)
        self.loops = len(self.owned) if isinstance(schedule, Schedule) else loops
        self.replica = replica
        self.replicas = replicas
        self.device = device
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.schedule = schedule
        self._wire(parts, device)
        self._dp_group: Any = None
        # one process group per message direction (seqify.distributed.link.directions); None: the default group
        self._directions: tuple[Any, Any] | None = None
        self._plans: dict[int, Schedule] = {}  # per micro-batch count: built once
        self._books = Books()  # the last training step's messages: a steady step's receivers need not wait for headers
        self.graphs = graphs
        self.runner = self.runners[self.owned[0]]
        # graphs=True: each partition's micro-batches as fixed programs (dist_replay), one set per partition
        self._programs: dict[int, RankPrograms] = (
            {p: RankPrograms(r, device, graphs, sized=self.sized, options=replay_options)
             for p, r in self.runners.items()} if graphs else {})
        self._probes = Probes()  # how undeclared losses reduce, found once per loss and layout

    def _wire(self, parts: dict[int, nn.Sequential], device: torch.device) -> None:
        """A runner per owned partition, popping and stashing the skips that cross into and out of it, with
        its normalisation layers and trained parameters."""
        self.runners: dict[int, Stage] = {}
        self.norms: dict[int, list[nn.modules.batchnorm._NormBase]] = {}
        self.params: dict[int, list[nn.Parameter]] = {}
        for p, part in parts.items():
            pops = tuple(self._key[r.index] for r in self.routes if r.dst == p)
            stashes = tuple(self._key[r.index] for r in self.routes if r.src == p)
            self.runners[p] = Stage(p, part, device, pops, stashes)
            self.norms[p] = list(norms_of(part))
            self.params[p] = [w for w in part.parameters() if w.requires_grad]

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the first partition (it takes the inputs)."""
        return self.placement[0] == self.index

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the last partition (it takes the target and returns the loss)."""
        return self.placement[-1] == self.index

    def rank_of(self, stage_index: int) -> int:
        """The global rank of this replica's pipeline rank ``stage_index``."""
        return self.replica * self.stages + stage_index

    def rank_of_partition(self, partition: int) -> int:
        return self.rank_of(self.placement[partition])

    @property
    def global_rank(self) -> int:
        return self.rank_of(self.index)

    def skip_key(self, route: Route) -> SkipKey:
        return self._key[route.index]

    @property
    def me(self) -> str:
        rank = dist.get_rank() if dist.is_initialized() else self.global_rank
        held = f"partitions {self.owned}" if len(self.owned) > 1 else f"partition {self.owned[0]}"
        return (f"rank {rank} (stage {self.index + 1}/{self.stages}, {held} of {self.partitions}, "
                f"replica {self.replica + 1}/{self.replicas})")

    def optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """``factory(stage.parameters())``, checked: this rank's optimizer, built as an in-process pipeline builds
        its own (:meth:`seqify.Pipeline.optimizer`); each process steps its own, as DDP's do."""
        return built_on(factory, list(self.parameters()), f"{self.me}'s")

    def checkpoint_share(self) -> Share:
        """What ``seqify.checkpoint.save`` and ``load`` keep of this rank: its layers and where the others are."""
        from seqify.checkpoint.ranks import Share

        return Share(self.model, self.partition, self.balance, self.placement, self.index, self.replica,
                     self.stages * self.replicas)

    def __repr__(self) -> str:
        return (f"DistributedStage({self.index + 1}/{self.stages}, partitions {self.owned} of {self.partitions}, "
                f"replica {self.replica + 1}/{self.replicas}, {len(self.partition)} layers on {self.device}, "
                f"chunks={self.chunks})")

    def _micro_inputs(self, inputs: Any) -> list[Any]:
        model = self.model
        if isinstance(inputs, tuple) and isinstance(model, Sequential):
            carried = model.flatten_inputs(*inputs)
        elif isinstance(model, Sequential) and not isinstance(inputs, tuple):
            carried = model.flatten_inputs(inputs)
        else:
            carried = inputs
        refuse_meta(carried, "the pipeline's input", self.device,
                    model.input_names() if isinstance(model, Sequential) else None)
        values = (carried,) if isinstance(carried, torch.Tensor) else tuple(carried)
        moved = tuple(t.to(self.device) for t in values)
        carried = moved[0] if isinstance(carried, torch.Tensor) else moved
        return scatter(carried, self.chunks, model.input_names if isinstance(model, Sequential) else None)

    def _sizes(self, micro: list[Any]) -> list[int]:
        """Every rank learns the micro-batch sizes the first partition's rank made (for loss weights and
        the schedule)."""
        source = self.rank_of(self.placement[0])
        count = torch.tensor([len(micro)], dtype=torch.int64, device=self.device)
        if self.stages > 1 and not self.is_first:
            with peer(self.me, source, "receiving the micro-batch sizes"):
                dist.recv(count, source)
        sizes = torch.tensor(
            [leaves(v)[0].size(0) for v in micro] if self.is_first else [0] * int(count[0]),
            dtype=torch.int64, device=self.device,
        )
        if self.stages > 1:
            if self.is_first:
                for j in range(self.stages):
                    if self.rank_of(j) != source:
                        with peer(self.me, self.rank_of(j), "sending the micro-batch sizes"):
                            dist.send(count, self.rank_of(j))
                            dist.send(sizes, self.rank_of(j))
            else:
                with peer(self.me, source, "receiving the micro-batch sizes"):
                    dist.recv(sizes, source)
        return [int(v) for v in sizes.tolist()]

    def plan(self, m: int) -> Schedule:
        """The shared schedule for ``m`` micro-batches (built once per count; every rank builds the same)."""
        if m not in self._plans:
            self._plans[m] = make(self.schedule, self.placement, m)
        return self._plans[m]

    def actions(self, m: int) -> list[Action]:
        """This rank's actions for ``m`` micro-batches, in the order the shared schedule gives them."""
        return self.plan(m).per_device()[self.index]

    def order(self, m: int) -> list[tuple[str, int]]:
        """This rank's ('F', i) forwards and ('B', i) backwards, of all its partitions (a split schedule's
        W steps left out)."""
        return [(a.kind, a.microbatch) for a in self.actions(m) if a.kind != "W"]

    def step(
        self,
        inputs: Any = None,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *,
        reduction: str | None = None,
        denominator: Count | None = None,
    ) -> torch.Tensor | None:
        """Forward and backward of one mini-batch. ``inputs`` on the rank holding the first partition,
        ``target`` and ``loss_fn(output, target)`` on the one holding the last, whose micro-batch losses
        are weighed as :meth:`seqify.Pipeline.step` weighs them (``reduction`` and ``denominator`` as there).
        Over data-parallel replicas the weights are shares of the global batch (what the loss divides by
        added over the replicas), so the averaged gradients are one device's on every replica's samples; the
        loss returned is this replica's own."""
        if self.is_last and loss_fn is None:
            raise BoundaryError("the rank holding the last partition needs loss_fn(output, target) to run backward")
        how = reduction_of(loss_fn, reduction, denominator) if self.is_last and loss_fn is not None else None
        if self.is_last and target is not None:
            refuse_meta(target, "target", self.device)
        micro = self._micro_inputs(inputs) if self.is_first else []
        sizes = self._sizes(micro)
        m = len(sizes)
        targets = scatter(target.to(self.device), m) if self.is_last and target is not None else [None] * m
        grad = torch.is_grad_enabled()
        if not grad:
            return self._forward_only(micro, sizes, Link(self.device, self.me, self._directions), targets, loss_fn, how)
        weigh = self._weigher(loss_fn, how, targets, sizes, replicas=self.replicas)
        # fixed programs send the same messages every step of the same sizes: after the first, receivers need not
        # wait for headers
        link = Link(self.device, self.me, self._directions, self._books if self._programs else None)
        stop = {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint]
        try:
            if self._programs:
                losses = program_step(self, link, micro, sizes, weigh, stop)  # averages its sums over replicas
            else:
                plan = self.plan(m)
                run = RankRun(self, link, micro, sizes, weigh, stop, plan.split)
                run.run(plan.per_device()[self.index])
                losses = run.losses
                self._all_reduce_grads()
            link.flush()
        except BaseException:
            self._books.clear()  # what this step sent is not a book its peers hold
            raise
        if weigh is None:
            return None
        total = torch.stack(losses).sum()
        return total if weigh.replicas == 1 else total * torch.as_tensor(weigh.report, dtype=torch.float64).to(total)

    def _weigher(self, loss_fn: Callable[[Any, Any], torch.Tensor] | None, how: Any, targets: list[Any],
                 sizes: list[int], replicas: int) -> Weigher | None:
        """The last partition's rank's micro-batch losses (None elsewhere); over ``replicas`` > 1, what the
        loss divides by is added over the replicas' last ranks (one all-reduce of a number)."""
        if loss_fn is None or how is None:
            return None
        model = self.model
        unflatten = model.unflatten_outputs if isinstance(model, Sequential) else (lambda y: y)
        total = self._over_replicas if replicas > 1 and self._dp_group is not None else None
        return Weigher(loss_fn, how, targets, sizes, self._probes, unflatten=unflatten, total=total,
                       replicas=replicas if total is not None else 1)

    def _over_replicas(self, local: float | torch.Tensor) -> float | torch.Tensor:
        """``local`` (a number, or a tensor on this rank's device, added there) added over this pipeline rank's
        data-parallel replicas."""
        value = torch.as_tensor(local, dtype=torch.float64).to(self.device).reshape(1).clone()
        others = [d * self.stages + self.index for d in range(self.replicas) if d != self.replica]
        with peer(self.me, others, "adding what the loss divides by over data-parallel replicas"):
            dist.all_reduce(value, group=self._dp_group)
        return value.reshape(()) if isinstance(local, torch.Tensor) else float(value)

    def _forward_only(self, micro: list[Any], sizes: list[int], link: Link, targets: list[Any],
                      loss_fn: Callable[[Any, Any], torch.Tensor] | None, how: Any = None) -> Any:
        """Every forward, in fill-drain order, without autograd: the loss (with ``loss_fn``: this replica's)
        or the outputs by micro-batch on the last partition's rank."""
        order = [a for a in gpipe(self.placement, len(sizes)).per_device()[self.index] if a.kind == "F"]
        weigh = self._weigher(loss_fn, how, targets, sizes, replicas=1)
        run = RankRun(self, link, micro, sizes, weigh, 0, False)
        run.run(order)
        link.flush()
        if loss_fn is not None:
            return torch.stack(run.losses).sum() if self.is_last else None
        return [run.outputs[i] for i in range(len(sizes))] if self.is_last else None

    def over_replicas(self) -> Callable[[list[torch.Tensor]], Callable[[], int]] | None:
        """What starts adding a partition's gradient sums over this rank's data-parallel replicas, in place (one
        all-reduce per flat tensor, no copy in or out), and returns what waits for them and gives the number of
        replicas; None without replicas."""
        if self.replicas == 1 or self._dp_group is None:
            return None
        return self._start_over_replicas

    def _start_over_replicas(self, sums: list[torch.Tensor]) -> Callable[[], int]:
        others = [d * self.stages + self.index for d in range(self.replicas) if d != self.replica]
        why = "averaging gradients over data-parallel replicas"
        with peer(self.me, others, why):
            works = [dist.all_reduce(t, group=self._dp_group, async_op=True) for t in sums]

        def summed() -> int:
            with peer(self.me, others, why):
                for work in works:
                    work.wait()
            return self.replicas

        return summed

    def _all_reduce_grads(self) -> None:
        """The eager step's ``.grad`` averaged over the data-parallel replicas, through one flat copy."""
        over = self.over_replicas()
        if over is None:
            return
        grads = [p.grad for p in self.partition.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        flat /= over([flat])()
        for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)

    @torch.no_grad()
    def forward(self, *inputs: Any) -> Any:
        """Inference over the pipeline: the output (source structure) on the last partition's rank, None elsewhere."""
        micro = self._micro_inputs(inputs if len(inputs) != 1 else inputs[0]) if self.is_first else []
        sizes = self._sizes(micro)
        outs = self._forward_only(micro, sizes, Link(self.device, self.me, self._directions), [None] * len(sizes), None)
        if not self.is_last:
            return None
        model = self.model
        out = gather(outs, model.output_spec.names if isinstance(model, Sequential) else None)
        return model.unflatten_outputs(out) if isinstance(model, Sequential) else out


def stage(
    model: nn.Module,
    *,
    balance: Sequence[int] | str | None = None,
    chunks: int = 1,
    checkpoint: str = "never",
    schedule: str | Schedule = "gpipe",
    loops: int = 1,
    graphs: bool = False,
    device: torch.device | str | None = None,
    sample: Any = None,
    example_inputs: Any = None,
    weights: str | os.PathLike[str] | None = None,
    buffers: BufferInit | None = None,
    config: PipeConfig | str | os.PathLike[str] | None = None,
) -> DistributedStage:
    """This process's partitions of a pipeline over all processes of the job (call under torchrun).

    With ``world_size = ranks * replicas``, rank ``r`` is pipeline rank ``r % ranks`` of replica
    ``r // ranks``. Each pipeline rank holds ``loops`` partitions (round-robin, or in a V for
    'zb-h1' with ``loops=2``; a ``Schedule`` brings its own placement): ``balance`` lists the layers of
    every partition (``ranks * loops`` entries), or a strategy name ('params', 'flops', 'time',
    'memory') splits the model into ``world_size * loops`` partitions. Rank 0 decides the balance and
    broadcasts it, so every rank agrees. Every rank must build the same model (seed it).
    ``graphs=True`` runs each partition's forward and backward of each micro-batch as fixed programs,
    captured as CUDA graphs after the first step in the order the schedule issues them (eager programs
    on the CPU); the sends and receives stay between them, and checkpointed micro-batches recompute
    inside their backward programs. A model built on the meta device (``with torch.device("meta")``) is
    converted without the self-check (it holds no values), and each rank gives only its own layers memory,
    filled from ``weights`` by source key (:func:`seqify.distributed.materialize.materialize`; ``buffers``
    sets non-persistent buffers). ``config``: a configuration :func:`seqify.tune` chose for as many GPUs as the
    job has processes (or a file it was saved to) gives the balance, chunks, checkpointing, schedule, loops and
    graphs, its replicas becoming the job's data-parallel replicas; those options are then not passed.
    """
    if not dist.is_initialized():
        init()
    if config is not None:
        given = dict(balance=balance, chunks=chunks, checkpoint=checkpoint, schedule=schedule, loops=loops,
                     graphs=graphs)
        options = stage_options(config, dist.get_world_size(), given)
        balance, chunks, checkpoint = options["balance"], options["chunks"], options["checkpoint"]
        schedule, loops, graphs = options["schedule"], options["loops"], options["graphs"]
    source, model = converted(model, example_inputs)
    world, rank = dist.get_world_size(), dist.get_rank()
    if device is None:
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if nccl else torch.device("cpu")
    device = torch.device(device)
    per_rank = len(schedule.placement) // (max(schedule.placement) + 1) if isinstance(schedule, Schedule) else loops
    if isinstance(balance, str) or balance is None:
        shared: list[Any] = [None]
        if rank == 0:
            from seqify.partition import balance as make_plan

            probe = sample if sample is not None else example_inputs
            parts = len(schedule.placement) if isinstance(schedule, Schedule) else world * per_rank
            # 'time' and 'memory' are measured where the partitions run (rank 0's device): timed on the CPU a
            # GPU job was balanced for the CPU, and slowly (torchrun gives each process one thread)
            shared[0] = make_plan(model, parts, sample=probe, by=balance or "params", device=device,
                                  progress=False).balance
        dist.broadcast_object_list(shared, src=0)
        counts = list(shared[0])
    else:
        counts = list(balance)
    if isinstance(schedule, Schedule):
        ranks = max(schedule.placement) + 1
    elif len(counts) % loops:
        raise BalanceError(f"balance has {len(counts)} partitions, not a multiple of loops={loops}: give loops "
                           "entries per rank")
    else:
        ranks = len(counts) // loops
    if world % ranks:
        raise DeviceError(f"world size {world} is not a multiple of the {ranks} pipeline ranks; launch "
                          "ranks x replicas processes")
    replicas = world // ranks
    owned = [p for p, r in enumerate(layout_of(counts, len(model), schedule, loops)[1]) if r == rank % ranks]
    materialize(model, counts, owned, device, weights, source=source, buffers=buffers)
    result = DistributedStage(model, counts, index=rank % ranks, replica=rank // ranks, replicas=replicas,
                              device=device, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                              graphs=graphs, loops=loops)
    result._directions = directions()
    if replicas > 1:
        for s in range(ranks):
            group = dist.new_group([d * ranks + s for d in range(replicas)])
            if s == rank % ranks:
                result._dp_group = group
    return result
