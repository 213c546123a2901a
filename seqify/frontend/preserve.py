"""Preserved: a model's attributes, tables, hook dicts, flags and outside-held values put back after code runs it."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from seqify.frontend.outside import Held, values_kept

__all__ = ["preserved", "attributes_of", "put_back", "kept_attributes"]


@contextmanager
def preserved(model: nn.Module) -> Iterator[Callable[[], list[Held]]]:
    """Restore every module's attributes, parameters, buffers, children and flags on exit, and the contents
    of plain dict and list attributes (a cache a forward fills, such as timm's attention-bias cache, must
    not keep the fake tensors a trace put there). Hook dicts (OrderedDicts) are restored too: transformers 5
    installs output-capturing hooks on a model's first call that records hidden states and marks it with
    an attribute; keeping the hooks but dropping the mark would install them again on the next call, and
    every hidden state would then be recorded twice (Segformer's decode head read the wrong stages).
    The values of tensors and the states of generators the model holds outside its module tree are put
    back too (``outside.values_kept``, whose function of what changed so far this yields). TorchScript
    modules keep their tables (views of compiled state that a forward does not change); their mode is put back.
    The parameters' and buffers' requires_grad flags and tensor hooks are restored too."""
    saved = [
        (m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules))
        for m in model.modules() if not isinstance(m, torch.jit.ScriptModule)
    ]
    contents = [(v, copy.copy(v)) for _, attrs, *_ in saved for v in attrs.values()
                if type(v) in (dict, list, OrderedDict)]
    scripted = [(m, m.training) for m in model.modules() if isinstance(m, torch.jit.ScriptModule)]
    # a forward may freeze or unfreeze its own parameters (requires_grad_ on what .parameters() gives) and hook
    # them (register_hook, register_post_accumulate_grad_hook): the source run to check a conversion must not
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_leaf]
    flags = [(t, t.requires_grad, _tensor_hooks(t)) for t in tensors]
    try:
        with values_kept(model) as changed:
            yield changed
    finally:
        for compiled, training in scripted:  # its mode lives in the compiled module: train()/eval() change it there
            compiled.training = training
        for t, flag, hooks in flags:
            if t.requires_grad != flag:
                t.requires_grad_(flag)
            _restore_tensor_hooks(t, hooks)
        for container, before in contents:
            if isinstance(container, dict):
                container.clear()
                container.update(before)
            else:
                container[:] = before
        for m, attrs, params, buffers, children in saved:
            m.__dict__.clear()
            m.__dict__.update(attrs)
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            m._modules.clear()
            m._modules.update(children)


Attributes = list[tuple[nn.Module, dict[str, Any]]]


def attributes_of(module: nn.Module) -> Attributes:
    """The attribute tables of ``module`` and its submodules (what a forward's ``self.x = ...`` changes)."""
    return [(m, dict(m.__dict__)) for m in module.modules()]


def put_back(attributes: Attributes) -> None:
    """Give each module the attributes :func:`attributes_of` found."""
    for module, attrs in attributes:
        module.__dict__.clear()
        module.__dict__.update(attrs)


@contextmanager
def kept_attributes(module: nn.Module) -> Iterator[None]:
    """Put ``module``'s and its submodules' attributes back on exit (a forward run for its example value may
    cache what it computed: torchvision's anchors)."""
    saved = attributes_of(module)
    try:
        yield
    finally:
        put_back(saved)


_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _tensor_hooks(t: torch.Tensor) -> list[tuple[Any, dict[Any, Any] | None]]:
    """Each hook dict of ``t`` (the object, or None) and what it holds."""
    found = [getattr(t, name, None) for name in _TENSOR_HOOKS]
    return [(d, None if d is None else dict(d)) for d in found]


def _restore_tensor_hooks(t: torch.Tensor, saved: list[tuple[Any, dict[Any, Any] | None]]) -> None:
    """Put ``t``'s hook dicts back as :func:`_tensor_hooks` found them: emptied or refilled in place, since
    autograd keeps calling the dict a hook was registered in, then the attribute itself."""
    for name, (before, items) in zip(_TENSOR_HOOKS, saved):
        now = getattr(t, name, None)
        if now is not None and now is not before:
            now.clear()
        if before is not None and dict(before) != items:
            before.clear()
            before.update(items or {})
        if now is not before:
            setattr(t, name, before)
