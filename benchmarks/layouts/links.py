"""Bandwidth between two GPUs in one process: a peer copy, NCCL reduce and broadcast (torch.cuda.nccl), and
torch.cuda.comm's coalesced forms, on 178 MB (ResNet-101's fp32 gradients) in one tensor and in ResNet-101's
314 parameter shapes."""

import statistics
import time

import torch
import torch.cuda.comm
import torchvision


def timed(fn, k=10):
    out = []
    for _ in range(k):
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize(0), torch.cuda.synchronize(1)
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main():
    print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1), "nccl", torch.cuda.nccl.version())
    n = 44_549_160
    a, b = torch.randn(n, device="cuda:0"), torch.randn(n, device="cuda:1")
    gb = n * 4 / 1e9
    for name, fn in [("peer copy", lambda: b.copy_(a)), ("nccl.reduce", lambda: torch.cuda.nccl.reduce([a, b], root=0)),
                     ("nccl.broadcast", lambda: torch.cuda.nccl.broadcast([a, b], root=0)),
                     ("nccl.all_reduce", lambda: torch.cuda.nccl.all_reduce([a, b]))]:
        ms = timed(fn)
        print(f"{name}: {ms:.2f} ms, {gb / ms * 1e3:.0f} GB/s")
    shapes = [p.shape for p in torchvision.models.resnet101().parameters()]
    xs = [torch.randn(s, device="cuda:0") for s in shapes]
    ys = [torch.randn(s, device="cuda:1") for s in shapes]
    print(f"broadcast_coalesced: {timed(lambda: torch.cuda.comm.broadcast_coalesced(xs, [0, 1])):.2f} ms")
    print(f"reduce_add_coalesced: {timed(lambda: torch.cuda.comm.reduce_add_coalesced([xs, ys], 0)):.2f} ms")
    print(f"per-tensor peer copies: {timed(lambda: [y.copy_(x, non_blocking=True) for x, y in zip(xs, ys)]):.2f} ms")
    print(f"_foreach_copy_ across: {timed(lambda: torch._foreach_copy_(ys, xs)):.2f} ms")


if __name__ == "__main__":
    main()
