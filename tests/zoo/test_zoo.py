"""seqify.zoo: every model converts exactly and pipelines exactly; hints are real plans; weights load; AmoebaNet-D."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils._pytree as pytree
import torchvision

import seqify
from helpers.sizes import checked
from seqify import zoo
from seqify.zoo import plans

warnings.filterwarnings("ignore", category=UserWarning)

TORCHVISION_FAMILIES = {
    "ResNet", "ResNeXt", "Wide ResNet", "VGG", "DenseNet", "MobileNet", "EfficientNet", "EfficientNetV2", "RegNet",
    "ConvNeXt", "ViT", "Swin", "MaxViT", "FCN", "DeepLabV3", "LR-ASPP",
}


def equal(a: object, b: object) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return pytree.tree_structure(a) == pytree.tree_structure(b) and all(torch.equal(x, y) for x, y in zip(la, lb))


def test_catalogue() -> None:
    names = zoo.list()
    assert len(names) == len(set(names))
    assert {"unet", "amoebanet_d", "resnet101", "vit_b_16", "swin_v2_t", "maxvit_t", "deeplabv3_resnet50"} <= set(names)
    assert {zoo.entry(n).family for n in names} >= TORCHVISION_FAMILIES | {"U-Net", "AmoebaNet-D", "Llama", "GPT-2"}
    assert [n for n in names if zoo.entry(n).tokens] == ["llama", "gpt2"]
    assert zoo.list("vit") == ["vit_b_16", "vit_b_32", "vit_l_16", "vit_l_32", "vit_h_14"]
    # every torchvision entry is torchvision's own builder name
    known = set(torchvision.models.list_models())
    assert all(n in known for n in names if zoo.entry(n).torchvision)
    with pytest.raises(zoo.ZooError, match="did you mean resnet101"):
        zoo.get("resnet1011")
    assert isinstance(seqify.zoo.ZooError("x"), seqify.SeqifyError)


def _module_of(e: zoo.Entry) -> str:
    if e.torchvision:
        return "torchvision.models"
    return "transformers.models" if e.extra == "hf" else "zoo."


@pytest.mark.parametrize("name", [n for n in zoo.list() if checked(n)])
def test_entry_converts_and_pipelines_exactly(name: str) -> None:
    """One small configuration per entry, built once (building dominates for the big ones): in eval mode
    the conversion is bit-equal to its source, and a 2-partition CPU pipeline over 2 micro-batches is
    bit-equal to the source run on each micro-batch. Token models (Llama, GPT-2) take token ids, and are
    converted for the sequence length of their small configuration. A larger torchvision size is checked by
    its family's smallest entry (helpers/sizes.py; every entry with SEQIFY_EVERY_SIZE=1), and
    test_cached_hints_table checks every entry's layers and plans."""
    e = zoo.entry(name)
    if e.extra == "hf":
        pytest.importorskip("transformers")
    kwargs, side = e.small
    torch.manual_seed(0)
    x = zoo.sample(name, 2, side, **kwargs) if e.tokens else torch.randn(2, e.in_channels, side, side)
    if e.tokens:
        assert x.dtype == torch.long and 0 <= int(x.min()) and int(x.max()) < kwargs["vocab_size"]
        seq, source = zoo.get(name, return_source=True, example_inputs={"input_ids": x}, train=False, **kwargs)
        assert seq.frontend == "export"
    else:
        seq, source = zoo.get(name, return_source=True, **kwargs)
    assert isinstance(seq, seqify.Sequential)
    assert _module_of(e) in type(source).__module__
    assert seq.original_keys() == list(source.state_dict())  # speaks the source's checkpoint keys
    source.eval()
    seq.eval()
    with torch.no_grad():
        halves = [source(x[:1]), source(x[1:])]
        assert equal(seq(x[:1]), halves[0])
        pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance="params", chunks=2)
        assert len(pipe.partitions) == 2 and sum(pipe.balance) == len(seq)
        got = pipe(x)
    assert equal(got, pytree.tree_map(lambda a, b: torch.cat([a, b]), *halves))


def test_hints_are_by_flops_plans() -> None:
    """hints() (cached table or computed on the meta device) equals seqify.balance by FLOPs on a real
    model and a real sample."""
    for name in ("resnet50", "unet"):
        torch.manual_seed(0)
        seq = zoo.get(name)
        x = zoo.sample(name)
        for gpus in (2, 4):
            plan = seqify.balance(seq, gpus, x, by="flops", progress=False)
            assert zoo.hints(name, gpus) == plan.balance, (name, gpus)
            assert zoo.plan(name, gpus).balance == plan.balance
    small = {"depth": 2, "blocks": 1, "channels": 8}
    seq = zoo.get("unet", **small)
    plan = seqify.balance(seq, 3, zoo.sample("unet", **small), by="flops", progress=False)
    assert zoo.hints("unet", 3, **small) == plan.balance
    assert zoo.hints("unet", 2, by="params", **small) == seqify.balance(seq, 2, by="params", progress=False).balance
    with pytest.raises(ValueError, match="static"):
        zoo.hints("unet", 2, by="time")


def test_cached_hints_table() -> None:
    table = plans.cached_table()
    if not table:
        pytest.skip("zoo/hints.json was written by another torch/torchvision; hints are computed instead")
    # every model but those of optional extras (transformers: their layers depend on its version too)
    assert set(table["models"]) == {n for n in zoo.list() if not zoo.entry(n).extra}
    for name, row in table["models"].items():
        for gpus, balance in row["balance"].items():
            assert len(balance) == int(gpus) and sum(balance) == row["layers"], name
    for name in ("resnet18", "unet"):  # the table is what the code computes
        facts = zoo.facts(name)
        row = table["models"][name]
        assert (row["layers"], row["skips"], row["params"], row["signature"]) == (
            facts.layers, facts.skips, facts.params, facts.signature
        ), "zoo/hints.json is stale: python -m seqify.zoo --write"
        assert row["balance"]["4"] == zoo.plan(name, 4).balance


def test_stale_cached_hints_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    stale = {"models": {"unet": {"signature": "0" * 16, "balance": {"2": [1, 66]}}}}
    monkeypatch.setattr(plans, "cached_table", lambda: stale)
    assert zoo.hints("unet", 2) == zoo.plan("unet", 2).balance != [1, 66]
    fresh = {"models": {"unet": {"signature": plans.signature("unet"), "balance": {"2": [1, 66]}}}}
    monkeypatch.setattr(plans, "cached_table", lambda: fresh)
    assert zoo.hints("unet", 2) == [1, 66]  # a matching fingerprint: the cache answers


def test_weights_from_checkpoint(tmp_path: object) -> None:
    torch.manual_seed(1)
    trained = torchvision.models.resnet18(num_classes=10).eval()
    path = f"{tmp_path}/r18.pth"
    torch.save(trained.state_dict(), path)
    torch.manual_seed(2)
    seq = zoo.get("resnet18", weights=path, num_classes=10).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert equal(seq(x), trained(x))
    seq = zoo.get("resnet18", weights=trained.state_dict(), num_classes=10)
    assert all(torch.equal(a, b) for a, b in zip(seq.original_state_dict().values(), trained.state_dict().values()))
    with pytest.raises(seqify.StateDictError, match="shapes"):
        zoo.get("resnet18", weights=path)  # 1000 classes by default
    with pytest.raises(zoo.ZooError, match="does not exist"):
        zoo.get("unet", weights=f"{tmp_path}/missing.pt")
    with pytest.raises(zoo.ZooError, match="IMAGENET1K_V1"):
        zoo.get("resnet18", weights="IMAGENET9K")


def test_torchvision_weights_enum(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights enum member (or its name) is fetched by torchvision (faked here: no network) and loaded
    through load_original_state_dict into a model built the way torchvision builds it for those weights."""
    from torchvision.models import ResNet18_Weights
    from torchvision.models.segmentation import FCN_ResNet50_Weights
    from torchvision.models._api import WeightsEnum

    torch.manual_seed(3)
    r18 = torchvision.models.resnet18().eval()
    fcn = torchvision.models.segmentation.fcn_resnet50(weights_backbone=None, num_classes=21, aux_loss=True).eval()
    fetched = []

    def fake(self: WeightsEnum, *args: object, **kwargs: object) -> dict[str, torch.Tensor]:
        fetched.append(self)
        return {ResNet18_Weights.IMAGENET1K_V1: r18, FCN_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1: fcn}[self].state_dict()

    monkeypatch.setattr(WeightsEnum, "get_state_dict", fake)
    x = torch.randn(1, 3, 32, 32)
    seq = zoo.get("resnet18", weights="DEFAULT").eval()
    with torch.no_grad():
        assert equal(seq(x), r18(x))
    seq = zoo.get("fcn_resnet50", weights=FCN_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1).eval()  # aux head, 21 classes
    with torch.no_grad():
        assert equal(seq(x), fcn(x))
    assert fetched == [ResNet18_Weights.IMAGENET1K_V1, FCN_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1]
    with pytest.raises(zoo.ZooError, match="not weights of resnet18"):
        zoo.get("resnet18", weights=FCN_ResNet50_Weights.DEFAULT)


@pytest.mark.parametrize(
    ("layers", "filters", "printed"),
    [(18, 208, "82M"), (18, 416, "318M"), (18, 544, "542M"), (36, 544, "1.05B"), (72, 512, "1.8B")],
)
def test_amoebanet_matches_gpipe_parameter_counts(layers: int, filters: int, printed: str) -> None:
    """GPipe's Table 1 sizes of AmoebaNet-D(L, F), within 1 % or the rounding of the printed figure."""
    with torch.device("meta"):
        model = zoo.amoebanet(layers, filters)
    count = sum(p.numel() for p in model.parameters())
    number, unit = printed[:-1], {"M": 1e6, "B": 1e9}[printed[-1]]
    decimals = len(number.split(".")[1]) if "." in number else 0
    paper = float(number) * unit
    assert abs(count - paper) <= max(0.01 * paper, 0.5 * 10**-decimals * unit), count


def test_amoebanet_structure() -> None:
    model = zoo.amoebanet(layers=6, filters=16, num_classes=10)
    reductions = [c.reduction for c in model.cells]
    assert reductions == [True, True, False, False, True, False, False, True, False, False]
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)
    seq = seqify.convert(model)
    # every cell reads the two cells before it: the older one travels as a skip
    assert len(seq.skips) >= len(model.cells)
    with pytest.raises(ValueError, match="multiple of 3"):
        zoo.amoebanet(layers=4)


def test_solver_cuts_only_where_allowed() -> None:
    from seqify.partition.solve import solve

    assert solve([1.0] * 10, 2).balance == (5, 5)
    assert solve([1.0] * 10, 2, cuts=[4, 8]).balance == (4, 6)
    assert solve([1.0] * 10, 3, cuts=[2, 4, 8]).balance == (4, 4, 2)
    with pytest.raises(seqify.BalanceError, match="allowed cuts"):
        solve([1.0] * 10, 3, cuts=[4])


@pytest.mark.parametrize(("name", "block"), [("llama", "model_layers_{}_input_layernorm"), ("gpt2", "transformer_h_{}_ln_1")])
def test_token_models_hint_cuts_at_decoder_layers(name: str, block: str) -> None:
    """The default (tiny) Llama and GPT-2 have 4 decoder layers: hints for 2 and 4 GPUs start every stage
    after the first at a decoder layer's first layer (or the final norm), and are the by-FLOPs optimum
    among those cuts (brute force over the cut positions)."""
    pytest.importorskip("transformers")
    import itertools

    from seqify.partition import default_transfer_cost, split

    _, measured, lays = plans._measure(name, "flops", None, ())
    names = list(lays.names)
    starts = {names.index(block.format(i)) for i in range(1, 4)} | {names.index(next(
        n for n in names if n in ("model_norm", "transformer_ln_f")))}
    for gpus in (2, 4):
        hint = zoo.hints(name, gpus)
        assert sum(hint) == len(names) == zoo.facts(name).layers
        bounds = list(itertools.accumulate(hint))[:-1]
        assert set(bounds) <= starts, (gpus, [names[b] for b in bounds])
        # each combination of boundary cuts, costed as the plan costs it (compute and transfer)
        forced = [split(measured, gpus, names, lays.routes, transfer_cost=default_transfer_cost("flops"), cuts=cut)
                  for cut in itertools.combinations(sorted(starts), gpus - 1)]
        assert all(list(itertools.accumulate(f.balance))[:-1] == list(c) for f, c in
                   zip(forced, itertools.combinations(sorted(starts), gpus - 1)))
        best = min(f.bottleneck for f in forced)
        assert zoo.plan(name, gpus).bottleneck == pytest.approx(best, rel=1e-9)
        assert zoo.plan(name, gpus).bottleneck >= split(measured, gpus, names, lays.routes,
                                                         transfer_cost=default_transfer_cost("flops")).bottleneck


def test_token_models_presets_and_samples() -> None:
    pytest.importorskip("transformers")
    with torch.device("meta"):
        big = zoo.build("llama", preset="0.89b")
        gpt = zoo.build("gpt2", preset="124m")
    assert round(sum(p.numel() for p in big.parameters()) / 1e9, 2) == 0.89
    assert (big.config.hidden_size, big.config.num_hidden_layers, big.config.num_attention_heads,
            big.config.num_key_value_heads, big.config.vocab_size) == (2048, 16, 16, 8, 32000)
    assert round(sum(p.numel() for p in gpt.parameters()) / 1e6) == 124  # GPT-2 small, tied head
    ids = zoo.sample("llama", 3, preset="0.89b")
    assert ids.shape == (3, zoo.entry("llama").size) and ids.dtype == torch.long and int(ids.max()) < 32000
    with pytest.raises(zoo.ZooError, match="no preset '9b'"):
        zoo.build("llama", preset="9b")


def test_zoo_lists_without_transformers_and_says_how_to_install() -> None:
    """transformers is an optional extra: without it the zoo still lists, and asking for Llama says what to
    install (a subprocess where importing transformers fails)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from seqify import zoo\n"
        "assert 'llama' in zoo.list() and 'resnet50' in zoo.list()\n"
        "assert not zoo.entry('llama').available and zoo.entry('resnet50').available  # zoo --check skips it\n"
        "try:\n    zoo.get('llama')\nexcept zoo.ZooError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'seqify[hf]'" in out.stdout


def test_cli_inspects_a_token_zoo_model(capsys: pytest.CaptureFixture[str]) -> None:
    """`seqify inspect zoo:gpt2` converts on token ids (the export frontend needs them) and plans stages."""
    pytest.importorskip("transformers")
    from seqify.tools.cli import main

    code = main(["inspect", "zoo:gpt2", "--arg", "n_layer=2", "--arg", "n_embd=16", "--arg", "n_head=2",
                 "--arg", "vocab_size=64", "--size", "8", "--batch", "2", "--stages", "2"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "export frontend" in text and "input_ids.size(1) == 8" in text and "2 stages" in text
