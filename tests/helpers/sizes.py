"""torchvision models the suite checks by a smaller model of their family, and the switch that checks them too."""

from __future__ import annotations

import os

__all__ = ["SIBLINGS", "EVERY_SIZE", "checked"]

#: Larger sizes of a family, each with the smallest model that runs the same code: the same blocks, built by
#: the same builder, with other widths, depths, group widths or patch sizes, which tracing does not branch on.
#: The suite checks the smaller one; ``SEQIFY_EVERY_SIZE=1`` checks these too (about 15 more minutes of two cores,
#: and up to 14 GiB of memory a model). A model torchvision adds is checked until it is listed here.
SIBLINGS: dict[str, str] = {
    "resnet34": "resnet18", "resnet101": "resnet50", "resnet152": "resnet50",
    "wide_resnet50_2": "resnet50", "wide_resnet101_2": "resnet50",
    "resnext101_32x8d": "resnext50_32x4d", "resnext101_64x4d": "resnext50_32x4d",
    "vgg13": "vgg11", "vgg16": "vgg11", "vgg19": "vgg11",
    "vgg13_bn": "vgg11_bn", "vgg16_bn": "vgg11_bn", "vgg19_bn": "vgg11_bn",
    "densenet161": "densenet121", "densenet169": "densenet121", "densenet201": "densenet121",
    **{f"efficientnet_b{i}": "efficientnet_b0" for i in range(1, 8)},
    "efficientnet_v2_m": "efficientnet_v2_s", "efficientnet_v2_l": "efficientnet_v2_s",
    **{f"regnet_x_{s}": "regnet_x_400mf" for s in ("800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf")},
    **{f"regnet_y_{s}": "regnet_y_400mf" for s in ("800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf", "128gf")},
    "convnext_small": "convnext_tiny", "convnext_base": "convnext_tiny", "convnext_large": "convnext_tiny",
    "swin_s": "swin_t", "swin_b": "swin_t", "swin_v2_s": "swin_v2_t", "swin_v2_b": "swin_v2_t",
    "vit_b_32": "vit_b_16", "vit_l_16": "vit_b_16", "vit_l_32": "vit_b_16", "vit_h_14": "vit_b_16",
    "mnasnet0_75": "mnasnet0_5", "mnasnet1_0": "mnasnet0_5", "mnasnet1_3": "mnasnet0_5",
    "shufflenet_v2_x1_0": "shufflenet_v2_x0_5", "shufflenet_v2_x1_5": "shufflenet_v2_x0_5",
    "shufflenet_v2_x2_0": "shufflenet_v2_x0_5",
    "fcn_resnet101": "fcn_resnet50", "deeplabv3_resnet101": "deeplabv3_resnet50",
    "swin3d_s": "swin3d_t", "swin3d_b": "swin3d_t",
    # detectors: the same detection code (transform, FPN, heads, post-processing) on another backbone or head
    "fasterrcnn_mobilenet_v3_large_fpn": "fasterrcnn_mobilenet_v3_large_320_fpn",
    "fasterrcnn_resnet50_fpn": "fasterrcnn_mobilenet_v3_large_320_fpn",
    "fasterrcnn_resnet50_fpn_v2": "fasterrcnn_mobilenet_v3_large_320_fpn",
    "maskrcnn_resnet50_fpn_v2": "maskrcnn_resnet50_fpn", "retinanet_resnet50_fpn_v2": "retinanet_resnet50_fpn",
    "ssd300_vgg16": "ssdlite320_mobilenet_v3_large",  # both torchvision's SSD class (builders in two modules)
}

EVERY_SIZE: bool = os.environ.get("SEQIFY_EVERY_SIZE", "") not in ("", "0")


def checked(name: str) -> bool:
    """Whether this run checks the torchvision model (or zoo entry) ``name``."""
    return EVERY_SIZE or name not in SIBLINGS
