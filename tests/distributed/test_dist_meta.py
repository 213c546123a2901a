"""Models built on the meta device under seqify.distributed: each rank holds memory for its own partitions only,
filled from a checkpoint, and trains bit for bit as the pipeline of the real model does (gloo, float64)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import meta_worker as worker
from helpers.procs import free_port, spawn

import seqify
from seqify.distributed.materialize import materialize

pytest.importorskip("safetensors")
pytestmark = pytest.mark.timeout(180)


def reference(name: str) -> dict[str, Any]:
    """Two SGD steps of the source in one process, micro-batch by micro-batch (two per step, losses weighted
    by size): each step's loss and gradients, and the parameters after."""
    model = worker.build(name).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"losses": [], "grads": []}
    for step in range(2):
        x, y = worker.data(name, step)
        opt.zero_grad()
        loss = sum(worker.loss_fn(name)(model(a), b) * (len(a) / len(x))
                   for a, b in zip(x.tensor_split(2), y.tensor_split(2)))
        loss.backward()
        out["losses"].append(float(loss))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def checkpoints(tmp: Path) -> dict[str, str]:
    """The weights each rank loads: a seqify.checkpoint folder (the large and the plain model) and an
    exported safetensors file (the Llama)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        big = worker.Big()
    big.to_empty(device="cpu")
    for p in big.parameters():
        torch.nn.init.uniform_(p, -0.02, 0.02)
    seqify.checkpoint.save(big, tmp / "big", rng_state=False)
    del big
    seqify.checkpoint.save(worker.build("scaled"), tmp / "scaled", rng_state=False)
    seqify.checkpoint.export(worker.build("llama"), tmp / "llama.safetensors")
    return {"big": str(tmp / "big"), "scaled": str(tmp / "scaled"), "llama": str(tmp / "llama.safetensors")}


def test_meta_built_ranks_hold_their_share_and_train_like_the_real_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    weights = checkpoints(tmp_path)
    spawn(worker.spawned, (free_port(), str(tmp_path), weights), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, record in enumerate(ranks):
        big = record["big"]
        print(f"rank {r}: peak memory grew {big['grown'] / 2**20:.0f} MiB while staging a {big['whole'] / 2**20:.0f} "
              f"MiB model from meta; its own parameters: {big['mine'] / 2**20:.0f} MiB")
        assert big["grown"] < 0.75 * big["whole"], big
        assert big["mine"] == big["whole"] // 2
    for name in ("scaled", "llama"):
        ref = reference(name)
        for step in range(2):
            meta = [r[name]["meta"] for r in ranks]
            real = [r[name]["real"] for r in ranks]
            assert [m["losses"][step] for m in meta] == [m["losses"][step] for m in real]
            (loss,) = [m["losses"][step] for m in meta if m["losses"][step] is not None]
            assert loss == pytest.approx(ref["losses"][step], rel=1e-12, abs=1e-12)
            seen: dict[str, torch.Tensor] = {}
            for m, q in zip(meta, real):
                assert m["grads"][step].keys() == q["grads"][step].keys()
                for k, g in m["grads"][step].items():
                    assert torch.equal(g, q["grads"][step][k]), (name, step, k)
                seen.update(m["grads"][step])
            assert set(seen) == set(ref["grads"][step])
            for k, g in seen.items():
                torch.testing.assert_close(g, ref["grads"][step][k], rtol=1e-10, atol=1e-12, msg=k)
        for m, q in zip(meta, real):
            assert all(torch.equal(p, q["params"][k]) for k, p in m["params"].items())


def meta_scaled() -> tuple[torch.nn.Module, seqify.Sequential]:
    with torch.device("meta"):
        source = worker.build("scaled")
    return source, seqify.convert(source, verify=False)


def test_meta_layers_without_weights_are_refused() -> None:
    source, seq = meta_scaled()
    with pytest.raises(seqify.MetaDeviceError, match=r"on the meta device .* pass weights="):
        materialize(seq, [len(seq)], [0], torch.device("cpu"), None, source=source)


def test_a_non_persistent_buffer_needs_buffers(tmp_path: Path) -> None:
    seqify.checkpoint.save(worker.build("scaled"), tmp_path / "ck", rng_state=False)
    source, seq = meta_scaled()
    with pytest.raises(seqify.MetaDeviceError, match=r"scale is a non-persistent buffer .* pass buffers=fn"):
        materialize(seq, [len(seq)], [0], torch.device("cpu"), tmp_path / "ck", source=source)
    source, seq = meta_scaled()
    with pytest.raises(seqify.MetaDeviceError, match=r"left the non-persistent buffer scale without values"):
        materialize(seq, [len(seq)], [0], torch.device("cpu"), tmp_path / "ck", source=source, buffers=lambda m: None)
    source, seq = meta_scaled()
    materialize(seq, [len(seq)], [0], torch.device("cpu"), tmp_path / "ck", source=source, buffers=worker.scale_init)
    x = worker.data("scaled", 0)[0]
    assert torch.equal(seq(x), worker.build("scaled")(x))


def test_weights_that_lack_a_key_name_it(tmp_path: Path) -> None:
    state = worker.build("scaled").state_dict()
    del state["c.bias"]
    import safetensors.torch

    safetensors.torch.save_file(state, str(tmp_path / "w.safetensors"))
    source, seq = meta_scaled()
    with pytest.raises(seqify.StateDictError, match=r"lacks keys .*'c.bias'"):
        materialize(seq, [len(seq)], [0], torch.device("cpu"), tmp_path / "w.safetensors", source=source,
                    buffers=worker.scale_init)


def test_the_benchmark_writes_the_checkpoint_its_ranks_read(tmp_path: Path) -> None:
    """benchmarks/meta_init's first command (--write), on a small model: the folder it documents loads."""
    import subprocess
    import sys

    from helpers.procs import child_env

    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, str(root / "benchmarks" / "meta_init" / "main.py"), "--write", str(tmp_path / "ckpt"),
            "--layers", "2", "--width", "8"]
    done = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    state = seqify.checkpoint.load_state_dict(tmp_path / "ckpt")
    assert list(state) == ["layers.0.weight", "layers.1.weight"] and all(t.shape == (8, 8) for t in state.values())
