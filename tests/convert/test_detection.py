"""torchvision's detectors convert exactly in eval mode: their post-processing (box selection by score, mask
pasting, ``ImageList`` bookkeeping) stays whole where fx cannot trace it, their backbones become fine layers,
and a pipeline cut inside the backbone computes what the source computes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torchvision import models
from torchvision.models.detection import keypoint_rcnn, mask_rcnn

import seqify
from helpers.sizes import checked

warnings.filterwarnings("ignore", category=UserWarning)

DETECTION = models.list_models(module=models.detection)


def detector(name: str) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """``name`` without weights, resizing to 96-128 pixels, keeping every box whatever its score (random
    weights score below the default thresholds: nothing would be compared), and two images of other sizes.
    The detection code is the same at these sizes; the work is a fraction."""
    torch.manual_seed(0)
    options: dict[str, object] = {"weights": None, "weights_backbone": None}
    if name.startswith("ssd"):
        options.update(score_thresh=0.0, detections_per_img=5)
    else:
        options.update(min_size=96, max_size=128)
        if "rcnn" in name:  # and 100 proposals an image, 64 sampled for the heads' losses (not 1000-2000, 512)
            options.update(box_score_thresh=0.0, box_detections_per_img=5, rpn_pre_nms_top_n_train=200,
                           rpn_pre_nms_top_n_test=200, rpn_post_nms_top_n_train=100, rpn_post_nms_top_n_test=100,
                           box_batch_size_per_image=64)
        if name.startswith("maskrcnn"):  # the same head class with one layer instead of four
            options.update(mask_head=mask_rcnn.MaskRCNNHeads(256, [256], 1))
        if name.startswith("keypointrcnn"):  # one layer instead of eight
            options.update(keypoint_head=keypoint_rcnn.KeypointRCNNHeads(256, (512,)))
        else:
            options.update(score_thresh=0.0, detections_per_img=5)
    generator = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 160, 200, generator=generator), torch.rand(3, 180, 150, generator=generator)]
    return models.get_model(name, **options).eval(), images


def targets(name: str, images: list[torch.Tensor], shift: float = 0.0) -> list[dict[str, torch.Tensor]]:
    """Two boxes an image, with the masks or keypoints the model's heads learn from."""
    boxes = torch.tensor([[10.0, 20.0, 80.0, 90.0], [30.0, 40.0, 100.0, 120.0]]) + shift
    found = []
    for image in images:
        target = {"boxes": boxes, "labels": torch.tensor([1, 1] if "keypoint" in name else [1, 2])}
        if "mask" in name:
            target["masks"] = (torch.rand(2, *image.shape[-2:]) > 0.5).to(torch.uint8)
        if "keypoint" in name:
            target["keypoints"] = torch.cat([torch.rand(2, 17, 2) * 60 + 30 + shift, torch.ones(2, 17, 1)], -1)
        found.append(target)
    return found


def assert_same(expected: object, got: object) -> None:
    assert pytree.tree_structure(expected) == pytree.tree_structure(got)
    for a, b in zip(pytree.tree_leaves(expected), pytree.tree_leaves(got)):
        assert torch.equal(a, b)


def cut_in_backbone(seq: seqify.Sequential) -> seqify.Pipeline:
    """A pipeline of two CPU partitions, cut halfway through the backbone's layers."""
    backbone = [i for i, (n, _) in enumerate(seq.named_children()) if n.startswith("backbone")]
    assert len(backbone) > 10  # the bulk is fine layers
    cut = backbone[len(backbone) // 2]
    return seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[cut, len(seq) - cut], chunks=1)


@pytest.mark.parametrize("name", [n for n in DETECTION if checked(n)])
def test_detector_converts_exactly_in_eval(name: str) -> None:
    model, images = detector(name)
    seq = seqify.convert(model, example_inputs=(images,))
    if name.startswith(("retinanet", "fcos", "ssd")):  # box selection is a method of the model: kept whole, named
        assert "postprocess_detections()" in {o.path for o in seq.opaque}
        assert "postprocess_detections()" in seq.summary()
    with torch.no_grad():
        expected = model(images)
        assert all(len(d["boxes"]) == 5 for d in expected)  # boxes to compare
        assert_same(expected, seq(images))
        other = [torch.rand_like(x) for x in images]  # other pictures of the same sizes, through a pipeline
        assert_same(model(other), cut_in_backbone(seq)(other))


#: Detectors converted in training mode, with targets: their losses (region sampling drawn in the source's order).
TRAINED = ["fasterrcnn_mobilenet_v3_large_320_fpn", "retinanet_resnet50_fpn", "fcos_resnet50_fpn",
           "ssdlite320_mobilenet_v3_large", "maskrcnn_resnet50_fpn", "keypointrcnn_resnet50_fpn"]


@pytest.mark.parametrize("name", TRAINED)
def test_detector_converts_exactly_in_training_with_targets(name: str) -> None:
    """convert's self-check compares the losses and every gradient; here other targets and another seed (the
    proposal samplers draw) give the source's losses and gradients too, through a pipeline."""
    model, images = detector(name)
    model.train()
    seq = seqify.convert(model, example_inputs=(images, targets(name, images)))
    other = targets(name, images, shift=5.0)
    torch.manual_seed(1)
    expected = model(images, other)
    sum(expected.values()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)  # the converted model trains the source's own parameters
    torch.manual_seed(1)
    got = cut_in_backbone(seq)(images, other)
    sum(got.values()).backward()
    assert_same(expected, got)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_detector_refuses_images_of_other_sizes_with_the_reason() -> None:
    """Resizing follows each image's size, which the conversion fixed: an image of another size is refused
    with the reason, not computed wrong."""
    model, images = detector("fasterrcnn_mobilenet_v3_large_320_fpn")
    seq = seqify.convert(model, example_inputs=(images,))
    with torch.no_grad(), pytest.raises(seqify.SeqifyError, match="transform"):
        seq([torch.rand(3, 100, 100), images[1]])
