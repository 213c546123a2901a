"""seqify.zoo: models for pipelines, as source modules or converted seqify.Sequentials."""

from __future__ import annotations

from .unet import UNet, unet

__all__ = ["UNet", "unet"]
