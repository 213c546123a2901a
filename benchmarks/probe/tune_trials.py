"""Probe: what the tuner predicts for ResNet-101 (batch 256, fp32) on two GPUs: its choice and the candidates
it ranked (print(cfg)), then ZB-H2 at 4 chunks fixed (predicted beside measured), the fastest configuration
measured by hand on 2x H200.

    python benchmarks/probe/tune_trials.py
"""

from __future__ import annotations

import torch
import torchvision

import seqify

torch.manual_seed(0)
seq = seqify.convert(torchvision.models.resnet101())
x = torch.randn(256, 3, 224, 224)
print(seqify.tune(seq, x, gpus=2, cache=False, show=False), flush=True)
print(seqify.tune(seq, x, gpus=2, cache=False, show=False, schedule="zb-h2", chunks=4, loops=1, graphs=True, top=1))
