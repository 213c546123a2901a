"""One conversion serves train and eval mode where the source computes other ops in each (attention dropout passed
as a number): each mode bit-equal to the source, and a pipeline that alternates training steps and evaluation
equals the source doing the same, in float64."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import seqify
from helpers.exactness import assert_exact, by_micro_batch, loss_of

transformers = pytest.importorskip("transformers")

from helpers import hf_decoders, hf_encoders  # noqa: E402

Built = tuple[nn.Module, dict[str, Any]]
T, B = 8, 4


def _ids(vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(B))


def bert() -> Built:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, max_position_embeddings=32)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 6:] = 0
    return transformers.BertModel(cfg), {"input_ids": _ids(), "attention_mask": mask}


def t5() -> Built:
    cfg = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                decoder_start_token_id=0, use_cache=False, tie_word_embeddings=False)
    return transformers.T5ForConditionalGeneration(cfg), {"input_ids": _ids(), "decoder_input_ids": _ids()[:, :5]}


#: BERT, RoBERTa, DistilBERT, GPT-2 (LM head, tied) and T5 pass their attention dropout as a number that depends
#: on self.training: torch.export records it in the mode it traces
MODELS: dict[str, Callable[[], Built]] = {
    "bert": bert,
    "roberta": hf_encoders.REGISTRY["RobertaModel"],
    "distilbert": hf_encoders.REGISTRY["DistilBertModel"],
    "gpt2": hf_decoders.gpt2_tied,
    "t5": t5,
}


def build(name: str) -> Built:
    torch.manual_seed(0)
    model, kwargs = MODELS[name]()
    for m in model.modules():  # dropout that draws: the modes differ, and draws must follow the source's order
        if isinstance(m, nn.Dropout):
            m.p = 0.25
    return model.double().train(), kwargs


@pytest.mark.parametrize(("name", "converted_in"), [(n, "train") for n in MODELS] + [("bert", "eval"), ("t5", "eval")])
def test_one_conversion_is_exact_in_train_and_eval(name: str, converted_in: str) -> None:
    model, kwargs = build(name)
    seq = seqify.convert(model.train(converted_in == "train"), example_inputs=kwargs)
    assert not seq.mode_dependent and seq.two_mode_layers, seq.summary()
    assert "train and eval:" in seq.summary()
    assert_exact(model, (), kwargs=kwargs, train=True, convert=lambda m: seq.train())
    assert_exact(model, (), kwargs=kwargs, train=False, backward=False, convert=lambda m: seq.eval())
    assert_exact(model, (), kwargs=kwargs, train=True, convert=lambda m: seq.train())
    alternate(model, seq, kwargs)


def alternate(model: nn.Module, seq: seqify.Sequential, kwargs: dict[str, Any], args: tuple[Any, ...] = ()) -> None:
    """Two rounds of a training step (forward, backward, SGD) and an evaluation forward, on a 2-partition pipeline
    and on a copy of the source: equal throughout. One micro-batch: dropout then draws in the source's order
    (over several micro-batches a pipeline draws partition by partition)."""
    source = copy.deepcopy(model)
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], chunks=1)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, source)]
    for _ in range(2):
        pipe.train(), source.train()
        outs = []
        for run, opt in zip((lambda: pipe(*args, **kwargs), lambda: by_micro_batch(source, args, 1, kwargs)),
                            optimizers):
            opt.zero_grad()
            torch.manual_seed(1)
            out = run()
            loss_of(out).backward()
            outs.append(out)
        assert _equal(*outs)
        trained = dict(source.named_parameters())
        for n, p in model.named_parameters():  # the pipeline's layers hold the source model's own parameters
            torch.testing.assert_close(p.grad, trained[n].grad, rtol=1e-10, atol=1e-12, msg=n)
        for opt in optimizers:
            opt.step()
        pipe.eval(), source.eval()
        with torch.no_grad():
            assert _equal(pipe(*args, **kwargs), by_micro_batch(source, args, 1, kwargs))


def _equal(a: Any, b: Any) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb))


def test_both_programs_survive_saving_and_copying() -> None:
    model, kwargs = build("bert")
    seq = seqify.convert(model, example_inputs=kwargs)
    buffer = io.BytesIO()
    torch.save(seq, buffer)
    buffer.seek(0)
    for other in (torch.load(buffer, weights_only=False), copy.deepcopy(seq)):
        assert other.two_mode_layers == seq.two_mode_layers
        for train in (True, False):
            other.train(train), seq.train(train), model.train(train)
            with torch.no_grad():
                torch.manual_seed(2)
                want = model(**kwargs)
                torch.manual_seed(2)
                assert _equal(other(**kwargs), want)
    layer = getattr(seq, seq.two_mode_layers[0])
    assert "# in eval mode:" in layer.code and "other ops in eval mode" in repr(layer)


def wav2vec2(**config: Any) -> Built:
    torch.manual_seed(0)
    cfg = hf_encoders.wav2vec2_cfg(transformers.Wav2Vec2Config, **config)
    return transformers.Wav2Vec2Model(cfg).double(), {"input_values": hf_encoders.audio_values().double()}


def test_wav2vec2_spec_augment_is_refused_in_train_mode_naming_the_setting() -> None:
    """SpecAugment draws its masks with numpy in train mode: a capture would keep one draw's masks for every call.
    Refused when converting in train mode, and named when a conversion made in eval mode is run in train mode."""
    np = pytest.importorskip("numpy")
    model, kwargs = wav2vec2(layerdrop=0.0, mask_time_prob=0.5, mask_time_length=2)
    state = np.random.get_state()
    with pytest.raises(seqify.StatefulForwardError, match="SpecAugment") as refused:
        seqify.convert(model.train(), example_inputs=kwargs)
    assert "config.apply_spec_augment = False" in str(refused.value)
    assert all((a == b).all() if hasattr(a, "shape") else a == b for a, b in zip(state, np.random.get_state()))
    seq = assert_exact(model, (), kwargs=kwargs, train=False, backward=False,
                       convert=lambda m: seqify.convert(m, example_inputs=kwargs))
    assert seq.mode_dependent
    seq.train()
    with pytest.raises(seqify.ModeError, match="SpecAugment"):
        seq(**kwargs)


def test_wav2vec2_without_random_steps_converts_once_for_both_modes() -> None:
    """With LayerDrop and SpecAugment off (the settings the refusal names), one conversion trains and evaluates."""
    model, kwargs = wav2vec2(layerdrop=0.0, mask_time_prob=0.5, mask_time_length=2, apply_spec_augment=False)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.25
    seq = seqify.convert(model.train(), example_inputs=kwargs)
    assert not seq.mode_dependent
    assert_exact(model, (), kwargs=kwargs, train=True, convert=lambda m: seq.train())
    assert_exact(model, (), kwargs=kwargs, train=False, backward=False, convert=lambda m: seq.eval())


def test_ghostnetv2_converts_once_for_both_modes_with_fx() -> None:
    """timm's GhostNetV2 applies its head's dropout with training=self.training in its own forward: fx records it
    in the mode it traces, and the conversion holds that layer's ops for each mode."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("ghostnetv2_100", pretrained=False, num_classes=10).double().train()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)  # the smallest its pooling takes
    seq = seqify.convert(model, (x,))
    assert seq.frontend == "fx" and not seq.mode_dependent and seq.two_mode_layers
    assert_exact(model, (x,), train=True, convert=lambda m: seq.train())
    assert_exact(model, (x,), train=False, backward=False, convert=lambda m: seq.eval())
    alternate(model, seq, {}, (x,))


class _CountsInTrain(nn.Module):
    """Adds one to a buffer in train mode only, and doubles its output there: the train program writes what the
    eval program only reads."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.f(x)) + self.n
        if self.training:
            self.n.add_(1)
        return y * 2.0 if self.training else y


def test_what_either_mode_writes_in_place_is_known_to_the_pipeline() -> None:
    """Converted in eval mode, the layer holding the train program's in-place write still reports the buffer
    (written_tensors, which placement and recomputation read, looks at every program, and knows aten's
    ``add_.Tensor`` as in place), and a train-mode call updates the source's buffer as the source does."""
    from seqify.pipe.inplace import written_tensors

    model = nn.Sequential(nn.Linear(4, 4), _CountsInTrain(), nn.Linear(4, 2)).eval()
    x = torch.randn(2, 4)
    seq = seqify.convert(model, x, frontend="export")
    assert seq.two_mode_layers == ("1",)
    written = written_tensors(getattr(seq, "1"))
    assert len(written) == 1 and written[0] is model[1].n
    assert_exact(model, (x,), train=True, convert=lambda m: seq.train())
