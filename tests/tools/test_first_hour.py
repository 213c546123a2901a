"""A new user's first hour with the seqify command: exit codes, no tracebacks or tracer internals for their
mistakes, advice that fits the cause, a layer table that agrees with the plan."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
import torchvision

import seqify
from seqify.tools import cli
from seqify.tools.advice import for_cli
from seqify.tools.cli import main

pytestmark = pytest.mark.timeout(120)

NETS = '''
import torch
from torch import nn


class ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.a(x)
        return x


class ShapeBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] > 1:
            return self.a(x)
        return x


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.g = Gate()
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.g(self.a(x)))


def value_branch():
    return ValueBranch()


def shape_branch():
    return ShapeBranch()


def gated():
    return Gated()


def broken():
    raise RuntimeError("no weights file at /nowhere/w.pt")
'''


@pytest.fixture()
def nets(tmp_path: Path) -> Path:
    path = tmp_path / "first_hour_nets.py"
    path.write_text(textwrap.dedent(NETS))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr, as a shell sees them (argparse's usage errors included)."""
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, err: str, *says: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err and "Proxy(" not in err
    for text in says:
        assert text in err, f"{text!r} missing from: {err}"


# -- the layer table ----------------------------------------------------------------------------------


def test_inspect_lists_every_layer_with_the_plans_index(capsys: pytest.CaptureFixture[str]) -> None:
    """ResNet reuses one ReLU per block: the table still has one row per layer, numbered as the plan counts."""
    code, out, _ = run(capsys, "inspect", "torchvision:resnet18", "--size", "64", "--stages", "3")
    assert code == 0
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet18())
    plan = seqify.balance(seq, 3, torch.randn(1, 3, 64, 64), by="flops", progress=False)
    names = list(seq._modules)
    assert len(names) == len(seq) == 69 and "layer1_0_relu_1" in names  # the shared ReLU's second use
    table = out.split("== layers (69)\n")[1].split("\n\n")[0].splitlines()
    rows = [line.split() for line in table[1:]]
    assert len(rows) == len(seq)
    stage_of = [j for j, n in enumerate(plan.balance) for _ in range(n)]
    for i, row in enumerate(rows):
        assert row[:3] == [str(i), str(stage_of[i]), names[i]], row


# -- exit codes and usage errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["demo", "--model", "resnet5O"], ["did you mean resnet50"]),
        (["bench", "--model", "resnet5O"], ["did you mean resnet50"]),
        (["demo", "--steps", "0"], ["--steps", "at least 1"]),
        (["demo", "--chunks", "0"], ["--chunks", "at least 1"]),
        (["demo", "--sweep", "0"], ["--sweep", "at least 1"]),
        (["demo", "--sweep", "2", "x"], ["--sweep", "not a whole number"]),
        (["bench", "--steps", "0"], ["--steps"]),
        (["inspect", "torchvision:resnet18", "--stages", "-1"], ["--stages", "at least 0"]),
        (["convert", "torchvision:resnet18", "--batch", "0", "-o", "x.pt"], ["--batch"]),
    ],
)
def test_bad_options_exit_2_before_any_work(capsys: pytest.CaptureFixture[str], argv: list[str], says: list[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert_user_error(code, err, *says)
    assert out == ""


def test_a_builder_that_raises_exits_2_without_traceback(capsys: pytest.CaptureFixture[str], nets: Path) -> None:
    code, _, err = run(capsys, "inspect", f"{nets}:broken")
    assert_user_error(code, err, "RuntimeError: no weights file at /nowhere/w.pt", "Fix the builder")


def test_demo_says_the_image_size_a_vit_needs(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "demo", "--model", "vit_b_16", "--size", "32", "--no-plots")
    assert_user_error(code, err, "the image size must be 224", "--size 224")


def test_demo_refuses_micro_batches_of_one_sample(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "demo", "--model", "resnet18", "--train-batch", "4", "--sweep", "1", "4", "--no-plots")
    assert_user_error(code, err, "1 sample", "at most 2")


def test_demo_defaults_pass_the_demos_own_checks(capsys: pytest.CaptureFixture[str]) -> None:
    """README command 1 is `seqify demo` with no options: its default sweep and batch must fit together
    (a default sweep of 8 micro-batches on the CPU's batch of 8 once made it exit 2)."""
    code, out, err = run(capsys, "demo", "--model", "resnet18", "--size", "32", "--train-size", "32", "--no-plots")
    assert code == 0, err
    assert "exact: yes" in out


def test_a_bug_exits_3_with_its_traceback(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    def bug(args: object) -> int:
        raise KeyError("internal")

    monkeypatch.setattr(cli, "zoo_cmd", bug)
    code, _, err = run(capsys, "zoo")
    assert code == 3 and "Traceback" in err and "a bug: please report it" in err


# -- advice that fits ------------------------------------------------------------------------------------


def test_a_branch_on_values_is_not_told_to_add_example(capsys: pytest.CaptureFixture[str], nets: Path) -> None:
    code, _, err = run(capsys, "inspect", f"{nets}:value_branch", "--shape", "2x4")
    assert_user_error(code, err, "if x.sum() > 0", "submodule", "no example input")
    assert "example_inputs" not in err and "add --example" not in err and "sum_1" not in err
    code, _, err = run(capsys, "inspect", f"{nets}:value_branch", "--shape", "2x4", "--example")
    assert_user_error(code, err, "if x.sum() > 0", "submodule", "no example input")
    assert "add --example" not in err


def test_a_branch_on_shapes_is_told_to_add_example(capsys: pytest.CaptureFixture[str], nets: Path) -> None:
    code, _, err = run(capsys, "inspect", f"{nets}:shape_branch", "--shape", "2x4")
    assert_user_error(code, err, "add --example")
    code, out, _ = run(capsys, "inspect", f"{nets}:shape_branch", "--shape", "2x4", "--example")
    assert code == 0 and "valid for inputs where" in out


def test_stages_fall_back_to_time_for_a_value_dependent_layer(capsys: pytest.CaptureFixture[str], nets: Path) -> None:
    code, out, _ = run(capsys, "inspect", f"{nets}:gated", "--shape", "2x4", "--stages", "2")
    assert code == 0
    assert "(--by time)" in out and "PartitionPlan by time on cpu: 2 stages" in out
    assert "sum_1" not in out and "example_inputs" not in out
    code, _, err = run(capsys, "inspect", f"{nets}:gated", "--shape", "2x4", "--stages", "2", "--by", "flops")
    assert_user_error(code, err, "--by time")
    assert "by='time'" not in err and "Exception" not in err and "aten." not in err


def test_for_cli_removes_tracer_internals_and_speaks_options() -> None:
    text = for_cli("Wrong image height! Expected 224 but got Proxy(getitem_2)! on the traced value `(sum_1 > 0)`; "
                   "balance by='time' (measured) (DataDependentOutputException: aten._local_scalar_dense.default)")
    assert "Proxy" not in text and "sum_1" not in text and "aten" not in text
    assert "--by time" in text and "by='time'" not in text
    assert for_cli("profile with device='cpu' or balance by='flops'") == "profile with --device cpu or balance --by flops"


def test_zoo_module_exits_2_on_an_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    from seqify.zoo.__main__ import main as zoo_main

    assert zoo_main(["resnett"]) == 2
    err = capsys.readouterr().err
    assert "did you mean resnet50" in err and "Traceback" not in err


# -- progress on long waits -------------------------------------------------------------------------------


def test_long_waits_print_lines_in_a_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a terminal a long wait still says how far it got: plain lines, no bar, nothing for short waits."""
    import io
    import sys

    from seqify import progress as module

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delenv("SEQIFY_PROGRESS", raising=False)
    assert list(module.progress(range(4), 4, "fast")) == [0, 1, 2, 3] and err.getvalue() == ""
    clock = iter(range(0, 1000, 4))  # every item takes 4 s
    monkeypatch.setattr(module.time, "perf_counter", lambda: float(next(clock)))
    assert list(module.progress(range(6), 6, "zoo: checking")) == list(range(6))
    lines = err.getvalue().splitlines()
    assert lines[0] == "zoo: checking: 1/6, 4 s" and lines[-1].startswith("zoo: checking: 6/6 done in")
    assert "\r" not in err.getvalue() and "[" not in err.getvalue()
    monkeypatch.setenv("SEQIFY_PROGRESS", "0")
    err.truncate(0)
    err.seek(0)
    clock = iter(range(0, 1000, 4))
    assert list(module.progress(range(3), 3, "quiet")) == [0, 1, 2] and err.getvalue() == ""
