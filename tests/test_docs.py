"""Generated documentation matches what it is generated from: docs/cli.md's option tables match seqify's parser,
and the benchmark pages and the README's results table match benchmarks/results/."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_cli_reference_matches_the_parser() -> None:
    gen = _script("docs/gen_cli.py")
    text = gen.DOC.read_text()
    assert gen.render(text) == text, "docs/cli.md is out of date: run python docs/gen_cli.py"


def test_benchmark_pages_match_the_results() -> None:
    pages = _script("benchmarks/pages.py")
    stale = [str(p.relative_to(ROOT)) for p, text in pages.expected().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"out of date: {stale}; run python benchmarks/pages.py"


def test_graphed_layout_rows_are_never_shown_by_their_allocated_peak() -> None:
    """A replayed graph's activations are not counted as allocated once captured: a graphed row shows its
    recorded in-use memory, or nothing, and only an eager row's allocated peak stands for what it held."""
    pages = _script("benchmarks/pages.py")
    eager = {"row": "DDP", "peak_gib": [15.8, 15.6]}
    graphed = {"row": "seqify 1 x 2 gpipe chunks 1 graphs", "peak_gib": [1.6, 1.3]}
    chosen = {"row": "seqify automatic", "config": "PipeConfig: ... graphs True ...", "peak_gib": [1.6, 1.3]}
    assert pages._in_use(eager) == [15.8, 15.6] and pages._held(eager) == 15.8
    assert pages._in_use(graphed) is None and pages._held(chosen) is None
    assert pages._held({**chosen, "in_use_gib": [19.0, 18.9]}) == 19.0


def test_readme_stays_short_and_names_no_commits() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert not re.findall(r"\b[0-9a-f]{7}\b", readme)


@pytest.mark.parametrize("command", [
    "python -m pip install -e . && seqify demo",
    "python -m pip install -e '.[test]' && python -m pytest -q -n 2",
])
def test_readme_gives_the_two_commands_ci_relies_on(command: str) -> None:
    assert command in (ROOT / "README.md").read_text()
    if "pytest" in command:
        assert command in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("module", ["seqify", "seqify.distributed", "seqify.tuning"])
def test_every_public_name_has_an_api_reference_entry(module: str) -> None:
    public = importlib.import_module(module).__all__
    pages = "\n".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    documented = set(re.findall(r"^\.\. auto\w+:: ([\w.]+)", pages, re.M))
    missing = [n for n in public if n not in documented and f"{module}.{n}" not in documented]
    assert not missing, f"add an autodoc entry under docs/reference/ for {module}: {missing}"
