"""pipe.step(x, target, loss_fn): every schedule trains like one device (float64: gradients, loss, BatchNorm)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import seqify
from helpers.fake_cuda import FakeGraph, fake_cuda
from seqify.errors import BoundaryError, ScheduleError
from seqify.pipe import memory
from seqify.schedule.actions import Schedule, ahead, make

pytestmark = pytest.mark.timeout(120)


class UNet(nn.Module):
    """Skips that cross partitions (encoder features reused by the decoder), BatchNorm, an in-place ReLU."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.inc = nn.Conv2d(2, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * c)
        self.mid = nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = nn.Conv2d(2 * c, c, 3, padding=1)
        self.out = nn.Conv2d(c, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn1(self.inc(x)), inplace=True)
        b = torch.tanh(self.bn2(self.down(a)))
        m = self.mid(b) + b
        u = self.up(m)
        d = F.relu(self.dec(torch.cat([u, a], 1)))
        return self.out(d).mean((2, 3))


def even(n: int, parts: int) -> list[int]:
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def setup(schedule: str | Schedule, parts: int, loops: int = 1, chunks: int = 4, checkpoint: str = "never",
          deferred: bool = False) -> tuple[nn.Module, seqify.Pipeline]:
    torch.manual_seed(0)
    source = UNet().double()
    model = copy.deepcopy(source)  # the pipeline moves and shares the converted model's modules
    seq = seqify.convert(model)
    pipe = seqify.pipeline(seq, devices=["cpu"] * (parts // loops), loops=loops, balance=even(len(seq), parts),
                           chunks=chunks, checkpoint=checkpoint, schedule=schedule, deferred_batch_norm=deferred)
    assert len(pipe.partitions) == parts
    assert any(a != b for a, b in pipe.skip_partitions.values())  # a skip does cross partitions
    return source, pipe


def data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def compare(source: nn.Module, pipe: seqify.Pipeline, loss_fn: nn.Module, steps: int = 2,
            buffers: bool = True) -> None:
    """One device, the source model over the same micro-batches (training BatchNorm normalises each
    micro-batch by its own statistics, in a pipeline as on one device fed those micro-batches)."""
    x, y = data()
    for _ in range(steps):  # twice: gradients accumulate into .grad as autograd's do
        expected = loss_fn(torch.cat([source(c) for c in x.tensor_split(pipe.chunks)]), y)
        expected.backward()
        got = pipe.step(x, y, loss_fn)
        assert got.requires_grad is False
        torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)
    theirs = dict(source.named_parameters())
    mine = dict(pipe.model.named_parameters()) if hasattr(pipe.model, "named_parameters") else {}
    assert len(theirs) == len(mine)
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
    if buffers:
        for a, b in zip(source.buffers(), pipe.model.buffers()):
            torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


CASES = [("gpipe", 2, 1), ("gpipe", 4, 2), ("1f1b", 2, 1), ("1f1b", 3, 1), ("1f1b", 4, 1),
         ("interleaved", 4, 2), ("zb-h1", 2, 1), ("zb-h1", 3, 1), ("zb-h1", 4, 1), ("zb-h1", 4, 2),
         ("zb-h2", 2, 1), ("zb-h2", 4, 1),
         # eight partitions (8-stage plans, on CPU devices): one per device, and two per device
         ("1f1b", 8, 1), ("zb-h2", 8, 1), ("interleaved", 8, 2), ("zb-h1", 8, 2)]


@pytest.mark.parametrize("schedule,parts,loops", CASES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_step_trains_like_one_device(schedule: str, parts: int, loops: int, checkpoint: str) -> None:
    source, pipe = setup(schedule, parts, loops, checkpoint=checkpoint)
    compare(source, pipe, nn.CrossEntropyLoss())


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_sum_reduction_and_uneven_micro_batches(schedule: str) -> None:
    source, pipe = setup(schedule, 3, chunks=3)  # 10 samples: 4, 3, 3
    compare(source, pipe, nn.CrossEntropyLoss(reduction="sum"), steps=1)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_deferred_batch_norm_statistics_equal_gpipe(checkpoint: str) -> None:
    """Deferred BatchNorm folds every micro-batch into one update per step, under every schedule."""
    x, y = data()
    stats = []
    for schedule, parts, loops in [("1f1b", 3, 1), ("zb-h1", 3, 1), ("interleaved", 4, 2), ("zb-h1", 4, 2)]:
        _, pipe = setup(schedule, parts, loops, deferred=True, checkpoint=checkpoint)
        pipe.step(x, y, nn.CrossEntropyLoss())
        stats.append([b.clone() for b in pipe.model.buffers()])
    _, pipe = setup("gpipe", 3, deferred=True, checkpoint=checkpoint)
    out = pipe(x)  # today's path: pipe(x) + loss.backward()
    nn.CrossEntropyLoss()(out, y).backward()
    reference = list(pipe.model.buffers())
    for got in stats:
        for a, b in zip(got, reference):
            assert torch.equal(a, b)


def test_step_refuses_inference_and_a_bad_target() -> None:
    _, pipe = setup("1f1b", 2)
    x, y = data()
    with pytest.raises(BoundaryError, match="target"):
        pipe.step(x, y[:3], nn.CrossEntropyLoss())
    with pytest.raises(ScheduleError, match="scalar"):
        pipe.step(x, y, nn.CrossEntropyLoss(reduction="none"), reduction="sum")
    pipe.eval()
    with pytest.raises(ScheduleError, match="train"):
        pipe.step(x, y, nn.CrossEntropyLoss())
    with pytest.raises(ScheduleError, match="choose one of"):
        seqify.pipeline(seqify.convert(UNet()), devices=["cpu"] * 2, balance=[4, 4] if False else None, schedule="2f2b")


def test_replay_issues_programs_in_the_gpipe_schedule_order_and_step_trains_through_it() -> None:
    """Replay (CUDA graphs' driver, here with eager programs on the CPU) reads its order from the
    pipeline's gpipe Schedule, looped over two partitions per device; pipe.step through it is exact."""
    from seqify.schedule.actions import gpipe

    source, pipe = setup("gpipe", 4, loops=2)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss(), steps=1)
    replay = pipe._graphed[1] if pipe._graphed is not None else None
    assert replay is not None, pipe.graph_error
    schedule = gpipe(pipe.placement, pipe.chunks)
    assert pipe.placement == (0, 1, 0, 1)
    assert replay.forward_order == schedule.forwards()
    assert replay.backward_order == schedule.backwards()
    on_zero = [ij for ij in replay.forward_order if ij[1] in (0, 2)]
    assert on_zero == [(i, 0) for i in range(4)] + [(i, 2) for i in range(4)]  # looped: breadth-first


@pytest.mark.parametrize("schedule,parts,loops", [c for c in CASES if c[0] != "gpipe"])
def test_replayed_step_runs_every_schedule_in_its_own_order(schedule: str, parts: int, loops: int) -> None:
    """pipe.step through Replay (the CUDA-graph driver, here with eager programs on the CPU) issues the
    schedule's own actions: 1F1B, interleaved and zero-bubble train like one device, and pipe(x)
    afterwards gets fill-drain programs of its own (programs captured for one order never run in another)."""
    source, pipe = setup(schedule, parts, loops)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss())
    key, replay = pipe._graphed
    assert replay.schedule.name == schedule and not replay.drains, pipe.graph_error
    last = [a.kind == "B" for a in replay.schedule.actions if a.partition == parts - 1 and a.kind != "W"]
    assert last != sorted(last)  # forwards and backwards interleave: the programs ran in that order
    x, y = data()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), torch.cat([source(c) for c in x.tensor_split(pipe.chunks)]))
    pipe(x).sum().backward()
    assert pipe._graphed[1].drains and pipe._graphed[1] is not replay


@pytest.mark.parametrize("schedule,parts,loops", [("1f1b", 3, 1), ("interleaved", 4, 2), ("zb-h1", 3, 1), ("zb-h2", 4, 1),
                                                  ("zb-h2", 8, 1), ("interleaved", 8, 2)])  # 8-stage plans
def test_replayed_step_runs_a_schedule_issued_ahead(schedule: str, parts: int, loops: int) -> None:
    """The order two lanes per GPU replay (each forward a run earlier, :func:`ahead`), given as a Schedule:
    Replay shares buffers and frees them by that order and trains like one device."""
    source, pipe = setup(schedule, parts, loops, chunks=8)
    early = ahead(make(schedule, pipe.placement, pipe.chunks))
    assert early.actions != make(schedule, pipe.placement, pipe.chunks).actions
    source, pipe = setup(early, parts, loops, chunks=8)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss())
    assert pipe._graphed[1].schedule == early
    assert pipe._graphed[1].shared or parts == 8  # cut in eight, one partition changes its input in place: none shared


@pytest.mark.parametrize("schedule,parts,loops", [("gpipe", 2, 1), ("1f1b", 3, 1), ("zb-h1", 4, 2)])
@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_replayed_checkpointed_step_trains_like_one_device(schedule: str, parts: int, loops: int,
                                                          checkpoint: str) -> None:
    """Checkpointed programs (what graphs=True captures: the forward keeps only its inputs, the backward
    recomputes it) train like one device, BatchNorm statistics updated once per micro-batch."""
    source, pipe = setup(schedule, parts, loops, checkpoint=checkpoint)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss())
    key, replay = pipe._graphed
    checkpointed = [p.flat.checkpoint is not None for p in replay.programs[0]]
    assert checkpointed == [i < (4 if checkpoint == "always" else 3) for i in range(4)]


def spy_split(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any, bool, set[int], bool, bool]]:
    """Record each B and W a replayed step runs eagerly: (kind, program, whether the program's input
    gradients exist afterwards, which of its accumulators changed, whether W started from B's boundary,
    whether the program keeps a graph for W afterwards)."""
    from seqify.pipe.executors import programs as rp

    seen: list[tuple[str, Any, bool, set[int], bool, bool]] = []
    boundary: list[bool] = []
    real_values = rp.weight_values

    def values(outs: Any, grads: Any, params: Any, later: Any, **how: Any) -> Any:
        boundary.append(later is not None and later.groups is not None)
        return real_values(outs, grads, params, later, **how)

    def spy(kind: str, real: Any) -> Any:
        def run(self: Any) -> None:
            before = [a.clone() for a in self.acc]
            boundary.clear()
            real(self)
            wanted = [k for k, t in enumerate(self.inputs) if t.requires_grad]
            has = bool(wanted) and all(self.in_grads[k] is not None for k in wanted)
            changed = {k for k, (a, b) in enumerate(zip(self.acc, before)) if not torch.equal(a, b)}
            seen.append((kind, self, has, changed, boundary == [True], self.kept is not None))
        return run

    monkeypatch.setattr(rp, "weight_values", values)
    monkeypatch.setattr(rp.Program, "_grads_input", spy("B", rp.Program._grads_input))
    monkeypatch.setattr(rp.Program, "_grads_weight", spy("W", rp.Program._grads_weight))
    monkeypatch.setattr(rp.Program, "_grads", spy("BW", rp.Program._grads))
    return seen


@pytest.mark.parametrize("parts,loops", [(2, 1), (3, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_replayed_zero_bubble_runs_b_and_w_apart(monkeypatch: pytest.MonkeyPatch, parts: int, loops: int,
                                                 checkpoint: str) -> None:
    """Replayed zb-h1: B computes a program's input gradients (and its BatchNorms' weights', which their
    backward yields anyway) and leaves the other weight gradients for W, which adds them into the
    partition's accumulators (not .grad) from what B kept at its boundary; they run as the schedule's
    own B and W actions, and the step still trains like one device. A partition's first B writes every
    accumulator (the norms' gradients, zeros for the rest), since nothing zeroes them before the step."""
    source, pipe = setup("zb-h1", parts, loops, checkpoint=checkpoint)
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss())  # builds and trains like one device, split
    seen = spy_split(monkeypatch)
    x, y = data()
    pipe.step(x, y, nn.CrossEntropyLoss())
    replay = pipe._graphed[1]
    where = {id(p): (j, i) for j, row in enumerate(replay.programs) for i, p in enumerate(row)}
    ran = [(kind, *where[id(p)]) for kind, p, *_ in seen]
    want = [(a.kind, a.partition, a.microbatch) for a in replay.schedule.actions if a.kind != "F"]
    assert replay.schedule.split and ran == want  # no unsplit backward ("BW") anywhere
    norm_ids = {id(w) for m in pipe.modules() if isinstance(m, memory.NORMS) for w in m.parameters()}
    for kind, p, has, changed, from_boundary, kept in seen:
        j, i = where[id(p)]
        norms = {k for k, w in enumerate(p.params) if id(w) in norm_ids}
        if kind == "B" and p.writes_sums == "B":  # its partition's first: writes every sum (zeros past its norms)
            assert changed >= (norms if j > 0 else set()), f"B of partition {j} micro-batch {i} wrote {changed}"
        elif kind == "B":
            assert changed == (norms if j > 0 else set()), f"B of partition {j} micro-batch {i} wrote {changed}"
            assert has == (j > 0), f"B of partition {j} micro-batch {i}: input gradients {has}"
            assert kept == (j > 0)  # the graph and boundary, for W (partition 0: W does it all)
        else:
            assert changed and (j == 0 or not changed & norms), f"W of partition {j} micro-batch {i}: {changed}"
            assert from_boundary == (j > 0)  # partition 0's inputs need no gradient: its W is its backward
            assert not kept  # released
    # with a BatchNorm past the first partition (4 partitions here), some B took its weights' gradients
    assert any(kind == "B" and changed & {k for k, w in enumerate(p.params) if id(w) in norm_ids}
               for kind, p, _, changed, *_ in seen) == (parts == 4)


def test_replayed_zero_bubble_recomputes_a_checkpointed_program_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpointed and split: B recomputes the forward and W walks that same graph (torch's checkpoint
    would recompute again for W's separate backward pass), one recomputation per program."""
    from seqify.pipe import recompute as ck

    source, pipe = setup("zb-h1", 4, 2, checkpoint="always")
    pipe._replay_eager = True
    compare(source, pipe, nn.CrossEntropyLoss())
    x, y = data()
    real = ck._scratch_statistics
    count = [0]

    def counted(norms: Any) -> Any:
        count[0] += 1
        return real(norms)

    monkeypatch.setattr(ck, "_scratch_statistics", counted)
    pipe.step(x, y, nn.CrossEntropyLoss())
    replay = pipe._graphed[1]
    assert all(p.flat.checkpoint is not None for row in replay.programs for p in row)
    assert count[0] == sum(len(row) for row in replay.programs)


def test_captured_zero_bubble_programs_are_f_b_w_graphs_in_the_schedule_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture, with CUDA graphs faked on the CPU: each split program gets a forward, a B and a W graph,
    captured in one pool per device in the order the device runs them (its partitions interleaved, as
    graphs=True captures), and replaying them trains like one device."""
    from seqify.pipe.executors import capture
    from seqify.pipe.executors import programs as rp

    source, pipe = setup("zb-h1", 4, 2)
    pipe._replay_eager = True
    x, y = data()
    expected = nn.CrossEntropyLoss()(torch.cat([source(c) for c in x.tensor_split(pipe.chunks)]), y)
    expected.backward()
    pipe.step(x, y, nn.CrossEntropyLoss())  # builds eager programs (and checks nothing yet)
    replay = pipe._graphed[1]
    captured: list[tuple[str, int, int]] = []
    names = {"_outputs": "F", "_grads_input": "B", "_grads_weight": "W", "_grads": "BW"}

    def spy(name: str) -> Any:
        real = getattr(rp.Program, name)

        def run(self: Any) -> None:
            if FakeGraph.capturing is not None:
                FakeGraph.capturing.parts.append(lambda: real(self))
                j, i = where[id(self)]
                captured.append((names[name], j, i))
            real(self)
        return run

    where = {id(p): (j, i) for j, row in enumerate(replay.programs) for i, p in enumerate(row)}
    for name in names:
        monkeypatch.setattr(rp.Program, name, spy(name))
    fake_cuda(monkeypatch)
    cpu = torch.device("cpu")
    for row in replay.programs:
        capture.warm(row, cpu, 1, None)  # type: ignore[arg-type]
    for row in replay.programs:
        for p in row:
            p.outputs, p.in_grads = (), [None] * len(p.inputs)
    (device, order), = replay.device_orders().items()  # the CPU partitions are one device
    assert device == cpu and len({j for _, j, _ in order}) == 4
    capture.capture_in_order([(k, replay.programs[j][i]) for k, j, i in order], cpu, None)  # type: ignore[arg-type]
    # partition 0's inputs need no gradient: its B computes nothing (no graph), its W is its backward
    want = [(a.kind, a.partition, a.microbatch) for a in replay.schedule.actions if (a.kind, a.partition) != ("B", 0)]
    assert captured == want  # the device's own order, partitions interleaved
    graphs = [(j, p.graphs) for j, row in enumerate(replay.programs) for p in row]
    assert all(g is not None and (g[1] is None) == (j == 0) and g[2] is not None for j, g in graphs)
    for p in pipe.model.parameters():
        p.grad = None
    source.zero_grad(set_to_none=True)
    x2 = x.flip(0)  # new values through the fixed buffers
    expected = nn.CrossEntropyLoss()(torch.cat([source(c) for c in x2.tensor_split(pipe.chunks)]), y)
    expected.backward()
    got = pipe.step(x2, y, nn.CrossEntropyLoss())
    torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(source.named_parameters(), pipe.model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_replayed_zero_bubble_checkpointed_dropout_draws_what_the_forward_drew() -> None:
    """A checkpointed, split program recomputes in B with the forward's random draws: with dropout, a
    checkpointed zb-h1 replay computes what the same replay without checkpointing computes."""
    results = []
    for checkpoint in ("never", "always"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5),
                              nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3)).double()
        seq = seqify.convert(model)
        pipe = seqify.pipeline(seq, devices=["cpu"] * 2, balance=even(len(seq), 2), chunks=4,
                               checkpoint=checkpoint, schedule="zb-h1")
        pipe._replay_eager = True
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)
        losses = []
        for _ in range(2):
            torch.manual_seed(2)
            losses.append(pipe.step(x, y, nn.CrossEntropyLoss()))
        replay = pipe._graphed[1]
        assert replay.schedule.split and all(p.split for row in replay.programs for p in row)
        results.append((losses, [p.grad.clone() for p in pipe.model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


class Mutating(nn.Module):
    """A skip (``a``) popped and changed in place by a later layer, with more layers after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a(x)
        b = self.c(torch.tanh(self.b(x)))
        a.add_(1)
        return self.d(a + b)


@pytest.mark.parametrize("mutating", [False, True])
def test_eager_step_copies_each_value_once_its_maker_is_done(monkeypatch: pytest.MonkeyPatch, mutating: bool) -> None:
    """Without graphs each value crosses to its consumer once the forward that made it is done (that forward's
    event), not once everything queued on its device so far is: in 1F1B order that queue holds later
    micro-batches' forwards, and the two GPUs took turns (an eager 1F1B step measured about one GPU's). Where a
    stage changes a value in place, skips wait for everything queued, as the source order needs. CPU devices
    record no events: each forward's stand-in event is checked against what its consumers' copies were given."""
    from seqify.pipe.executors.scheduled import ScheduledStep
    from seqify.pipe.transfer import Transfer

    counter = iter(range(1 << 30))
    monkeypatch.setattr(Transfer, "mark", staticmethod(lambda device: f"event {next(counter)}"))
    events: dict[tuple[int, int], Any] = {}
    given: list[tuple[tuple[int, int], bool, Any]] = []
    forward, leaf = ScheduledStep._forward, ScheduledStep._leaf

    def spy_forward(self: ScheduledStep, j: int, i: int, x: Any, *args: Any) -> Any:
        self.current_skips = {id(v) for _, v in args[0].values()}  # type: ignore[attr-defined]
        y = forward(self, j, i, x, *args)
        events[(j, i)] = args[1][j][i].ready
        return y

    def spy_leaf(self: ScheduledStep, t: Any, device: Any, source: tuple[int, int, int], *args: Any) -> Any:
        given.append((source[:2], source[2] in self.current_skips, args[-1]))  # type: ignore[attr-defined]
        return leaf(self, t, device, source, *args)

    monkeypatch.setattr(ScheduledStep, "_forward", spy_forward)
    monkeypatch.setattr(ScheduledStep, "_leaf", spy_leaf)
    if mutating:
        torch.manual_seed(0)
        source = Mutating().double()
        seq = seqify.convert(copy.deepcopy(source))
        n = len(seq)
        pipe = seqify.pipeline(seq, devices=["cpu"] * 3, balance=even(n, 3), chunks=4, checkpoint="never",
                               schedule="1f1b")
        assert any(st.mutated_skips or st.mutates_input for st in pipe.stages)
        x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
        expected = F.mse_loss(torch.cat([source(c) for c in x.tensor_split(4)]), y)
        expected.backward()
        got = pipe.step(x, y, F.mse_loss)
        torch.testing.assert_close(got, expected.detach(), rtol=1e-12, atol=1e-12)
        for a, b in zip(source.parameters(), pipe.model.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12)
    else:
        source, pipe = setup("1f1b", 3)
        compare(source, pipe, nn.CrossEntropyLoss(), steps=1)
    skips = [g for g in given if g[1]]
    assert skips and len(skips) < len(given)  # both kinds crossed
    assert len(events) == 3 * 4 and len(set(events.values())) == 12
    for (j, i), is_skip, ready in given:
        assert ready == (None if is_skip and mutating else events[(j, i)]), ((j, i), is_skip)
