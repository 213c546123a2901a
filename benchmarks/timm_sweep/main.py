"""Sweep: timm architectures no test names, at their own input size, randomly initialised (no download).

Run: ``python benchmarks/timm_sweep/main.py [names...] [--trace]``; one line per model (see tests/helpers/sweep.py). Not in
the CI (about 50 minutes on one core): a wider look than tests/convert/test_timm.py, run by hand.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# the sweep's harness is the one tests/convert/test_sweep.py runs: tests/helpers/sweep.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from helpers import sweep as harness  # noqa: E402

import timm  # noqa: E402

NAMES = [
    "nest_tiny_jx", "twins_svt_small", "xcit_nano_12_p16_224", "gcvit_xxtiny", "davit_tiny", "sequencer2d_s",
    "resmlp_12_224", "gmlp_ti16_224", "mixer_s16_224", "convmixer_768_32", "dla34", "dpn68", "hrnet_w18_small",
    "cspresnet50", "res2net50_14w_8s", "skresnet18", "selecsls42b", "tresnet_m", "ese_vovnet19b_dw", "rexnet_100",
    "lcnet_050", "tinynet_e", "mobilenetv4_conv_small", "inception_next_tiny", "eva02_tiny_patch14_224",
    "nextvit_small", "starnet_s1", "vit_little_patch16_reg4_gap_256", "efficientformer_l1", "cs3darknet_s",
    "resnest14d", "nf_resnet26", "halonet26t", "botnet26t_256", "lambda_resnet26t", "visformer_tiny", "pit_ti_224",
    "tnt_s_patch16_224", "convit_tiny", "fasternet_t0",
    "repvit_m1", "fastvit_t8", "mobilevit_xxs", "mobilevitv2_050", "edgenext_xx_small", "levit_128s", "cait_xxs24_224",
    "deit_tiny_distilled_patch16_224", "efficientvit_b0", "efficientvit_m0", "tiny_vit_5m_224", "swinv2_cr_tiny_ns_224",
    "swinv2_tiny_window8_256", "maxxvit_rmlp_nano_rw_256", "coatnet_nano_rw_224", "regnetz_b16", "ecaresnet26t",
    "seresnext26d_32x4d", "gernet_s", "repvgg_a0", "mobileone_s0", "hgnet_tiny", "hgnetv2_b0", "xception41",
    "inception_v4", "mnasnet_small", "fbnetc_100", "ghostnet_100", "dm_nfnet_f0", "resnetv2_50x1_bit", "resnetrs50",
    "cspdarknet53", "darknet53", "densenetblur121d", "rdnet_tiny", "vit_relpos_small_patch16_224", "mambaout_femto",
    "vitamin_small_224", "convformer_s18", "caformer_s18", "pvt_v2_b0", "flexivit_small", "deit3_small_patch16_224",
    "levit_conv_128s", "repghostnet_050", "sam2_hiera_tiny", "gcresnet33ts", "sebotnet33ts_256", "eca_halonext26ts",
    "resnet50_gn", "bat_resnext26ts", "vit_base_patch16_clip_224", "beit_base_patch16_224",
    "vit_medium_patch16_rope_reg1_gap_256", "coat_tiny", "crossvit_9_240", "pit_xs_distilled_224", "dla46_c",
    "vgg11_bn", "legacy_seresnet18", "tf_efficientnetv2_b0", "efficientnet_lite0", "mixnet_s", "mobilenetv3_rw",
    "csatv2", "shvit_s1", "starnet_s050", "naflexvit_base_patch16_gap",
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
