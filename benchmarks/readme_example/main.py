"""The README's "same on two GPUs" example as written, timed: ResNet-101, batch 256, ``seqify.pipeline(model,
gpus=2, sample=x)`` (tuning included), then 10 steps of ``pipe.step``; prints the chosen configuration, the last
loss and the seconds from building the model to the end of step 10.

    python benchmarks/readme_example/main.py          # needs 2 GPUs
"""

from __future__ import annotations

import time

import torch
import torchvision

import seqify


def main() -> None:
    start = time.perf_counter()
    model = torchvision.models.resnet101()
    x = torch.randn(256, 3, 224, 224)
    y = torch.randint(0, 1000, (256,))

    pipe = seqify.pipeline(model, gpus=2, sample=x)
    print(pipe.config)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)

    x, y = x.to(pipe.input_device), y.to(pipe.output_device)
    for _ in range(10):
        opt.zero_grad()
        loss = pipe.step(x, y, torch.nn.functional.cross_entropy)
        opt.step()
    torch.cuda.synchronize()
    print(f"loss {loss.item()} total s {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    main()
