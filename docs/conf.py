"""Sphinx configuration: MyST Markdown pages, API reference from the docstrings (Google style), furo."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the seqify of this checkout
sys.path.insert(0, str(HERE / "_ext"))

from seqify._version import __version__  # noqa: E402

project = "seqify"
author = "the seqify authors"
copyright = "the seqify authors"
release = version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "seqify_docs",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_default_options = {"show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

nitpicky = False
html_theme = "furo"
html_title = f"seqify {version}"

# Every name in these modules' __all__ must have an entry in the API reference (checked by _ext/seqify_docs.py).
seqify_public_modules = ["seqify", "seqify.distributed", "seqify.tuning"]
