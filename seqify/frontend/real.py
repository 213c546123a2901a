"""Real example values of submodules: the source run once on the real example, outside fx, leaving no trace."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.nn.modules.module import register_module_forward_hook

from seqify.errors import SourceRaisesError
from seqify.frontend.preserve import attributes_of, put_back

__all__ = ["RealRun", "Plain", "tracing", "unpatched", "buffers_kept", "record_inputs", "source_error", "raises_itself"]


class Plain(Protocol):
    """A tracer whose patched ``nn.Module.__call__`` / ``__getattr__`` act plainly while ``plain`` > 0."""

    plain: int


_TRACING: list[Plain] = []  # seqify's tracers now tracing, innermost last


@contextmanager
def tracing(tracer: Plain) -> Iterator[None]:
    """While ``tracer`` traces, ``unpatched`` switches it to plain calls instead of undoing fx's patches."""
    _TRACING.append(tracer)
    try:
        yield
    finally:
        _TRACING.remove(tracer)


@contextmanager
def unpatched() -> Iterator[None]:
    """Let code run inside see plain modules and tensors: module calls run their forward and attribute
    reads give the attribute, not proxies. Inside seqify's tracer this is a switch on the tracer; elsewhere
    fx's patches of ``nn.Module.__call__`` / ``__getattr__`` (and wrapped functions) are undone for a while.
    (Undoing them sets two attributes of ``nn.Module``, which invalidates the attribute caches of every
    subclass: about 0.2 ms a time with transformers and diffusers imported, and a leaf's example value
    needs it once per call, seconds per large model.) fx's wrapped functions stay wrapped: they act only
    on proxies, and plain code passes none."""
    if not _TRACING:
        with _maybe_revert_all_patches():
            yield
        return
    tracer = _TRACING[-1]
    tracer.plain += 1
    try:
        yield
    finally:
        tracer.plain -= 1


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal values in the same layout (sparse tensors compared through their dense values)."""
    if a.layout != b.layout or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.layout != torch.strided:
        return torch.equal(a.to_dense(), b.to_dense())
    return torch.equal(a, b)


@contextmanager
def buffers_kept(model: nn.Module, *, parameters: bool = False) -> Iterator[Callable[[], list[str]]]:
    """Put every buffer's values back on exit (code run eagerly while tracing, or a real run, may update
    BatchNorm statistics in place); with ``parameters``, every parameter's too (a forward may write its own
    weights: ``nn.Embedding(max_norm=...)`` renormalises rows, ``weight.clamp_()`` under no_grad). Yields a
    function giving the names of the buffers changed so far."""
    named = list(model.named_buffers()) + (list(model.named_parameters()) if parameters else [])
    saved = [(name, t, t.detach().clone()) for name, t in named if not t.is_meta]
    buffers = {name for name, _ in model.named_buffers()}
    try:
        yield lambda: [name for name, t, copy in saved if name in buffers and not _equal(t.detach(), copy)]
    finally:
        with torch.no_grad():
            for _, t, copy in saved:
                if not _equal(t.detach(), copy):
                    t.copy_(copy)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaNs in the same places (a NaN is not unequal to itself here); sparse tensors compared
    through their dense values."""
    if a.layout != torch.strided or b.layout != torch.strided:
        return same_values(a, b)
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


def source_error(
    model: nn.Module, call: Callable[[], Any], preserve: Callable[[], AbstractContextManager[Any]]
) -> Exception | None:
    """What the source raises when ``call`` runs it plainly (no trace) on the example; None where it runs. It
    changes nothing: attributes by ``preserve()``, buffers copied back, random draws on a forked generator."""
    try:
        with unpatched(), preserve(), buffers_kept(model), torch.random.fork_rng(devices=[]), torch.no_grad():
            call()
    except Exception as e:
        return e
    return None


def raises_itself(name: str, error: Exception | str) -> SourceRaisesError:
    """The error for example inputs the source itself cannot run: the inputs are wrong, not the conversion."""
    first = str(error).splitlines()[0] if str(error) else ""
    what = error if isinstance(error, str) else f"{type(error).__name__}: {first}"
    return SourceRaisesError(
        f"the source {name} itself raises on the example inputs: {what}. Pass example_inputs the source model "
        "runs on (e.g. token ids below the vocabulary size, the shapes and options its forward expects)"
    )


def _kept(m: nn.Module) -> bool:
    """Modules whose outputs are worth keeping: torch.nn's own leaves always evaluate on fake tensors."""
    return not type(m).__module__.startswith("torch.nn.") or bool(m._modules)


class RealRun:
    """The outputs of every (non-torch.nn-leaf) submodule call when the source runs on the real example.

    Computed at most once, lazily: only a submodule whose example value cannot be computed on fake tensors
    (it branches on tensor values, or calls non-torch code) needs it. The run changes nothing: attributes are
    restored by ``preserve()``, buffers (BatchNorm statistics) are copied back, and random
    draws happen inside the caller's ``fork_rng``.
    """

    def __init__(
        self, model: nn.Module, call: Callable[[], Any], preserve: Callable[[], AbstractContextManager[Any]]
    ) -> None:
        self.model = model
        self.call = call
        self.preserve = preserve
        # the attributes as they are before tracing: a traced forward may write proxies into them
        # (torchvision's AnchorGenerator caches anchors cast to the input's dtype), and the real run is lazy
        self.attributes = attributes_of(model)
        self.outputs: dict[str, list[Any]] | None = None
        self.methods: defaultdict[str, list[Any]] = defaultdict(list)  # what the root's method calls returned
        self.running = False
        self.error: str | None = None

    def output(self, path: str, index: int) -> Any:
        """The value of the ``index``-th call of submodule ``path``; raises if there is none."""
        if self.outputs is None:
            self.outputs = self._run()
        calls = self.outputs.get(path, [])
        if index >= len(calls):
            reason = f": the source fails on the example ({self.error})" if self.error else ""
            raise LookupError(f"{path} was not called {index + 1} time(s) on the real example{reason}")
        return calls[index]

    def method_output(self, key: str, index: int) -> Any:
        """The value of the ``index``-th call of method ``key`` (``path.name``) from the root's forward."""
        if self.outputs is None:
            self.outputs = self._run()
        calls = self.methods.get(key, [])
        if index >= len(calls):
            reason = f": the source fails on the example ({self.error})" if self.error else ""
            raise LookupError(f"{key}() was not called {index + 1} time(s) on the real example{reason}")
        return calls[index]

    def method_returned(self, key: str, out: Any) -> None:
        self.methods[key].append(out)

    def _run(self) -> dict[str, list[Any]]:
        paths = {id(m): p for p, m in self.model.named_modules()}
        outputs: dict[str, list[Any]] = defaultdict(list)

        def hook(m: nn.Module, args: Any, out: Any) -> None:
            path = paths.get(id(m))
            if path is not None and _kept(m):
                outputs[path].append(out)

        handle = register_module_forward_hook(hook)
        self.running = True
        try:
            with unpatched(), torch.no_grad(), self.preserve(), buffers_kept(self.model), \
                    torch.random.fork_rng(devices=[]):  # a trace going on sees no draw of this run
                put_back(self.attributes)
                self.call()
        except Exception as e:  # the values gathered so far are still right
            self.error = f"{type(e).__name__}: {e}".splitlines()[0]
        finally:
            handle.remove()
            self.running = False
        return dict(outputs)


Call = tuple[str, int]  # (submodule path, index of its call in one forward)


def record_inputs(
    model: nn.Module,
    call: Callable[[], Any],
    preserve: Callable[[], AbstractContextManager[Any]],
    wanted: Collection[Call],
) -> dict[Call, tuple[tuple[Any, ...], dict[str, Any]]]:
    """The arguments (tensors cloned) of the ``wanted`` submodule calls when ``call`` runs the source on the
    real example. Like :class:`RealRun` it changes nothing: its hooks go again, attributes and buffers
    are restored, and random draws happen on a forked generator."""
    counts: dict[str, int] = defaultdict(int)
    found: dict[Call, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def keep(path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        index = counts[path]
        counts[path] += 1
        if (path, index) in wanted:
            found[(path, index)] = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))

    handles = []
    for path in sorted({p for p, _ in wanted}):
        module = model.get_submodule(path)
        handles.append(module.register_forward_pre_hook(
            lambda _m, args, kwargs, path=path: keep(path, args, kwargs), with_kwargs=True))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), preserve(), buffers_kept(model):
            call()
    except Exception:  # the calls recorded before the failure are still right
        pass
    finally:
        for handle in handles:
            handle.remove()
    return found
