"""seqify.zoo: pipeline-ready models by name, with recommended partitions per GPU count.

    import seqify
    seqify.zoo.list()                                  # ['resnet18', ..., 'unet', 'amoebanet_d']
    seq = seqify.zoo.get("resnet101")                  # a seqify.Sequential, exact against torchvision's
    pipe = seqify.pipeline(seq, gpus=4, balance=seqify.zoo.hints("resnet101", 4), chunks=8)
    seq = seqify.zoo.get("resnet50", weights="IMAGENET1K_V2")   # torchvision's weights (downloads)
    seq = seqify.zoo.get("amoebanet_d", layers=18, filters=256)  # GPipe's AmoebaNet-D(18, 256)
    seq = seqify.zoo.get("llama", preset="0.89b")      # transformers' LlamaForCausalLM from a config
    ids = seqify.zoo.sample("llama", batch=8)          # token ids: seq(input_ids=ids).logits

The torchvision families (ResNet, ResNeXt, Wide ResNet, VGG, DenseNet, MobileNet v2/v3, EfficientNet
v1/v2, RegNet, ConvNeXt, ViT, Swin, MaxViT, FCN, DeepLabV3, LR-ASPP) by their torchvision names, plus
the pipeline models of the GPipe literature torchvision lacks: U-Net(B, C) and AmoebaNet-D(L, F), and
the language models pipelines train most, built from a transformers config without downloading:
``llama`` (LlamaForCausalLM) and ``gpt2`` (GPT2LMHeadModel), which need ``pip install 'seqify[hf]'``.
``python -m seqify.zoo`` prints the table (docs/zoo.md).
"""

from __future__ import annotations

import builtins

from seqify.zoo.amoebanet import AmoebaNetD, amoebanet
from seqify.zoo.catalog import ENTRIES, Entry, ZooError, build, entry, get, load_weights, names, sample
from seqify.zoo.hf import GPT2_PRESETS, LLAMA_PRESETS, gpt2, llama
from seqify.zoo.plans import Facts, facts, hints, plan
from seqify.zoo.unet import UNet, unet

__all__ = [
    "list",
    "get",
    "build",
    "hints",
    "plan",
    "facts",
    "sample",
    "entry",
    "Entry",
    "ENTRIES",
    "ZooError",
    "Facts",
    "load_weights",
    "UNet",
    "unet",
    "AmoebaNetD",
    "amoebanet",
    "llama",
    "gpt2",
    "LLAMA_PRESETS",
    "GPT2_PRESETS",
]


def list(family: str | None = None) -> builtins.list[str]:  # noqa: A001 - seqify.zoo.list() reads best
    """Every zoo name, or those of one ``family`` (``'ResNet'``, ``'ViT'``, ``'U-Net'``, ...)."""
    return names(family)

