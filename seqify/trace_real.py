"""Real example values of submodules: the source run once on the real example, outside fx, leaving no trace."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.fx._symbolic_trace import _maybe_revert_all_patches
from torch.nn.modules.module import register_module_forward_hook

__all__ = ["RealRun", "unpatched", "buffers_kept"]


@contextmanager
def unpatched() -> Iterator[None]:
    """Undo fx's patches of ``nn.Module.__call__`` / ``__getattr__`` (and wrapped functions) for a while,
    so code run inside sees plain modules and tensors."""
    with _maybe_revert_all_patches():
        yield


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Put every buffer's values back on exit (code run eagerly while tracing, or a real run, may update
    BatchNorm statistics in place)."""
    saved = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in saved:
                if not torch.equal(b, copy):
                    b.copy_(copy)


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
        self, model: nn.Module, call: Callable[[], Any], preserve: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self.model = model
        self.call = call
        self.preserve = preserve
        self.outputs: dict[str, list[Any]] | None = None
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

    def _run(self) -> dict[str, list[Any]]:
        paths = {id(m): p for p, m in self.model.named_modules()}
        outputs: dict[str, list[Any]] = defaultdict(list)

        def hook(m: nn.Module, args: Any, out: Any) -> None:
            path = paths.get(id(m))
            if path is not None and _kept(m):
                outputs[path].append(out)

        handle = register_module_forward_hook(hook)
        try:
            with unpatched(), torch.no_grad(), self.preserve(), buffers_kept(self.model):
                self.call()
        except Exception as e:  # the values gathered so far are still right
            self.error = f"{type(e).__name__}: {e}".splitlines()[0]
        finally:
            handle.remove()
        return dict(outputs)
