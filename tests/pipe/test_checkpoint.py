"""seqify.checkpoint in one process: what a checkpoint folder holds, the optimizer keyed by source names, the
checks made before anything loads, saves that never leave a half-written folder, and safetensors export."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from test_tied import TinyGPT
from torch import nn

import seqify
from seqify import checkpoint
from seqify.checkpoint import store

pytestmark = pytest.mark.timeout(120)

CPU2, CPU3 = ["cpu", "cpu"], ["cpu", "cpu", "cpu"]


def gpt_pipe(seed: int, balance: list[int]) -> tuple[TinyGPT, seqify.Pipeline]:
    torch.manual_seed(seed)
    source = TinyGPT()
    seq = seqify.convert(source, (torch.randint(0, 11, (2, 6)),))
    return source, seqify.pipeline(seq, devices=["cpu"] * len(balance), balance=balance)


def trained(pipe: seqify.Pipeline, opt: torch.optim.Optimizer, steps: int = 2) -> None:
    torch.manual_seed(5)
    for _ in range(steps):
        idx = torch.randint(0, 11, (4, 6))
        opt.zero_grad()
        pipe(idx).square().mean().backward()
        opt.step()


def by_name(opt: torch.optim.Optimizer, names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer's per-parameter state keyed by ``names`` (one per parameter, in the optimizer's order)."""
    state = opt.state_dict()["state"]
    return {names[i]: s for i, s in state.items()}


def source_names(module: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    names = {id(p): k for k, p in reversed(list(module.state_dict(keep_vars=True).items()))}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def test_a_checkpoint_is_a_folder_of_dcp_tensors_plain_state_and_json(tmp_path: Path) -> None:
    source, pipe = gpt_pipe(0, [6, 7])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    trained(pipe, opt)
    files = checkpoint.save(pipe, tmp_path / "ck", opt, step=2, extra={"note": "hi"})
    assert sorted(os.path.relpath(f, tmp_path / "ck") for f in files) == [
        "seqify.json", "state.pt", "tensors/.metadata", "tensors/__0_0.distcp"]
    meta = json.loads((tmp_path / "ck" / "seqify.json").read_text())
    assert meta["format"] == store.FORMAT and meta["balance"] == [6, 7] and meta["step"] == 2
    assert meta["keys"] == list(source.state_dict()) and meta["optimizer"] == "SGD"
    state = torch.load(tmp_path / "ck" / "state.pt", weights_only=True)  # plain values only
    assert state["extra"] == {"note": "hi"} and state["optimizer"]["groups"][0]["params"][0] == "wte.weight"
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(tmp_path / "ck" / "tensors")).read_metadata().state_dict_metadata
    assert {"model/wte.weight", "model/lm_head.weight", "optimizer/wte.weight/momentum_buffer"} <= set(saved)


def test_optimizer_state_follows_the_parameters_onto_another_balance_and_the_source(tmp_path: Path) -> None:
    source, pipe = gpt_pipe(0, [6, 7])
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    trained(pipe, opt)
    checkpoint.save(pipe, tmp_path / "ck", opt)
    want = by_name(opt, source_names(source, opt))

    other_source, other = gpt_pipe(1, [4, 4, 5])
    params = list(other.parameters())[::-1]  # another order: state goes by name, not by position
    other_opt = torch.optim.Adam(params, lr=0.5)
    checkpoint.load(other, tmp_path / "ck", other_opt)
    plain = TinyGPT()
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.5)
    checkpoint.load(plain, tmp_path / "ck", plain_opt)
    for model, o in ((other_source, other_opt), (plain, plain_opt)):
        assert o.param_groups[0]["lr"] == 0.01
        got = by_name(o, source_names(model, o))
        assert got.keys() == want.keys()
        for k, s in want.items():
            assert all(torch.equal(got[k][n], v) for n, v in s.items()), k
        for k, v in source.state_dict().items():
            assert torch.equal(model.state_dict()[k], v), k
    assert plain.lm_head.weight is plain.wte.weight  # still tied


def test_a_plain_sequential_pipeline_and_a_converted_model_save_and_load(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = seqify.pipeline(copy.deepcopy(model), devices=CPU2, balance=[2, 1])
    checkpoint.save(pipe, tmp_path / "a", step=9)
    fresh = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    assert checkpoint.load(fresh, tmp_path / "a").step == 9
    x = torch.randn(5, 3)
    assert torch.equal(fresh(x), model(x))
    seq = seqify.convert(model)
    checkpoint.save(seq, tmp_path / "b")
    assert checkpoint.load_state_dict(tmp_path / "b").keys() == model.state_dict().keys()


def test_the_random_generators_come_back(tmp_path: Path) -> None:
    import random

    import numpy as np

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    model = nn.Linear(2, 2)
    checkpoint.save(model, tmp_path / "ck")
    want = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(4), random.seed(4), np.random.seed(4)
    checkpoint.load(model, tmp_path / "ck")
    got = torch.rand(3), random.random(), np.random.rand()
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
    checkpoint.load(model, tmp_path / "ck", rng_state=False)  # leaves them as they are
    assert not torch.equal(torch.rand(3), want[0])


def test_a_save_that_fails_leaves_the_previous_checkpoint_whole(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(3, 3)
    checkpoint.save(model, tmp_path / "ck", step=1)
    with torch.no_grad():
        model.weight.add_(1)

    def dies(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(store.dcp, "save", dies)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(model, tmp_path / "ck", step=2)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ck"]  # no temporary folder left behind
    assert checkpoint.load(nn.Linear(3, 3), tmp_path / "ck").step == 1
    with pytest.raises(seqify.CheckpointError, match="weights_only=True"):
        checkpoint.save(model, tmp_path / "ck", extra={"a": object()})
    assert checkpoint.load(nn.Linear(3, 3), tmp_path / "ck").step == 1
    checkpoint.save(model, tmp_path / "ck", step=3)  # a finished save replaces it
    assert checkpoint.load(nn.Linear(3, 3), tmp_path / "ck").step == 3 and os.listdir(tmp_path) == ["ck"]


def test_a_folder_of_other_files_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(seqify.CheckpointError, match="new or empty folder"):
        checkpoint.save(nn.Linear(2, 2), tmp_path)
    (tmp_path / "index.json").write_text("{}")  # beside a checkpoint of seqify 0.1: still the user's file
    with pytest.raises(seqify.CheckpointError, match="new or empty folder"):
        checkpoint.save(nn.Linear(2, 2), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    checkpoint.save(nn.Linear(2, 2), tmp_path / "ck", step=torch.tensor(4))
    assert checkpoint.load(nn.Linear(2, 2), tmp_path / "ck").step == 4
    with pytest.raises(seqify.CheckpointError, match="step=0.5"):
        checkpoint.save(nn.Linear(2, 2), tmp_path / "ck", step=0.5)


def test_a_checkpoint_of_seqify_0_1_still_loads(tmp_path: Path) -> None:
    """The per-stage files seqify 0.1 wrote: index.json and stage_J.pt."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    state = model.state_dict()
    torch.save({k: state[k] for k in ("0.weight", "0.bias")}, tmp_path / "stage_0.pt")
    torch.save({k: state[k] for k in ("1.weight", "1.bias")}, tmp_path / "stage_1.pt")
    stages = [{"file": f"stage_{j}.pt", "keys": [f"{j}.weight", f"{j}.bias"]} for j in range(2)]
    (tmp_path / "index.json").write_text(json.dumps({"balance": [1, 1], "stages": stages}))
    pipe = seqify.pipeline(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), devices=CPU2, balance=[1, 1])
    checkpoint.load(pipe, tmp_path)
    x = torch.randn(2, 3)
    assert torch.equal(pipe(x), model(x))
    with pytest.raises(seqify.CheckpointError, match="model's state only"):
        checkpoint.load(pipe, tmp_path, torch.optim.SGD(pipe.parameters(), lr=0.1))


def test_export_writes_safetensors_under_the_source_keys_with_ties_once(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    source, pipe = gpt_pipe(0, [6, 7])
    path = checkpoint.export(pipe, tmp_path / "gpt.safetensors")
    with safetensors.safe_open(path, framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and "wte.weight" in f.keys()  # stored once
    state = checkpoint.load_exported(path)
    assert list(state) == list(source.state_dict())
    target = TinyGPT()
    target.load_state_dict(state)
    again = TinyGPT()
    safetensors.load_model(again, path)  # safetensors' own loader knows the tie as well
    idx = torch.randint(0, 11, (2, 6))
    with torch.no_grad():
        assert torch.equal(target(idx), source(idx)) and torch.equal(again(idx), source(idx))
    assert target.lm_head.weight is target.wte.weight


def test_a_transformers_model_saves_pretrained_from_a_checkpoint(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, use_cache=False, tie_word_embeddings=True)
    torch.manual_seed(0)
    source = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 64, (2, 8))
    seq = seqify.convert(source, example_inputs={"input_ids": ids})
    pipe = seqify.pipeline(seq, devices=CPU2, balance=[2, len(seq) - 2])
    checkpoint.save(pipe, tmp_path / "ck")
    fresh = transformers.GPT2LMHeadModel(cfg).eval()  # in a new process: built from the config, no download
    fresh.load_state_dict(checkpoint.load_state_dict(tmp_path / "ck"))
    fresh.save_pretrained(tmp_path / "hf")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, source(ids).logits)
