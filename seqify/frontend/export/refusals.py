"""What the export frontend refuses because a converted model could not reproduce it: a key/value cache, a
reseed inside forward, an attribute carried between calls, a TorchScript submodule."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import ConversionError, ExampleInputError, ExportError, StatefulForwardError
from seqify.frontend.preserve import preserved
from seqify.frontend.reseeds import Reseed

__all__ = [
    "cache_error", "recording_writes", "refuse_cache", "refuse_cache_output", "refuse_reseeds", "refuse_scripted",
    "refuse_writes",
]


_CACHE = (
    "{name} would return a key/value cache (use_cache is on, from {source}): a cache is state kept between "
    "calls, which a converted model cannot return. Pass use_cache=False in example_inputs (and to every call), "
    "or set model.config.use_cache = False before converting"
)


def cache_error(name: str, source: str) -> ExampleInputError:
    """The refusal of model ``name`` returning a key/value cache because ``source`` turns use_cache on."""
    return ExampleInputError(_CACHE.format(name=name, source=source))


def refuse_cache(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """A key/value cache is state carried between calls: a pipeline cannot split it. Refuse it up front."""
    name = type(model).__name__
    if kwargs.get("past_key_values") is not None:
        raise ExampleInputError(
            f"example_inputs pass past_key_values to {name}: seqify converts the model for whole-sequence "
            "forwards (training, prefill); pass use_cache=False and no past_key_values"
        )
    if kwargs.get("use_cache"):
        raise cache_error(name, "example_inputs")


def refuse_cache_output(model: nn.Module, structure: Any, spec: Any) -> None:
    """A cache object in the output (use_cache from the model's config) is refused like an explicit one."""
    past = structure.get("past_key_values") if isinstance(structure, dict) else None
    if past is not None or "Cache" in str(spec):
        raise cache_error(type(model).__name__, "model.config.use_cache")


@contextmanager
def recording_writes(model: nn.Module) -> Iterator[list[tuple[str, Any, Any]]]:
    """Record the plain attributes (not parameters, buffers or submodules) the forward changes on the model's
    modules, tensors included (export itself restores them)."""
    paths = {id(m): p for p, m in model.named_modules()}
    seen: list[tuple[str, Any, Any]] = []
    original = nn.Module.__setattr__

    def setattr_(self: nn.Module, name: str, value: Any) -> None:
        if (id(self) in paths and not name.startswith("_") and name != "training"
                and name not in self._parameters and name not in self._buffers and name not in self._modules):
            old = self.__dict__.get(name, _MISSING)
            if old is not value and not isinstance(value, nn.Module) and not _same(old, value):
                seen.append((f"{paths[id(self)]}.{name}".lstrip("."), old, value))
        original(self, name, value)

    nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        nn.Module.__setattr__ = original  # type: ignore[method-assign]


def refuse_reseeds(model: nn.Module, seeded: list[Reseed]) -> None:
    """A reseed inside forward runs once, while exporting: the graph has no such op, so a converted model
    would never reseed and every draw after it would differ. Refused; fx keeps a submodule that does it whole."""
    if not seeded:
        return
    first = seeded[0]
    where = first.where(model)
    fix = ("seed before calling the model instead of inside forward" if not first.module else
           "convert with frontend='fx' (or 'auto'), which keeps a submodule that reseeds whole as one layer, or seed "
           "before calling the model instead of inside forward")
    raise StatefulForwardError(
        f"{where} reseeds torch's random number generator ({first.call} at {first.site}) while it runs: the export "
        "frontend runs that call once, while capturing, and records no op for it, so a converted model would never "
        f"reseed and every random draw after it (dropout, sampling) would differ from the source's. What to do: {fix}"
    )


def refuse_writes(model: nn.Module, kwargs: dict[str, Any], seen: list[tuple[str, Any, Any]]) -> None:
    """A forward that sets an attribute it read before (a step counter, a state carried between calls) would
    have the value seen at conversion baked in: refused. One that always writes an attribute before reading it
    (RecurrentGemma's recurrent state without a cache: reset, then computed, every call) computes it afresh
    each call, as the graph does: kept."""
    if not seen or _fresh_each_call(model, kwargs, {where for where, _, _ in seen}):
        return
    where, old, value = seen[0]
    raise ConversionError(
        f"{type(model).__name__}: forward writes the attribute {where} ({_shown(old)} -> {_shown(value)}) after "
        "reading the value an earlier call left; a converted model would compute every call with the value seen "
        "at conversion. Keep the value in a buffer (register_buffer, updated in place), or convert with "
        "frontend='fx', which refuses or keeps such modules whole"
    )


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "unset"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return repr(value)


class _Unread:
    """Stands in for an attribute's value from before a call: reading it in any way raises."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"read of a value from before the call ({name})")

    def __bool__(self) -> bool:
        raise TypeError("read of a value from before the call")

    def __eq__(self, other: object) -> bool:
        raise TypeError("read of a value from before the call")

    __hash__ = None  # type: ignore[assignment]


def _fresh_each_call(model: nn.Module, kwargs: dict[str, Any], written: set[str]) -> bool:
    """Whether the forward computes the same with the ``written`` attributes (``module.path.name``)
    unreadable as with their values from before: then it writes each before reading it."""
    def run(hide: bool) -> Any:
        with preserved(model), torch.random.fork_rng(devices=[]), torch.no_grad():
            if hide:
                for where in written:
                    owner, _, name = where.rpartition(".")
                    (model.get_submodule(owner) if owner else model).__dict__[name] = _Unread()
            torch.manual_seed(0)
            return model(**kwargs)

    try:
        before, hidden = run(False), run(True)
    except Exception:
        return False
    a, spec_a = pytree.tree_flatten(before)
    b, spec_b = pytree.tree_flatten(hidden)
    if spec_a != spec_b:
        return False
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
               else type(x) is type(y) and _same(x, y) for x, y in zip(a, b))


_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def refuse_scripted(model: nn.Module) -> None:
    """A TorchScript submodule runs compiled code that export cannot flatten into ops; fx keeps it whole."""
    path, module = next(((p, m) for p, m in model.named_modules() if p and isinstance(m, torch.jit.ScriptModule)),
                        ("", None))
    if module is not None:
        kind = getattr(module, "original_name", type(module).__name__)
        raise ExportError(
            f"submodule {path!r} ({kind}) of {type(model).__name__} is a TorchScript module (torch.jit.script): "
            "its forward is compiled code that the torch.export frontend cannot flatten into ops. Convert with "
            "frontend='fx' (or 'auto'), which keeps it whole as one layer, or convert the Python module before "
            "scripting it"
        )
