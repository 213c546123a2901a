"""The ceiling a 2-stage pipeline can reach: one GPU's ResNet-101 training
throughput at each micro-batch size, eager and with CUDA graphs (launch
overhead removed), fp32 and bf16 autocast.

ideal pipeline (n stages, m micro-batches of size b) ~= n * thr(b) * m / (m + n - 1)

    python benchmarks/limits.py [--out DIR]      # writes DIR/limits.json
"""
import argparse
import json
import os
import time

import torch
import torchvision
from torch import nn

RES = 224


def bench(b, graphed, bf16, steps=10, warm=3):
    torch.manual_seed(0)
    m = torchvision.models.resnet101().cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x = torch.randn(b, 3, RES, RES, device="cuda")
    y = torch.randint(0, 1000, (b,), device="cuda")
    if graphed:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
                    loss = nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(g):
            with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
        step = g.replay
    else:
        def step():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", torch.bfloat16, enabled=bf16):
                loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
    for _ in range(warm):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return b * steps / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    rows = []
    for bf16 in (False, True):
        for b in (8, 16, 32, 64, 128, 256):
            for graphed in (False, True):
                try:
                    thr = bench(b, graphed, bf16)
                    row = dict(b=b, graphed=graphed, bf16=bf16, samples_per_s=round(thr, 1))
                except Exception as e:  # record and go on
                    row = dict(b=b, graphed=graphed, bf16=bf16, error=f"{type(e).__name__}: {str(e)[:200]}")
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    with open(os.path.join(args.out, "limits.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
