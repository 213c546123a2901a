"""172 Hugging Face architectures no other test names (decoders, recent decoder and state-space families,
encoders, encoder-decoders, audio, vision, diffusers), each from a tiny config, checked as a new user meets them
by ``tests/helpers/sweep.py``: convert (frontend="auto", example inputs), eval and train exact against the
source, a batch one larger, a 2-stage CPU pipeline. The harness's conversion from a one-sample example (a third
export of each architecture) is left out here: test_hf.py checks it per family. A model seqify cannot take must
be refused with the SeqifyError listed here, at the stage listed here: never a raw crash, never a wrong model."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from helpers import sweep as harness  # noqa: E402

REGISTRIES = {name: importlib.import_module(f"helpers.{name}").REGISTRY
              for name in ("hf_decoders", "hf_recent", "hf_encoders", "hf_vision")}

# (stage, error class): refusals that are right. Data-dependent control flow torch.export cannot capture
# (MoE routing written as a Python loop over the experts hit, LayerDrop's random skip in train mode, a labels
# check), fx stopped by torch.finfo of a traced dtype in a root forward export cannot capture either, and a
# loss reduced over the whole batch, which micro-batches cannot make.
REFUSED = {
    "mixtral_eager_experts": ("convert+eval", "ExportError"),
    "dbrx": ("convert+eval", "ExportError"),
    "Wav2Vec2Model": ("train", "ExportError"),
    "HubertModel": ("train", "ExportError"),
    "M2M100ForConditionalGeneration": ("train", "ExportError"),
    "Wav2Vec2ForCTC+labels": ("convert+eval", "ExportError"),
    "LongformerModel+pad": ("convert+eval", "UntraceableError"),
    "NystromformerModel": ("convert+eval", "UntraceableError"),
    "clip_loss": ("bigger batch", "SpecializationError"),
    "vit_labels": ("pipeline", "BoundaryError"),
    "vqmodel": ("pipeline", "BoundaryError"),
    # PhiMoE's router applies a custom autograd.Function in train mode; fx cannot trace the decorated root and
    # export keeps the Function's forward ops without its backward: refused rather than trained wrong
    "phimoe": ("train", "AutogradContextError"),
    # RecurrentGemma's RG-LRU applies a custom autograd.Function (SqrtBoundDerivative): the same refusal
    "recurrent_gemma": ("convert+eval", "AutogradContextError"),
    # Lumina 2 takes the set and max of its batch's sequence lengths in Python: the conversion holds for the
    # example's batch size (export cannot capture it at all), other batch sizes get SpecializationError
    "lumina2": ("bigger batch", "SpecializationError"),
    # LLaVA and Idefics3 turn their batch of image features into a Python list (list(image_features)): the
    # conversion holds for the example's batch size, other batch sizes get SpecializationError
    "llava": ("bigger batch", "SpecializationError"),
    "idefics3": ("bigger batch", "SpecializationError"),
}

CASES = [(registry, name) for registry, models in REGISTRIES.items() for name in models]


@pytest.mark.parametrize(("registry", "name"), CASES, ids=[f"{r}:{n}" for r, n in CASES])
def test_architecture_converts_exactly_or_is_refused_clearly(registry: str, name: str) -> None:
    build = REGISTRIES[registry][name]
    row = harness.check(name, build, pipeline=getattr(build, "pipeline", True), one_sample=False)
    if not row["ok"] and row["stage"] == "build" and row["error"].startswith(("AttributeError", "ImportError")):
        pytest.skip(f"this transformers/diffusers lacks it: {row['error']}")
    if name in REFUSED:
        stage, error = REFUSED[name]
        assert not row["ok"], f"{name} now converts: take it off REFUSED"
        assert row["seqify_error"] and row["error"].startswith(error) and row["stage"] == stage, row["trace"]
    else:
        assert row["ok"], f"[{row.get('stage')}] {row.get('error')}\n{row.get('trace')}"
