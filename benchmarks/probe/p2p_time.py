"""Probe: how long one pipeline message takes between two GPUs, NCCL send/recv against a copy engine.

    torchrun --nproc-per-node 2 benchmarks/probe/p2p_time.py --mb 25.7    # NCCL, this process's NCCL_* settings
    python benchmarks/probe/p2p_time.py --copy --mb 25.7                  # one process, a device-to-device copy

Times a message of the size ResNet-101's activations take at the 8-chunk cut (32 x 1024 x 14 x 14 fp32), one
way at a time and both ways at once (1F1B's activations and gradients cross together), idle and under a
matmul load on both GPUs, as the median of 30. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=25.7)
    p.add_argument("--copy", action="store_true")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    n = int(args.mb * 1e6 / 4)
    env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_P2P") or "P2P_NCHANNELS" in k}
    if args.copy:
        d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
        a, b = torch.randn(n, device=d0), torch.empty(n, device=d1)
        c, e = torch.randn(n, device=d1), torch.empty(n, device=d0)
        s0, s1 = torch.cuda.Stream(d0), torch.cuda.Stream(d1)
        for busy in (False, True):
            for both in (False, True):
                times = []
                for _ in range(args.reps):
                    if busy:
                        for d in (d0, d1):
                            with torch.cuda.device(d):
                                m = torch.randn(8192, 8192, device=d)
                                for _ in range(4):
                                    m @ m
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    with torch.cuda.stream(s0):
                        t0.record(s0)
                        b.copy_(a, non_blocking=True)
                        if both:
                            with torch.cuda.stream(s1):
                                e.copy_(c, non_blocking=True)
                            s0.wait_stream(s1)
                        t1.record(s0)
                    torch.cuda.synchronize(d0), torch.cuda.synchronize(d1)
                    times.append(t0.elapsed_time(t1))
                print(json.dumps({"how": "copy engine", "mb": args.mb, "busy": busy, "both_ways": both,
                                  "ms": round(statistics.median(times), 3),
                                  "GBps": round(args.mb / statistics.median(times), 1)}), flush=True)
        return
    dist.init_process_group("nccl")
    r = dist.get_rank()
    dev = torch.device("cuda", r)
    torch.cuda.set_device(dev)
    up = dist.new_group([0, 1])
    down = dist.new_group([0, 1])
    out, into = torch.randn(n, device=dev), torch.empty(n, device=dev)
    for g in (up, down):  # make the communicators
        if r == 0:
            dist.send(out, 1, group=g)
        else:
            dist.recv(into, 0, group=g)
    if r == 1:
        for g in (up, down):
            dist.send(out, 0, group=g)
    else:
        for g in (up, down):
            dist.recv(into, 1, group=g)
    torch.cuda.synchronize()
    side = torch.cuda.Stream(dev)
    m = torch.randn(8192, 8192, device=dev)
    for busy in (False, True):
        for both in (False, True):
            times = []
            for _ in range(args.reps):
                dist.barrier(group=up)
                torch.cuda.synchronize()
                if busy:  # on a stream of its own, running while the message crosses
                    with torch.cuda.stream(side):
                        for _ in range(4):
                            m @ m
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                works = []
                if r == 0:
                    works.append(dist.isend(out, 1, group=up))
                    if both:
                        works.append(dist.irecv(into, 1, group=down))
                else:
                    works.append(dist.irecv(into, 0, group=up))
                    if both:
                        works.append(dist.isend(out, 0, group=down))
                for w in works:
                    w.wait()
                t1.record()
                torch.cuda.synchronize()
                times.append(t0.elapsed_time(t1))
            med = statistics.median(times)
            row = {"how": "nccl", "env": env, "rank": r, "mb": args.mb, "busy": busy, "both_ways": both,
                   "ms": round(med, 3), "GBps": round(args.mb / med, 1)}
            if r == 1:
                print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
