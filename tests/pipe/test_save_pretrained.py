"""seqify.checkpoint.save_pretrained: a trained pipeline's weights as a Hugging Face folder that transformers loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import dist_worker
from torch import nn

import seqify

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)


def test_a_trained_pipeline_saves_a_folder_from_pretrained_loads(tmp_path: Path) -> None:
    source = dist_worker.build("llama").train()
    seq = dist_worker.converted("llama", source)
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance="params", chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    x, y = dist_worker.data("llama", 4)
    pipe.step(x, y, dist_worker.lm_loss)
    opt.step()
    fresh = dist_worker.build("llama")  # the same configuration, its initial weights
    assert seqify.checkpoint.save_pretrained(pipe, fresh, tmp_path / "hf") == str(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    trained = seq.original_state_dict()
    initial = dist_worker.build("llama").state_dict()
    assert any(not torch.equal(t, initial[k]) for k, t in trained.items())  # the step changed the weights
    for key, t in loaded.state_dict().items():
        assert torch.equal(t, trained[key]), key
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, seq.eval()(input_ids=x).logits)


def test_a_model_without_save_pretrained_is_refused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(seqify.CheckpointError, match="has no save_pretrained .* seqify.checkpoint.export"):
        seqify.checkpoint.save_pretrained(model, model, tmp_path / "hf")
