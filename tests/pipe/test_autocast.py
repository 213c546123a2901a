"""bf16 autocast around export-converted models: autocast-off regions the forward enters only under autocast."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from torch import nn

import seqify
from seqify.convert.verify import bit_equal

pytestmark = pytest.mark.timeout(300)


def maybe_autocast_off(device_type: str) -> Any:
    """transformers' ``maybe_autocast(device_type, enabled=False)``: turn autocast off only when it is on."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else contextlib.nullcontext()


class Upcast(nn.Module):
    """A float32 matmul between autocast layers (GPT-2's upcast attention, in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        with maybe_autocast_off(y.device.type):
            z = y.float() @ self.w.float()
        return self.b(z) + z


class Rotary(nn.Module):
    """Llama's rotary embedding as transformers 5.17 wrote it: no_grad, and a float32 matmul in an
    autocast-off region (captured with autocast off, its dtype asserts failed under bf16 autocast on a GPU:
    "Tensor dtype mismatch")."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        with maybe_autocast_off(x.device.type):
            freqs = (inv.float() @ pos.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class RotaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.rotary = Rotary()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        cos, sin = self.rotary(x, pos)
        q = self.q(x)
        return self.out(q * cos + q.flip(-1) * sin)


def _same_under_autocast(model: nn.Module, seq: nn.Module, kwargs: dict[str, Any], *, grads: bool) -> None:
    """Forward bit-equal to the source under CPU bf16 autocast (and without); gradients equal to bf16's
    resolution (2 ** -7 of the largest): the converted graph adds up a value's gradients in another order
    (fp32 sums equal to 1e-7), and a bf16 matmul's backward rounds that difference to one bf16 step."""
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = reference(**kwargs), seq(**kwargs)
    assert bit_equal(got, want)
    leaf = (lambda o: o.logits) if hasattr(want, "logits") else (lambda o: o)
    assert leaf(got).dtype == leaf(want).dtype
    if grads:
        leaf(want).float().pow(2).mean().backward()
        leaf(got).float().pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if q.grad is not None:
                assert p.grad is not None, name
                assert (p.grad - q.grad).abs().max() <= 2 ** -7 * q.grad.abs().max() + 1e-7, name
    with torch.no_grad():
        assert bit_equal(seq(**kwargs), model(**kwargs))  # the same conversion stays exact without autocast


@pytest.mark.parametrize("net", [Upcast, RotaryNet])
def test_autocast_off_regions_survive_conversion(net: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = net()
    x = torch.randn(2, 4, 16 if net is Upcast else 8)
    seq = seqify.convert(model, example_inputs={"x": x}, frontend="export")  # converted without autocast
    _same_under_autocast(model, seq, {"x": x}, grads=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[1, len(seq) - 1], chunks=2)
        assert bit_equal(pipe(x), torch.cat([model(x[:1]), model(x[1:])]))


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def test_llama_trains_under_bf16_autocast() -> None:
    """Transformers 5.23's Llama has no autocast region left (its rotary embedding multiplies instead of a
    matmul), so this passes without the autocast fix too: it keeps the converted Llama exact under bf16
    autocast. 5.17's rotary, which failed on GPUs, is RotaryNet above."""
    transformers = _transformers()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    kwargs = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))}
    seq = seqify.convert(model, example_inputs=kwargs, frontend="export")
    _same_under_autocast(model, seq, kwargs, grads=True)


def test_gpt2_upcast_attention_under_bf16_autocast() -> None:
    """GPT-2 with reorder_and_upcast_attn computes its attention scores in float32 inside an autocast-off
    region it enters only under autocast."""
    transformers = _transformers()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, reorder_and_upcast_attn=True, attn_pdrop=0.0, resid_pdrop=0.0,
                                  embd_pdrop=0.0)
    cfg._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(cfg)
    kwargs = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)), "use_cache": False}
    seq = seqify.convert(model, example_inputs=kwargs, frontend="export")
    assert "autocast_region(" in str(seq)  # the autocast-off region is in the graph
    _same_under_autocast(model, seq, kwargs, grads=True)


def test_autocast_regions_follow_the_device_they_were_made_for() -> None:
    """A region captured as `autocast(<the example's device>, enabled=False)` turns autocast off on the device
    its tensors are on at run time (a model converted on the CPU, run on a GPU); a region naming another
    device type stays as written, as in the source (CUDA autocast off leaves CPU autocast on)."""
    from seqify.frontend.export.regions import autocast_region

    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moved = autocast_region("cuda", "cuda", torch.float16, False, None, torch.matmul, a, a)  # made on cuda, run on cpu
        named = autocast_region("cpu", "cuda", torch.float16, False, None, torch.matmul, a, a)  # names cuda, made on cpu
        on = autocast_region("cpu", "cpu", torch.float32, True, None, torch.matmul, a, a)  # on, at the neutral dtype
    assert moved.dtype == torch.float32 and named.dtype == torch.bfloat16 and on.dtype == torch.bfloat16


def test_a_failing_no_grad_region_leaves_grad_mode_on() -> None:
    """torch's wrap_with_set_grad_enabled left gradients off for the whole process when its region raised
    (one failing call of a converted Llama's rotary embedding, and every later backward failed)."""
    from seqify.frontend.export.regions import grad_region

    seq = seqify.convert(RotaryNet(), example_inputs={"x": torch.randn(2, 4, 8)}, frontend="export")
    assert "grad_region(" in str(seq)

    def fails(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("inside the region")

    with pytest.raises(RuntimeError, match="inside the region"):
        grad_region(False, fails, torch.randn(2))
    assert torch.is_grad_enabled()
