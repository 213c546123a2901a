"""Sweep: timm architectures no test names, at their own input size, randomly initialised (no download).

Run: ``python benchmarks/sweep/timm_models.py [names...] [--trace]``; one line per model (see harness.py). Not in
the CI (about 10 minutes on one core): a wider look than tests/test_timm.py, run by hand.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

import timm  # noqa: E402

NAMES = [
    "nest_tiny_jx", "twins_svt_small", "xcit_nano_12_p16_224", "gcvit_xxtiny", "davit_tiny", "sequencer2d_s",
    "resmlp_12_224", "gmlp_ti16_224", "mixer_s16_224", "convmixer_768_32", "dla34", "dpn68", "hrnet_w18_small",
    "cspresnet50", "res2net50_14w_8s", "skresnet18", "selecsls42b", "tresnet_m", "ese_vovnet19b_dw", "rexnet_100",
    "lcnet_050", "tinynet_e", "mobilenetv4_conv_small", "inception_next_tiny", "eva02_tiny_patch14_224",
    "nextvit_small", "starnet_s1", "vit_little_patch16_reg4_gap_256", "efficientformer_l1", "cs3darknet_s",
    "resnest14d", "nf_resnet26", "halonet26t", "botnet26t_256", "lambda_resnet26t", "visformer_tiny", "pit_ti_224",
    "tnt_s_patch16_224", "convit_tiny", "fasternet_t0",
]


def model(name: str) -> Callable[[], harness.Built]:
    def build() -> harness.Built:
        m = timm.create_model(name, pretrained=False, num_classes=10)
        size = m.pretrained_cfg.get("input_size", (3, 224, 224))
        first = next(iter(inspect.signature(m.forward).parameters))
        return m, {first: torch.randn(2, *size)}
    build.__name__ = name
    return build


REGISTRY = {name: model(name) for name in NAMES}

if __name__ == "__main__":
    raise SystemExit(harness.main(REGISTRY))
