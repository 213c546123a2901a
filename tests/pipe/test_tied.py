"""Weights tied across partitions (GPT-2's embedding and LM head) train exactly as on one device."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import seqify
from helpers.exactness import by_micro_batch
from seqify.pipe import memory

pytestmark = pytest.mark.timeout(120)


class TinyGPT(nn.Module):
    """GPT-2's shape in miniature: token + position embeddings, two blocks, an LM head tied to the embedding."""

    def __init__(self, vocab: int = 11, dim: int = 8, length: int = 6) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(length, dim)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU()) for _ in range(2)])
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        h = self.wte(idx) + self.wpe(pos)
        h = h + self.blocks(h)
        return self.lm_head(self.ln_f(h))


def backward_ops(out: torch.Tensor) -> set[str]:
    """The kinds of node in ``out``'s autograd graph."""
    seen: dict[int, str] = {}
    todo = [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and id(fn) not in seen:
            seen[id(fn)] = type(fn).__name__
            todo += [f for f, _ in fn.next_functions]
    return set(seen.values())


def loss_of(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("cut", ["after wte", "middle", "before lm_head"])
def test_tied_embedding_and_head_train_as_on_one_device(checkpoint: str, cut: object) -> None:
    torch.manual_seed(0)
    source = TinyGPT().double()
    one = copy.deepcopy(source)
    idx = torch.randint(0, 11, (4, 6))
    seq = seqify.convert(source, (idx,))
    names = list(seq._modules)
    first = {"after wte": names.index("wte") + 1, "middle": len(seq) // 2, "before lm_head": names.index("lm_head")}[cut]
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[first, len(seq) - first], chunks=2, checkpoint=checkpoint)
    assert len(pipe.ties) == 1 and pipe.ties[0].param is source.wte.weight
    assert source.lm_head.weight is source.wte.weight  # the source stays tied

    assert "ToCopyBackward0" in backward_ops(pipe(idx))  # the later partition computes with a copy
    ref_loss = sum(loss_of(one(i), i) for i in idx.tensor_split(2))
    ref_loss.backward()
    logits = pipe(idx)  # one mini-batch of two micro-batches
    loss = sum(loss_of(lg, i) for lg, i in zip(logits.tensor_split(2), idx.tensor_split(2)))
    loss.backward()
    with torch.no_grad():
        assert torch.equal(logits, torch.cat([one(i) for i in idx.tensor_split(2)]))
    for (name, p), q in zip(source.named_parameters(), one.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert len(list(pipe.parameters())) == len(list(source.parameters()))  # the tied weight once, for optimizers

    for model in (source, one):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    for (name, p), q in zip(source.named_parameters(), one.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=name)
    with torch.no_grad():  # the next step sees the updated weight in both partitions
        torch.testing.assert_close(pipe(idx), torch.cat([one(i) for i in idx.tensor_split(2)]), rtol=1e-12, atol=1e-12)


def test_a_plain_sequential_with_a_tied_weight_in_two_partitions() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    model = nn.Sequential(a, nn.Tanh(), b).double()
    one = copy.deepcopy(model)
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe = seqify.pipeline(model, devices=["cpu", "cpu"], balance=[2, 1], chunks=2)
    y = pipe(x)
    expected = by_micro_batch(one, (x,), 2)
    assert torch.equal(y, expected)
    y.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    torch.testing.assert_close(a.weight.grad, one[0].weight.grad, rtol=1e-12, atol=1e-12)
    assert b.weight is a.weight and model[2].weight is model[0].weight


def test_a_tied_weight_changed_in_place_by_the_forward_is_refused() -> None:
    class Decaying(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(self.a(x))
            self.a.weight.mul_(0.5)  # a frozen weight decayed as the model runs
            return self.b(y)

    model = Decaying()
    model.a.weight.requires_grad_(False)
    seq = seqify.convert(model)
    with pytest.raises(seqify.TiedParameterError, match="changes it in place") as info:
        seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[1, len(seq) - 1])
    assert isinstance(info.value, seqify.SharedParameterError) and "Change the balance" in str(info.value)


def test_tied_weights_across_processes_are_refused() -> None:
    from seqify.distributed import DistributedStage

    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    model = nn.Sequential(a, nn.Tanh(), b)
    with pytest.raises(seqify.TiedParameterError, match=r"layer '2' \(partition 1, rank 1\).*seqify.pipeline"):
        DistributedStage(model, [2, 1], index=1, device=torch.device("cpu"))
    DistributedStage(model, [3], index=0, device=torch.device("cpu"))  # one stage holds both: fine


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_scheduled_step_with_tied_weights_equals_one_device(schedule: str) -> None:
    torch.manual_seed(0)
    source = TinyGPT().double()
    one = copy.deepcopy(source)
    idx = torch.randint(0, 11, (4, 6))
    seq = seqify.convert(source, (idx,))
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[3, len(seq) - 3], chunks=2, schedule=schedule)
    loss = pipe.step(idx, idx, loss_of)
    expected = sum(loss_of(one(i), i) for i in idx.tensor_split(2)) / 2
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(source.named_parameters(), one.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_tied_weights_across_two_gpus(checkpoint: str) -> None:
    """The copy crosses devices: the LM head on cuda:1 computes with a copy of the embedding on cuda:0."""
    torch.manual_seed(0)
    source = TinyGPT().double()
    one = copy.deepcopy(source)
    idx = torch.randint(0, 11, (4, 6))
    seq = seqify.convert(source, (idx,))
    pipe = seqify.pipeline(seq, devices=["cuda:0", "cuda:1"], balance=[3, len(seq) - 3], chunks=2, checkpoint=checkpoint)
    assert source.wte.weight.device == torch.device("cuda:0") and source.lm_head.weight is source.wte.weight
    logits = pipe(idx)
    sum(loss_of(lg, i) for lg, i in zip(logits.tensor_split(2), idx.cuda(1).tensor_split(2))).backward()
    sum(loss_of(one(i), i) for i in idx.tensor_split(2)).backward()
    for (name, p), q in zip(source.named_parameters(), one.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_the_tuner_proposes_captured_graphs_only_where_a_tied_weight_stays_on_one_device(monkeypatch) -> None:
    """Captured graphs cannot replay a weight copied to another device per call: on GPUs the tuner's
    graphs=True candidates keep the embedding and the head on one device (in one partition, or the first
    and last partitions of zb-h1's V, both on cuda:0), eager candidates still put them apart, and
    graphs=True fixed by the user where no candidate is left is refused with what to do."""
    from seqify import tuning
    from seqify.errors import TuneError
    from seqify.pipe.tied import across, crossing

    torch.manual_seed(0)
    idx = torch.randint(0, 11, (8, 6))
    seq = seqify.convert(TinyGPT(), (idx,))
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]  # only their type and count are read here
    fixed = dict(chunks=None, loops=None, balance=None, checkpoint=None, graphs=None, schedule=None, memory_cap=None, top=1)
    _, hi = tuning.layer_model(seq, idx, torch.device("cpu"), lo=2, show=False)
    found = [c for c, _, _ in tuning.space.candidates(seq, idx, hi, gpus, fixed, float("inf"))]
    assert any(crossing(across(seq, c.balance), c.devices) for c in found if not c.graphs)
    assert not any(crossing(across(seq, c.balance), c.devices) for c in found if c.graphs)
    apart = [c for c in found if c.graphs and across(seq, c.balance)]  # split, yet on one device: the V among them
    assert any(c.schedule == "zb-h1" and c.devices[0] == c.devices[-1] == "cuda:0" for c in apart)
    monkeypatch.setattr(tuning.space, "candidates", lambda *a, **k: [])
    with pytest.raises(TuneError, match="graphs=True: parameter wte.weight .* schedule='zb-h1' with loops=2"):
        seqify.tune(seq, idx, devices=["cpu", "cpu"], graphs=True, cache=False, show=False)


def test_graphs_with_a_tied_weight_are_refused_only_across_devices() -> None:
    """The check placement runs: partitions sharing a weight on two devices cannot be captured; on one device
    (a V placement's first and last partitions) they can."""
    from seqify.pipe import tied

    torch.manual_seed(0)
    idx = torch.randint(0, 11, (4, 6))
    seq = seqify.convert(TinyGPT(), (idx,))
    n = len(seq)
    parts = [seq[:3], seq[3:6], seq[6:n - 2], seq[n - 2:]]
    ties = tied.find(parts)
    assert len(ties) == 1 and ties[0].owner == 0 and 3 in ties[0].slots
    tied.check(ties, parts, True, ["cuda:0", "cuda:1", "cuda:1", "cuda:0"])  # the V: wte and lm_head on cuda:0
    tied.check(ties, parts, False, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"])  # eager: copies
    with pytest.raises(seqify.TiedParameterError, match="on another device; graphs=True.*zb-h1"):
        tied.check(ties, parts, True, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"])


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_tied_weight_on_one_device_replays_as_fixed_programs(checkpoint: str) -> None:
    """zb-h1 in a V over two devices puts the embedding (partition 0) and the head (partition 3) on the first
    device: the step runs as fixed programs (the graphs path, with eager programs on the CPU), each copying
    the weight inside its program, and its loss and gradients are one device's (float64)."""
    torch.manual_seed(0)
    source = TinyGPT().double()
    one = copy.deepcopy(source)
    idx = torch.randint(0, 11, (4, 6))
    seq = seqify.convert(source, (idx,))
    n = len(seq)
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], loops=2, schedule="zb-h1", balance=[3, 3, n - 8, 2],
                           chunks=2, checkpoint=checkpoint)
    assert len(pipe.ties) == 1 and 3 in pipe.ties[0].slots
    pipe._replay_eager = True
    loss = pipe.step(idx, idx, loss_of)
    assert pipe._graphed is not None, "the step did not run as fixed programs"
    expected = sum(loss_of(one(i), i) for i in idx.tensor_split(2)) / 2
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(source.named_parameters(), one.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
    # no zero_grad: the next step adds into .grad (views of the first partition's sums), the tied weight's two sums too
    pipe.step(idx, idx, loss_of)
    for (name, p), q in zip(source.named_parameters(), one.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_tied_weight_on_one_device_replays_as_captured_cuda_graphs(checkpoint: str) -> None:
    """The V on GPUs (cuda:0 and cuda:1, or cuda:0 twice on a one-GPU machine): the embedding and the head
    share cuda:0 and the step replays captured CUDA graphs; three SGD steps train as one device (float64)."""
    torch.manual_seed(0)
    source = TinyGPT().double()
    one = copy.deepcopy(source).cuda()
    idx = torch.randint(0, 11, (4, 6))
    seq = seqify.convert(source, (idx,))
    n = len(seq)
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    pipe = seqify.pipeline(seq, devices=devices, loops=2, schedule="zb-h1", balance=[3, 3, n - 8, 2], chunks=2,
                           checkpoint=checkpoint, graphs=True)
    assert len(pipe.ties) == 1 and source.lm_head.weight is source.wte.weight
    mine = torch.optim.SGD(source.parameters(), lr=0.1)
    theirs = torch.optim.SGD(one.parameters(), lr=0.1)
    for _ in range(3):
        loss = pipe.step(idx, idx, loss_of)
        expected = sum(loss_of(one(i), i) for i in idx.cuda().tensor_split(2)) / 2
        expected.backward()
        torch.testing.assert_close(loss.cpu(), expected.detach().cpu(), rtol=1e-10, atol=1e-12)
        for (name, p), q in zip(source.named_parameters(), one.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-9, atol=1e-12, msg=name)
        mine.step(), theirs.step(), mine.zero_grad(), theirs.zero_grad()
    assert pipe.graph_error is None and pipe._graphed is not None, f"the step ran eagerly: {pipe.graph_error}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_module_called_in_two_partitions_keeps_its_weight_with_the_first() -> None:
    """A cut between two calls of one module ties its weight to itself: while partitions move, the shared
    slot is empty, so the weight is put on the first partition's device afterwards (it stayed on the CPU
    and the first partition failed with a device mismatch). Trains as one device (float64)."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 4)
            self.lin = nn.Linear(4, 4)
            self.out = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(torch.tanh(self.inp(x)))
            return self.out(self.lin(torch.relu(h)))

    torch.manual_seed(0)
    source = Twice().double()
    one = copy.deepcopy(source).cuda()
    x = torch.randn(4, 4, dtype=torch.float64)
    seq = seqify.convert(source)
    names = list(seq._modules)
    cut = names.index("relu")  # the first call of lin before it, the second after
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    pipe = seqify.pipeline(seq, devices=devices, balance=[cut, len(seq) - cut], chunks=2)
    assert len(pipe.ties) == 2 and source.lin.weight.device == torch.device("cuda:0")
    pipe(x).pow(2).sum().backward()
    one(x.cuda()).pow(2).sum().backward()
    for (name, p), q in zip(source.named_parameters(), one.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-10, atol=1e-12, msg=name)


def test_memory_planned_for_a_tied_weight_across_partitions_counts_what_b_keeps() -> None:
    """pipe.plan_memory measures through the stage's own modules: a layer holding a tied weight is called
    through a wrapper there (it crashed on the wrapper once), and its output is still what B keeps for W."""
    torch.manual_seed(0)
    source = TinyGPT().double()
    idx = torch.randint(0, 11, (4, 6))
    seq = seqify.convert(source, (idx,))
    pipe = seqify.pipeline(seq, devices=["cpu", "cpu"], balance=[3, len(seq) - 3], chunks=2)
    assert pipe.plan_memory(idx, schedule="zb-h1", checkpoint="never").peak > 0
    parts = memory.measure(pipe.stages, idx[:2])
    assert parts[0].kept == 0 and parts[1].kept > 0  # the last partition's B keeps the head's output gradient
