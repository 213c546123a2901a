"""U-Net training with checkpointing: eager against CUDA graphs (graphs recompute inside captured backwards).

    python benchmarks/unet_graphs.py [--batch 16] [--res 256] [--chunks 4] [--steps 4] [--loops 1]

On every visible GPU (one GPU: the partitions share it, which measures the graph path's cost and memory,
not pipeline speed-up): the source model on one GPU, then seqify.pipeline with checkpoint='always' eagerly
and with graphs=True, under GPipe (pipe(x) + backward) and 1F1B (pipe.step; interleaved 1F1B with --loops > 1,
``loops`` partitions per GPU, so skips cross partitions even on one GPU). Prints samples/s, the ratio to the
eager checkpointed row of the same schedule, and peak allocated / reserved GiB per GPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import time
from collections.abc import Callable

import torch

import seqify
from seqify.pipe.executors.options import ReplayOptions


def gpus() -> list[int]:
    return list(range(torch.cuda.device_count()))


def reset() -> None:
    gc.collect()
    for d in gpus():
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(d)


def timed(step: Callable[[], None], warm: int, steps: int) -> float:
    for _ in range(warm):
        step()
    for d in gpus():
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    for d in gpus():
        torch.cuda.synchronize(d)
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--res", type=int, default=256)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--loops", type=int, default=1, help="partitions per GPU")
    p.add_argument("--compare-buffers", action="store_true",
                   help="also run graphs with a boundary buffer set per micro-batch (before buffers were shared)")
    args = p.parse_args()
    n = len(gpus())
    print(f"# {datetime.date.today()} {torch.cuda.get_device_name(0)} x{n}, torch {torch.__version__}")
    x = torch.randn(args.batch, 3, args.res, args.res, device="cuda:0")
    rows: list[tuple[str, float, list[float], list[float]]] = []

    def record(name: str, sec: float) -> None:
        alloc = [round(torch.cuda.max_memory_allocated(d) / 2**30, 2) for d in gpus()]
        reserved = [round(torch.cuda.max_memory_reserved(d) / 2**30, 2) for d in gpus()]
        rows.append((name, args.batch / sec, alloc, reserved))
        print(f"{name}: {args.batch / sec:.1f} samples/s, allocated {alloc}, reserved {reserved}", flush=True)

    torch.manual_seed(0)
    source = seqify.zoo.unet().cuda()
    opt = torch.optim.SGD(source.parameters(), lr=0.01)

    def plain() -> None:
        opt.zero_grad(set_to_none=True)
        source(x).float().pow(2).mean().backward()
        opt.step()

    reset()
    record("one GPU, source", timed(plain, args.warm, args.steps))
    del source, opt
    variants = [(False, True), (True, True)] + ([(True, False)] if args.compare_buffers else [])
    for schedule in ("gpipe", "1f1b" if args.loops == 1 else "interleaved"):
        for graphs, share in variants if schedule != "gpipe" else variants[:2]:  # fill-drain shares none
            options = ReplayOptions(share_buffers=share)
            name = f"{schedule}, checkpoint=always, {'graphs' if graphs else 'eager'}, {args.chunks} chunks"
            name += ", a buffer set per micro-batch" if not share else ""
            torch.manual_seed(0)
            seq = seqify.convert(seqify.zoo.unet())
            parts = n * args.loops
            bal = seqify.balance(seq, parts, sample=x[: args.batch // args.chunks].cpu(), by="time", device=x.device,
                                 progress=False).balance if parts > 1 else [len(seq)]
            pipe = seqify.pipeline(seq, gpus=n, loops=args.loops, balance=bal, chunks=args.chunks, checkpoint="always", graphs=graphs,
                                   schedule=schedule, replay_options=options)
            opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
            target = torch.zeros(1, device=pipe.devices[-1])

            def loss_fn(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
                return out.float().pow(2).mean()

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                if schedule == "gpipe":
                    loss_fn(pipe(x), target).backward()
                else:
                    pipe.step(x, target.expand(args.batch), loss_fn)
                opt.step()

            reset()
            record(name, timed(step, args.warm, args.steps))
            if graphs and pipe.graph_error:
                print(f"# {name}: graphs fell back to eager: {pipe.graph_error.splitlines()[-1]}", flush=True)
            del seq, pipe, opt
            reset()
    base = {r[0].split(",")[0]: r[1] for r in rows if "eager" in r[0]}
    print("\n| configuration | samples/s | × eager, same schedule | peak GiB allocated | reserved |")
    print("|---|---|---|---|---|")
    for name, rate, alloc, reserved in rows:
        b = base.get(name.split(",")[0])
        ratio = f"{rate / b:.2f}" if b and "source" not in name else ""
        print(f"| {name} | {rate:.1f} | {ratio} | {' / '.join(map(str, alloc))} | {' / '.join(map(str, reserved))} |")


if __name__ == "__main__":
    main()
