"""The torch.export frontend on Hugging Face transformers and diffusers families (tiny configs, no network)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import seqify
from helpers.exactness import assert_exact, assert_unchanged, snapshot
from seqify.convert.verify import bit_equal, first_difference

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

B, T = 2, 8


def ids(vocab: int = 64, batch: int = B) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, T), generator=torch.Generator().manual_seed(batch))


def bert() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=32)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0
    return transformers.BertModel(cfg), {"input_ids": ids(), "attention_mask": mask}


def gpt2(tied: bool = False) -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids(), "use_cache": False}


def llama() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   use_cache=False)
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids()}


def qwen2() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   use_cache=False)
    return transformers.Qwen2ForCausalLM(cfg), {"input_ids": ids()}


def t5() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                decoder_start_token_id=0, use_cache=False,
                                tie_word_embeddings=False)
    return transformers.T5ForConditionalGeneration(cfg), {"input_ids": ids(), "decoder_input_ids": ids(batch=B + 1)[:B]}


def vit() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2, num_labels=3)
    return transformers.ViTForImageClassification(cfg), {"pixel_values": torch.randn(B, 3, 16, 16)}


def clip_vision() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, projection_dim=8)
    return transformers.CLIPVisionModel(cfg), {"pixel_values": torch.randn(B, 3, 16, 16)}


def unet2d() -> tuple[nn.Module, dict[str, Any]]:
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.UNet2DModel(sample_size=8, in_channels=2, out_channels=2, layers_per_block=1,
                                  block_out_channels=(8, 16), norm_num_groups=4,
                                  down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                                  up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=4)
    return model, {"sample": torch.randn(B, 2, 8, 8), "timestep": torch.tensor([3, 7])}


def unet2d_condition() -> tuple[nn.Module, dict[str, Any]]:
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=2, out_channels=2, layers_per_block=1, block_out_channels=(8, 16),
        norm_num_groups=4, cross_attention_dim=8, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )
    return model, {"sample": torch.randn(B, 2, 8, 8), "timestep": torch.tensor([3, 7]),
                   "encoder_hidden_states": torch.randn(B, 4, 8)}


def autoencoder_kl() -> tuple[nn.Module, dict[str, Any]]:
    diffusers = pytest.importorskip("diffusers")
    model = diffusers.AutoencoderKL(in_channels=2, out_channels=2, latent_channels=2, block_out_channels=(8, 8),
                                    down_block_types=("DownEncoderBlock2D",) * 2,
                                    up_block_types=("UpDecoderBlock2D",) * 2, norm_num_groups=4,
                                    layers_per_block=1, sample_size=8)
    return model, {"sample": torch.randn(B, 2, 8, 8)}


FAMILIES: dict[str, Callable[[], tuple[nn.Module, dict[str, Any]]]] = {
    "bert": bert, "gpt2": gpt2, "llama": llama, "qwen2": qwen2, "t5": t5, "vit": vit, "clip_vision": clip_vision,
    "unet2d": unet2d, "unet2d_condition": unet2d_condition, "autoencoder_kl": autoencoder_kl,
}


def _bigger(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The same inputs with a batch of 3 (not the example's 2): the batch dimension must be dynamic."""
    return {k: torch.cat([v, v[:1]]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in kwargs.items()}


def two_stages(seq: seqify.Sequential) -> list[int]:
    """A 2-stage balance nearest the middle that no shared parameter crosses (T5 shares its embedding
    between encoder and decoder)."""
    layers = list(seq._modules.values())  # one module may be several layers (a shared activation)
    owned = [{id(p) for p in layer.parameters()} for layer in layers]
    cuts = [k for k in range(1, len(layers))
            if not set().union(*owned[:k]) & set().union(*owned[k:])]
    k = min(cuts, key=lambda c: abs(c - len(layers) // 2))
    return [k, len(layers) - k]


def by_micro_batch(model: nn.Module, kwargs: dict[str, Any], chunks: int) -> Any:
    """The source run on each micro-batch, outputs joined along the batch: what a pipeline computes (a
    batch of 1 may take other kernels than a batch of 2, so whole-batch bits can differ in the last place)."""
    outs = [model(**{k: v.chunk(chunks)[i] if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                     for k, v in kwargs.items()}) for i in range(chunks)]
    leaves = [pytree.tree_flatten(o) for o in outs]
    joined = [torch.cat(xs) if isinstance(xs[0], torch.Tensor) else xs[0] for xs in zip(*(lv for lv, _ in leaves))]
    return pytree.tree_unflatten(joined, leaves[0][1])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_is_exact_and_pipelines(family: str) -> None:
    torch.manual_seed(0)
    model, kwargs = FAMILIES[family]()
    for m in model.modules():  # dropout draws must match the source's order
        if isinstance(m, nn.Dropout):
            m.p = 0.25

    seq = assert_exact(model, (), kwargs=kwargs, train=False,
                       convert=lambda m: seqify.convert(m, example_inputs=kwargs, frontend="export"))
    assert seq.frontend == "export" and "export frontend" in seq.summary()
    assert list(seq.original_state_dict()) == list(model.state_dict())
    held = {id(p) for p in seq.parameters()}
    assert all(id(p) in held for p in model.parameters()), "the converted model must hold the source's own parameters"
    with torch.no_grad():
        bigger = _bigger(kwargs)
        assert bit_equal(seq(**bigger), model(**bigger))
        pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=two_stages(seq), chunks=2)
        assert bit_equal(pipe(**kwargs), by_micro_batch(model, kwargs, 2))
    assert_runs_on_meta(seq, model, kwargs)
    # Train mode: the same conversion where the graph does not depend on the mode (dropout modules are the
    # source's own and follow train()), else a conversion in train mode.
    again = seq.train() if not seq.mode_dependent else None
    assert_exact(model, (), kwargs=kwargs, train=True, convert=lambda m: again or seqify.convert(
        m, example_inputs=kwargs, frontend="export", check_modes=False))


def test_train_pipeline_gradients_match_source() -> None:
    torch.manual_seed(0)
    model, kwargs = llama()
    reference = copy.deepcopy(model)
    seq = seqify.convert(model, example_inputs=kwargs, frontend="export")
    plan = seqify.balance(seq, 2, kwargs, by="flops", progress=False)
    for by in ("params", "time"):
        assert sum(seqify.balance(seq, 2, kwargs, by=by, progress=False).balance) == len(seq)
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=plan.balance, chunks=2)
    pipe(**kwargs).logits.pow(2).mean().backward()
    reference(**kwargs).logits.pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_auto_falls_back_to_export_where_fx_cannot_trace() -> None:
    model, kwargs = llama()
    with pytest.raises(seqify.UntraceableError):
        seqify.convert(model, example_inputs=kwargs, frontend="fx")
    seq = seqify.convert(model, example_inputs=kwargs)
    assert seq.frontend == "export"
    assert "model_layers_0_self_attn_q_proj" in dict(seq.named_children())
    q_proj = model.model.layers[0].self_attn.q_proj
    layer = dict(seq.named_children())["model_layers_0_self_attn_q_proj"]
    assert layer is q_proj or any(m is q_proj for m in layer.modules())  # the module, or a layer calling it
    assert seq.lm_head is model.lm_head  # one call of a leaf module on the carried tensor: the module itself
    with torch.no_grad():
        assert bit_equal(seq(**kwargs), model(**kwargs))


def test_tied_weights_stay_tied_and_state_dict_round_trips() -> None:
    model, kwargs = gpt2(tied=True)
    assert model.lm_head.weight is model.transformer.wte.weight
    seq = seqify.convert(model, example_inputs=kwargs, frontend="export", check_modes=False)
    state = {k: v.detach().clone() + 1 for k, v in model.state_dict().items()}
    seq.load_original_state_dict(state)
    assert torch.equal(model.transformer.wte.weight, state["transformer.wte.weight"])
    assert model.lm_head.weight is model.transformer.wte.weight


def test_use_cache_is_refused_with_the_fix() -> None:
    model, kwargs = llama()
    model.config.use_cache = True
    with pytest.raises(seqify.ExampleInputError, match="use_cache=False"):
        seqify.convert(model, example_inputs=kwargs, frontend="export")
    with pytest.raises(seqify.ExampleInputError, match="use_cache=False"):
        seqify.convert(model, example_inputs={**kwargs, "use_cache": True}, frontend="export")


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.f(x) * self.calls


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.bn(self.conv(x)))) * x.shape[0]


def test_export_needs_example_inputs_and_refuses_attribute_writes() -> None:
    with pytest.raises(seqify.OptionError, match="example_inputs"):
        seqify.convert(ConvBN(), frontend="export")
    model = Counter()
    before = snapshot(model)
    with pytest.raises(seqify.ConversionError, match="calls"):
        seqify.convert(model, example_inputs=torch.randn(2, 4), frontend="export")
    assert_unchanged(model, before)


class Carried(nn.Module):
    """A tensor state carried between calls in a plain attribute (not a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.state = torch.zeros(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state = self.state + x.sum().detach()
        return self.f(x) * self.state


class Scratch(nn.Module):
    """RecurrentGemma's pattern without a cache: an attribute reset, then computed, every call (never read
    from an earlier call)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = None
        y = self.f(x)
        if self.last is None:
            y = y * 2
        self.last = y.detach()
        return y


def test_export_refuses_a_tensor_state_read_across_calls_and_keeps_one_written_first() -> None:
    # a tensor attribute read then written was baked in as a constant: wrong from the second call on
    model, x = Carried(), torch.randn(2, 4)
    with pytest.raises(seqify.ConversionError, match="state"):
        seqify.convert(model, example_inputs=x, frontend="export")
    # written before it is read, each call: converted, and equal to the source call after call (after a first
    # call left a tensor there, which used to be refused as a write of None over it)
    model = Scratch()
    model(x)
    twin = copy.deepcopy(model)
    seq = seqify.convert(model, example_inputs=x, frontend="export")
    for _ in range(3):
        assert torch.equal(seq(x), twin(x))


@pytest.mark.parametrize("train", [False, True])
def test_batchnorm_statistics_land_in_the_source(train: bool) -> None:
    x = torch.randn(4, 3, 6, 6)
    seq = assert_exact(ConvBN(), (x,), train=train,
                       convert=lambda m: seqify.convert(m, example_inputs=(x[:2],), frontend="export"))
    assert isinstance(seq.bn, nn.BatchNorm2d) and isinstance(seq.drop, nn.Dropout)


def test_verify_names_the_first_layer_that_differs() -> None:
    x = torch.randn(2, 3, 6, 6)
    model = ConvBN().eval()
    seq = seqify.convert(model, example_inputs=(x,), frontend="export")
    assert first_difference(model, seq, (x,)) is None
    wrong = copy.deepcopy(model.bn)
    with torch.no_grad():
        wrong.bias += 1
    assert seq.bn is model.bn
    seq._modules["bn"] = wrong
    text = first_difference(model, seq, (x,))
    assert text is not None and "'bn'" in text


def test_llama_benchmark_runs_tiny_on_cpu(tmp_path: Any) -> None:
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "llama" / "main.py"
    spec = importlib.util.spec_from_file_location("llama_main", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "llama.json"
    rows = bench.main(["--tiny", "--device", "cpu", "--out", str(out)])
    names = [r["name"] for r in rows]
    assert names[0].startswith("source") and any("converted" in n for n in names) and any("pipeline" in n for n in names)
    assert all(r.get("loss_finite") for r in rows), rows
    assert json.loads(out.read_text())["rows"] == rows


def test_cli_converts_a_transformers_spec(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from seqify.tools.cli import main

    out = tmp_path / "llama.pt"
    code = main(["convert", "transformers:LlamaForCausalLM", "--example", "--arg", "hidden_size=16",
                 "--arg", "intermediate_size=32", "--arg", "num_hidden_layers=1", "--arg", "num_attention_heads=2",
                 "--arg", "num_key_value_heads=1", "--arg", "vocab_size=64", "--size", "8", "--batch", "2",
                 "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "export frontend" in text and "bit-equal to the source: True" in text
    saved = torch.load(out)  # torch's default, weights_only=True: plain values and tensors
    assert saved["frontend"] == "export"
    assert saved["layers"] and saved["state_dict"]["lm_head.weight"].shape == (64, 16)


def test_self_check_leaves_the_source_alone() -> None:
    x = torch.randn(4, 3, 6, 6)
    model = ConvBN().train()
    before = snapshot(model)
    seqify.convert(model, example_inputs=(x,), frontend="export")
    assert_unchanged(model, before)  # BatchNorm statistics and attributes as they were


def segformer() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
                                       patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                                       mlp_ratios=[2, 2], decoder_hidden_size=16, num_labels=3)
    return transformers.SegformerForSemanticSegmentation(cfg).eval(), {"pixel_values": torch.randn(B, 3, 32, 32)}


@pytest.mark.parametrize("ran_first", [False, True])
def test_hidden_state_recording_hooks_neither_leak_nor_block(ran_first: bool) -> None:
    """transformers 5 installs hooks recording hidden states on a model's first call that asks for them (and
    marks the model): a capture must leave neither hooks nor mark behind (kept hooks without the mark were
    installed twice, every stage recorded twice: Segformer's decode head then read the wrong stages), and
    hooks the source installed itself, before or after conversion, are no hooks of the user's to refuse."""
    model, kwargs = segformer()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        expected = reference(**kwargs).logits
        if ran_first:
            model(**kwargs)
        before = snapshot(model)
        seq = seqify.convert(model, example_inputs=kwargs)
        assert_unchanged(model, before)
        assert torch.equal(seq(**kwargs).logits, expected)
        assert torch.equal(model(**kwargs).logits, expected)  # the source installs its hooks once, as it would
        assert torch.equal(seq(**kwargs).logits, expected)


def test_a_loss_output_names_itself_when_a_pipeline_cannot_split_it() -> None:
    """labels= makes the model reduce a loss over the whole batch: a pipeline's error names that output."""
    model, kwargs = vit()
    kwargs = {**kwargs, "labels": torch.tensor([0, 2])}
    pipe = seqify.pipeline(seqify.convert(model.eval(), example_inputs=kwargs), devices=["cpu", "cpu"], chunks=2)
    with pytest.raises(seqify.BoundaryError, match=r"The output \['loss'\] is a scalar.*labels="):
        pipe(**kwargs)


def test_keywords_through_kwargs_are_baked_by_export() -> None:
    """transformers 5 takes output_hidden_states through **kwargs: fx refuses it (naming export), auto falls
    back to export, which bakes it, and every call must pass it again."""
    model, kwargs = vit()
    model.eval()
    kwargs = {**kwargs, "output_hidden_states": True}
    with pytest.raises(seqify.KeywordArgumentsError, match="frontend='export'"):
        seqify.convert(model, example_inputs=kwargs, frontend="fx")
    seq = seqify.convert(model, example_inputs=kwargs)
    assert seq.frontend == "export"
    with torch.no_grad():
        assert bit_equal(seq(**kwargs), model(**kwargs)) and len(seq(**kwargs).hidden_states) == 2
        with pytest.raises(seqify.InputError, match="missing argument 'output_hidden_states'"):
            seq(pixel_values=kwargs["pixel_values"])
        bigger = {**kwargs, "pixel_values": torch.randn(B + 1, 3, 16, 16)}  # the batch stays dynamic
        assert bit_equal(seq(**bigger), model(**bigger))


def _attention_calls(seq: seqify.Sequential) -> list[Any]:
    return [op for layer in seq for op in getattr(layer, "ops", []) if "scaled_dot_product" in str(op.target)]


def test_causal_attention_keeps_is_causal_like_the_source() -> None:
    """Without attention_mask (and position ids the model makes), the source leaves causality to SDPA's
    is_causal (the flash kernel on GPUs); the export frontend keeps it so instead of capturing the explicit
    mask export would build, and stays bit-equal. A padding mask or given position ids keep the mask."""
    model, kwargs = llama()
    model.eval()
    seq = seqify.convert(model, example_inputs=kwargs, frontend="export")
    calls = _attention_calls(seq)
    assert calls and all(op.args[3] is None and op.args[5] is True for op in calls), calls
    padded = {**kwargs, "attention_mask": torch.ones_like(kwargs["input_ids"])}
    padded["attention_mask"][0, :2] = 0
    positions = {**kwargs, "position_ids": torch.arange(kwargs["input_ids"].size(1)).expand_as(kwargs["input_ids"])}
    for given in (padded, positions):
        masked = seqify.convert(model, example_inputs=given, frontend="export")
        assert all(op.args[3] is not None for op in _attention_calls(masked))
        with torch.no_grad():
            assert torch.equal(masked(**given).logits, model(**given).logits)
    with torch.no_grad():
        for batch in (kwargs, {"input_ids": ids(batch=5)}):
            assert torch.equal(seq(**batch).logits, model(**batch).logits)


def test_size_skips_replay_and_data_never_does() -> None:
    """A skip made from shapes alone (export's batch size, carried to a later reshape) is a size: the
    replayed step (CUDA graphs' driver, eager programs on the CPU) keeps it per micro-batch, here over
    uneven micro-batches (3 and 2 samples), bit-equal forward and source-equal gradients. A value read
    from data is never a size."""
    import operator

    from seqify.model.layer import Layer, Op, Ref
    from seqify.skip.namespace import Namespace
    from seqify.model.stash_sizes import size_skips

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    example = {"input_ids": ids(batch=5)}
    seq = seqify.convert(model, example_inputs=example, frontend="export")
    sized = size_skips(seq)
    assert sized and all(key[1].startswith("sym_size") for key in sized), sized
    pipe = seqify.pipeline(seq, devices=["cpu"] * 2, chunks=2, checkpoint="never", example_inputs=example)
    assert any(key in sized for key in pipe.skip_partitions if pipe.skip_partitions[key][0] != pipe.skip_partitions[key][1])
    pipe._replay_eager = True
    reference = copy.deepcopy(model)
    x = ids(batch=5)
    out = pipe(input_ids=x).logits
    assert pipe.graph_error is None and pipe._graphed is not None, pipe.graph_error
    want = torch.cat([reference(input_ids=c).logits for c in x.tensor_split(2)])
    assert torch.equal(out, want)
    out.float().pow(2).mean().backward()
    want.float().pow(2).mean().backward()
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)

    ns = Namespace()
    ops = [Op("n", "call_function", torch.ops.aten.sym_size.int, (Ref("x"), 0)),
           Op("half", "call_function", operator.floordiv, (Ref("n"), 2)),
           Op("v", "call_function", torch.ops.aten._local_scalar_dense.default, (Ref("x"),)),
           Op("mixed", "call_function", operator.mul, (Ref("n"), Ref("v")))]
    layer = Layer(inputs=["x"], ops=ops, outputs=["x"],
                  stashes=[((ns, "half"), "half"), ((ns, "v"), "v"), ((ns, "mixed"), "mixed")])
    assert size_skips([layer]) == {(ns, "half")}


class _PositionsFromKeyword(nn.Embedding):
    """BART's learned positional embedding: called with ``position_ids=`` the forward ignores ``input_ids``."""

    def forward(self, input_ids: torch.Tensor, past: int = 0, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1)
        return super().forward(position_ids + 2)


class _BartLikeDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(64, 16)
        self.embed_positions = _PositionsFromKeyword(10, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(input_ids.shape[1])
        return self.embed_tokens(input_ids) + self.embed_positions(input_ids, 0, position_ids=position_ids)


def test_leaf_called_with_its_tensor_in_another_argument_is_not_made_a_call_of_it() -> None:
    # The export frontend turns a run of ops reading one tensor into a call of its leaf module with that
    # tensor; here the tensor is position_ids, not the first argument, so the call would crash (BART).
    model = _BartLikeDecoder()
    kwargs = {"input_ids": ids()}
    seq = assert_exact(model, (), kwargs=kwargs, train=False,
                       convert=lambda m: seqify.convert(m, example_inputs=kwargs, frontend="export"))
    layer = dict(seq.named_children())["embed_tokens"]  # a one-argument leaf is still called as the module
    assert layer is model.embed_tokens or any(m is model.embed_tokens for m in layer.modules())


def bart() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32, pad_token_id=1, use_cache=False)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0
    return transformers.BartForConditionalGeneration(cfg), {
        "input_ids": ids().clamp(min=3), "attention_mask": mask, "decoder_input_ids": ids(batch=B + 1)[:B].clamp(min=3)}


def test_bart_with_padding_is_exact() -> None:
    model, kwargs = bart()
    assert_exact(model, (), kwargs=kwargs, train=False, convert=lambda m: seqify.convert(m, example_inputs=kwargs))


class Positions(nn.Embedding):
    """OPT's learned positions: called on the attention mask and the positions, its ops read only the latter."""

    def forward(self, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = attention_mask.cumsum(1) - 1
        return super().forward(position_ids + 2)


class PositionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = Positions(T + 2, 4)

    def forward(self, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.pos(attention_mask, position_ids=attention_mask.cumsum(1) * attention_mask - 1)


def test_a_leaf_module_called_on_several_arguments_stays_its_ops() -> None:
    # before: the export layers called pos(positions) (its one input), which reads them as the mask: IndexError
    model = PositionNet()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0
    seq = assert_exact(model, (mask,), train=True,
                       convert=lambda m: seqify.convert(m, example_inputs=(mask,), frontend="export"))
    assert not any(layer is model.pos for layer in seq)


def opt() -> tuple[nn.Module, dict[str, Any]]:
    cfg = transformers.OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
                                 max_position_embeddings=32, word_embed_proj_dim=16, use_cache=False)
    return transformers.OPTForCausalLM(cfg), {"input_ids": ids()}


def test_opt_converts_exactly() -> None:
    model, kwargs = opt()
    seq = assert_exact(model, (), kwargs=kwargs, train=False,
                       convert=lambda m: seqify.convert(m, example_inputs=kwargs))
    assert seq.frontend == "export"


def assert_runs_on_meta(seq: seqify.Sequential, model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Converted layers make their values where they run, not on the example's device: torch.export bakes that
    device into ops (``t.to(x.device)`` in a rotary embedding's no_grad block, ``arange(device=...)``). On the
    meta device any value still made on the CPU fails ("cannot copy out of meta tensor")."""
    with torch.no_grad():
        want = pytree.tree_leaves(model(**kwargs))
        meta = copy.deepcopy(seq).to("meta")
        got = pytree.tree_leaves(meta(**{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}))
    assert [tuple(t.shape) for t in got if isinstance(t, torch.Tensor)] == \
        [tuple(t.shape) for t in want if isinstance(t, torch.Tensor)]
    assert all(t.device.type == "meta" for t in got if isinstance(t, torch.Tensor))


def test_a_forward_under_deprecate_kwarg_traces_with_fx() -> None:
    """transformers' deprecate_kwarg wraps a forward as (*args, **kwargs) and only renames one keyword: with
    inputs that do not use that keyword, fx traces the wrapped forward (LED's forward gained this decorator
    in transformers 5.24, and whole-model export stops at its global-attention branch). The class's forward
    is the decorated one again afterwards; a deprecated keyword in the inputs is still refused."""
    from transformers.utils.deprecation import deprecate_kwarg

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @deprecate_kwarg("hidden", new_name="x", version="99.0")
        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, use_cache: bool = False, output_attentions: bool = False,
                    return_dict: bool = True, **kwargs: Any) -> torch.Tensor:
            y = self.lin(x) * (scale if scale is not None else 1.0)
            return y if shift is None else y + shift

    model = Renamed()
    decorated = Renamed.forward
    x = torch.randn(2, 4)
    # a forward with **kwargs under a (*args, **kwargs) wrapper: fx patches the wrapper's code to take the
    # forward's arguments, and that code has too few local names ("co_varnames is too small")
    seq = seqify.convert(model, example_inputs={"x": x}, frontend="fx")
    assert Renamed.forward is decorated and "forward" in Renamed.__dict__
    assert seq.frontend == "fx"
    with torch.no_grad():
        assert bit_equal(seq(x=x), model(x=x))
    with pytest.raises(seqify.SeqifyError):
        seqify.convert(model, example_inputs={"hidden": x}, frontend="fx")
    assert Renamed.forward is decorated


@pytest.mark.parametrize("family", ["llama", "bert", "t5", "unet2d"])
def test_a_one_sample_example_converts_for_every_batch(family: str) -> None:
    # people trace with one sample: export keeps the batch symbolic only where it is above one, so seqify exports
    # the sample twice over and checks the result on the sample itself
    torch.manual_seed(0)
    model, kwargs = FAMILIES[family]()
    model.eval()
    one = pytree.tree_map(lambda v: v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v, kwargs)
    # the family's own test checks the modes; here the batch (finding out the mode exports a second time)
    seq = seqify.convert(model, example_inputs=one, frontend="export", check_modes=False)
    assert not any(g.expr.endswith("size(0)") for g in seq.guards), seq.guards
    with torch.no_grad():
        for batch in (one, kwargs, _bigger(kwargs)):
            assert bit_equal(seq(**batch), model(**batch))
        pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=two_stages(seq), chunks=2)
        assert bit_equal(pipe(**kwargs), by_micro_batch(model, kwargs, 2))


def test_pipeline_of_a_transformers_model_given_only_a_sample_converts_it_from_that_sample() -> None:
    """seqify.pipeline(model, sample=ids): fx cannot trace the model without values, so the sample's first two
    samples become the example inputs (the batch stays dynamic) and the pipeline equals the source per micro-batch."""
    torch.manual_seed(0)
    model, _ = llama()
    x = ids(batch=6)
    pipe = seqify.pipeline(model, devices=["cpu", "cpu"], sample=x, chunks=3)
    assert pipe.model.frontend == "export"
    with torch.no_grad():
        assert bit_equal(pipe(x), by_micro_batch(model, {"input_ids": x}, 3))
