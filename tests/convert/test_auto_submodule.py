"""frontend='auto' per submodule: fx for the model, torch.export inside the submodules fx cannot trace."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import seqify
from helpers.exactness import assert_exact
from seqify.convert.verify import bit_equal

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.timeout(300)

B, T = 4, 8


def mask() -> torch.Tensor:
    m = torch.ones(B, T, dtype=torch.long)
    m[1, 6:] = 0
    return m


def llama(dropout: float = 0.0) -> nn.Module:
    """Eager attention with a padding mask: transformers' masking calls torch.finfo on a dtype, which fx cannot trace."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                   use_cache=False, attn_implementation="eager", attention_dropout=dropout)
    return transformers.LlamaModel(cfg)


def bert() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=32, attn_implementation="eager",
                                  hidden_dropout_prob=0.25, attention_probs_dropout_prob=0.25)
    return transformers.BertModel(cfg)


class Net(nn.Module):
    """A user model: a convolution stem, a transformers body called with keyword arguments, a head."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Conv1d(8, 16, 3, padding=1)
        self.norm = nn.LayerNorm(16)
        self.body = body
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.stem(x.transpose(1, 2)).transpose(1, 2)))
        out = self.body(inputs_embeds=h, attention_mask=attention_mask)
        return self.head(out.last_hidden_state + h)


def example() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(B, T, 8, generator=torch.Generator().manual_seed(0)), mask()


def by_micro_batch(model: nn.Module, args: tuple[torch.Tensor, ...], chunks: int) -> Any:
    outs = [model(*(a.chunk(chunks)[i] for a in args)) for i in range(chunks)]
    return torch.cat(outs)


@pytest.mark.parametrize("body", [llama, bert])
def test_transformers_body_is_made_by_export_inside_fx_layers(body: Any) -> None:
    torch.manual_seed(0)
    model = Net(body())
    args = example()
    seq = assert_exact(model, args, train=False, convert=lambda m: seqify.convert(m, example_inputs=args))
    layers = dict(seq.named_children())
    # the body is not one opaque layer (as it was before frontend='auto' worked per submodule)
    assert [o.path for o in seq.opaque] == [] and sum(n.startswith("body") for n in layers) > 5, seq.summary()
    # fx made the stem and head: the source's own modules, named as in the source
    assert layers["stem"] is model.stem and layers["head"] is model.head
    assert any(m is model.norm for m in layers["norm"].modules())  # with the body's input checks beside it
    assert {seq.layer_frontends[n] for n in ("stem", "norm", "head")} == {"fx"}
    # export made the body: many layers named after its modules, none of them one opaque layer
    made = [n for n, f in seq.layer_frontends.items() if f == "export"]
    assert len(made) > 5 and all(n.startswith("body") for n in made), made
    assert not seq.opaque and seq.frontend == "fx+export"
    assert [e.path for e in seq.exported] == ["body"] and set(seq.exported[0].layers) == set(made)
    q_proj = dict(model.named_modules())["body.layers.0.self_attn.q_proj" if body is llama else
                                         "body.encoder.layer.0.attention.self.query"]
    assert any(m is q_proj for m in seq.modules()), "export layers call the source's own leaf modules"
    held = {id(p) for p in seq.parameters()}
    unused = {"body.embed_tokens.weight", "body.embeddings.word_embeddings.weight"}  # inputs_embeds is given
    assert all(id(p) in held for k, p in model.named_parameters() if k not in unused)
    assert list(seq.original_state_dict()) == list(model.state_dict())
    source = model.state_dict(keep_vars=True)
    assert all(seq._tensor(k) is source[k] for k in source), "the source's own parameters and buffers"
    with torch.no_grad():
        bigger = tuple(torch.cat([a, a[:2]]) for a in args)  # a batch of 6: export's batch dimension is dynamic
        assert bit_equal(seq(*bigger), model(*bigger))
        pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], chunks=2)
        assert bit_equal(pipe(*args), by_micro_batch(model, args, 2))
    # train mode: dropout inside the body draws in the source's order; gradients match
    assert_exact(model, args, train=True, convert=lambda m: seqify.convert(m, example_inputs=args))


def test_summary_names_both_frontends() -> None:
    model = Net(llama()).eval()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    rng = torch.random.get_rng_state()
    seq = seqify.convert(model, example_inputs=example())
    assert torch.equal(rng, torch.random.get_rng_state()), "conversion draws no random numbers of the caller's"
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters()), "gradients left alone"
    text = seq.summary()
    assert "made by the fx and export frontends" in text and "fx: 7 layers, export: " in text, text
    assert "body (LlamaModel) ->" in text and "; fx: TypeError: torch.finfo()" in text
    assert "body: inputs_embeds.size(2) == 16" in text  # export's shape guards name the submodule
    # Llama's eager attention passes its dropout to F.dropout with training=self.training: export records it in
    # train mode only. The layers of both modes' conversions line up, so the one conversion holds both programs
    assert not seq.mode_dependent and seq.two_mode_layers and "train and eval:" in text, text
    model.zero_grad(set_to_none=True)
    assert_exact(model, example(), train=True, convert=lambda m: seq.train())
    seq.eval()
    model.eval()
    buffer = io.BytesIO()
    torch.save(seq, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert loaded.frontend == "fx+export" and loaded.layer_frontends == seq.layer_frontends
    with torch.no_grad():
        assert bit_equal(loaded(*example()), model(*example()))


class Picky(nn.Module):
    """A block fx cannot trace (torch.finfo of a traced dtype) with BatchNorm statistics inside."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).clamp(min=torch.finfo(x.dtype).min / 2)


class Branchy(nn.Module):
    """A block neither frontend can capture: it branches on a tensor's values."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.f(x)
        return y * 2 if y.sum() > 0 else y - 1


class Vision(nn.Module):
    def __init__(self, block: nn.Module, twice: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = block
        self.twice = twice
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        y = self.block(h)
        if self.twice:
            y = self.block(y) + h
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("twice", [False, True])
def test_untraceable_block_with_batchnorm(train: bool, twice: bool) -> None:
    x = torch.randn(4, 3, 6, 6)
    model = Vision(Picky(), twice)
    seq = assert_exact(model, (x,), train=train, convert=lambda m: seqify.convert(m, example_inputs=(x,)))
    assert seq.frontend == "fx+export" and not seq.opaque and [e.path for e in seq.exported] == ["block"]
    assert seq.block_bn is model.block.bn or any(m is model.block.bn for m in seq.modules())
    assert bit_equal(seqify.pipeline(seq, devices=["cpu", "cpu"], chunks=2)(x).detach(),
                     torch.cat([model(c) for c in x.chunk(2)]).detach()) or train  # train: batch statistics per chunk


def test_an_example_batch_of_one_keeps_the_block_opaque() -> None:
    """Export fixes a batch of 1 (only larger batches become dynamic): the block stays whole, so any batch runs."""
    model = Vision(Picky()).eval()
    seq = seqify.convert(model, example_inputs=(torch.randn(1, 3, 6, 6),))
    assert seq.frontend == "fx" and "a batch of 2 or more" in seq.opaque[0].reason
    x = torch.randn(3, 3, 6, 6)
    with torch.no_grad():
        assert bit_equal(seq(x), model(x))


def test_export_failure_keeps_the_block_opaque_and_exact() -> None:
    x = torch.randn(2, 3, 6, 6)
    model = Vision(Branchy()).eval()
    seq = assert_exact(model, (x,), train=False, convert=lambda m: seqify.convert(m, example_inputs=(x,)))
    assert seq.frontend == "fx" and [o.path for o in seq.opaque] == ["block"]
    assert "torch.export could not capture it either" in seq.opaque[0].reason
    assert "export frontend" not in seq.summary().splitlines()[1] or "fx frontend" in seq.summary()


def test_self_check_failure_falls_back_to_the_opaque_block(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    convert = sys.modules["seqify.convert"]  # the package (seqify.convert is also the function)
    real = convert.check
    calls: list[str] = []

    def failing_mixed(source: nn.Module, seq: Any, example_inputs: Any, *, frontend: str = "") -> None:
        calls.append(frontend)
        if frontend == "fx+export":
            raise seqify.VerifyError("the converted Vision does not compute what the source computes (simulated)")
        real(source, seq, example_inputs, frontend=frontend)

    monkeypatch.setattr(convert, "check", failing_mixed)
    x = torch.randn(2, 3, 6, 6)
    model = Vision(Picky()).eval()
    seq = assert_exact(model, (x,), train=False, convert=lambda m: seqify.convert(m, example_inputs=(x,)))
    assert calls == ["fx+export", "fx"]
    assert seq.frontend == "fx" and [o.path for o in seq.opaque] == ["block"]
    assert "fails the self-check" in seq.opaque[0].reason


class Half(nn.Module):
    """fx runs the autocast region at trace time and records none of it: its layers compute in float32 where
    the source computes in bfloat16, and fail the self-check; export captures the region."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return self.out(y.float())


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.block = Half()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.stem(x))))


def test_submodule_whose_fx_layers_fail_the_self_check_is_made_by_export() -> None:
    x = torch.randn(4, 4)
    model = Mixed().eval()
    with pytest.raises(seqify.VerifyError, match="source module 'block.lin'") as info:
        seqify.convert(model, example_inputs=x, frontend="fx")
    assert info.value.module_path == "block.lin"
    for train in (False, True):
        seq = assert_exact(model, (x,), train=train, convert=lambda m: seqify.convert(m, example_inputs=x))
        assert seq.frontend == "fx+export", seq.summary()  # before: the whole model by export
        assert seq.head is model.head and any(m is model.stem for m in seq.stem.modules())  # + block's input check
        assert [e.path for e in seq.exported] == ["block"] and "self-check" in seq.exported[0].reason
    assert "fx: its layers fail the self-check (source module 'block.lin' differs first)" in seq.summary()


def test_fx_frontend_and_no_example_keep_the_block_opaque() -> None:
    x = torch.randn(2, 3, 6, 6)
    model = Vision(Picky()).eval()
    for seq in (seqify.convert(model, example_inputs=(x,), frontend="fx"), seqify.convert(model)):
        assert seq.frontend == "fx" and [o.path for o in seq.opaque] == ["block"]
        assert set(seq.layer_frontends.values()) == {"fx"}


class Pair(Picky):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        y = super().forward(x)
        return y, -y


class WholeUse(nn.Module):
    """The block's output tuple is used whole (handed to torch.cat), which splicing does not rebuild."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.block(x), 1) + 1


class _Projected(nn.Module):
    """A tiny Llama body (fx cannot trace it) fed by a projection fx can: subclasses say what it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.body = llama()
        self.proj = nn.Linear(4, 16)


def test_returning_the_body_output_and_whole_uses() -> None:
    x = torch.randn(2, 4, 6, 6)

    class Returns(_Projected):
        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> Any:
            return self.body(inputs_embeds=self.proj(x), attention_mask=attention_mask)

    m = Returns().eval()
    args = (torch.randn(B, T, 4), mask())
    seq = seqify.convert(m, example_inputs=args)
    assert seq.frontend == "fx+export" and not seq.opaque
    with torch.no_grad():
        assert bit_equal(seq(*args), m(*args))
    whole = WholeUse().eval()
    seq = seqify.convert(whole, example_inputs=(x,))
    assert seq.frontend == "fx" and "used whole by cat" in seq.opaque[0].reason
    with torch.no_grad():
        assert bit_equal(seq(x), whole(x))


def test_returning_fields_of_the_body_output_that_export_returns_as_none() -> None:
    """Bloom's and GPT-J's heads return ``outputs.hidden_states`` and ``outputs.attentions`` of a body fx
    cannot trace: export's graph has None there, and the model's output must read None, not erased nodes."""

    class Fields(_Projected):
        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> Any:
            out = self.body(inputs_embeds=self.proj(x), attention_mask=attention_mask)
            return {"h": out.last_hidden_state, "hidden_states": out.hidden_states, "attentions": out.attentions}

    m = Fields().eval()
    args = (torch.randn(B, T, 4), mask())
    seq = seqify.convert(m, example_inputs=args)
    assert seq.frontend == "fx+export" and not seq.opaque, seq.summary()
    with torch.no_grad():
        got = seq(*args)
        assert bit_equal(got, m(*args)) and got["hidden_states"] is None and got["attentions"] is None
