"""The package's import contract: each layer imports only from itself or from layers below it, and no module
imports another that imports it back, deferred and type-only imports included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "seqify"

#: Bottom to top. A module belongs to the first layer whose prefix names it or a package above it.
LAYERS: list[tuple[str, ...]] = [
    ("seqify.errors", "seqify._version", "seqify._paths", "seqify.progress"),
    ("seqify.skip",),
    ("seqify.model",),
    ("seqify.frontend",),
    ("seqify.convert",),
    ("seqify.partition",),
    ("seqify.schedule",),
    ("seqify.pipe", "seqify.checkpoint"),
    ("seqify.distributed",),
    ("seqify.tuning",),
    ("seqify.api",),
    ("seqify.measure", "seqify.plot"),
    ("seqify.compat",),
    ("seqify.zoo",),
    ("seqify.tools",),
    ("seqify", "seqify.__main__"),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    for i, prefixes in reversed(list(enumerate(LAYERS))):  # the most specific prefix wins ("seqify" is last)
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "seqify"):
            return i
    if module in ("seqify", "seqify.__main__"):
        return len(LAYERS) - 1
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layout.py")


def _imports(module: str) -> set[str]:
    """The seqify modules ``module`` imports anywhere in its source (``from X import name`` where name is a
    submodule counts as that submodule)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t not in MODULES and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in MODULES and t != module and t.startswith("seqify"):
                found.add(t)
    return found


GRAPH = {m: _imports(m) for m in MODULES}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_imports_only_its_layer_and_below(module: str) -> None:
    mine = layer_of(module)
    above = sorted(d for d in GRAPH[module] if layer_of(d) > mine and not module.startswith(d + "."))
    assert not above, (f"{module} (layer {LAYERS[mine]}) imports {above} from a layer above; move the shared "
                       "code down, or pass it in as an argument")


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_contract_can_fail() -> None:
    """The checker sees an upward import: the converted model's layer does not know about pipelines."""
    assert layer_of("seqify.model.sequential") < layer_of("seqify.pipe.pipeline")
    assert "seqify.model.sequential" in GRAPH["seqify.pipe.pipeline"]


#: Packages that take seconds to import and that seqify needs only on some paths (torch.export's tracing,
#: zero bubble's split backward, a model family): every torchrun rank and CLI call would pay for them.
HEAVY = ("torch._dynamo", "torch.distributed.pipelining", "torch.distributed.tensor", "transformers", "diffusers",
         "timm", "matplotlib", "hypothesis")


def test_importing_seqify_loads_no_heavy_optional_package() -> None:
    code = ("import sys, seqify, seqify.distributed, seqify.tools.cli, seqify.zoo\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "", f"importing seqify loads {done.stdout.strip()}: import them where used"
