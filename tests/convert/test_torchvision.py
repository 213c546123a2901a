"""torchvision's classification, segmentation and video models convert exactly (every family; every size with
SEQIFY_EVERY_SIZE=1); detection models are in test_detection.py."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from torchvision import models

import seqify
from helpers.exactness import assert_exact
from helpers.sizes import SIBLINGS, checked

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)

# Smallest inputs each family accepts, to keep CI fast; the model code is torchvision's own.
SMALL: dict[str, tuple[dict, int]] = {
    "inception_v3": ({}, 299),
    "maxvit_t": ({}, 224),
    "vit_b_16": ({"image_size": 32}, 32),
    "vit_b_32": ({"image_size": 32}, 32),
    "vit_l_16": ({"image_size": 32}, 32),
    "vit_l_32": ({"image_size": 32}, 32),
    "vit_h_14": ({"image_size": 28}, 28),
    "regnet_y_128gf": ({}, 32),
    "regnet_y_32gf": ({}, 32),
    "regnet_x_32gf": ({}, 32),
    "regnet_y_16gf": ({}, 32),
    "regnet_x_16gf": ({}, 32),
}

# Models that take 12-14 GB of memory each (sizes checked only with SEQIFY_EVERY_SIZE): one after another on a
# single pytest-xdist worker (tests/conftest.py picks --dist loadgroup), since two at once do not fit 23 GiB.
GIANTS = {"regnet_y_128gf", "vit_h_14", "regnet_y_32gf", "regnet_x_32gf", "vit_l_16", "vit_l_32"}


def _checked(names: list[str]) -> list[object]:
    """The models a run checks: every one with SEQIFY_EVERY_SIZE, else those that are no larger sibling."""
    names = [n for n in names if checked(n)]
    return [pytest.param(n, marks=pytest.mark.xdist_group("giants")) if n in GIANTS else n for n in names]


CLASSIFICATION = models.list_models(module=models)
SEGMENTATION = models.list_models(module=models.segmentation)
VIDEO = models.list_models(module=models.video)
DETECTION = models.list_models(module=models.detection)


def test_every_sibling_names_a_checked_model_of_its_family() -> None:
    """A sibling's stand-in is a model the suite checks, built by the same torchvision builder module."""
    known = set(CLASSIFICATION + SEGMENTATION + VIDEO + DETECTION)
    assert set(SIBLINGS) <= known, sorted(set(SIBLINGS) - known)
    for big, small in SIBLINGS.items():
        assert small in known and small not in SIBLINGS, (big, small)
        if big in DETECTION:  # the same detector class: its code is the detection code checked
            with torch.device("meta"):
                assert type(build(big, weights_backbone=None)) is type(build(small, weights_backbone=None)), (big, small)
        else:
            assert models.get_model_builder(big).__module__ == models.get_model_builder(small).__module__, (big, small)


def build(name: str, **kwargs: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return models.get_model(name, weights=None, **kwargs)


def round_trip(seq: seqify.Sequential, model: torch.nn.Module) -> None:
    """original_state_dict speaks the source's keys; a checkpoint written for the source loads into the
    tensors the source and seq share (strict key and shape checks)."""
    sd = seq.original_state_dict()
    source = model.state_dict()
    assert list(sd) == list(source)
    for k, v in source.items():
        assert torch.equal(sd[k], v), k
    # a distinct offset per key: tensors that start equal (BatchNorm's ones) still tell a swap apart
    wanted = {k: v + (i + 1) for i, (k, v) in enumerate(source.items())}
    seq.load_original_state_dict(wanted)
    loaded = model.state_dict()
    for k, v in wanted.items():
        assert torch.equal(loaded[k], v), f"{k} not loaded into the shared source tensor"


@pytest.mark.parametrize("name", _checked(CLASSIFICATION))
def test_classification(name: str) -> None:
    kwargs, res = SMALL.get(name, ({}, 64))
    model = build(name, **kwargs)
    x = torch.randn(2, 3, res, res)
    mode_dependent = name in ("googlenet", "inception_v3")
    seq = assert_exact(model, (x,), train=True, backward=True)
    assert seq.mode_dependent == mode_dependent
    assert all(isinstance(layer, torch.nn.Module) for layer in seq)
    if mode_dependent:
        # googlenet and inception return auxiliary logits in train mode only: one conversion per mode, and the
        # eval-mode one refuses train mode
        eval_seq = assert_exact(model, (x,), train=False, backward=False)
        assert eval_seq.mode_dependent
        eval_seq.train()
        with pytest.raises(seqify.ModeError, match="train mode"):
            eval_seq(x)
    else:
        # One conversion serves both modes (converting is the costly part for the largest models). It reads the
        # source's own tensors: after the train-mode run moved BatchNorm statistics, eval still equals the source.
        assert_exact(model, (x,), train=False, backward=False, convert=lambda m: seq.eval())
    round_trip(seq, model)


@pytest.mark.parametrize("name", _checked(SEGMENTATION))
def test_segmentation(name: str) -> None:
    options = {"weights_backbone": None} if "lraspp" in name else {"weights_backbone": None, "aux_loss": True}
    model = build(name, **options)
    x = torch.randn(2, 3, 64, 64)
    for train in (False, True):
        seq = assert_exact(model, (x,), train=train, backward=train)
    out = seq(x)
    assert type(out) is type(model(x))
    round_trip(seq, model)


@pytest.mark.parametrize("name", _checked(VIDEO))
def test_video(name: str) -> None:
    model = build(name)
    # mvit and s3d take 16 frames of 224x224 and no fewer (fixed positional embeddings, a fixed final pool).
    # swin3d takes any size: 16 frames (8 after its 2-frame patches: one temporal window, as at 224x224) of
    # 64x64 keep its shifted, padded spatial windows in the first two stages, at a tenth of the work.
    big = name.startswith(("mvit", "s3d", "swin3d"))
    side = 64 if name.startswith("swin3d") else 224
    x = torch.randn(1, 3, 16, side, side) if big else torch.randn(2, 3, 4, 32, 32)
    assert_exact(model, (x,), train=False, backward=False)
    if not big:
        assert_exact(model, (x,), train=True)


def test_pretrained_style_checkpoint_keys() -> None:
    """A checkpoint written for torchvision's resnet50 (its exact keys) loads with strict checking."""
    source = build("resnet50")
    seq = seqify.convert(source)
    donor = build("resnet50")
    checkpoint = {k: v.clone() + 1 for k, v in donor.state_dict().items() if v.is_floating_point()}
    checkpoint.update({k: v.clone() for k, v in donor.state_dict().items() if not v.is_floating_point()})
    seq.load_original_state_dict(checkpoint)
    for k, v in checkpoint.items():
        assert torch.equal(seq.original_state_dict()[k], v)
    with pytest.raises(seqify.StateDictError, match="missing keys"):
        seq.load_original_state_dict({k: v for k, v in checkpoint.items() if k != "fc.weight"})
    with pytest.raises(seqify.StateDictError, match="unexpected keys"):
        seq.load_original_state_dict({**checkpoint, "head.weight": torch.zeros(1)})
    bad = dict(checkpoint)
    bad["fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(seqify.StateDictError, match="shapes"):
        seq.load_original_state_dict(bad)
    assert torchvision.__version__
