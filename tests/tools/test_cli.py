"""The seqify command: every subcommand, its output and its exit codes (0 ok, 1 not exact, 2 usage/input)."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchvision

import seqify
from seqify.tools.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


NETS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = nn.Conv2d(3, width, 3, padding=1)
        self.b = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return self.b(y) + y


def build(width=4):
    torch.manual_seed(0)
    return Net(width)


class Noisy(nn.Module):
    def forward(self, x):
        return x + torch.randn_like(x)   # random in eval mode too: no conversion can be bit-equal to a rerun


def noisy():
    return Noisy()


class Star(nn.Module):
    def forward(self, *xs):
        return xs[0]


def star():
    return Star()


def not_a_module():
    return 3
'''


@pytest.fixture()
def nets(tmp_path: Path) -> Path:
    path = tmp_path / "cli_nets.py"
    path.write_text(textwrap.dedent(NETS))
    return path


def test_help_teaches(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for text in ("examples:", "seqify demo", "seqify inspect torchvision:resnet50 --stages 4", "FILE.py:FACTORY",
                 "exit codes:"):
        assert text in out
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--help"])
    assert e.value.code == 0 and "--stages" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["inspect"])  # SPEC missing: argparse's usage error
    assert e.value.code == 2


def test_inspect_prints_layers_skips_and_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "inspect", "torchvision:resnet18", "--stages", "3", "--size", "64")
    assert code == 0
    torch.manual_seed(0)
    seq = seqify.convert(torchvision.models.resnet18())
    plan = seqify.balance(seq, 3, torch.randn(1, 3, 64, 64), by="flops", progress=False)
    assert f"balance={plan.balance}" in out
    assert "PartitionPlan by flops: 3 stages over 69 layers" in out
    assert f"== skips ({len(seq.skips)})" in out and str(seq.skips[0]) in out
    assert "== layers (69)" in out and "layer4_1_conv2" in out
    assert "none: every module was split into layers" in out


def test_inspect_zoo_with_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    code, out, _ = run(capsys, "inspect", "zoo:unet", "--arg", "depth=2", "--arg", "channels=8", "--arg", "blocks=1",
                       "--stages", "2", "--by", "params", "--no-layers", "--plots", str(tmp_path))
    assert code == 0
    assert "== layers" not in out and "2 skips" in out and "PartitionPlan by params" in out
    assert (tmp_path / "skips.png").exists() and (tmp_path / "plan.svg").exists()


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_convert_saves_weights_that_rebuild_the_model(capsys: pytest.CaptureFixture[str], tmp_path: Path, nets: Path,
                                                      suffix: str) -> None:
    out_file = tmp_path / f"net{suffix}"
    code, out, _ = run(capsys, "convert", f"{nets}:build", "--arg", "width=6", "--shape", "2x3x8x8", "-o", str(out_file))
    assert code == 0, out
    assert "bit-equal to the source: True" in out and "saved to" in out and "model.load_state_dict(" in out
    spec = importlib.util.spec_from_file_location("cli_nets_reference", nets)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the file's own builder: same seed, same weights
    x = torch.randn(3, 3, 8, 8)
    source = module.build(6)
    if suffix == ".pt":
        saved = torch.load(out_file)  # torch's default, weights_only=True: no pickled module
        assert (saved["spec"], saved["args"], saved["input_shape"]) == (f"{nets}:build", ["width=6"], [2, 3, 8, 8])
        state = saved["state_dict"]
    else:
        state = seqify.checkpoint.load_exported(out_file)
    rebuilt = module.Net(6)  # other weights, until the file's load
    rebuilt.load_state_dict(state)
    seq = seqify.convert(rebuilt)
    assert torch.equal(seq(x), source(x))
    if suffix == ".pt":
        assert [name for name, _ in seq.named_layers()] == saved["layers"]


def test_convert_torchvision_to_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "convert", "torchvision:mobilenet_v3_small", "--size", "32", "-o", str(tmp_path / "m.pt"))
    assert code == 0 and "157 layers" in out
    saved = torch.load(tmp_path / "m.pt")
    assert saved["source"] == "MobileNetV3" and len(saved["layers"]) == 157
    model = torchvision.models.mobilenet_v3_small()
    model.load_state_dict(saved["state_dict"])


def test_exactness_failure_exits_1(capsys: pytest.CaptureFixture[str], tmp_path: Path, nets: Path) -> None:
    code, out, err = run(capsys, "convert", f"{nets}:noisy", "--shape", "1x4", "-o", str(tmp_path / "n.pt"))
    assert code == 1
    assert "bit-equal to the source: False" in out and "not saved" in err
    assert not (tmp_path / "n.pt").exists()


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("resnet50", "expected SOURCE:NAME"),
        ("torchvision:resnet5000", "has no model 'resnet5000'"),
        ("zoo:unett", "did you mean unet"),
        ("missing_file.py:build", "does not exist"),
        ("{nets}:nothing", "defines no 'nothing'"),
        ("{nets}:not_a_module", "not an nn.Module"),
        ("no_such_module_xyz:build", "cannot import module"),
    ],
)
def test_bad_spec_exits_2(capsys: pytest.CaptureFixture[str], nets: Path, spec: str, says: str) -> None:
    code, out, err = run(capsys, "inspect", spec.format(nets=nets))
    assert code == 2 and out == ""
    assert err.startswith("seqify: error:") and says in err and "SPEC names a model" in err


def test_seqify_errors_exit_2(capsys: pytest.CaptureFixture[str], nets: Path, tmp_path: Path) -> None:
    code, _, err = run(capsys, "inspect", f"{nets}:star")
    assert code == 2 and "reads *xs" in err
    code, _, err = run(capsys, "inspect", f"{nets}:build", "--arg", "width")
    assert code == 2 and "KEY=VALUE" in err
    code, _, err = run(capsys, "convert", f"{nets}:build", "--shape", "1x5x8x8", "-o", str(tmp_path / "x.pt"))
    assert code == 2 and "--shape" in err  # the model fails on the input: say how to give the right one
    assert not (tmp_path / "x.pt").exists()
    code, _, err = run(capsys, "inspect", "torchvision:resnet18", "--stages", "500")
    assert code == 2 and "partitions <= 69" in err


def test_zoo_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "zoo")
    assert code == 0 and "amoebanet_d" in out and "torchvision.models.resnet101" in out
    code, out, _ = run(capsys, "zoo", "--check", "resnet18", "unet")
    assert code == 0 and "2 of 2 zoo models convert and pipeline exactly" in out
    code, _, err = run(capsys, "zoo", "resnet")
    assert code == 2 and "did you mean" in err


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="with GPUs, bench measures pipelines")
def test_bench_without_gpus_shows_conversion_speed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "bench", "--model", "resnet18", "--batch", "2", "--size", "32", "--steps", "1")
    assert code == 0
    assert "this machine has 0 GPUs" in out and "| converted speed / source speed |" in out


def test_demo_small(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["demo", "--model", "resnet18", "--size", "32", "--train-batch", "4", "--train-size", "32", "--chunks", "2",
            "--sweep", "1", "2"]
    pytest.importorskip("matplotlib")
    code, out, _ = run(capsys, *args, "--plots", str(tmp_path))
    assert code == 0, out
    for text in ("== 1. convert", "eval forward bit-equal (torch.equal):      True", "PartitionPlan by flops: 2 stages",
                 "chunks   2:", "Timeline: 2 partitions, 2 micro-batches",
                 "pipeline eval forward bit-equal to the source run on each micro-batch: True", "exact: yes"):
        assert text in out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{n}.{e}" for n in ("plan", "skips", "timeline", "sweep") for e in ("png", "svg")
    )
    from seqify.tools import demo
    from seqify import plot

    monkeypatch.setattr(plot, "available", lambda: False)
    demo._demo_plots(str(tmp_path / "none"), None, None, None, None, "resnet18")
    assert "plots: skipped: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "none").exists()


def test_process_exit_codes() -> None:
    """Through a real process, as scripts see it."""
    done = subprocess.run([sys.executable, "-m", "seqify", "inspect", "nothing:here"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "seqify: error:" in done.stderr


def test_reference_documents_every_option() -> None:
    from seqify.tools.cli import _parser

    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in commands.items():
        assert f"## `seqify {name}`" in doc
        for action in sub._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in doc, f"docs/cli.md does not mention seqify {name} {option}"
