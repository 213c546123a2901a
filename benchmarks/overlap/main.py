"""Probe: can a GPU run one micro-batch's forward beside another's backward (two streams) faster than one
after the other, at the small micro-batches a 16-chunk pipeline gives? ResNet-101 (fp32, train mode), whole
and in two halves, each as captured CUDA graphs: two slots (a, b) of forward + backward programs with pools
of their own, replayed serially on one stream against F on one stream beside B on another (F of one slot
next to B of the other, the steady state of 1F1B on one device). Prints ms per micro-batch (F + B) and the
speed-up of overlapping, with peak memory.

    python benchmarks/overlap/main.py --micro 16 32 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torchvision
from torch import nn


class _Slot:
    """One micro-batch's forward and backward as two CUDA graphs in a pool of their own."""

    def __init__(self, model: nn.Module, micro: int, acc: list[torch.Tensor], side: torch.cuda.Stream) -> None:
        params = [p for p in model.parameters()]
        self.x = torch.randn(micro, *model.in_shape, device="cuda", requires_grad=model.needs_grad)
        with torch.cuda.stream(side):
            for _ in range(3):  # warm: cuDNN picks kernels outside capture
                out = model(self.x)
                gout = torch.randn_like(out)
                torch.autograd.grad(out, ([self.x] if model.needs_grad else []) + params, gout)
        torch.cuda.synchronize()
        self.gout = gout
        pool = torch.cuda.graph_pool_handle()
        self.f, self.b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.f, pool=pool, stream=side):
            self.out = model(self.x)
        with torch.cuda.graph(self.b, pool=pool, stream=side):
            wrt = [self.x] if model.needs_grad else []
            grads = torch.autograd.grad(self.out, wrt + params, self.gout)
            self.xgrad = grads[0] if wrt else None
            torch._foreach_add_(acc, list(grads[len(wrt):]))
        torch.cuda.synchronize()


def measure(model: nn.Module, micro: int, steps: int) -> dict:
    acc = [torch.zeros_like(p) for p in model.parameters()]
    side = torch.cuda.Stream()
    torch.cuda.reset_peak_memory_stats()
    a, b = _Slot(model, micro, acc, side), _Slot(model, micro, acc, side)
    fs, bs = torch.cuda.Stream(), torch.cuda.Stream()

    def serial(n: int) -> None:
        with torch.cuda.stream(fs):
            for _ in range(n):
                for s in (a, b):
                    s.f.replay()
                    s.b.replay()

    def overlapped(n: int) -> None:
        # F(b) beside B(a), then F(a) beside B(b): each slot's B after its F, its next F after its B
        done_f = {id(a): torch.cuda.Event(), id(b): torch.cuda.Event()}
        done_b = {id(a): torch.cuda.Event(), id(b): torch.cuda.Event()}
        with torch.cuda.stream(fs):
            a.f.replay()
            done_f[id(a)].record(fs)
        for _ in range(n):
            for now, other in ((b, a), (a, b)):
                with torch.cuda.stream(fs):
                    if started[id(now)]:
                        fs.wait_event(done_b[id(now)])
                    now.f.replay()
                    done_f[id(now)].record(fs)
                with torch.cuda.stream(bs):
                    bs.wait_event(done_f[id(other)])
                    other.b.replay()
                    done_b[id(other)].record(bs)
                    started[id(other)] = True
        fs.wait_stream(bs)

    started = {id(a): False, id(b): False}
    rows = {}
    for name, fn in (("serial", serial), ("overlapped", overlapped)):
        for n in (3, steps):
            started.update({id(a): False, id(b): False})
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn(n)
            torch.cuda.synchronize()
        rows[name] = (time.perf_counter() - t) * 1e3 / (2 * steps)
    peak = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30
    return {"micro": micro, "serial_ms": rows["serial"], "overlapped_ms": rows["overlapped"],
            "speedup": rows["serial"] / rows["overlapped"], "peak_allocated_gib": round(peak[0], 2),
            "peak_reserved_gib": round(peak[1], 2)}


def parts() -> dict[str, nn.Module]:
    m = torchvision.models.resnet101()
    first = nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, m.layer2, *m.layer3[:10])
    second = nn.Sequential(*m.layer3[10:], m.layer4, m.avgpool, nn.Flatten(), m.fc)
    whole = nn.Sequential(first, second)
    for mod, shape, grad in ((whole, (3, 224, 224), False), (first, (3, 224, 224), False),
                             (second, (1024, 14, 14), True)):
        mod.in_shape, mod.needs_grad = shape, grad
    return {"whole": whole.cuda(), "first half": first, "second half": second}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--micro", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'part':<12} {'micro':>5} {'serial ms':>10} {'overlap ms':>11} {'x':>6} {'alloc GiB':>10} {'resv GiB':>9}")
    for name, model in parts().items():
        for micro in args.micro:
            r = {"part": name, **measure(model, micro, args.steps)}
            rows.append(r)
            print(f"{name:<12} {micro:>5} {r['serial_ms']:>10.2f} {r['overlapped_ms']:>11.2f} {r['speedup']:>6.3f} "
                  f"{r['peak_allocated_gib']:>10.2f} {r['peak_reserved_gib']:>9.2f}", flush=True)
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "overlap_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
