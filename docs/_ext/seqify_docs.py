"""Sphinx extension for seqify's documentation.

- A check that every public name (``__all__``) of the modules in ``seqify_public_modules`` has an API entry:
  a missing one is a warning, which ``sphinx-build -W`` makes an error.
- Docstrings whose literal block is not indented under its ``::`` line are indented before docutils reads them.
"""

from __future__ import annotations

import importlib
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)


# -- every public name has an entry ----------------------------------------------------------------------------


def _resolve(full: str) -> Any:
    parts = full.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except Exception:  # noqa: BLE001 - not a module: try the parent
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def check_public_names(app: Sphinx, env: Any) -> None:
    documented = set(env.get_domain("py").objects)
    documented |= {name for name in env.get_domain("py").data.get("modules", {})}
    by_identity: dict[int, str] = {}
    for full in documented:
        obj = _resolve(full)
        if obj is not None and not isinstance(obj, (int, float, str, bool, tuple, type(None))):
            by_identity.setdefault(id(obj), full)
    for module_name in app.config.seqify_public_modules:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            full = f"{module_name}.{name}"
            if full in documented:
                continue
            obj = getattr(module, name)
            if not isinstance(obj, (int, float, str, bool, tuple)) and id(obj) in by_identity:
                continue
            logger.warning(f"public name {full} has no API reference entry: add it to a page under docs/reference/",
                           type="seqify", subtype="public")


# -- docstrings ------------------------------------------------------------------------------------------------


def indent_literal_blocks(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """A docstring that opens with ``text::`` and continues, after ``inspect.cleandoc``, with an unindented block."""
    i = 0
    while i < len(lines):
        if not lines[i].rstrip().endswith("::"):
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or lines[j].startswith(" "):
            i = j
            continue
        k = j
        while k < len(lines) and lines[k].strip():
            k += 1
        lines[i + 1:k] = ["", *("    " + line for line in lines[j:k])]
        i = k + 1


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("seqify_public_modules", [], "env")
    app.connect("env-check-consistency", check_public_names)
    app.connect("autodoc-process-docstring", indent_literal_blocks)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
