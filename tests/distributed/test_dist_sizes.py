"""seqify.distributed with size skips (ints made from shapes, e.g. a transformers model's batch size) crossing
ranks: a tiny export-converted Llama on real gloo processes, eager and fixed programs, equal to one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import dist_worker as worker
import seqify
import seqify.distributed as sd
from seqify.distributed.sizes import decode, encode, is_size
from seqify.skip.layout import routes
from seqify.model.stash_sizes import size_skips
from helpers.procs import free_port, spawn

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)
# 22 layers; partitions 0-1-2-3 placed 0, 1, 1, 0 (a V): the batch size stashed by layer 1 is popped by
# layer 5 (partition 0 -> 1, across ranks), its copies by layers 7 (1 -> 2, within rank 1) and 9 (2 -> 3,
# across again). With one partition per rank ([5, 17]) the first crosses from rank 0 to rank 1.
V = [5, 2, 2, 13]


def reference(chunks: int = 4, batch: int = 8) -> dict[str, Any]:
    """Two SGD steps in one process on the same micro-batches: losses and gradients per step, then the
    logits of the first batch."""
    model = worker.build("llama").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"losses": [], "grads": []}
    for step in range(2):
        x, y = worker.data("llama", batch, step)
        opt.zero_grad()
        loss = sum(worker.lm_loss(model(input_ids=a), b) * (len(a) / len(x))
                   for a, b in zip(x.tensor_split(chunks), y.tensor_split(chunks)))
        loss.backward()
        out["losses"].append(float(loss.detach()))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    with torch.no_grad():
        out["logits"] = model(input_ids=worker.data("llama", batch, 0)[0]).logits
    return out


def test_the_cuts_put_size_skips_across_ranks_and_within_one() -> None:
    seq = worker.converted("llama", worker.build("llama"))
    sized = size_skips(seq)
    starts = [sum(V[:j]) for j in range(len(V) + 1)]
    part = [j for j in range(len(V)) for _ in range(V[j])]
    crossing = sorted((part[r.stash], part[r.pop]) for r in routes(seq) if r.key in sized)
    assert crossing == [(0, 1), (1, 2), (2, 3)] and starts[-1] == len(seq)


def test_sizes_travel_exactly_in_a_header() -> None:
    for value in [0, 3, -7, 2**62, 0.1, -1e300, float("inf"), True, False, torch.Size([]), torch.Size([4, 8, 16])]:
        kind, words = encode(value)
        back = decode(kind, words)
        assert is_size(value) and type(back) is type(value) and back == value
    assert not is_size(torch.tensor(3)) and not is_size((3, 4)) and not is_size(None)


def test_one_rank_of_programs_holds_each_size_per_micro_batch_and_refuses_another() -> None:
    # two partitions on one rank under a split schedule: the size stashed by partition 0 reaches partition
    # 1's programs as a constant of each micro-batch; two steps train like the source
    model = worker.build("llama").train()
    stage = sd.DistributedStage(worker.converted("llama", model), [5, 17], index=0, device=torch.device("cpu"),
                                chunks=3, schedule=worker.one_rank_zb(2, 3), graphs=True)
    source = worker.build("llama").train()
    for step in range(2):
        x, y = worker.data("llama", 8, step)
        for p in (*model.parameters(), *source.parameters()):
            p.grad = None
        loss = stage.step(x, y, loss_fn=worker.lm_loss)
        want = sum(worker.lm_loss(source(input_ids=a), b) * (len(a) / len(x)) for a, b in zip(x.tensor_split(3),
                                                                                              y.tensor_split(3)))
        want.backward()
        assert loss is not None and float(loss) == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-12)
        for (n, a), b in zip(source.named_parameters(), model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=n)
    programs = stage._programs[1]
    assert [list(p.flat.given.values()) for p in programs.programs] == [[3], [3], [2]]
    # the same micro-batch sizes but another size skip value (the other shapes changed): refused by name
    prog = programs.programs[0]
    k = 1 if prog.flat.carried is None else prog.flat.carried
    x_in = prog.inputs[0] if prog.flat.carried is None else tuple(prog.inputs[:k])
    tensor_keys = [key for key in programs.runner.pops if key not in prog.flat.given]
    skips = {**dict(zip(tensor_keys, prog.inputs[k:])), **{key: v + 1 for key, v in prog.flat.given.items()}}
    with pytest.raises(seqify.GraphError, match=r"partition 1, micro-batch 0.*sym_size.*graphs=False"):
        programs.forward(0, x_in, skips, needs_grad=True)
    # the same sizes but a tensor of another shape that would broadcast into the fixed input: refused too
    first = prog.inputs[0]
    narrow = first[..., :1].clone()  # [b, s, 1] copies into [b, s, h] without complaint
    x_narrow = narrow if prog.flat.carried is None else (narrow, *prog.inputs[1:k])
    skips = {**dict(zip(tensor_keys, prog.inputs[k:])), **prog.flat.given}
    with pytest.raises(seqify.GraphError, match=r"partition 1, micro-batch 0: its programs were built for inputs"):
        programs.forward(0, x_narrow, skips, needs_grad=True)


@pytest.mark.parametrize(("schedule", "loops", "balance", "graphs"), [
    ("1f1b", 1, [5, 17], False),
    ("zb-h1", 2, V, False),
    ("zb-h1", 2, V, True),  # fixed programs (eager on the CPU) keep each size as a per-micro-batch constant
])
def test_a_llama_whose_batch_size_skips_across_ranks_trains_like_one_process(
        tmp_path: Path, schedule: str, loops: int, balance: list[int], graphs: bool) -> None:
    # chunks=3 on a batch of 8: micro-batches of 3, 3 and 2, so each one's size is its own
    spawn(worker.spawned, args=(2, free_port(), str(tmp_path), "llama", balance, schedule, loops, 3, 8, "never",
                                   "", -1, graphs), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref = reference(chunks=3)
    for step in range(2):
        losses = [r["losses"][step] for r in results if r["losses"][step] is not None]
        assert losses == [pytest.approx(ref["losses"][step], rel=1e-12, abs=1e-12)]
        seen: dict[str, torch.Tensor] = {}
        for r in results:
            assert not set(seen) & set(r["grads"][step])
            seen.update(r["grads"][step])
        assert set(seen) == set(ref["grads"][step])
        for n, g in seen.items():
            torch.testing.assert_close(g, ref["grads"][step][n], rtol=1e-10, atol=1e-12, msg=n)
    outputs = [r["output"] for r in results if r["output"] is not None]
    assert len(outputs) == 1
    torch.testing.assert_close(outputs[0].logits, ref["logits"], rtol=1e-10, atol=1e-12)
    if graphs:
        for r in results:
            assert all(all(split) for split in r["split"].values()) and r["split"]
        # each program holds its micro-batch's batch size (3, 3, 2): partition 0 stashes it, 1 pops it (from
        # rank 0) and stashes its copy for 2 (same rank), which stashes one for 3 (back on rank 0)
        held = {p: sizes for r in results for p, sizes in r["sizes"].items()}
        for i, n in enumerate([3, 3, 2]):
            assert [sorted(held[p][i][0].values()) for p in range(4)] == [[], [n], [n], [n]]
            assert [sorted(held[p][i][1].values()) for p in range(4)] == [[n], [n], [n], []]
