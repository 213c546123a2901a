"""State a model reaches through plain attributes but holds outside its module tree (lists, dicts, helper objects)."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from seqify.errors import StatefulForwardError, UnregisteredError

__all__ = ["Held", "outside", "find", "values_kept", "registered", "unregistered_error", "generator_error",
           "what_is"]

#: What ``nn.Module.__init__`` puts in a module's ``__dict__``: torch's own bookkeeping, never user state.
_INTERNALS = frozenset(nn.Module().__dict__)
#: Values that hold no tensors, skipped without a look inside.
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, torch.dtype, torch.device, torch.Size,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)
#: A walk visits at most this many objects and goes this deep: a model holding a data set or a tokenizer
#: in an attribute must not make every trace slow; weights sit a few attributes deep.
_BUDGET = 20000
_DEPTH = 8


@dataclass(frozen=True)
class Held:
    """An object the model reaches outside its module tree: ``owner`` is the registered module whose plain
    attribute starts the chain ('' for the model itself), ``where`` the chain from it (``layers[0].weight``)."""

    owner: str
    where: str
    obj: Any

    def path(self, model: nn.Module) -> str:
        """The attribute path a user reads in the source (``M3.layers[0].weight``)."""
        return ".".join([type(model).__name__, *([self.owner] if self.owner else []), self.where])


def registered(model: nn.Module) -> set[int]:
    """The ids of the model's own parameters, buffers and modules (what ``.to()`` and ``state_dict`` see)."""
    found: set[int] = set()
    for m in model.modules():  # the tables directly: parameters() and buffers() walk the tree twice more
        found.add(id(m))
        found.update(id(t) for t in m._parameters.values() if t is not None)
        found.update(id(t) for t in m._buffers.values() if t is not None)
    return found


class _Walk:
    """One walk over a model's plain attributes, recording the first path to each object outside its tree."""

    def __init__(self, model: nn.Module) -> None:
        self.mine = registered(model)
        self.seen: set[int] = set()
        self.found: list[Held] = []
        self.left = _BUDGET

    def module_attrs(self, m: nn.Module, owner: str, where: str, depth: int) -> None:
        if isinstance(m, torch.jit.ScriptModule):
            return  # compiled: its state lives in C++ and its forward reads only what it registered
        if type(m).__module__.partition(".")[0] == "seqify":
            return  # a converted model's bookkeeping (the source modules it flattened), not state it reads
        for name, value in m.__dict__.items():
            if name not in _INTERNALS:
                self.visit(value, owner, f"{where}.{name}" if where else name, depth + 1)

    def visit(self, value: Any, owner: str, where: str, depth: int) -> None:
        if isinstance(value, _LEAVES) or id(value) in self.seen or depth > _DEPTH or self.left <= 0:
            return
        self.seen.add(id(value))
        self.left -= 1
        if isinstance(value, torch.Tensor):
            if id(value) not in self.mine and not isinstance(value, FakeTensor):
                self.found.append(Held(owner, where, value))
        elif isinstance(value, torch.Generator):
            self.found.append(Held(owner, where, value))
        elif isinstance(value, nn.Module):
            if id(value) in self.mine:
                return  # a reference to one of the model's own modules: its state is registered
            self.found.append(Held(owner, where, value))
            for kind in ("_parameters", "_buffers", "_modules"):
                for name, item in value.__dict__.get(kind, {}).items():
                    self.visit(item, owner, f"{where}.{name}", depth + 1)
            self.module_attrs(value, owner, where, depth)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.visit(item, owner, f"{where}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                self.visit(item, owner, f"{where}[{key!r}]", depth + 1)
        elif type(value).__module__.partition(".")[0] not in ("torch", "builtins"):
            try:  # an object without a __dict__ may answer through its own __getattr__
                attrs = vars(value)
            except Exception:
                return
            if isinstance(attrs, dict):
                for name, item in list(attrs.items()):
                    self.visit(item, owner, f"{where}.{name}", depth + 1)


def outside(model: nn.Module) -> list[Held]:
    """The tensors (parameters included), modules and ``torch.Generator`` objects that ``model`` reaches
    through plain attributes of its modules (lists, tuples, dicts, helper objects, unregistered modules)
    but does not register: ``model.parameters()``, ``.to()`` and ``state_dict`` do not see them.

    The rule a conversion follows for them: one that trains (requires grad) is refused by its path, since
    layers could only bake it in (no gradient) or hold it where the source's casts and moves do not reach;
    one that does not (a frozen module kept in a list, a constant) is read by the layers as the source's own
    tensor, which the converted model's dtype casts leave alone as the source's do; a submodule whose forward
    uses either, the fx frontend may keep whole (exact: it runs the source's code)."""
    walk = _Walk(model)
    for path, m in model.named_modules():
        walk.module_attrs(m, path, "", 0)
    return walk.found


def _view(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What identifies a tensor's view of memory (export lifts a parameter as a detached alias of it)."""
    if t.is_meta or isinstance(t, FakeTensor) or t.layout != torch.strided:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device


def find(model: nn.Module, obj: Any, found: list[Held] | None = None) -> Held | None:
    """Where ``model`` holds ``obj`` outside its module tree: the object itself, for a tensor the one viewing
    the same memory the same way, for a generator one in the same state; None where it holds none such."""
    found = outside(model) if found is None else found
    hit = next((h for h in found if h.obj is obj), None)
    if hit is None and isinstance(obj, torch.Generator):  # export lifts a generator as a copy of its state
        hit = next((h for h in found if isinstance(h.obj, torch.Generator) and h.obj.device == obj.device
                    and _same(h.obj.get_state(), obj.get_state())), None)
    if hit is not None or not isinstance(obj, torch.Tensor):
        return hit
    key = _view(obj)
    if key is None:
        return None
    return next((h for h in found if isinstance(h.obj, torch.Tensor) and _view(h.obj) == key), None)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, NaNs in the same places."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


@contextmanager
def values_kept(model: nn.Module) -> Iterator[Callable[[], list[Held]]]:
    """Put back on exit the values of the tensors (not requiring grad: those cannot change in place under
    autograd) and the states of the generators ``model`` holds outside its module tree, which a forward
    run while converting may change; yields a function giving those changed so far."""
    saved: list[tuple[Held, Any]] = []
    for held in outside(model):
        if isinstance(held.obj, torch.Generator):
            saved.append((held, held.obj.get_state()))
        elif isinstance(held.obj, torch.Tensor) and not held.obj.requires_grad and _view(held.obj) is not None:
            saved.append((held, held.obj.detach().clone()))

    def differs(held: Held, before: Any) -> bool:
        now = held.obj.get_state() if isinstance(held.obj, torch.Generator) else held.obj.detach()
        return not _same(now, before)

    try:
        yield lambda: [held for held, before in saved if differs(held, before)]
    finally:
        for held, before in saved:
            if differs(held, before):
                if isinstance(held.obj, torch.Generator):
                    held.obj.set_state(before)
                else:
                    with torch.no_grad():
                        held.obj.copy_(before)


def what_is(model: nn.Module, held: Held | None, obj: Any) -> str:
    """``M3.layers[0] (Linear)``: where the model holds ``obj`` outside its tree and what it is."""
    kind = (type(obj).__name__ if isinstance(obj, nn.Module) else "a parameter" if isinstance(obj, nn.Parameter)
            else "a tensor that requires grad" if isinstance(obj, torch.Tensor) and obj.requires_grad
            else "a tensor" if isinstance(obj, torch.Tensor) else type(obj).__name__)
    if held is None:
        return f"{kind} that is not part of {type(model).__name__} (one made while forward runs?)"
    return f"{held.path(model)} ({kind})"


def _frozen(obj: Any) -> bool:
    """A module whose weights never train, or a tensor that does not require grad."""
    if isinstance(obj, nn.Module):
        return not any(p.requires_grad for p in obj.parameters())
    return isinstance(obj, torch.Tensor) and not obj.requires_grad


def unregistered_error(model: nn.Module, held: Held | None, obj: Any, *, frontend: str) -> UnregisteredError:
    """The refusal of a forward that uses a module, or a tensor requiring grad, held outside the module tree."""
    name = type(model).__name__
    export_ok = frontend == "fx" and _frozen(obj) and held is not None
    return UnregisteredError(
        f"{name}.forward uses {what_is(model, held, obj)}, which {name} keeps outside its module tree (in a plain "
        "list, tuple, dict or helper object, not as a registered submodule, parameter or buffer): "
        "model.parameters(), .to(), .double() and state_dict() do not see it, and converted layers cannot hold "
        "it as the source does (they would bake its weights in as constants that no gradient reaches, or move "
        "and cast them unlike the source). What to do: register it (nn.ModuleList([...]) or nn.ModuleDict({...}) "
        "for modules, nn.Parameter or nn.ParameterList for trained tensors, self.register_buffer(...) for the "
        "rest), or move the code that uses it into a submodule (if it is not in one already) and convert with "
        "frontend='fx' or 'auto', which keep such a submodule whole as one layer"
        + (". Weights that never train (requires_grad=False, as here) also convert with frontend='export' (or "
           "'auto'), which reads them as constants shared with the source" if export_ok else "")
    )


def generator_error(model: nn.Module, held: Held | None, obj: Any) -> StatefulForwardError:
    """The refusal of a forward that draws from a private ``torch.Generator``."""
    name = type(model).__name__
    where = held.path(model) if held is not None else "a torch.Generator made while forward runs"
    return StatefulForwardError(
        f"{name}.forward draws random numbers from its own torch.Generator ({where}): a pipeline cannot replay a "
        "private generator's draws (it splits each batch into micro-batches, and recomputing a checkpointed layer "
        "replays torch's global generator only), so seqify does not split such a forward into layers. What to "
        "do: draw from torch's global generator (seeded with torch.manual_seed before the run), or move the draw "
        "into a submodule, which the fx frontend (frontend='fx' or 'auto') keeps whole as one layer that draws "
        "as the source does"
    )
