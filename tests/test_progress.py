"""seqify.progress under torchrun: rank 0 draws the bar and the log lines, every other rank nothing."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from seqify import progress as module


@pytest.fixture
def err(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> pytest.CaptureFixture[str]:
    monkeypatch.setenv("SEQIFY_PROGRESS", "1")
    monkeypatch.delenv("RANK", raising=False)
    return capsys


def drawn(err: pytest.CaptureFixture[str]) -> str:
    assert list(module.progress(range(3), 3, "tune")) == [0, 1, 2]  # every item, drawn or not
    return err.readouterr().err


@pytest.mark.parametrize("rank", [None, "0"])
def test_rank_zero_and_a_single_process_draw(err: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                             rank: str | None) -> None:
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
    text = drawn(err)
    assert module.shown() and "tune [" in text and "3/3" in text


@pytest.mark.parametrize("rank", ["1", "7"])
def test_other_ranks_draw_nothing(err: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, rank: str) -> None:
    monkeypatch.setenv("RANK", rank)
    assert not module.shown() and drawn(err) == ""


def test_other_ranks_print_no_log_lines_either(err: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a terminal a long wait prints a line now and then, on rank 0 alone."""
    monkeypatch.delenv("SEQIFY_PROGRESS")
    for rank, want in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        clock = iter(range(0, 1000, 4))  # every item takes 4 s
        monkeypatch.setattr(module.time, "perf_counter", lambda clock=clock: float(next(clock)))
        assert list(module.progress(range(6), 6, "checking")) == list(range(6))
        assert ("checking: 6/6 done in" in err.readouterr().err) is want


def test_the_process_group_s_rank_wins_once_it_is_up(err: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    assert module.rank() == 2 and drawn(err) == ""


def test_a_rank_that_is_not_a_number_counts_as_rank_zero(err: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "")
    assert module.rank() == 0 and "tune [" in drawn(err)
