"""Benchmark scripts for the tests that check them: each file under benchmarks/ is imported by its path, under a
name of its own, so the tests need no benchmark folder on sys.path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def path(name: str) -> Path:
    """``benchmarks/NAME`` (e.g. ``"scaling/main.py"``)."""
    return BENCHMARKS / name


def load(name: str) -> ModuleType:
    """``benchmarks/NAME`` imported as module ``FOLDER_STEM`` (``scaling/main.py``: ``scaling_main``, the name
    its sibling scripts import it under), once per process."""
    module_name = "_".join(Path(name).with_suffix("").parts)
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path(name))
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[module_name]
