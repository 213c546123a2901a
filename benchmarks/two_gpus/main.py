"""Training throughput of ResNet-101 on GPUs: one GPU, seqify's pipeline, torchgpipe and torch pipelining.

    python benchmarks/two_gpus/main.py [--batch 256] [--chunks 4 8 16 32] [--loops 1 2] [--precision fp32]
                                        [--schedule gpipe 1f1b interleaved zb-h1 zb-h2] [--anchors] [--out DIR]

Everything runs in one invocation on the same GPUs, one configuration after another: the one-GPU
baseline (the source model, eager), the converted model on one GPU, seqify over two GPUs (eager and
with CUDA graphs) for each chunk count, looped placements (``--loops 2``: four partitions on
cuda:0, cuda:1, cuda:0, cuda:1, CUDA-graphed, run breadth-first), torchgpipe 0.0.7 over a hand-flattened Sequential when it is
installed, and torch.distributed.pipelining with hand-cut stages (through torchrun, --anchors).
``--schedule`` adds, per chunk count, one row per schedule side by side, trained with
``pipe.step(x, y, loss_fn)``: gpipe (looped with ``--loops 2``), 1f1b, interleaved (two partitions per
GPU), zb-h1 (also in a V over two partitions per GPU with ``--loops 2``) and zb-h2, with CUDA graphs and
eagerly (``--schedule-graphs``), each with the memory the schedule's plan predicts per GPU. The
schedule rows run on every visible GPU (one GPU: partitions share it, which shows memory, not speed).
Prints a table of samples/s, the ratio to the one-GPU baseline of the same precision, and the peak
allocated and reserved memory per GPU on every row; writes the rows as JSON to DIR/pipeline_bench_PRECISION.json. seqify.distributed
(distributed_bench.py) runs with --anchors in fp32 only.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torchvision
from torch import nn

import seqify
from seqify.schedule.actions import SCHEDULES

ROWS: list[dict[str, Any]] = []


def gpus() -> list[int]:
    return list(range(torch.cuda.device_count()))


def sync() -> None:
    for d in gpus():
        torch.cuda.synchronize(d)


def timed(step: Callable[[], None], warm: int, steps: int) -> float:
    for _ in range(warm):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - start) / steps


def record(name: str, sec: float, batch: int, **extra: Any) -> None:
    """Peak memory per GPU: what tensors held (allocated) and what the caching allocator reserved
    (captured graphs' pools included); ``peak_gib`` is the reserved one, as in older result files."""
    row = dict(name=name, batch=batch, sec_per_step=round(sec, 4), samples_per_s=round(batch / sec, 1),
               peak_gib=[round(torch.cuda.max_memory_reserved(d) / 2**30, 2) for d in gpus()],
               peak_allocated_gib=[round(torch.cuda.max_memory_allocated(d) / 2**30, 2) for d in gpus()], **extra)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def failed(name: str, e: BaseException) -> None:
    row = dict(name=name, error=f"{type(e).__name__}: {str(e)[:300]}")
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def cleanup() -> None:
    gc.collect()
    for d in gpus():
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = model(x)
        nn.functional.cross_entropy(out.float(), y).backward()
        opt.step()

    return step


def scheduled_step(pipe: seqify.Pipeline, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                   bf16: bool) -> Callable[[], None]:
    """A training step that lets the pipeline's schedule own the loss (1F1B, interleaved, zero bubble)."""
    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.float(), target)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            pipe.step(x, y, loss_fn)
        opt.step()

    return step


def schedule_rows(args: argparse.Namespace, x: torch.Tensor, y1: torch.Tensor, bf16: bool, tag: str,
                  plans: dict[tuple[int, int], list[int]]) -> None:
    """One row per (chunks, schedule): the same model, batch and balance strategy, side by side."""
    B = x.size(0)
    n_gpus = len(gpus())
    modes = {"eager": [False], "graphs": [True], "both": [False, True]}[args.schedule_graphs]
    for chunks in args.chunks:
        for schedule in args.schedule:
            one = schedule in ("1f1b", "zb-h2")  # one partition per GPU only
            layouts = [2] if schedule == "interleaved" else ([1, 2] if 2 in args.loops and not one else [1])
            lanes = {"off": [False], "on": [True], "both": [False, True]}[args.lanes]
            for loops, graphs, two in [(lo, g, t) for lo in layouts for g in modes for t in (lanes if g else [False])]:
                shape = ("-v" if schedule == "zb-h1" else f"-loop{loops}") if loops > 1 else ""
                name = f"sched-{schedule}{shape}-{'graphs' if graphs else 'eager'}{'-lanes' if two else ''}-c{chunks}{tag}"
                try:
                    seq = seqify.convert(fresh())
                    parts = n_gpus * loops
                    if (chunks, parts) not in plans:
                        plans[(chunks, parts)] = seqify.balance(seq, parts, sample=x[: B // chunks].cpu(), by=args.balance,
                                                                device=x.device, progress=False).balance
                        cleanup()
                    balance = plans[(chunks, parts)]
                    pipe = seqify.pipeline(seq, gpus=n_gpus, loops=loops, balance=balance, chunks=chunks,
                                           checkpoint="never", graphs=graphs, schedule=schedule, overlap=two)
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):  # measured as the step runs
                        predicted = [round(b / 2**30, 2) for b in pipe.plan_memory(x).per_device]
                    cleanup()
                    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
                    step = scheduled_step(pipe, opt, x, y1, bf16)
                    record(name, timed(step, args.warm, args.steps), B, balance=balance, predicted_gib=predicted)
                    if graphs and pipe.graph_error:
                        failed(name + " (graphs fell back to eager)", RuntimeError(pipe.graph_error[-300:]))
                    del seq, pipe, opt, step
                except Exception as e:
                    failed(name, e)
                cleanup()


def inference_rows(args: argparse.Namespace, x: torch.Tensor, bf16: bool, tag: str,
                   plans: dict[tuple[int, int], list[int]]) -> None:
    """Inference (eval, torch.no_grad()): the source on one GPU, then seqify per chunk count, eagerly and
    replaying forward-only CUDA graphs, over every visible GPU."""
    B = x.size(0)
    n_gpus = len(gpus())

    def infer(model: nn.Module) -> Callable[[], None]:
        def step() -> None:
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                model(x)
        return step

    try:
        model = fresh().to(x.device).eval()
        record(f"infer-single{tag}", timed(infer(model), args.warm, args.steps), B)
        del model
    except Exception as e:
        failed(f"infer-single{tag}", e)
    cleanup()
    for chunks in args.chunks:
        for graphs in (False, True):
            name = f"infer-{'graphs' if graphs else 'eager'}-c{chunks}{tag}"
            try:
                seq = seqify.convert(fresh())
                if (chunks, n_gpus) not in plans:
                    plans[(chunks, n_gpus)] = seqify.balance(seq, n_gpus, sample=x[: B // chunks].cpu(), by=args.balance,
                                                             device=x.device, progress=False).balance
                    cleanup()
                pipe = seqify.pipeline(seq, gpus=n_gpus, balance=plans[(chunks, n_gpus)], chunks=chunks,
                                       checkpoint="never", graphs=graphs).eval()
                record(name, timed(infer(pipe), args.warm, args.steps), B, balance=plans[(chunks, n_gpus)])
                if graphs and pipe.graph_error:
                    failed(name + " (graphs fell back to eager)", RuntimeError(pipe.graph_error[-300:]))
                del seq, pipe
            except Exception as e:
                failed(name, e)
            cleanup()


def torchrun(script: str, args: list[str], label: str) -> None:
    """Run a script of benchmarks/ (a path from this folder) on 2 processes under torchrun; keep the JSON rows it prints."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(os.path.dirname(os.path.abspath(__file__)), script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            ROWS.append(json.loads(line))
            print(line, flush=True)
    if done.returncode:
        failed(label, RuntimeError(done.stderr[-300:]))


#: the memory format of every row's weights and input (``--channels-last``: NHWC, the baseline included)
FORMAT = torch.contiguous_format


def fresh() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet101().to(memory_format=FORMAT)


def flat_resnet101() -> nn.Sequential:
    """torchgpipe needs a hand-flattened Sequential (what users write today)."""
    r = fresh()
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for n, c in r.named_children():
        if isinstance(c, nn.Sequential):
            for i, b in enumerate(c):
                layers[f"{n}_{i}"] = b
        else:
            if n == "fc":
                layers["flatten"] = nn.Flatten()
            layers[n] = c
    return nn.Sequential(layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16", "both"], default="fp32",
                   help="fp32 (default math), bf16 (torch.autocast), or both")
    p.add_argument("--anchors", action="store_true", help="also run torchgpipe and torch.distributed.pipelining")
    p.add_argument("--balance", default="time", help="seqify balance strategy (default: time)")
    p.add_argument("--skip-eager", action="store_true", help="only CUDA-graphed seqify runs")
    p.add_argument("--loops", type=int, nargs="+", default=[1],
                   help="partitions per GPU to try (1: one partition per GPU; 2: cuda:0, cuda:1, cuda:0, cuda:1)")
    p.add_argument("--schedule", nargs="+", default=[], choices=list(SCHEDULES),
                   help="also train with pipe.step under these schedules, one row each per chunk count")
    p.add_argument("--schedule-graphs", choices=["eager", "graphs", "both"], default="both",
                   help="--schedule rows with CUDA graphs, eagerly, or both (default)")
    p.add_argument("--inference", action="store_true",
                   help="also time inference (eval, no_grad): one GPU, and seqify eager and graphs per chunk count")
    p.add_argument("--skip-seqify", action="store_true", help="skip the seqify rows without --schedule")
    p.add_argument("--cudnn-benchmark", action="store_true",
                   help="torch.backends.cudnn.benchmark = True for every row, the one-GPU baseline included")
    p.add_argument("--channels-last", action="store_true",
                   help="weights and input in channels-last (NHWC) memory format for every row, the one-GPU baseline "
                        "included (cuDNN picks other kernels; the 16-chunk rows run micro-batches of 16)")
    p.add_argument("--lanes", choices=["off", "on", "both"], default="off",
                   help="schedule rows with graphs: forwards and backwards on two streams per GPU "
                        "(seqify.pipeline(overlap=True)), without, or each both ways ('-lanes' rows)")
    p.add_argument("--out", default=".")
    args = p.parse_args()
    global FORMAT
    FORMAT = torch.channels_last if args.channels_last else torch.contiguous_format
    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    B = args.batch
    d0 = torch.device("cuda:0")
    x = torch.randn(B, 3, args.res, args.res, device=d0).to(memory_format=FORMAT)
    y0 = torch.randint(0, 1000, (B,), device=d0)
    y1 = y0.to(f"cuda:{torch.cuda.device_count() - 1}")
    print(f"# {datetime.date.today()} {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}")
    print(f"# {' '.join([os.path.basename(sys.executable), *sys.argv])}", flush=True)
    precisions = {"fp32": [False], "bf16": [True], "both": [False, True]}[args.precision]

    plans: dict[tuple[int, int], list[int]] = {}
    cleanup()
    for bf16 in precisions:
        tag = "-bf16" if bf16 else ""
        try:
            model = fresh().to(d0)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            record(f"single{tag}", timed(train_step(model, opt, x, y0, bf16), args.warm, args.steps), B)
            del model, opt
        except Exception as e:
            failed(f"single{tag}", e)
        cleanup()
        try:
            seq = seqify.convert(fresh()).to(d0)
            opt = torch.optim.SGD(seq.parameters(), lr=0.01)
            record(f"single-converted{tag}", timed(train_step(seq, opt, x, y0, bf16), args.warm, args.steps), B)
            del seq, opt
        except Exception as e:
            failed(f"single-converted{tag}", e)
        cleanup()
        if args.schedule:
            schedule_rows(args, x, y1, bf16, tag, plans)
        if args.inference:
            inference_rows(args, x, bf16, tag, plans)
        for chunks in ([] if args.skip_seqify else args.chunks):
            for loops in args.loops:
                for graphs in ([True] if args.skip_eager or loops > 1 else [False, True]):
                    loop = f"-loop{loops}" if loops > 1 else ""
                    name = f"seqify-{'graphs' if graphs else 'eager'}-c{chunks}{loop}{tag}"
                    try:
                        seq = seqify.convert(fresh())
                        parts = 2 * loops
                        if (chunks, parts) not in plans:  # balanced for this micro-batch size, measured on cuda:0
                            plan = seqify.balance(seq, parts, sample=x[: B // chunks].cpu(), by=args.balance,
                                                  device=d0, progress=False)
                            plans[(chunks, parts)] = plan.balance
                            print(f"# seqify balance by {args.balance} at micro-batch {B // chunks}, {parts} "
                                  f"partitions: {plan.balance}, predicted imbalance {plan.imbalance:.3f}", flush=True)
                            cleanup()
                        plan_balance = plans[(chunks, parts)]
                        pipe = seqify.pipeline(seq, gpus=2, loops=loops, balance=plan_balance, chunks=chunks,
                                               checkpoint="never", graphs=graphs)
                        opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
                        record(name, timed(train_step(pipe, opt, x, y1, bf16), args.warm, args.steps), B,
                               balance=plan_balance)
                        if graphs and pipe.graph_error:
                            failed(name + " (graphs fell back to eager)", RuntimeError(pipe.graph_error[-300:]))
                        del seq, pipe, opt
                    except Exception as e:
                        failed(name, e)
                    cleanup()
        if args.anchors:
            try:
                from torchgpipe import GPipe
                from torchgpipe.balance import balance_by_time
            except ImportError as e:
                failed(f"torchgpipe{tag}", e)
            else:
                probe = flat_resnet101()
                for m in probe.modules():
                    if isinstance(m, nn.ReLU):
                        m.inplace = False  # torchgpipe's profiler trips on in-place ReLU
                gp_balance = balance_by_time(2, probe, torch.randn(B // 8, 3, args.res, args.res), device=d0)
                del probe
                for chunks in args.chunks:
                    name = f"torchgpipe-c{chunks}{tag}"
                    try:
                        gp = GPipe(flat_resnet101(), balance=gp_balance, devices=["cuda:0", "cuda:1"], chunks=chunks,
                                   checkpoint="never")
                        opt = torch.optim.SGD(gp.parameters(), lr=0.01)
                        record(name, timed(train_step(gp, opt, x, y1, bf16), args.warm, args.steps), B, balance=list(gp_balance))
                        del gp, opt
                    except Exception as e:
                        failed(name, e)
                    cleanup()
    if args.anchors:
        common = ["--batch", str(B), "--res", str(args.res), "--steps", str(args.steps), "--warm", str(args.warm),
                  "--out", args.out, "--chunks", *[str(c) for c in args.chunks if c <= 16]]
        for bf16 in precisions:
            # the old hand cut and one near seqify's time-balanced cut (torchpp.py --cuts)
            torchrun("torchpp.py", common + ["--cuts", "0", "3"] + (["--bf16"] if bf16 else []),
                     "torchpp" + ("-bf16" if bf16 else ""))
        if False in precisions:  # seqify.distributed, fp32
            torchrun("../distributed/main.py", common, "seqify-distributed")

    with open(os.path.join(args.out, f"pipeline_bench_{args.precision}.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    # each row against one GPU doing the same (training or inference) in the same precision
    base = {r["name"]: r["samples_per_s"] for r in ROWS if r.get("name", "").startswith(("single", "infer-single"))
            and "samples_per_s" in r}
    print("\n| configuration | samples/s | x one GPU (same work and precision) | peak GiB allocated per GPU | peak GiB "
          "reserved per GPU | predicted GiB per GPU |")
    print("|---|---|---|---|---|---|")
    for r in ROWS:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:60]} | | | | |")
            continue
        tag = "-bf16" if r["name"].endswith("-bf16") else ""
        b = base.get(("infer-single" if r["name"].startswith("infer-") else "single") + tag)
        ratio = f"{r['samples_per_s'] / b:.2f}" if b else "n/a"
        gib = [" / ".join(str(v) for v in r.get(k, [])) for k in ("peak_allocated_gib", "peak_gib", "predicted_gib")]
        print(f"| {r['name']} | {r['samples_per_s']:.1f} | {ratio} | {gib[0]} | {gib[1]} | {gib[2]} |")


if __name__ == "__main__":
    main()
