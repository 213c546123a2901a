"""The tuner told the optimizer: its state is probed, placed on the GPUs that will hold it, and counted in every
memory bound, so a choice that fits a step without the state cannot run out of memory at the first opt.step()."""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest
import torch
from torch import nn

import seqify
from seqify.pipe.config import Trial
from seqify.tuning import memory_bounds
from seqify.tuning.measure import out_of_memory
from seqify.tuning.memory_bounds import (fullness, optimizer_ratio, per_device, predicted_to_fit, state_ratio,
                                         step_ratio, trainable_bytes, with_room, with_state)
from seqify.tuning.predict import Candidate
from seqify.tuning.choice import lean

CPU2 = ["cpu", "cpu"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SEQIFY_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("optimizer, ratio", [
    (torch.optim.Adam, 2.0),
    (functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1), 2.0),
    (torch.optim.SGD, 0.0),
    (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), 1.0),
    (torch.optim.Adagrad, 1.0),
    (lambda params: torch.optim.RMSprop(params, lr=1e-3), 1.0),
    (2.5, 2.5),
    (None, 0.0),
])
def test_the_state_an_optimizer_keeps_per_parameter_byte_is_probed(optimizer, ratio) -> None:
    assert state_ratio(optimizer) == ratio


@pytest.mark.parametrize("optimizer, step", [
    (torch.optim.Adam, 1.0),  # the square roots of the second moments, all parameters' at once
    (functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1), 1.0),
    (functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), 0.0),  # in place
    (torch.optim.Adagrad, 2.0),
    (2.5, 0.0),
    (None, 0.0),
])
def test_what_an_optimizer_step_allocates_for_a_moment_is_probed_as_on_gpus(optimizer, step) -> None:
    """On GPUs torch steps with its multi-tensor implementation, whose temporaries cover every parameter at
    once; the probe steps that way on the CPU too, and the tuner counts the temporaries beside the state."""
    assert step_ratio(optimizer) == step
    assert optimizer_ratio(optimizer) == state_ratio(optimizer) + step
    single = functools.partial(torch.optim.Adam, foreach=False)  # chosen by the caller: stepped as built
    assert step_ratio(single) > 0 and state_ratio(single) == 2.0


@pytest.mark.parametrize("optimizer, says", [
    (True, "optimizer's class"),
    (-1.0, ">= 0"),
    (float("inf"), ">= 0"),
    ("adam", "not an optimizer"),
    (torch.optim.LBFGS, "could not be probed"),  # its step needs a closure
    (lambda params: None, "built a NoneType, not a torch.optim.Optimizer"),
])
def test_what_cannot_be_an_optimizer_is_refused_with_what_to_pass(optimizer, says) -> None:
    with pytest.raises(seqify.TuneError, match=says) as info:
        state_ratio(optimizer)
    assert "functools.partial(torch.optim.AdamW" in str(info.value) or ">= 0" in says


def test_an_optimizer_already_built_is_refused_with_the_order_to_follow() -> None:
    built = torch.optim.Adam(nn.Linear(2, 2).parameters())
    with pytest.raises(seqify.TuneError, match=r"already built \(Adam\).*pipe.parameters\(\) afterwards"):
        state_ratio(built)


def test_trainable_bytes_count_shared_and_frozen_parameters_as_an_optimizer_steps_them() -> None:
    shared = nn.Linear(4, 4)
    frozen = nn.Linear(4, 2)
    frozen.requires_grad_(False)
    model = nn.Sequential(shared, nn.ReLU(), shared, frozen, nn.Linear(2, 3).double())
    assert trainable_bytes(model) == [20 * 4, 0, 0, 0, 9 * 8]


def test_the_state_lands_on_the_first_replicas_devices_by_partition() -> None:
    devices = [torch.device(f"cuda:{i}") for i in range(4)]
    trainable = [100, 200, 300, 400]
    # a V (zb-h1, loops 2): partitions on cuda:0, cuda:1, cuda:1, cuda:0; the other two GPUs hold another replica
    held = per_device([1, 1, 1, 1], ["cuda:0", "cuda:1", "cuda:1", "cuda:0"], trainable, 2.0, devices)
    assert held == (2 * (100 + 400), 2 * (200 + 300), 0, 0)


def trial(**options) -> Trial:
    base = dict(chunks=2, loops=1, by="params", checkpoint="never", graphs=False, schedule="gpipe", balance=(2, 1),
                predicted_s=1.0, memory_bytes=1000, memory_per_device=(1000, 600))
    return Trial(**{**base, **options})


def test_predicted_peaks_gain_the_state_of_each_devices_partitions() -> None:
    t = trial()
    c = Candidate((2, 1), ("cuda:0", "cuda:1"), 2, "never", False, "gpipe", (0, 1))
    got = with_state(t, c, 2.0, [10, 20, 300], [torch.device("cuda:0"), torch.device("cuda:1")])
    assert got.memory_per_device == (1000 + 60, 600 + 600)
    assert got.memory_bytes == 1200
    assert got.optimizer_bytes == (60, 600)
    on_cpu = with_state(t, Candidate((2, 1), ("cpu", "cpu"), 2, "never", False, "gpipe", (0, 1)), 2.0,
                        [10, 20, 300], [torch.device("cpu")] * 2)
    assert on_cpu.memory_per_device == (1060, 1200) and on_cpu.optimizer_bytes == ()


def test_the_memory_bounds_compare_the_step_with_its_optimizer_state() -> None:
    light = trial(measured_s=1.0, measured_peak=(500, 500), measured_reserved=(600, 600), optimizer_bytes=(400, 0))
    assert light.held() == (900, 500)
    assert lean([light], 1000, 1000) == [light]
    assert lean([light], 899, None) == []  # the step alone held 500: its state puts cuda:0 over the bound
    assert lean([light], None, 999) == []  # reserved 600 + 400
    assert trial(measured_peak=(5, 7)).held() == (5, 7)  # no optimizer given: the measured peaks alone


def test_no_candidate_is_kept_whose_step_and_state_overfill_a_gpu(monkeypatch) -> None:
    class Props:
        total_memory = 1000

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    cuda = [torch.device("cuda:0"), torch.device("cuda:1")]
    fits = trial(measured_s=2.0, measured_peak=(500, 500), optimizer_bytes=(400, 0))  # 90% of cuda:0
    full = trial(measured_s=1.0, measured_peak=(600, 100), optimizer_bytes=(400, 0), balance=(1, 2))  # 100%
    assert fullness(fits, cuda) == pytest.approx(0.9) and fullness(full, cuda) == pytest.approx(1.0)
    assert with_room([fits, full], cuda) == [fits]
    with pytest.raises(seqify.MemoryCapError, match=r"room for the optimizer's state.*100% of a GPU"):
        with_room([full], cuda)
    assert with_room([full], [torch.device("cpu")]) == [full]  # nothing measured to hold against


def test_with_graphs_a_gpu_is_held_to_the_steps_reserved_peak(monkeypatch) -> None:
    """A replayed step runs in its graphs' memory pools, which the allocated peak does not count and which stay
    taken while the optimizer steps: the room left on a GPU is judged from the reserved peak."""
    class Props:
        total_memory = 1000

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    cuda = [torch.device("cuda:0")]
    eager = trial(measured_s=1.0, measured_peak=(300,), measured_reserved=(700,), optimizer_bytes=(300,))
    graphed = replace(eager, graphs=True)
    assert eager.occupied() == eager.held() == (600,) and graphed.occupied() == (1000,)
    assert fullness(eager, cuda) == pytest.approx(0.6) and fullness(graphed, cuda) == pytest.approx(1.0)
    assert with_room([graphed, eager], cuda) == [eager]


class Wide(nn.Module):
    """Parameters outweigh the activations of a small batch: Adam's state decides what fits."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_a_memory_cap_sgd_meets_is_refused_for_adam_and_the_error_says_what_works() -> None:
    torch.manual_seed(0)
    seq = seqify.convert(Wide())
    x = torch.randn(4, 8)
    options = dict(devices=CPU2, chunks=2, loops=1, balance="params", top=0, show=False, cache=False)
    free = seqify.tune(seq, x, **options)
    adam = seqify.tune(seq, x, optimizer=torch.optim.Adam, **options)
    trainable = trainable_bytes(seq)
    first = sum(trainable[:free.balance[0]])
    # same plan, with its two moments and the square roots of one its step allocates for a moment
    assert adam.memory_per_device[0] == free.memory_per_device[0] + 3 * first
    cap = max(free.memory_per_device)
    assert max(seqify.tune(seq, x, memory_cap=cap, **options).memory_per_device) <= cap
    with pytest.raises(seqify.MemoryCapError, match="smallest cap that works"):
        seqify.tune(seq, x, memory_cap=cap, optimizer=torch.optim.Adam, **options)


def test_the_choice_for_an_optimizer_is_cached_apart_and_the_pipeline_takes_it(monkeypatch) -> None:
    torch.manual_seed(0)
    seq = seqify.convert(Wide())
    x = torch.randn(4, 8)
    ratios = []
    real = memory_bounds.optimizer_ratio

    def seen(optimizer):
        ratios.append(real(optimizer))
        return ratios[-1]

    monkeypatch.setattr(memory_bounds, "optimizer_ratio", seen)
    pipe = seqify.pipeline(copy.deepcopy(seq), devices=CPU2, sample=x, optimizer=torch.optim.AdamW)
    assert ratios == [3.0] and pipe.config is not None  # two moments, and the square roots of one for a moment
    assert seqify.tune(seq, x, devices=CPU2, optimizer=3.0, show=False).key == pipe.config.key  # a cache hit
    assert seqify.tune(seq, x, devices=CPU2, show=False).key != pipe.config.key  # tuned apart without the state


def test_candidates_predicted_over_the_gpus_memory_are_not_timed_unless_none_fits(monkeypatch) -> None:
    class Props:
        total_memory = 1000

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    cuda = [torch.device("cuda:0"), torch.device("cuda:1")]
    small, large = trial(memory_bytes=900), trial(memory_bytes=1500, balance=(1, 2))
    assert predicted_to_fit([large, small], cuda) == [small]
    assert predicted_to_fit([large], cuda) == [large]  # the timed steps find out
    assert predicted_to_fit([large, small], [torch.device("cpu")] * 2) == [large, small]


@pytest.mark.parametrize("error, oom", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 112.00 MiB"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("out of memory"), False),
])
def test_a_library_failing_to_allocate_counts_as_running_out_of_memory(error, oom) -> None:
    assert out_of_memory(error) is oom


def test_a_timed_candidate_that_fails_to_allocate_is_passed_over_and_other_errors_are_not(monkeypatch) -> None:
    torch.manual_seed(0)
    seq = seqify.convert(Wide())
    x = torch.randn(4, 8)
    real, built = seqify.tuning.measure.step_seconds, seqify.tuning.search.build_trial
    timing, failed = [], []

    def candidate(*args, **kwargs):  # only the timed candidates are built here: calibration builds its own
        timing.append(True)
        return built(*args, **kwargs)

    def first_fails(pipe, *args, **kwargs):
        if timing and not failed:
            failed.append(pipe)
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return real(pipe, *args, **kwargs)

    monkeypatch.setattr(seqify.tuning.search, "build_trial", candidate)
    monkeypatch.setattr(seqify.tuning.measure, "step_seconds", first_fails)
    options = dict(devices=CPU2, chunks=2, balance="params", top=2, steps=1, warm=0, show=False, cache=False)
    cfg = seqify.tune(seq, x, **options)
    timed = [t for t in cfg.trials if t.measured_s is not None]
    assert failed and timed and cfg.measured_s is not None

    def broken(pipe, *args, **kwargs):
        if not timing:
            return real(pipe, *args, **kwargs)
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    timing.clear()

    monkeypatch.setattr(seqify.tuning.measure, "step_seconds", broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        seqify.tune(seq, x, **options)
