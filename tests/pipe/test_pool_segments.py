"""Graph pools in expandable segments: captures grow one mapping per pool, whose freed blocks merge, and the
allocator's settings are the user's again after each capture (their other options kept, their expandable
segments left on)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torchvision

import seqify
from seqify.pipe.executors import pool_segments
from seqify.pipe.executors.options import ReplayOptions
from seqify.pipe.executors.pool_segments import expandable_segments, is_expandable


class Allocator:
    """The runtime settings functions, recorded: what each change set."""

    def __init__(self, settings: str) -> None:
        self.settings = settings
        self.changes: list[str] = []

    def get(self) -> str:
        return self.settings

    def change(self, settings: str) -> None:
        self.changes.append(settings)
        self.settings = settings


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> Allocator:
    fake = Allocator("")
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", fake.get, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", fake.change, raising=False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    return fake


def test_settings_strings_say_whether_segments_are_expandable() -> None:
    assert not is_expandable("")
    assert is_expandable("expandable_segments:True")
    assert is_expandable("max_split_size_mb:128, expandable_segments:True")
    assert not is_expandable("expandable_segments:True,expandable_segments:False")
    assert not is_expandable("max_split_size_mb:128")


def test_capturing_turns_them_on_and_back_off(allocator: Allocator) -> None:
    with expandable_segments():
        assert allocator.settings == "expandable_segments:True"
    assert allocator.changes == ["expandable_segments:True", "expandable_segments:False"]


def test_the_users_other_settings_stay(allocator: Allocator) -> None:
    """A change resets the options it does not name: the user's are named in both."""
    allocator.settings = "max_split_size_mb:128,garbage_collection_threshold:0.6"
    with pytest.raises(RuntimeError):
        with expandable_segments():
            raise RuntimeError("a capture failed")
    assert allocator.changes == ["max_split_size_mb:128,garbage_collection_threshold:0.6,expandable_segments:True",
                                 "max_split_size_mb:128,garbage_collection_threshold:0.6,expandable_segments:False"]


@pytest.mark.parametrize("settings", ["expandable_segments:True", "backend:cudaMallocAsync"])
def test_nothing_changes_where_segments_are_expandable_or_another_allocator_runs(
        allocator: Allocator, monkeypatch: pytest.MonkeyPatch, settings: str) -> None:
    allocator.settings = settings
    if "backend" in settings:
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    with expandable_segments():
        pass
    with expandable_segments(enabled=False):
        pass
    assert allocator.changes == []


def test_nothing_changes_where_torch_cannot_change_them_at_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: pytest.fail("asked the backend"))
    with expandable_segments():
        pass


def test_without_a_runtime_reader_the_environments_settings_are_kept(allocator: Allocator,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch that can change the settings at runtime but not read them back: the environment says what they are."""
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    with expandable_segments():
        pass
    assert allocator.changes == ["max_split_size_mb:64,expandable_segments:True",
                                 "max_split_size_mb:64,expandable_segments:False"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with expandable_segments():
        pass
    assert len(allocator.changes) == 2


def test_this_torch_changes_them_and_reads_them_back() -> None:
    """Against the real allocator settings (they parse without a GPU): on, then off, the user's kept."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is None or not hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        pytest.skip("this torch has no runtime allocator settings")
    before = get()
    try:
        torch._C._accelerator_setAllocatorSettings("max_split_size_mb:256")
        with expandable_segments():
            assert get() == "max_split_size_mb:256,expandable_segments:True"
        assert get() == "max_split_size_mb:256,expandable_segments:False"
    finally:
        torch._C._accelerator_setAllocatorSettings(before or "expandable_segments:False")
    assert pool_segments._settings() == (before or "expandable_segments:False")


def _pools(device: torch.device) -> tuple[int, int]:
    """(segments, bytes reserved) of the graphs' private pools on ``device``."""
    mine = [s for s in torch.cuda.memory_snapshot() if s["device"] == device.index
            and tuple(s["segment_pool_id"]) != (0, 0)]
    return len(mine), sum(s["total_size"] for s in mine)


def _steps(expandable: bool) -> tuple[list[torch.Tensor], tuple[int, int]]:
    device = torch.device("cuda:0")
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet50(num_classes=10))
    pipe = seqify.pipeline(seq, devices=[device, device], chunks=2, schedule="1f1b", checkpoint="never",
                           graphs=True, replay_options=ReplayOptions(expandable_pools=expandable))
    x = torch.randn(64, 3, 128, 128, device=device, generator=torch.Generator(device).manual_seed(1))
    y = torch.randint(0, 10, (64,), device=device, generator=torch.Generator(device).manual_seed(2))
    losses = [pipe.step(x, y, F.cross_entropy).detach() for _ in range(3)]
    assert pipe.graphs and pipe.graph_error is None and pipe._graphed is not None
    pools = _pools(device)
    del pipe
    torch.cuda.empty_cache()
    return losses, pools


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_graphed_step_keeps_its_pool_in_few_segments() -> None:
    """The same replayed steps in fixed-size and in expandable segments: the same losses, the pools in far fewer
    segments and fewer bytes (a ResNet-50's activations: enough for fragmentation to outweigh an expandable
    segment's rounding up to its 20 MiB pages), and the allocator's settings as they were."""
    if not hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        pytest.skip("this torch has no runtime allocator settings")
    before = pool_segments._settings()
    if is_expandable(before):
        pytest.skip("expandable segments are on for the whole process")
    fixed, (fixed_segments, fixed_bytes) = _steps(False)
    grown, (segments, reserved) = _steps(True)
    for a, b in zip(fixed, grown, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert segments <= 4 < fixed_segments
    assert reserved < fixed_bytes
    assert not is_expandable(pool_segments._settings())
