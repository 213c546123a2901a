"""Both modes in one conversion: the layers of a train-mode and an eval-mode trace joined where only ops differ."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from seqify.convert.verify import check
from seqify.errors import SeqifyError, VerifyError
from seqify.frontend.preserve import preserved
from seqify.frontend.traced import attribute
from seqify.model.layer import Attr, Layer, Op, Program
from seqify.model.sequential import Sequential
from seqify.skip.namespace import SkipKey

__all__ = ["join_modes", "join_other_mode", "forget_other_modes", "check_both_modes", "check_other_mode"]

log = logging.getLogger("seqify.frontend")


def join_other_mode(model: nn.Module, seq: Sequential, reconvert: Callable[[tuple[str, ...]], Sequential],
                    leaf_paths: tuple[str, ...], example_inputs: Any) -> None:
    """A mode-dependent conversion ``seq`` of ``model`` converted again in the other mode (``reconvert`` of the
    paths to keep whole: what the first kept whole too) and joined with it layer by layer where the two differ
    only inside layers; checked in the other mode on ``example_inputs`` (None: not checked). Where they do not
    join, or the check fails, ``seq`` stays as it was: it refuses the other mode."""
    kept = tuple(dict.fromkeys([*leaf_paths, *(o.path for o in seq.opaque)]))
    with preserved(model):
        model.train(not seq.converted_training)
        try:
            other = reconvert(kept)
        except SeqifyError:
            return
    joined = join_modes(seq, other)
    if joined is None:
        return
    seq.mode_dependent, seq.two_mode_layers = False, joined
    if example_inputs is None:
        return
    try:
        check_other_mode(model, seq, example_inputs)
    except VerifyError as e:
        forget_other_modes(seq)
        seq.mode_dependent, seq.two_mode_layers = True, ()
        log.warning("converting %s: the layers traced in the other mode fail the self-check there (%s); the "
                    "conversion runs only in the mode it was made in", type(model).__name__,
                    str(e).splitlines()[0])


def check_both_modes(model: nn.Module, seq: Sequential, example_inputs: Any) -> None:
    """The self-check in the model's mode, and in the other mode too where the conversion holds ops for it."""
    check(model, seq, example_inputs, frontend="export")
    if seq.two_mode_layers:
        check_other_mode(model, seq, example_inputs)


def check_other_mode(model: nn.Module, seq: Sequential, example_inputs: Any) -> None:
    """The self-check with the source and ``seq`` in the mode ``seq`` was not converted in."""
    mode = seq.training
    with preserved(model):
        model.train(not seq.converted_training)
        seq.train(not seq.converted_training)
        try:
            check(model, seq, example_inputs, frontend=seq.frontend)
        finally:
            seq.train(mode)


def join_modes(seq: Sequential, other: Sequential) -> tuple[str, ...] | None:
    """Give each layer of ``seq`` whose ops differ in ``other`` (the same model converted in the other mode)
    ``other``'s program for that mode. They join only where both conversions have the same layers, inputs,
    outputs, guards and skips (each skip stashed and popped by the same layers), and every parameter, buffer,
    module or constant ``other``'s ops read is the same one ``seq``'s layer holds. Returns the names of the
    layers that now hold two programs, or None (and changes nothing) where the conversions do not join."""
    plan = _plan(seq, other)
    if plan is None:
        return None
    for layer, program in plan:
        layer.run_in_other_mode(program, other.converted_training)
    return tuple(name for name, layer in seq.named_children() if any(layer is done for done, _ in plan))


def forget_other_modes(seq: Sequential) -> None:
    """Undo :func:`join_modes`: every layer runs only its own program again."""
    for layer in seq.children():
        if isinstance(layer, Layer):
            layer.forget_other_mode()


def _plan(seq: Sequential, other: Sequential) -> list[tuple[Layer, Program]] | None:
    if not _same_frame(seq, other):
        return None
    keys = _key_map(seq, other)
    if keys is None:
        return None
    plan: list[tuple[Layer, Program]] = []
    for mine, theirs in zip(seq.children(), other.children()):
        if mine is theirs:
            continue
        if not (isinstance(mine, Layer) and isinstance(theirs, Layer)) or not _same_state(mine, theirs):
            return None
        program = theirs.program()
        program = program._replace(pops=tuple((keys[k], n) for k, n in program.pops),
                                   stashes=tuple((keys[k], n) for k, n in program.stashes))
        if program != mine.program():
            plan.append((mine, program))
    return plan


def _same_frame(seq: Sequential, other: Sequential) -> bool:
    """The same layer names, the same way in and out, the same guards, and skips between the same layers."""
    return (
        list(seq._modules) == list(other._modules)
        and repr(seq.input_spec) == repr(other.input_spec)
        and seq.entry == other.entry
        and repr(seq.output_spec) == repr(other.output_spec)
        and [g.expr for g in seq.guards] == [g.expr for g in other.guards]
        and all(_arity(a) == _arity(b) for a, b in zip(seq.children(), other.children()))
    )


def _arity(layer: nn.Module) -> tuple[int, ...]:
    if not isinstance(layer, Layer):
        return (-1,)
    return (len(layer.inputs), len(layer.outputs), len(layer.pops), len(layer.stashes))


def _key_map(seq: Sequential, other: Sequential) -> dict[SkipKey, SkipKey] | None:
    """``other``'s skip keys as ``seq``'s, matched by the layer and place that stash them; None unless every
    skip is popped by the same layers at the same places in both."""
    def uses(model: Sequential) -> dict[SkipKey, list[tuple[int, str, int]]]:
        found: dict[SkipKey, list[tuple[int, str, int]]] = {}
        for i, layer in enumerate(model.children()):
            for what in ("stashes", "pops"):
                for place, (key, _) in enumerate(getattr(layer, what, ())):
                    found.setdefault(key, []).append((i, what, place))
        return found

    mine, theirs = uses(seq), uses(other)
    by_use = {tuple(v): k for k, v in mine.items()}
    keys = {k: by_use.get(tuple(v)) for k, v in theirs.items()}
    if len(mine) != len(theirs) or any(v is None for v in keys.values()) or len(set(keys.values())) != len(keys):
        return None
    return {k: v for k, v in keys.items() if v is not None}


def _same_state(mine: Layer, theirs: Layer) -> bool:
    """Whatever ``theirs``'s ops read from their layer, ``mine`` holds too: the very same module, parameter
    or buffer, or a constant of the same value."""
    return all(_same(_get(mine, name), _get(theirs, name)) for name in _attrs(theirs.ops))


def _attrs(ops: tuple[Op, ...]) -> set[str]:
    names: set[str] = set()

    def visit(a: Any) -> None:
        if isinstance(a, Attr):
            names.add(a.name)
        elif isinstance(a, (tuple, list)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
        elif isinstance(a, slice):
            visit((a.start, a.stop, a.step))

    for op in ops:
        if op.kind == "call_module":
            names.add(str(op.target))
        visit(op.args)
        visit(op.kwargs)
    return names


_MISSING = object()


def _get(layer: nn.Module, name: str) -> Any:
    try:
        return attribute(layer, name)
    except AttributeError:
        return _MISSING


def _same(a: Any, b: Any) -> bool:
    if a is _MISSING or b is _MISSING:
        return False
    if a is b:
        return True
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and a.shape == b.shape and a.device == b.device and not a.requires_grad and not b.requires_grad
            and bool(torch.equal(a, b)))
