"""The zoo's catalogue: every model by name, how to build it, its default input, and weights that fit it."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from seqify.errors import ZooError
from seqify.zoo.amoebanet import amoebanet
from seqify.zoo.hf import gpt2, llama, vocab_size
from seqify.zoo.unet import unet

__all__ = ["Entry", "ZooError", "ENTRIES", "entry", "names", "build", "get", "sample", "load_weights"]


@dataclass(frozen=True)
class Entry:
    """One zoo model.

    ``size``: the side of the default square input (``in_channels x size x size``), or for a token model
    the default sequence length, used for partition hints and ``seqify inspect``; ``small``: keyword
    arguments and input side (or sequence length) of a small configuration of the same code, for quick
    checks; ``torchvision``: whether torchvision publishes weights for it. A token model (``vocab`` set:
    the vocabulary size of the configuration its keyword arguments build) takes ``input_ids``;
    ``blocks`` matches the names of its repeated blocks' layers (group 1: the block's index), where
    partition hints cut; ``frontend`` is the one ``get`` converts with; ``extra`` names the optional
    dependencies it needs (``pip install 'seqify[hf]'``).
    """

    name: str
    family: str
    source: str
    task: str
    size: int
    small: tuple[dict[str, Any], int]
    builder: Callable[..., nn.Module] = field(repr=False, compare=False)
    defaults: dict[str, Any] = field(default_factory=dict)
    in_channels: int = 3
    torchvision: bool = False
    about: str = ""
    vocab: Callable[..., int] | None = field(default=None, repr=False, compare=False)
    blocks: str = ""
    frontend: str = "auto"
    extra: str = ""

    @property
    def tokens(self) -> bool:
        """Whether the model takes token ids (``input_ids``) rather than images."""
        return self.vocab is not None

    @property
    def available(self) -> bool:
        """Whether the optional dependencies it needs are installed (transformers for ``extra='hf'``)."""
        if self.extra != "hf":
            return True
        import importlib.util

        try:
            return importlib.util.find_spec("transformers") is not None
        except ValueError:  # a module in sys.modules without a spec (None: imports of it are blocked)
            return False


def _torchvision_builder(name: str) -> Callable[..., nn.Module]:
    def build(**kwargs: Any) -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None, **kwargs)

    return build


_FAMILIES: list[tuple[str, list[str]]] = [
    ("ResNet", ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]),
    ("ResNeXt", ["resnext50_32x4d", "resnext101_32x8d", "resnext101_64x4d"]),
    ("Wide ResNet", ["wide_resnet50_2", "wide_resnet101_2"]),
    ("VGG", ["vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn"]),
    ("DenseNet", ["densenet121", "densenet161", "densenet169", "densenet201"]),
    ("MobileNet", ["mobilenet_v2", "mobilenet_v3_large", "mobilenet_v3_small"]),
    ("EfficientNet", [f"efficientnet_b{i}" for i in range(8)]),
    ("EfficientNetV2", ["efficientnet_v2_s", "efficientnet_v2_m", "efficientnet_v2_l"]),
    (
        "RegNet",
        [f"regnet_x_{s}" for s in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf")]
        + [f"regnet_y_{s}" for s in ("400mf", "800mf", "1_6gf", "3_2gf", "8gf", "16gf", "32gf", "128gf")],
    ),
    ("ConvNeXt", ["convnext_tiny", "convnext_small", "convnext_base", "convnext_large"]),
    ("ViT", ["vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14"]),
    ("Swin", ["swin_t", "swin_s", "swin_b", "swin_v2_t", "swin_v2_s", "swin_v2_b"]),
    ("MaxViT", ["maxvit_t"]),
]
_SEGMENTATION: list[tuple[str, list[str]]] = [
    ("FCN", ["fcn_resnet50", "fcn_resnet101"]),
    ("DeepLabV3", ["deeplabv3_resnet50", "deeplabv3_resnet101", "deeplabv3_mobilenet_v3_large"]),
    ("LR-ASPP", ["lraspp_mobilenet_v3_large"]),
]


def _small(name: str) -> tuple[dict[str, Any], int]:
    """A configuration of torchvision's own code that runs fast on a CPU."""
    if name.startswith("vit_"):
        side = 28 if name == "vit_h_14" else 32
        return {"image_size": side}, side
    if name.startswith("regnet_"):
        return {}, 32
    if name == "maxvit_t":
        return {}, 224  # its attention windows need 224 x 224
    return {}, 64


def _catalogue() -> dict[str, Entry]:
    out: dict[str, Entry] = {}
    for family, members in _FAMILIES:
        for name in members:
            out[name] = Entry(name, family, f"torchvision.models.{name}", "classification", 224, _small(name),
                              _torchvision_builder(name), torchvision=True)
    for family, members in _SEGMENTATION:
        for name in members:
            out[name] = Entry(name, family, f"torchvision.models.segmentation.{name}", "segmentation", 520,
                              ({}, 64), _torchvision_builder(name), defaults={"weights_backbone": None},
                              torchvision=True)
    out["unet"] = Entry(
        "unet", "U-Net", "seqify.zoo.unet", "segmentation", 256, ({"depth": 2, "blocks": 1, "channels": 8}, 32),
        unet, about="U-Net(B=blocks, C=channels) with `depth` levels; sides divisible by 2**depth",
    )
    out["amoebanet_d"] = Entry(
        "amoebanet_d", "AmoebaNet-D", "seqify.zoo.amoebanet", "classification", 224,
        ({"layers": 6, "filters": 16, "num_classes": 10}, 32), amoebanet,
        about="AmoebaNet-D(L=layers, F=filters), GPipe's model; sides divisible by 32",
    )
    out["llama"] = Entry(
        "llama", "Llama", "transformers.LlamaForCausalLM", "language modelling", 128,
        ({"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "vocab_size": 64}, 8),
        llama, vocab=lambda **kw: vocab_size("llama", **kw), blocks=r"model_layers_(\d+)(?:_|$)",
        frontend="export", extra="hf",
        about="LlamaForCausalLM from a LlamaConfig: preset='tiny' (default), '0.89b' or '8b', or config fields",
    )
    out["gpt2"] = Entry(
        "gpt2", "GPT-2", "transformers.GPT2LMHeadModel", "language modelling", 128,
        ({"n_embd": 16, "n_layer": 2, "n_head": 2, "vocab_size": 64}, 8),
        gpt2, vocab=lambda **kw: vocab_size("gpt2", **kw), blocks=r"transformer_h_(\d+)(?:_|$)",
        frontend="export", extra="hf",
        about=("GPT2LMHeadModel from a GPT2Config: preset='tiny' (default), '124m', '355m', '774m' or '1.5b', or "
               "config fields"),
    )
    return out


ENTRIES: dict[str, Entry] = _catalogue()


def names(family: str | None = None) -> list[str]:
    """Every zoo name (or those of one family, e.g. ``'ResNet'``), in catalogue order."""
    return [n for n, e in ENTRIES.items() if family is None or e.family.lower() == family.lower()]


def entry(name: str) -> Entry:
    """The catalogue entry for ``name``; :class:`ZooError` with close names when there is none."""
    found = ENTRIES.get(name)
    if found is None:
        import difflib

        close = difflib.get_close_matches(name, ENTRIES, n=4, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ZooError(f"no zoo model named {name!r}{hint}; seqify.zoo.list() names all {len(ENTRIES)}")
    return found


def _weights_enum(name: str, weights: Any) -> Any:
    """The torchvision weights enum member ``weights`` names for model ``name``, or None if it names none."""
    import torchvision
    from torchvision.models import WeightsEnum

    cls = torchvision.models.get_model_weights(name)
    if isinstance(weights, WeightsEnum):
        if not isinstance(weights, cls):
            raise ZooError(f"weights {weights} are not weights of {name}; use one of {', '.join(str(w) for w in cls)}")
        return weights
    if isinstance(weights, str) and "/" not in weights and os.sep not in weights and not os.path.exists(weights):
        short = weights.split(".", 1)[1] if weights.startswith(cls.__name__ + ".") else weights
        if short == "DEFAULT":
            return cls.DEFAULT
        try:
            return cls[short]
        except KeyError:
            raise ZooError(
                f"{weights!r} names no weights of {name} and no file; use one of "
                f"{', '.join(['DEFAULT', *(w.name for w in cls)])}, or a path to a checkpoint"
            ) from None
    return None


def _adapt(e: Entry, enum: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """What torchvision's builder sets when given weights: the head and input size they were trained with."""
    meta = enum.meta
    kwargs = dict(kwargs)
    kwargs.setdefault("num_classes", len(meta["categories"]))
    if e.name.startswith("vit_"):
        kwargs.setdefault("image_size", meta["min_size"][0])
    if e.name == "maxvit_t":
        kwargs.setdefault("input_size", meta["min_size"])
    if e.name.startswith(("fcn_", "deeplabv3_")):
        kwargs.setdefault("aux_loss", True)
    return kwargs


def build(name: str, **kwargs: Any) -> nn.Module:
    """The source model ``name`` (no weights), built with ``kwargs`` (e.g. ``num_classes=10``)."""
    e = entry(name)
    return e.builder(**{**e.defaults, **kwargs})


def _read_checkpoint(weights: Any) -> Mapping[str, torch.Tensor]:
    if isinstance(weights, Mapping):
        state = weights
    else:
        path = os.fspath(weights)
        if not os.path.exists(path):
            raise ZooError(f"weights file {path!r} does not exist")
        state = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("state_dict", "model"):  # common checkpoint wrappers: {"model": state_dict, "epoch": ...}
        inner = state.get(key) if isinstance(state, Mapping) else None
        if isinstance(inner, Mapping):
            state = inner
    if not isinstance(state, Mapping):
        raise ZooError(f"weights {weights!r} hold a {type(state).__name__}, not a state dict")
    return state


def load_weights(seq: Any, weights: Any, enum: Any = None) -> None:
    """Load ``weights`` (a torchvision weights enum, a state dict, or a checkpoint path) into ``seq``
    through :meth:`seqify.Sequential.load_original_state_dict` (strict keys and shapes)."""
    state = enum.get_state_dict(progress=True, check_hash=True) if enum is not None else _read_checkpoint(weights)
    seq.load_original_state_dict(state)


def get(
    name: str,
    weights: Any = None,
    *,
    example_inputs: Any = None,
    return_source: bool = False,
    train: bool = True,
    **kwargs: Any,
) -> Any:
    """Zoo model ``name`` converted into a pipeline-ready :class:`seqify.Sequential`.

    Args:
        name: a zoo name (``seqify.zoo.list()``): torchvision names such as ``'resnet50'`` or
            ``'vit_b_16'``, and ``'unet'``, ``'amoebanet_d'``.
        weights: None (random initialisation, no download); for torchvision models a weights enum
            member (``ResNet50_Weights.IMAGENET1K_V2``) or its name (``'IMAGENET1K_V2'``, ``'DEFAULT'``),
            which torchvision downloads; or, for any model, a state dict or a checkpoint file written
            for the source (``torch.save(model.state_dict(), path)``). Loaded with
            ``load_original_state_dict``: keys and shapes must match.
        example_inputs: passed to :func:`seqify.convert` (for shape-dependent code). Token models
            (``llama``, ``gpt2``) are converted by the export frontend on ``{'input_ids': ids}`` of 2
            sequences of the entry's default length (128) unless given: the sequence length is fixed at
            conversion (``seq.guards``), the batch is not.
        return_source: return ``(seq, source)``; the two share every parameter and buffer.
        train: convert the source in train mode (the default) or, if False, in eval mode (``seq`` and
            ``source`` are then in eval mode). It matters only for forwards whose ops differ between the
            modes (GPT-2 passes its attention dropout as a number): such a conversion refuses to run in
            the other mode (``ModeError``).
        kwargs: passed to the builder, e.g. ``num_classes=10``, ``image_size=384`` (ViT),
            ``depth=5, blocks=2, channels=64`` (U-Net), ``layers=18, filters=256`` (AmoebaNet-D),
            ``preset='0.89b'`` or config fields such as ``num_hidden_layers=8`` (Llama, GPT-2).
    """
    from seqify.convert import convert

    e = entry(name)
    enum = _weights_enum(name, weights) if weights is not None and e.torchvision else None
    if enum is not None:
        kwargs = _adapt(e, enum, kwargs)
    source = build(name, **kwargs).train(train)
    if e.tokens and example_inputs is None:
        example_inputs = {"input_ids": _example_ids(e, **kwargs)}
    seq = convert(source, example_inputs, frontend=e.frontend)
    if weights is not None:
        load_weights(seq, weights, enum)
    return (seq, source) if return_source else seq


def _example_ids(e: Entry, **kwargs: Any) -> torch.Tensor:
    """The token ids a token model is converted on: 2 x the default length, the same on every call."""
    assert e.vocab is not None
    return torch.randint(0, e.vocab(**kwargs), (2, e.size), generator=torch.Generator().manual_seed(0))


def sample(name: str, batch: int = 1, size: int | None = None, device: Any = None, **kwargs: Any) -> torch.Tensor:
    """A random input batch for ``name``: ``batch x in_channels x size x size`` (the entry's default side,
    or the ``image_size`` a ViT was built with); for a token model (``llama``, ``gpt2``) token ids
    (``input_ids``, int64) of ``batch x size`` below the vocabulary of the configuration ``kwargs`` build."""
    e = entry(name)
    if e.vocab is not None:
        return torch.randint(0, e.vocab(**kwargs), (batch, size or e.size), device=device)
    side = size or kwargs.get("image_size") or e.size
    channels = kwargs.get("in_channels", e.in_channels)
    return torch.randn(batch, channels, side, side, device=device)
