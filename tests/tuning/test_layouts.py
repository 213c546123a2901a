"""The tuner's layouts (stages x replicas): which it considers, how it prices them, and what it builds."""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

import seqify
from seqify.pipe.config import Trial
from seqify.pipe.replicated import ReplicatedPipeline
from seqify.tuning import measure, space
from seqify.tuning.predict import Calibration, Candidate, LayerModel, predict
from seqify.tuning.choice import TIE, steady

from helpers import benchmarks
from helpers.procs import child_env

pytestmark = pytest.mark.timeout(300)


def test_every_divisor_of_distinct_gpus_is_a_layout() -> None:
    gpus = [torch.device(f"cuda:{i}") for i in range(4)]
    assert space.replica_counts(gpus, 64, {}) == [1, 2, 4]
    assert space.replica_counts(gpus, 2, {}) == [1, 2]  # each replica needs a sample
    assert space.replica_counts(gpus, 64, {"replicas": 2}) == [2]
    assert space.replica_counts([torch.device("cpu")] * 4, 64, {}) == [1]  # replicas on the host share it
    assert space.replica_counts([torch.device("cuda:0")] * 2, 64, {}) == [1]


def _layers(n: int = 4) -> LayerModel:
    return LayerModel(fixed_s=(1e-4,) * n, per_sample_s=(1e-4,) * n, saved_per_sample=(1e3,) * n,
                      state_bytes=(4 * 2**20,) * n, cut_per_sample=(1e3,) * n)


def test_replicas_are_priced_with_their_share_and_the_gradient_sum() -> None:
    layers = _layers()
    gpus = Calibration(task_s=1e-5, launch_s=1e-5, copy_latency_s=1e-5, copy_bytes_per_s=1e11, host_serial=False)
    one = Candidate((4,), ("cuda:0",), 1, "never")
    alone = predict(one, layers, gpus, 64)
    half = predict(one, layers, gpus, 32)
    two = predict(one, layers, gpus, 64, replicas=2)
    summed = 2 * (gpus.copy_latency_s + 4 * 4 * 2**20 / gpus.copy_bytes_per_s)
    issue = gpus.task_s + 4 * gpus.launch_s  # the host's time to issue one replica's step (one partition)
    assert two.seconds == pytest.approx(half.seconds + summed + issue)  # the second replica starts that late
    assert two.seconds < alone.seconds and two.memory_bytes == half.memory_bytes
    host = Calibration(task_s=1e-5, launch_s=1e-5, copy_latency_s=1e-5, copy_bytes_per_s=1e11, host_serial=True)
    assert predict(one, layers, host, 64, replicas=2).seconds >= 2 * predict(one, layers, host, 32).seconds


@pytest.mark.parametrize("graphs", [False, True])
def test_replayed_replicas_leave_only_the_first_partitions_sum_after_the_backward(graphs: bool) -> None:
    """Two partitions on one GPU (1 and 3 layers): eagerly all four layers' gradients are reduced after the
    backward and their weights broadcast before the forward; with graphs only the first partition's (the others'
    beside the backward and the forward)."""
    layers = _layers()
    c = Candidate((1, 3), ("cuda:0", "cuda:0"), 2, "never", graphs=graphs, placement=(0, 0))

    def at(bandwidth: float) -> float:
        cal = Calibration(task_s=1e-5, launch_s=1e-5, copy_latency_s=1e-5, copy_bytes_per_s=bandwidth,
                          host_serial=False)
        return predict(c, layers, cal, 64, replicas=2).seconds

    copied = 2 * (1 if graphs else 4) * 4 * 2**20  # the reduce left after the backward, the broadcast before
    assert at(1e10) - at(1e11) == pytest.approx(copied / 1e10 - copied / 1e11)


def test_a_replica_on_one_gpu_is_cut_into_buckets_only_where_its_graphs_sum_them_early() -> None:
    """Replicas on one GPU each: loops 2 and 4 are considered as buckets (replayed graphs, whose partitions' sums
    start beside the backward), in GPipe's order and interleaved (one micro-batch through the partitions at a
    time, which holds fewer activations); eager replicas, one pipeline on one GPU and replicas of a two-GPU
    pipeline get no extra candidates."""
    torch.manual_seed(0)
    seq = seqify.convert(Net())
    x = torch.randn(16, 8)
    hi = seqify.partition.cost.param_costs(seq, x)
    one = [torch.device("cuda:0")]
    fixed = dict(balance="params")

    def looped(devices: list[torch.device], replicas: int) -> set[tuple[int, bool, str]]:
        found = space.candidates(seq, x, hi, devices, fixed, 1e11, replicas=replicas)
        return {(loops, c.graphs, c.schedule) for c, _, loops in found if loops > 1}

    assert looped(one, 2) == {(v, True, s) for v in (2, 4) for s in ("gpipe", "interleaved")}
    assert looped(one, 1) == set()
    assert looped([torch.device("cpu")], 2) == set()  # on the host replicas share it: no graphs, no buckets
    two = looped([torch.device("cuda:0"), torch.device("cuda:1")], 2)
    assert two and two == looped([torch.device("cuda:0"), torch.device("cuda:1")], 1)  # a pipeline's own loops


def test_interleaved_buckets_are_predicted_to_hold_one_micro_batch_of_activations() -> None:
    """A replica cut into four buckets on one GPU, its share in two micro-batches: GPipe's order keeps both
    micro-batches' activations until the backward, the interleaved order about one micro-batch's, and both leave
    only the first partition's sum after the backward."""
    layers = _layers(8)
    cal = Calibration(task_s=1e-5, launch_s=1e-5, copy_latency_s=1e-5, copy_bytes_per_s=1e11, host_serial=False)
    seen = {}
    for schedule in ("gpipe", "interleaved"):
        c = Candidate((2, 2, 2, 2), ("cuda:0",) * 4, 2, "never", graphs=True, schedule=schedule,
                      placement=(0, 0, 0, 0))
        seen[schedule] = predict(c, layers, cal, 64, replicas=2)
    activations = 8 * 1e3 * 32  # every layer's saved bytes for the replica's 32 samples
    held = seen["gpipe"].memory_bytes - seen["interleaved"].memory_bytes
    assert activations * 0.3 <= held <= activations * 0.5  # one of two micro-batches, less a partition's share
    assert seen["interleaved"].seconds == pytest.approx(seen["gpipe"].seconds, rel=0.05)


def test_replayed_candidates_hold_the_gradients_once() -> None:
    """Replayed programs add into sums of their own, which .grad views at the step's end: a graphed candidate's
    predicted peak is the eager one's."""
    layers = _layers()
    cal = Calibration(task_s=1e-5, launch_s=1e-5, copy_latency_s=1e-5, copy_bytes_per_s=1e11, host_serial=False)
    eager = Candidate((2, 2), ("cuda:0", "cuda:1"), 2, "never")
    graphed = Candidate((2, 2), ("cuda:0", "cuda:1"), 2, "never", graphs=True)
    extra = [g - e for g, e in zip(predict(graphed, layers, cal, 8).per_device, predict(eager, layers, cal, 8).per_device)]
    assert extra == [0, 0]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_fixed_layout_is_tuned_saved_and_built() -> None:
    torch.manual_seed(0)
    source = Net()
    seq = seqify.convert(copy.deepcopy(source))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    cfg = seqify.tune(seq, x, devices=["cpu"] * 4, replicas=2, cache=False, show=False)
    assert cfg.replicas == 2 and all(t.replicas == 2 for t in cfg.trials)
    assert "as 2 replicas" in str(cfg) and "2 x 2," in str(cfg)
    assert seqify.PipeConfig.from_dict(cfg.to_dict()) == cfg
    pipe = seqify.pipeline(seq, config=cfg)
    assert isinstance(pipe, ReplicatedPipeline) and pipe.config == cfg and len(pipe.replicas) == 2
    loss = pipe.step(x, y, nn.CrossEntropyLoss())
    assert torch.isfinite(loss)


def test_timed_replicas_each_update_their_own_copy_as_pipe_optimizer_steps_them(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """A timed candidate's steps end with a pass over the parameters in place, as an optimizer's step does: they
    keep every value, bit for bit; replicas each make it on their own copy (``pipe.optimizer``'s way), so none
    takes the first's state again, and a model updated by :func:`measure.updated` (an optimizer of its
    parameters) hands its replicas the new state before the next step."""
    torch.manual_seed(0)
    seq = seqify.convert(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    x = torch.randn(16, 8)
    pipe = seqify.pipeline(seq, devices=["cpu"] * 2, replicas=2, chunks=2, checkpoint="never")
    assert isinstance(pipe, ReplicatedPipeline)
    copies = []
    copy_state = ReplicatedPipeline._copy_state
    monkeypatch.setattr(ReplicatedPipeline, "_copy_state", lambda self: (copies.append(1), copy_state(self)))
    before = [p.detach().clone() for p in pipe.parameters()]
    measure.step_seconds(pipe, x, [torch.device("cpu")], steps=2, warm=1)
    assert len(copies) == 1  # the parameters never changed: taken once
    versions = [p._version for r in pipe.replicas for p in r.partitions.parameters()]
    measure.step_seconds(pipe, x, [torch.device("cpu")], steps=2, warm=1, update=True)
    assert len(copies) == 1  # each replica rewrote its own copy
    assert all(p._version > v for p, v in zip((p for r in pipe.replicas for p in r.partitions.parameters()),
                                              versions))
    assert all(torch.equal(p, b) for p, b in zip(pipe.parameters(), before))
    measure.updated(pipe)
    pipe.step(x, None, lambda out, _: out.sum())
    assert len(copies) == 2  # the first's new state, taken by the others
    odd = nn.Parameter(torch.tensor([-0.0, 5e-324, float("inf"), float("nan"), 1.5], dtype=torch.float64))
    holder = nn.Module()
    holder.odd = odd
    version = odd._version
    measure.updated(holder)
    assert odd._version > version
    assert torch.equal(odd.detach().view(torch.int64), torch.tensor([-0.0, 5e-324, float("inf"), float("nan"), 1.5],
                                                                    dtype=torch.float64).view(torch.int64))


def _timed(ms: float, **options: object) -> Trial:
    base: dict[str, object] = dict(chunks=4, loops=1, by="time", checkpoint="never", graphs=True, schedule="1f1b",
                                   balance=(2, 2), predicted_s=0.1, replicas=1)
    return Trial(**{**base, **options, "measured_s": ms / 1e3})  # type: ignore[arg-type]


def test_timed_candidates_within_noise_of_the_fastest_are_chosen_in_a_fixed_order() -> None:
    """The same candidates timed again differ by timing noise: among those within TIE of the fastest the choice
    follows their options, whatever their order and whichever of them ran fastest this time."""
    plain = _timed(101.5, replicas=2, schedule="gpipe", chunks=1, balance=(4,))
    piped = _timed(100.0, schedule="zb-h2", chunks=8)
    checkpointed = _timed(100.5, checkpoint="always", replicas=2, schedule="gpipe", chunks=1, balance=(4,))
    for order in itertools.permutations([plain, piped, checkpointed]):
        assert steady(list(order)) is plain
    faster = _timed(100.0 * (1 - 2 * TIE), schedule="zb-h2", chunks=8, balance=(1, 3))
    assert steady([plain, piped, faster]) is faster  # beyond the noise, the fastest


GIB = 2**30


def _fit(ms: float, gib: float, **options: object) -> Trial:
    """A predicted one-GPU replica of an 8-layer model over two GPUs: ``ms`` and ``gib`` its predicted step and
    fullest device."""
    base: dict[str, object] = dict(chunks=1, loops=1, by="time", checkpoint="never", graphs=True, schedule="gpipe",
                                   balance=(8,), replicas=2)
    return Trial(**{**base, **options, "predicted_s": ms / 1e3, "memory_bytes": int(gib * GIB),  # type: ignore[arg-type]
                    "memory_per_device": (int(gib * GIB),)})


def test_a_layout_is_held_to_what_eager_data_parallelism_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory reference is data parallelism without graphs (what DDP holds), timed beside the best: graphed
    replicas keep a step's activations in their pools and hold more. Where the fastest holds more than it, the
    best predicted to hold less are timed too, and the fastest of those within the reference is chosen (on two
    H200s ResNet-101's graphed GPipe replicas reserved 19.4 GiB against DDP's 18.0 and ran 1.051x its throughput;
    1F1B at two micro-batches reserved 10.3 at 1.012x; without graphs, 17.9 at 0.974x)."""
    from seqify.tuning import choice, search

    gpipe = _fit(93, 24)
    pipeline = _fit(110, 12, replicas=1, balance=(4, 4), chunks=4, schedule="1f1b")
    gpipe2 = _fit(104, 24, chunks=2)  # GPipe keeps both micro-batches in flight: predicted no lighter
    light = _fit(105, 12, chunks=2, schedule="1f1b")
    lighter_but_slow = _fit(106, 11, chunks=2, schedule="zb-h1", checkpoint="always")
    eager = _fit(140, 16, graphs=False)
    fits = [gpipe, gpipe2, pipeline, light, lighter_but_slow, eager]
    ran = {id(gpipe): (100.0, 17.0, 19.4), id(pipeline): (112.0, 12.0, 14.0), id(gpipe2): (101.0, 17.0, 18.7),
           id(eager): (108.0, 15.6, 17.9), id(light): (104.0, 9.0, 10.3), id(lighter_but_slow): (115.0, 8.0, 9.0)}
    timed_ids: list[int] = []

    def confirm(model, sample, placed, timed, *, steps, warm, show, refused=None):  # type: ignore[no-untyped-def]
        timed_ids.extend(id(t) for t in timed)
        return [replace(t, measured_s=ran[id(t)][0] / 1e3, measured_peak=(int(ran[id(t)][1] * GIB),) * 2,
                        measured_reserved=(int(ran[id(t)][2] * GIB),) * 2) for t in timed]

    monkeypatch.setattr(search, "_confirm", confirm)
    one_gpu = (int(30 * GIB), int(32 * GIB))  # one GPU training the whole batch
    placed = [torch.device("cuda", 0), torch.device("cuda", 1)]
    confirmed, _ = search._time_best(nn.Sequential(), None, placed, fits, one_gpu, top=2, steps=1, warm=0, show=False)
    assert id(eager) in timed_ids  # timed as the reference, though predicted far behind
    assert id(light) in timed_ids and id(lighter_but_slow) in timed_ids and id(gpipe2) in timed_ids
    reference = choice.bound_to_ddp(confirmed, one_gpu, len(placed))
    # eager's, not the graphed data parallelism's; its reserved peak within the allocator's noise
    assert reference == (int(15.6 * GIB), int(int(17.9 * GIB) * (1 + choice.RESERVED_TIE)))
    chosen = steady(choice.lean(confirmed, *reference))
    assert (chosen.schedule, chosen.chunks, chosen.graphs) == ("1f1b", 2, True)
    # where no eager one was timed, the fastest graphed data parallelism is the reference
    assert choice.bound_to_ddp([c for c in confirmed if c.graphs], one_gpu, 2)[1] == int(int(19.4 * GIB) * 1.02)


def test_the_memory_reference_runs_as_ddp_does_not_recomputed_nor_in_micro_batches() -> None:
    """DDP neither recomputes activations nor splits a replica's share: eager replicas that do hold less than it,
    and are no reference even where predicted faster or timed (MaxViT's bound was once an eager replica with
    checkpoint='always', which held its batch's activations no more than graphed GPipe replicas did)."""
    from seqify.tuning import choice, search

    recomputed = _fit(120, 10, graphs=False, checkpoint="always")
    split = _fit(125, 12, graphs=False, chunks=2, schedule="1f1b")
    ddp = _fit(130, 16, graphs=False)
    graphed, graphed2 = _fit(100, 17), _fit(101, 17, loops=2)
    timed = choice.to_time([graphed, graphed2, recomputed, split, ddp], 2, gpus=2)
    assert any(t is ddp for t in timed) and not any(t is split for t in timed)  # (recomputed: the best eager one)
    ran = [replace(t, measured_s=s / 1e3, measured_peak=(int(g * GIB),) * 2, measured_reserved=(int(g * GIB),) * 2)
           for t, s, g in [(graphed, 100, 17), (recomputed, 110, 11), (split, 111, 12), (ddp, 112, 16)]]
    tied = 1 + choice.RESERVED_TIE
    assert choice.bound_to_ddp(ran, (None, None), 2) == (int(16 * GIB), int(int(16 * GIB) * tied))
    assert choice.bound_to_ddp(ran[:3], (None, None), 2) == (int(11 * GIB), int(int(11 * GIB) * tied))  # else the fastest eager one


def test_a_layout_reserving_within_the_allocators_noise_of_data_parallelism_is_not_left_out() -> None:
    """Reserved peaks move from run to run with fragmentation: DenseNet-121's graphed replicas on two H200s
    allocated 8.92 GiB against DDP's 9.01 and reserved 11.03 against 11.00, and were left out for 0.03 GiB; beyond
    RESERVED_TIE a layout is still left out, and allocated peaks have no such slack."""
    from seqify.tuning import choice

    ddp = replace(_fit(116, 9, graphs=False), measured_s=0.116, measured_peak=(int(9.01 * GIB),) * 2,
                  measured_reserved=(int(11.0 * GIB),) * 2)

    def graphed(allocated: float, reserved: float) -> Trial:
        return replace(_fit(54, 9), measured_s=0.054, measured_peak=(int(allocated * GIB),) * 2,
                       measured_reserved=(int(reserved * GIB),) * 2)

    bound = choice.bound_to_ddp([ddp], (None, None), 2)
    assert choice.lean([graphed(8.92, 11.03)], *bound)
    assert not choice.lean([graphed(8.92, 11.0 * (1 + choice.RESERVED_TIE) + 0.01)], *bound)
    assert not choice.lean([graphed(9.02, 11.0)], *bound)


def test_lighter_candidates_are_the_untimed_ones_predicted_to_hold_less_in_predicted_order() -> None:
    from seqify.tuning.choice import lighter

    fastest, same, less, least, timed = _fit(90, 24), _fit(95, 24), _fit(100, 12), _fit(101, 8), _fit(99, 10)
    assert lighter([fastest, same, timed, less, least], [fastest, timed], fastest) == [less, least]


def test_lighter_candidates_of_another_kind_come_before_another_cut_of_one_layout() -> None:
    """Three cuts of one layout hold about as much: with room to time three (MaxViT-T on two H200s timed its
    interleaved replicas cut by flops, memory and time), the best predicted of each kind comes first."""
    from seqify.tuning.choice import lighter

    fastest = _fit(90, 24)
    cuts = [_fit(100 + k, 12, chunks=2, loops=2, schedule="interleaved", balance=(3 + k, 5 - k)) for k in range(3)]
    other = _fit(104, 11, chunks=2, schedule="1f1b")
    assert lighter([fastest, *cuts, other], [fastest], fastest) == [cuts[0], other, cuts[1], cuts[2]]


def _ran(t: Trial, ms: float) -> Trial:
    return replace(t, measured_s=ms / 1e3, measured_peak=(GIB, GIB), measured_reserved=(GIB, GIB))


def test_close_timings_on_gpus_are_timed_again_before_one_is_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates within RUNOFF of the fastest are built and timed again with twice the steps, each kept at the
    mean of both timings: one lucky timing of an eager step no longer decides (on two H200s ResNet-101's eager
    replicas timed 100.5 ms against graphed 1F1B's 106.1, then trained 8% slower than them)."""
    from seqify.tuning import choice, search

    eager = _ran(_fit(140, 16, graphs=False), 100.0)
    graphed = _ran(_fit(105, 12, chunks=2, schedule="1f1b"), 106.0)
    slow = _ran(_fit(110, 12, chunks=4, schedule="1f1b"), 120.0)  # beyond RUNOFF: not timed again
    again = {id(eager): 115.0, id(graphed): 104.0}
    calls: list[tuple[int, int]] = []

    def confirm(model, sample, placed, timed, *, steps, warm, show, refused=None):  # type: ignore[no-untyped-def]
        calls.extend((id(t), steps) for t in timed)
        return [replace(t, measured_s=again[id(t)] / 1e3, measured_peak=(9 * GIB,) * 2) for t in timed]

    monkeypatch.setattr(search, "_confirm", confirm)
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    confirmed = [slow, eager, graphed]
    pool = search._runoff(nn.Sequential(), None, gpus, [eager, graphed, slow], confirmed, steps=2, warm=1,
                          show=False)
    assert calls == [(id(eager), 4), (id(graphed), 4)]  # the fastest first, twice the steps
    assert [t.measured_s for t in pool] == pytest.approx([0.1075, 0.105, 0.120])
    assert [t.measured_s for t in confirmed] == pytest.approx([0.120, 0.1075, 0.105])  # print(cfg) shows the means
    assert pool[0].measured_peak == (GIB, GIB)  # the peaks the bounds passed, not the second build's
    chosen = steady(pool)
    assert (chosen.graphs, chosen.schedule) == (True, "1f1b")
    assert steady([eager, graphed, slow]) is eager  # control: on the first timings alone, the eager step

    calls.clear()  # on the CPU nothing is timed again
    cpu = [torch.device("cpu")] * 2
    assert search._runoff(nn.Sequential(), None, cpu, [eager, graphed], [eager, graphed], steps=2, warm=1,
                          show=False) == [eager, graphed] and not calls


def test_a_contender_whose_second_build_runs_out_of_memory_keeps_its_first_timing(monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    from seqify.tuning import choice, search

    first, second = _ran(_fit(100, 12), 100.0), _ran(_fit(101, 12, chunks=2), 101.0)
    monkeypatch.setattr(search, "_confirm", lambda model, sample, placed, timed, **kw: [
        replace(t, measured_s=0.090) for t in timed if t is second])  # the first ran out of memory
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    pool = search._runoff(nn.Sequential(), None, gpus, [first, second], [first, second], steps=2, warm=1, show=False)
    assert [t.measured_s for t in pool] == pytest.approx([0.100, 0.0955])


def test_contenders_are_the_timed_ones_within_runoff_of_the_fastest_fastest_first() -> None:
    from seqify.tuning.choice import RUNOFF, RUNOFF_MOST, contenders

    a, b, c = _ran(_fit(1, 1), 100.0), _ran(_fit(1, 1, chunks=2), 100.0 * (1 + RUNOFF)), _ran(
        _fit(1, 1, chunks=4), 100.0 * (1 + RUNOFF) + 1)
    untimed = _fit(1, 1, chunks=8)
    assert contenders([c, b, untimed, a]) == [a, b]
    many = [_ran(_fit(1, 1, chunks=k), 100.0 + k) for k in range(1, 6)]
    assert len(contenders(many)) == RUNOFF_MOST and contenders([]) == []


def test_the_layout_benchmark_runs_each_layout_in_one_process_and_under_torchrun(tmp_path: Path) -> None:
    """benchmarks/layouts/main.py's CPU smoke run: a layout row, the same configuration run by
    seqify.distributed under torchrun (gloo, one process per device), and torch pipelining's schedules on its
    cuts with the same loss and optimizer, each row in the results file."""
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, str(benchmarks.path("layouts/main.py")), "--tiny", "--device", "cpu",
                           "--gpus", "2", "--per-gpu", "4", "--steps", "1", "--warm", "1", "--layouts", "2x1:1f1b:2",
                           "--no-ddp", "--torchrun", "--torchpp", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    names = [r["row"] for r in rows]
    assert names == ["one GPU", "seqify 2 x 1 1f1b chunks 2", "seqify 2 x 1 1f1b chunks 2 under torchrun",
                     "torch pipelining ScheduleGPipe chunks 2", "torch pipelining Schedule1F1B chunks 2"]
    assert all(r["cuts_of"] == "seqify 2 x 1 1f1b chunks 2" and r["samples_per_s"] > 0 for r in rows[3:])
    layout = seqify.PipeConfig.from_dict(rows[1]["layout"])
    assert (layout.replicas, layout.schedule, layout.chunks, len(layout.balance)) == (1, "1f1b", 2, 2)
    assert rows[2]["samples_per_s"] > 0 and rows[2]["x_in_process"] > 0
    assert "of the same layout in one process" in done.stdout


def test_the_recompute_benchmark_changes_no_value(tmp_path: Path) -> None:
    """benchmarks/layouts/recompute.py's CPU smoke run: the tiny Llama plain and with its cheap layers recomputed
    in the backward, each row timed, and the first step's loss and gradients the same in every row."""
    pytest.importorskip("transformers")
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, str(benchmarks.path("layouts/recompute.py")), "--tiny", "--device", "cpu",
                           "--steps", "1", "--warm", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    assert [r["row"] for r in rows] == ["none", "norms", "mlp", "norms+mlp"]
    assert all(r["samples_per_s"] > 0 for r in rows) and rows[0]["x_first"] == 1.0
    assert len({r["first_loss"] for r in rows}) == 1
    assert all(r["first_grad_norm"] == pytest.approx(rows[0]["first_grad_norm"], rel=1e-6) for r in rows)


def test_the_pool_memory_benchmark_finds_each_pools_peak_and_what_held_it() -> None:
    """benchmarks/layouts/pool_memory.py's history replay, on a history whose answer is known: the most bytes alive
    at once in the default pool and in the graphs' pools (told apart by the segments' pools), and the allocating
    lines alive then, a freed block no longer counted."""
    script = f"""
import json, sys
sys.path.insert(0, {str(benchmarks.path("layouts"))!r})
import pool_memory as pm
ours = lambda line: [{{"filename": "/x/seqify/pipe/a.py", "line": line, "name": "f"}}]
trace = [
    dict(action="alloc", addr=1000, size=100, frames=ours(1)),
    dict(action="alloc", addr=5000, size=50, frames=[]),
    dict(action="alloc", addr=1200, size=300, frames=ours(2)),
    dict(action="free_completed", addr=1000, size=100),
    dict(action="alloc", addr=5100, size=60, frames=ours(3)),
    dict(action="alloc", addr=1000, size=40, frames=ours(4)),
]
segments = [dict(device=0, address=1000, total_size=1000, allocated_size=340, segment_pool_id=(0, 1)),
            dict(device=0, address=5000, total_size=1000, allocated_size=110, segment_pool_id=(0, 0))]
print(json.dumps(pm.at_peaks(dict(segments=segments, device_traces=[trace]), 0, 5)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    private, default = got["private"], got["default"]
    assert private["event"] == 2 and private["sites"] == [
        {"gib": round(300 / 2**30, 3), "n": 1, "site": "a.py:2:f"},
        {"gib": round(100 / 2**30, 3), "n": 1, "site": "a.py:1:f"}]
    assert default["event"] == 4 and {s["site"] for s in default["sites"]} == {
        "a.py:3:f", "no line of ours: autograd engine"}
    assert (private["segments"], default["segments"]) == (1, 1)
