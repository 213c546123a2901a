"""torch.distributed.pipelining on the cuts seqify's tuner chose: the anchor of benchmarks/scaling/main.py.

    python benchmarks/scaling/main.py --models resnet101 --out results/scaling.json
    torchrun --nproc-per-node 4 benchmarks/scaling/torchpp.py --rows results/scaling.json --out results/torchpp.jsonl

For every seqify row of ``--rows`` pipelined over as many GPUs as this run has ranks, the model is built
and converted as scaling.py does, split into the same partitions (``config.balance``) placed on the same
ranks (``config.placement``), and each partition is wrapped as a ``PipelineStage``: skips that cross a
cut travel as extra stage outputs and inputs (passed through the partitions in between, since torch
pipelining sends only to the next stage). One partition per rank runs ``ScheduleGPipe`` and
``Schedule1F1B``; several per rank in a loop ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS`` and
``ScheduleInterleavedZeroBubble``; two per rank in a V ``ScheduleZBVZeroBubble``; each at the tuned chunk
count and at twice the ranks. Rank 0 appends one JSON row per run to ``--out`` (speed, peak allocated and
reserved GiB per rank, or the error). ``--device cpu`` runs on CPU processes over gloo (a smoke test).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

import seqify
from seqify.pipe.config import PipeConfig
from seqify.pipe.stage import Stage
from seqify.skip.layout import routes
from seqify.skip.namespace import SkipKey


def _scaling() -> Any:
    """benchmarks/scaling/main.py, imported by its path (torchrun's workers and the tests load this file alone)."""
    if "scaling_main" not in sys.modules:
        spec = importlib.util.spec_from_file_location("scaling_main", Path(__file__).with_name("main.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["scaling_main"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["scaling_main"]


scaling = _scaling()


@dataclass
class Cut:
    """What flows into a partition: the structure of its input, the skips alive across the cut, and the
    values among them that are not tensors (torch pipelining sends tensors only; these stay the same from
    step to step, so each stage keeps its own copy)."""

    spec: pytree.TreeSpec
    live: list[SkipKey]
    constants: dict[int, Any]  # position among (input leaves + live skips) -> the value


class CarryStage(nn.Module):
    """A seqify partition as torch pipelining wants a stage: tensors in and out. ``forward(*flat)`` takes the
    tensors among the leaves of the value flowing into the partition and the skips alive across the cut
    before it (``into``), and returns those of its output and the skips alive after it (``onto``)."""

    def __init__(self, stage: Stage, into: Cut, onto: Cut | None) -> None:
        super().__init__()
        self.layers = stage.layers
        self.stage = stage
        self.into = into
        self.onto = onto

    def forward(self, *flat: torch.Tensor) -> Any:
        sent = iter(_ContiguousGrad.apply(t) if t.requires_grad else t for t in flat)
        total = self.into.spec.num_leaves + len(self.into.live)
        values = [self.into.constants[i] if i in self.into.constants else next(sent) for i in range(total)]
        n = self.into.spec.num_leaves
        x = pytree.tree_unflatten(values[:n], self.into.spec)
        got = dict(zip(self.into.live, values[n:]))
        y, stashed = self.stage(x, {k: got.pop(k) for k in self.stage.pops})
        got.update(stashed)
        out = pytree.tree_leaves(y) + ([got[k] for k in self.onto.live] if self.onto else [])
        out = [_sendable(t) for i, t in enumerate(out) if not (self.onto and i in self.onto.constants)]
        return out[0] if len(out) == 1 else tuple(out)


def cuts(seq: nn.Sequential, balance: list[int], x: Any, device: torch.device) -> list[Cut]:
    """What flows into each partition, from a forward of one micro-batch ``x`` partition by partition on
    ``device`` (constants such as a reshape's batch size are the micro-batch's)."""
    names, layers = list(seq._modules), list(seq._modules.values())
    part_of = [j for j, count in enumerate(balance) for _ in range(count)]
    crossing = [(r.key, part_of[r.stash], part_of[r.pop]) for r in routes(seq) if part_of[r.stash] != part_of[r.pop]]
    starts = [sum(balance[:j]) for j in range(len(balance))]
    pool: dict[SkipKey, Any] = {}
    found = []
    x = pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, x)
    with torch.no_grad():
        for j in range(len(balance)):
            live = [k for k, a, b in crossing if a < j <= b]
            leaves, spec = pytree.tree_flatten(x)
            values = leaves + [pool[k] for k in live]
            found.append(Cut(spec, live, {i: v for i, v in enumerate(values) if not isinstance(v, torch.Tensor)}))
            part = nn.Sequential(OrderedDict(zip(names[starts[j]:starts[j] + balance[j]],
                                                 layers[starts[j]:starts[j] + balance[j]])))
            stage = Stage(j, part.to(device), device, tuple(k for k, a, b in crossing if b == j),
                          tuple(k for k, a, b in crossing if a == j))
            x, out = stage(x, {k: pool[k] for k in stage.pops})
            pool.update(out)
    seq.to("cpu")
    return found


class _ContiguousGrad(torch.autograd.Function):
    """A copy whose backward makes the gradient contiguous: torch pipelining sizes its gradient receive
    buffers by the strides of the gradient the next stage computes (a slice of a concatenation's gradient is
    not contiguous), and gloo and NCCL receive only into contiguous tensors. A copy, not a view, since a
    partition may change its input in place."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _sendable(t: Any) -> Any:
    """A stage output torch pipelining can send, receive gradients for and detach in place: contiguous and not
    a view (a skip that only passes through is already ``_ContiguousGrad``'s copy)."""
    if isinstance(t, torch.Tensor) and (t._is_view() or not t.is_contiguous()):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def stages_of(seq: nn.Sequential, balance: list[int], mine: list[int], device: torch.device,
              into: list[Cut]) -> list[CarryStage]:
    """The partitions numbered ``mine`` of ``seq`` cut by ``balance``, on ``device``, as CarryStages."""
    names, layers = list(seq._modules), list(seq._modules.values())
    part_of = [j for j, count in enumerate(balance) for _ in range(count)]
    crossing = [(r.key, part_of[r.stash], part_of[r.pop]) for r in routes(seq) if part_of[r.stash] != part_of[r.pop]]
    starts = [sum(balance[:j]) for j in range(len(balance))]
    out = []
    for j in mine:
        part = nn.Sequential(OrderedDict(zip(names[starts[j]:starts[j] + balance[j]],
                                             layers[starts[j]:starts[j] + balance[j]]))).to(device)
        pops = tuple(k for k, a, b in crossing if b == j)
        stashes = tuple(k for k, a, b in crossing if a == j)
        out.append(CarryStage(Stage(j, part, device, pops, stashes), into[j], into[j + 1] if j + 1 < len(into) else None))
    return out


def schedules(placement: tuple[int, ...], world: int) -> list[Any]:
    """torch pipelining's schedules that run this placement of partitions on ranks."""
    import torch.distributed.pipelining as pp

    if len(placement) == world:
        return [pp.ScheduleGPipe, pp.Schedule1F1B]
    if placement == tuple(j % world for j in range(len(placement))):
        return [pp.ScheduleInterleaved1F1B, pp.ScheduleLoopedBFS, pp.ScheduleInterleavedZeroBubble]
    return [pp.ScheduleZBVZeroBubble]


def run(row: dict[str, Any], seq: nn.Module, sample: Callable[[int], Any], args: argparse.Namespace,
        device: torch.device, done: set[tuple[Any, ...]]) -> None:
    """Every schedule and chunk count for one seqify row not in ``done``; one result row each in ``args.out``."""
    from torch.distributed.pipelining import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = PipeConfig.from_dict(row["config"])
    placement = cfg.placement
    balance = list(cfg.balance)
    mine = [j for j, r in enumerate(placement) if r == rank]
    batch = row["batch"]
    torch.manual_seed(0)
    x = sample(batch).to(device)
    counts = sorted({c for c in (cfg.chunks, 2 * world) if batch % c == 0})
    for schedule in schedules(placement, world):
        for chunks in counts:
            name = f"{schedule.__name__} c{chunks}"
            base = dict(model=row["model"], scaling=row["scaling"], gpus=world, batch=batch, runner="torchpp",
                        name=name, schedule=schedule.__name__, chunks=chunks, balance=balance,
                        placement=list(placement))
            if _key(base) in done:
                continue
            try:  # building fails alike on every rank (e.g. fewer micro-batches than stages): record and go on
                torch.manual_seed(1)
                into = cuts(seq, balance, sample(batch // chunks), device)
                parts = stages_of(seq, balance, mine, device, into)
                stages = [PipelineStage(p, j, len(balance), device) for p, j in zip(parts, mine)]
                kwargs = dict(n_microbatches=chunks, loss_fn=lambda out, _: scaling._loss(out))
                sched = schedule(stages[0], **kwargs) if len(placement) == world else schedule(stages, **kwargs)
            except Exception as e:
                base.update(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}")
                _write(args.out, base, rank == 0)
                seq.to("cpu")
                continue
            first, last = 0 in mine, len(balance) - 1 in mine
            params = [p for part in parts for p in part.parameters()]
            if device.type == "cuda":  # what cuts() ran (the whole model, once) is not this schedule's to hold
                torch.cuda.empty_cache()

            def step() -> None:
                for p in params:
                    p.grad = None
                target = torch.empty(batch, device=device) if last else None
                if first:
                    sched.step(x, target=target, losses=[] if last else None)
                else:
                    sched.step(target=target, losses=[] if last else None)

            try:
                sec, allocated, reserved = measure(step, args.warm, args.steps, device)
            except Exception as e:
                # the other ranks wait on this one's sends: record the error and end every rank (torchrun stops
                # the rest); the next launch skips what is recorded
                base.update(error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}")
                print(f"rank {rank}: {name}: {base['error']}", file=sys.stderr, flush=True)
                traceback.print_exc()
                _write(args.out, base, True)
                os._exit(3)
            base.update(seconds=sec, samples_per_s=batch / sec, peak_allocated=allocated, peak_reserved=reserved)
            parts = stages = sched = None  # type: ignore[assignment]
            seq.to("cpu")  # the next run places its partitions afresh
            if device.type == "cuda":
                torch.cuda.empty_cache()
            dist.barrier()
            _write(args.out, base, rank == 0)


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["model"], r["scaling"], r["gpus"], r["batch"], r["name"])


def _write(path: str, r: dict[str, Any], me: bool) -> None:
    if me:
        print(json.dumps(r), flush=True)
        with open(path, "a") as f:
            f.write(json.dumps(r) + "\n")


def measure(step: Callable[[], None], warm: int, steps: int, device: torch.device) -> tuple[float, list[float], list[float]]:
    """Median seconds per step after ``warm`` untimed steps; every rank's peak allocated and reserved GiB."""
    cuda = device.type == "cuda"
    times = []
    for k in range(warm + steps):
        if cuda:
            torch.cuda.synchronize(device)
            if k == warm:
                torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        if k >= warm:
            times.append(time.perf_counter() - start)
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
                         torch.cuda.max_memory_reserved(device) / 2**30 if cuda else 0.0],
                        device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    times.sort()
    return times[len(times) // 2], [round(float(v[0]), 2) for v in every], [round(float(v[1]), 2) for v in every]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", required=True, help="scaling.py's JSON (its --out)")
    p.add_argument("--models", nargs="+", help="only these models (default: every one in --rows)")
    p.add_argument("--out", required=True, help="append one JSON row per run here (JSON lines)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warm", type=int, default=2)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    with open(args.rows) as f:
        data = json.load(f)
    tiny = bool(data.get("tiny"))
    done: set[tuple[Any, ...]] = set()
    if os.path.exists(args.out):  # a launch after one that ended on an error goes on from there
        with open(args.out) as f:
            done = {_key(json.loads(line)) for line in f if line.strip()}
    catalogue = scaling.models(tiny)
    wanted = [r for r in data["rows"] if r.get("runner") == "seqify" and r.get("gpus") == world and r.get("config")
              and "samples_per_s" in r and (not args.models or r["model"] in args.models)]
    for name in dict.fromkeys(r["model"] for r in wanted):
        m = catalogue[name]
        torch.manual_seed(0)
        seq = seqify.convert(m.build(), (m.sample(2),) if m.convert_example else None)
        for row in (r for r in wanted if r["model"] == name):
            run(row, seq, m.sample, args, device, done)
        del seq
    dist.destroy_process_group()
    exit_without_teardown()


def exit_without_teardown() -> None:
    """End the rank now that every row is written. torch pipelining's gloo sends can leave work objects that
    abort the interpreter's teardown ("terminate called without an active exception", SIGABRT) about one
    launch in twenty on a loaded CPU, which would fail a run whose rows are all in."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
