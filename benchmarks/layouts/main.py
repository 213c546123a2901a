"""Layouts (stages x replicas) beside data parallelism, in one run: torchvision ResNet-101 (fp32, SGD) or, with
``--model llama``, the 0.89 B Llama of benchmarks/data_parallel/fsdp.py (bf16 autocast, SGD, sequences of 2048),
or ``--model llama8b``, its ~7.2 B config with fp32 Adam (no one GPU trains it: no one-GPU or DDP row, FSDP2 is the
anchor), ``--per-gpu`` samples per GPU. Rows: one GPU on its share, DDP over every GPU (benchmarks/data_parallel/
under torchrun; FSDP2 too for the Llamas), seqify with each layout given by ``--layouts``
(``STAGESxREPLICAS:schedule:chunks[:graphs][:loopsK][:unfused]``, ``loopsK``: K partitions per GPU, ``unfused``:
cast weights' gradients widened into their sums after the backward, not written by it), and seqify's automatic
choice (``--auto``, told the optimizer). Each row: samples/s,
its ratio to one GPU, DDP and FSDP2, peak allocated and reserved GiB per GPU (from the first timed step's start),
and what was still allocated when the row started (``alive_before_gib``: earlier rows' leftovers, which its peaks
then include; a warning says so).
Every row is timed as the DDP and FSDP2 scripts time theirs: steps run back to back, synchronized at the ends.
seqify's rows step with ``pipe.optimizer`` (an optimizer per replica, as DDP's processes step); ``--optimizer first``
adds (or, alone, makes) rows with one optimizer of ``pipe.parameters()`` whose update reaches the other replicas by
broadcast. ``--torchrun`` follows each seqify row with its configuration under torchrun (``seqify.distributed``), and
``--torchpp`` adds torch.distributed.pipelining's schedules on the cuts of the fastest pure pipeline row.

    python benchmarks/layouts/main.py --gpus 4 --layouts 4x1:zb-h2:4:graphs 2x2:1f1b:4:graphs 1x4:gpipe:1:graphs --auto
    python benchmarks/layouts/main.py --model llama8b --gpus 2 --per-gpu 2 --steps 4 --warm 2 --auto
    python benchmarks/layouts/main.py --tiny --device cpu --gpus 4 --layouts 2x2:1f1b:2 --no-ddp   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import seqify
from seqify.pipe.executors.options import ReplayOptions

GIB = 2**30


@dataclass
class Workload:
    """A model to train, its data, its loss and precision."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    autocast: bool  # bf16 autocast around forward and loss
    example: bool = False  # converted with the first samples as example inputs
    optimizer: Callable[[Any], torch.optim.Optimizer] = functools.partial(torch.optim.SGD, lr=1e-3)
    one_gpu: bool = True  # whether one GPU can train it (else no one-GPU row and no DDP)
    data_parallel_env: dict[str, str] = field(default_factory=dict)  # for benchmarks/data_parallel/fsdp.py


def resnet(tiny: bool) -> Workload:
    from torchvision.models.resnet import Bottleneck, ResNet, resnet101

    def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        side, classes = (32, 10) if tiny else (224, 1000)
        return torch.randn(n, 3, side, side, generator=g), torch.randint(0, classes, (n,), generator=g)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return ResNet(Bottleneck, [1, 1, 2, 1], num_classes=10) if tiny else resnet101()

    return Workload("ResNet-101, fp32, SGD", build, data, F.cross_entropy, autocast=False)


def llama(tiny: bool, size: str = "0.89b", layers: int | None = None) -> Workload:
    """The 0.89 B Llama with SGD, or (``size="8b"``) the ~7.2 B one with Adam, which no one GPU trains; ``layers``
    decoder layers instead of the config's (one pipeline stage's share, say)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    seq, vocab = (16, 128) if tiny else (2048, 32000)
    big = size == "8b"
    hidden, inter, deep, heads = (4096, 14336, 32, 32) if big else (2048, 5632, 16, 16)
    layers = layers or deep
    config = (LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=seq, use_cache=False)
              if tiny else
              LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=8, vocab_size=vocab, max_position_embeddings=seq, use_cache=False))

    def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))
        return ids, ids

    def build() -> nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    def loss(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out["logits"] if isinstance(out, dict) else out
        return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    if big:
        return Workload("Llama 7.2 B, bf16 autocast, fp32 Adam", build, data, loss, autocast=True, example=True,
                        optimizer=functools.partial(torch.optim.Adam, lr=1e-5), one_gpu=False,
                        data_parallel_env=dict(SIZE="8b", OPT="adam", MODES="fsdp"))
    return Workload("Llama 0.89 B, bf16 autocast, SGD", build, data, loss, autocast=True, example=True)


def workload(model: str, tiny: bool) -> Workload:
    """The workload ``--model`` names (``--tiny``: its CPU smoke-run size)."""
    if model.startswith("llama"):
        return llama(tiny, "8b" if model == "llama8b" else "0.89b")
    return resnet(tiny)


def devices_of(kind: str, n: int) -> list[torch.device]:
    return [torch.device(f"cuda:{i}") for i in range(n)] if kind == "cuda" else [torch.device("cpu")] * n


def reset(devices: list[torch.device]) -> None:
    gc.collect()
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            torch.empty(0, device=d)  # the device's allocator exists before its peaks are reset
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(d)


def peaks(devices: list[torch.device]) -> tuple[list[float], list[float], list[float]]:
    """Per GPU, GiB: the peak allocated, the peak reserved, and the peak in use with CUDA graphs' pools counted
    (:func:`in_use`); three empty lists on the CPU."""
    if devices[0].type != "cuda":
        return [], [], []
    return ([round(torch.cuda.max_memory_allocated(d) / GIB, 2) for d in devices],
            [round(torch.cuda.max_memory_reserved(d) / GIB, 2) for d in devices],
            [round(in_use(d) / GIB, 2) for d in devices])


def in_use(device: torch.device) -> int:
    """Bytes the timed steps held on ``device``: the peak allocated plus what CUDA graphs' private pools hold
    beyond their live tensors. A replayed graph writes its intermediates into its pool's free blocks without
    asking the allocator, so after capture ``max_memory_allocated`` leaves them out; those blocks serve no other
    allocation, so they count as held for the whole step."""
    index = torch.device(device).index
    idle = sum(s["total_size"] - s["allocated_size"] for s in torch.cuda.memory_snapshot()
               if s["device"] == index and tuple(s["segment_pool_id"]) != (0, 0))
    return torch.cuda.max_memory_allocated(device) + idle


def alive(devices: list[torch.device], name: str) -> list[float]:
    """GiB per GPU still allocated when a row starts, after :func:`reset`: what earlier rows of this process left
    alive, which this row's peaks then include (warned about; run such a row alone to measure it clean)."""
    held = [round(torch.cuda.memory_allocated(d) / GIB, 2) for d in dict.fromkeys(devices) if d.type == "cuda"]
    if any(h > 0.1 for h in held):
        print(f"{name}: starts with {held} GiB per GPU still allocated by earlier rows; its peaks include them",
              file=sys.stderr, flush=True)
    return held


def sync(devices: list[torch.device]) -> None:
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def timed(step: Any, devices: list[torch.device], steps: int, warm: int,
          barrier: Callable[[], Any] | None = None) -> float:
    """Mean seconds of ``step()`` (forward, backward and an SGD step) over ``steps`` run back to back after ``warm``
    untimed ones, the GPUs synchronized only at the ends: how benchmarks/data_parallel/ times DDP and FSDP2, and
    how a training loop that does not read the loss every step runs (the host prepares a step while the GPUs
    still run the last). Peak memory is counted from the first timed step (what building and capturing held is
    not a training step's). ``barrier``: under torchrun, what every rank waits at before and after the timed
    steps."""
    for _ in range(warm):
        step()
    sync(devices)
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)
    if barrier is not None:  # every process of a torchrun job starts and ends together
        barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(devices)
    if barrier is not None:
        barrier()
    return (time.perf_counter() - start) / steps


def cast(work: Workload, device: torch.device) -> Any:
    """bf16 autocast on ``device`` where the workload trains in it, else nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=work.autocast)


def plain_step(work: Workload, dev: torch.device, per_gpu: int) -> Callable[[], None]:
    """A training step of the model itself on ``dev``, ``per_gpu`` samples (forward, backward, optimizer)."""
    net = work.build().to(dev)
    x, y = (t.to(dev) for t in work.data(per_gpu))
    opt = work.optimizer(net.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with cast(work, dev):
            out = net(x)
        work.loss(out, y).backward()
        opt.step()

    return step


def one_gpu(args: argparse.Namespace, work: Workload, devices: list[torch.device]) -> dict[str, Any]:
    """One device on one GPU's share of the batch: the throughput every ratio is against."""
    dev = devices[0]
    reset(devices)
    before = alive(devices, "one GPU")
    step = plain_step(work, dev, args.per_gpu)
    sec = timed(step, [dev], args.steps, args.warm)
    allocated, reserved, held = peaks([dev])
    del step
    return dict(row="one GPU", batch=args.per_gpu, samples_per_s=args.per_gpu / sec, peak_gib=allocated,
                reserved_gib=reserved, in_use_gib=held, alive_before_gib=before)


def data_parallel(args: argparse.Namespace, work: Workload) -> list[dict[str, Any]]:
    """DDP over every GPU, ``--per-gpu`` samples each, under torchrun (benchmarks/data_parallel/: main.py for
    ResNet-101, fsdp.py with DDP and FSDP2 for the Llama)."""
    here = os.path.join(os.path.dirname(__file__), "..", "data_parallel")
    env = {**os.environ, "B": str(args.per_gpu * args.gpus), "STEPS": str(args.steps), "WARM": str(args.warm),
           **work.data_parallel_env}
    script = os.path.join(here, "fsdp.py" if args.model.startswith("llama") else "main.py")
    got = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.gpus), script],
                         env=env, capture_output=True, text=True, timeout=600)
    found = [json.loads(line) for line in got.stdout.splitlines() if line.startswith("{")]
    if not found:
        print(got.stdout[-2000:], got.stderr[-4000:], file=sys.stderr)
    out = []
    for r in found:
        name = "FSDP2" if "fsdp" in r["name"] else "DDP"
        rate = r["samples_per_s"] if "samples_per_s" in r else r["tokens_per_s"] / r["seq"]
        out.append(dict(row=name, batch=r["batch"], samples_per_s=rate, peak_gib=r["peak_gib"],
                        reserved_gib=r["reserved_gib"]))
    return out


def layout_row(args: argparse.Namespace, work: Workload, devices: list[torch.device], spec: str | None,
               stepping: str = "replicas") -> dict[str, Any] | None:
    """seqify on every device: the layout ``spec`` (``STAGESxREPLICAS:schedule:chunks[:graphs]``), or the tuner's
    choice (``None``), stepped by ``pipe.optimizer`` (``stepping="replicas"``: every replica its own copy) or by an
    optimizer of ``pipe.parameters()`` (``"first"``: the first replica's, copied to the others; None where the
    layout has no replicas, for which both are one)."""
    batch = args.per_gpu * args.gpus
    reset(devices)
    before = alive(devices, spec or "seqify automatic")
    x, y = work.data(batch)
    # the self-check runs the model on the CPU: minutes for 7.2 B parameters (tests/convert checks Llamas exactly)
    seq = seqify.convert(work.build(), (x[:2],) if work.example else None, verify=work.one_gpu)
    x, y = x.to(devices[0]), y.to(devices[0])
    with cast(work, devices[0]):
        if spec is None:
            pipe = seqify.pipeline(seq, devices=devices, chunks="auto", sample=x, optimizer=work.optimizer)
            name = "seqify automatic"
        else:
            shape, schedule, chunks, *rest = spec.split(":")
            stages, replicas = (int(v) for v in shape.split("x"))
            loops = next((int(r[len("loops"):]) for r in rest if r.startswith("loops")), 1)
            assert stages * replicas == args.gpus, f"{spec}: stages x replicas must be --gpus ({args.gpus})"
            options = ReplayOptions(fuse_grads="unfused" not in rest)
            pipe = seqify.pipeline(seq, devices=devices, replicas=replicas, chunks=int(chunks), schedule=schedule,
                                   loops=loops, graphs="graphs" in rest, checkpoint="never", balance="time", sample=x,
                                   replay_options=options)
            pipe.config = pipe.config or seqify.PipeConfig(
                chunks=int(chunks), loops=loops, balance=tuple(pipe.balance), by="time", checkpoint="never",
                graphs="graphs" in rest, devices=tuple(str(d) for d in devices), schedule=schedule, replicas=replicas)
            name = (f"seqify {stages} x {replicas} {schedule} chunks {chunks}"
                    + (f" loops {loops}" if loops > 1 else "") + (" graphs" if "graphs" in rest else "")
                    + (" unfused" if "unfused" in rest else ""))
    replicated = isinstance(pipe, seqify.ReplicatedPipeline)
    if stepping == "first" and not replicated:
        return None
    opt = work.optimizer(pipe.parameters()) if stepping == "first" else pipe.optimizer(work.optimizer)
    name += " (optimizer of the first replica)" if stepping == "first" else ""
    if spec is None and pipe.config is not None:  # the choice and its candidates, before a timed step can fail
        print(pipe.config, flush=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with cast(work, devices[0]):
            pipe.step(x, y, work.loss)
        opt.step()

    sec = timed(step, devices, args.steps, args.warm + 1)
    allocated, reserved, held = peaks(devices)
    cfg = pipe.config.without_trials() if pipe.config is not None else None
    layout = cfg.to_dict() if cfg is not None else None
    del pipe, opt, seq
    return dict(row=name, batch=batch, samples_per_s=batch / sec, peak_gib=allocated, reserved_gib=reserved,
                in_use_gib=held, alive_before_gib=before, config=str(cfg) if cfg is not None else None, layout=layout,
                optimizer="pipe.optimizer" if stepping == "replicas" else "pipe.parameters()")


def under_torchrun(args: argparse.Namespace, script: str, layout: dict[str, Any], *extra: str) -> list[dict[str, Any]]:
    """The JSON rows rank 0 of ``script`` (a worker beside this file) prints, run under torchrun on one process per
    GPU with the configuration ``layout`` (a ``PipeConfig.to_dict()``) and this run's workload and timing."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "layout.json")
        seqify.PipeConfig.from_dict(layout).save(path)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.gpus),
                   os.path.join(os.path.dirname(__file__), script), "--model", args.model, "--per-gpu",
                   str(args.per_gpu), "--config", path, "--steps", str(args.steps), "--warm", str(args.warm),
                   *(["--tiny"] if args.tiny else []), *extra]
        got = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    found = [json.loads(line) for line in got.stdout.splitlines() if line.startswith("{")]
    for r in found:
        if "error" in r:
            print(f"{r['row']}: {r['error']}", file=sys.stderr)
    if not found:
        print(got.stdout[-2000:], got.stderr[-4000:], file=sys.stderr)
    return [r for r in found if "error" not in r]


def torchpp_rows(args: argparse.Namespace, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch.distributed.pipelining on the cuts of the fastest pure pipeline among the seqify ``rows`` (one
    replica), one row per schedule it has for that placement (torchpp_layout.py); none where no seqify row is a
    pure pipeline."""
    pipelines = [r for r in rows if r.get("layout") and seqify.PipeConfig.from_dict(r["layout"]).replicas == 1
                 and "under torchrun" not in r["row"]]
    if not pipelines:
        print("--torchpp: no seqify row is a pure pipeline (STAGESx1) to take the cuts of", file=sys.stderr)
        return []
    best = max(pipelines, key=lambda r: r["samples_per_s"])
    return [{**r, "cuts_of": best["row"]} for r in under_torchrun(args, "torchpp_layout.py", best["layout"])]


def torchrun_row(args: argparse.Namespace, row: dict[str, Any]) -> dict[str, Any] | None:
    """The layout of an in-process seqify ``row`` run by ``seqify.distributed`` under torchrun, one process per
    device (torchrun_layout.py), timed the same way: the row named ``... under torchrun``."""
    found = under_torchrun(args, "torchrun_layout.py", row["layout"], "--name", f"{row['row']} under torchrun") \
        if row.get("layout") else []
    if not found:
        return None
    return {**found[0], "x_in_process": round(found[0]["samples_per_s"] / row["samples_per_s"], 3)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet101", "llama", "llama8b"], default="resnet101")
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--per-gpu", type=int, default=128)
    p.add_argument("--layouts", nargs="*", default=[])
    p.add_argument("--auto", action="store_true")
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--torchpp", action="store_true", help="torch pipelining's schedules on the cuts of the fastest "
                   "pure pipeline among the seqify rows (a STAGESx1 layout)")
    p.add_argument("--torchrun", action="store_true", help="after each seqify row, its layout under torchrun "
                   "(seqify.distributed, one process per device)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--out", default=None, help="a JSON lines file to append the rows to")
    p.add_argument("--optimizer", nargs="+", choices=["replicas", "first"], default=["replicas"],
                   help="how seqify's rows step: pipe.optimizer, an optimizer per replica (replicas), and/or one "
                        "optimizer of pipe.parameters() whose update is copied to the other replicas (first)")
    args = p.parse_args(argv)
    work = workload(args.model, args.tiny)
    devices = devices_of(args.device, args.gpus)
    head = dict(model=args.model, date=datetime.date.today().isoformat(), torch=torch.__version__,
                seqify=seqify.__version__,
                device=f"{args.gpus}x {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "cpu",
                gpus=args.gpus, timing="steps back to back, synchronized at the ends", command="python benchmarks/layouts/main.py " + " ".join(
                    argv if argv is not None else sys.argv[1:]))
    rows: list[dict[str, Any]] = []
    if args.out and not os.path.exists(args.out):  # JSON lines under the run's environment (what pages.py reads)
        with open(args.out, "w") as f:
            f.write("# environment: " + json.dumps(head) + "\n")

    def keep(row: dict[str, Any] | None) -> None:
        """Print and record ``row`` as soon as it is measured: a run cut short (a later row out of memory, a
        time limit) keeps what it measured."""
        if row is not None:
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")

    if work.one_gpu:
        keep(one_gpu(args, work, devices))
    if not args.no_ddp and args.device == "cuda":
        for row in data_parallel(args, work):
            keep(row)
    for spec in [*args.layouts, *([None] if args.auto else [])]:
        for stepping in args.optimizer:
            row = layout_row(args, work, devices, spec, stepping)
            keep(row)
            if args.torchrun and row is not None and stepping == "replicas":
                keep(torchrun_row(args, row))
    if args.torchpp:
        for row in torchpp_rows(args, rows):
            keep(row)
    def rate(name: str) -> float | None:
        return next((r["samples_per_s"] for r in rows if r["row"] == name), None)

    anchors = {"x_one_gpu": rate("one GPU"), "x_ddp": rate("DDP"), "x_fsdp2": rate("FSDP2")}
    print(f"{head['device']}, torch {head['torch']}, {head['date']}: {work.name}, {args.per_gpu} samples per GPU")
    print("| row | samples/s | x one GPU | x DDP | x FSDP2 | peak allocated GiB per GPU | reserved GiB per GPU | "
          "in use GiB per GPU (graph pools counted) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for k, base in anchors.items():
            r[k] = round(r["samples_per_s"] / base, 3) if base else None
        ratios = " | ".join(f"{r[k]:.3f}" if r[k] is not None else "-" for k in anchors)
        print(f"| {r['row']} | {r['samples_per_s']:.1f} | {ratios} | {' / '.join(map(str, r['peak_gib']))} | "
              f"{' / '.join(map(str, r['reserved_gib']))} | {' / '.join(map(str, r.get('in_use_gib', [])))} |",
              flush=True)
    for r in rows:
        if "x_in_process" in r:
            print(f"{r['row']}: {r['x_in_process']:.3f} of the same layout in one process", flush=True)


if __name__ == "__main__":
    main()
