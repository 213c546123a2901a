"""A pipeline over one device against the converted model itself: what the executor adds per step.

    python benchmarks/probe/one_device_pipe.py --model resnet101 --batch 128     # on a GPU

Alternating rounds of training steps (forward, a loss, backward) of ``seq`` and of
``seqify.pipeline(seq, devices=[dev], chunks=1)``; prints the median per-step times, their ratio, and for one
profiled step of each the CUDA kernels launched and their summed time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torchvision

import seqify


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet101")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--after-tune", action="store_true", help="time both again after seqify.tune ran on the model")
    p.add_argument("--as-tuned", action="store_true",
                   help="also the pipeline as seqify.tune builds a trial (every option given), timed by its step_seconds")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    seq = seqify.convert(getattr(torchvision.models, args.model)()).to(dev).train()
    x = torch.randn(args.batch, 3, args.size, args.size, device=dev)
    pipe = seqify.pipeline(seq, devices=[dev], chunks=args.chunks)

    def step(m: torch.nn.Module) -> None:
        m(x).float().pow(2).mean().backward()
        seq.zero_grad(set_to_none=True)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def timed(m: torch.nn.Module) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(m)
        sync()
        return (time.perf_counter() - start) / args.steps

    runs = {"seq": seq, "pipe": pipe}

    def compare(when: str) -> None:
        for m in runs.values():
            timed(m)
        got: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            for k in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                got[k].append(timed(runs[k]))
        ms = {k: 1e3 * statistics.median(v) for k, v in got.items()}
        print(f"{when}: {args.model} b{args.batch} on {dev}: seq {ms['seq']:.2f} ms, pipeline (1 device, chunks "
              f"{args.chunks}) {ms['pipe']:.2f} ms, seq / pipeline speed {ms['seq'] / ms['pipe']:.3f}", flush=True)

    if args.as_tuned:
        from seqify.tuning import step_seconds

        trial = seqify.pipeline(seq, devices=[dev], loops=1, balance=[len(seq)], chunks=args.chunks,
                                checkpoint="never", graphs=False, schedule="gpipe").train()
        got2: dict[str, list[float]] = {"seq": [], "trial": []}
        for r in range(args.rounds):
            for k, m in (("seq", seq), ("trial", trial))[:: 1 if r % 2 == 0 else -1]:
                got2[k].append(step_seconds(m, x, [dev], steps=args.steps, warm=1))
        ms2 = {k: 1e3 * statistics.median(v) for k, v in got2.items()}
        print(f"step_seconds: seq {ms2['seq']:.2f} ms, trial pipeline {ms2['trial']:.2f} ms "
              f"({[round(1e3 * v, 1) for v in got2['trial']]})", flush=True)
    compare("before tune" if args.after_tune else "")
    if args.after_tune:
        seqify.tune(seq, x, devices=[dev], cache=False, show=False)
        compare("after tune")
    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        for k, m in runs.items():
            sync()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(m)
                sync()
            events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"  {k}: {len(events)} kernels, {sum(e.device_time for e in events) / 1e3:.2f} ms of kernels")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
