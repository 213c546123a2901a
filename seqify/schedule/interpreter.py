"""Interpreter: one loop walks a device's (or rank's) schedule actions in order, calling its executor's handlers.

Every executor of a :class:`~seqify.schedule.actions.Schedule` (the in-process scheduled step, the replayed
programs, a torchrun rank eager or replayed) supplies only its *handlers*, one method per action kind named
in :data:`HANDLERS` (``forward(partition, microbatch)`` for F, ``backward`` for B, ``weights`` for W), and
optionally the hooks of :class:`Hooks`; :func:`interpret` drives them (DeepSpeed's ``_INSTRUCTION_MAP``,
torch.distributed.pipelining's ``_step_microbatches``).

Design note: what the skeleton guarantees.

* Order: the actions run exactly in the order given, one at a time, each once; nothing is reordered,
  skipped or merged (the order in which work is issued is the schedule's, so results stay exact).
* Completeness first: the handler of every kind the actions hold is looked up before the first action
  runs; a kind without one raises :class:`~seqify.errors.ScheduleError` naming the executor and the kind,
  and no action has run.
* Per action: ``with hooks.around(action):`` the kind's handler, then ``hooks.after(action)``; ``begin()``
  before the first action and ``end()`` after the last. An exception from a handler or hook propagates as
  it is (no ``end``): undoing a half-run step is the executor's business.
* Profiling: while a torch profiler runs, each action's handler and ``after`` run inside a
  ``torch.profiler.record_function`` range named by :func:`range_name` (``PP:0F1``: partition 0's forward of
  micro-batch 1, as torch.distributed.pipelining names its ranges); with none running, no range is made
  (one check per action).
* Handlers are looked up by name on the object at each call of :func:`interpret` (a class's methods
  patched by a test are the ones called).
* Adding a kind is one entry in :data:`HANDLERS` (and the kind in :mod:`.actions`): every executor that
  meets it without a method of that name is then told so, by name.

This module imports no executor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from seqify.errors import ScheduleError
from seqify.schedule.actions import Action

__all__ = ["HANDLERS", "Handler", "Hooks", "handlers_for", "interpret", "range_name"]

#: Action kind -> the name of the method that runs it, ``method(partition, microbatch)``: the one table.
HANDLERS: dict[str, str] = {"F": "forward", "B": "backward", "W": "weights"}

#: A bound handler: ``handler(partition, microbatch)``.
Handler = Callable[[int, int], Any]


class Hooks:
    """The hooks an executor may override (each does nothing here); subclass it next to the handlers."""

    def begin(self) -> None:
        """Before the first action."""

    def around(self, action: Action) -> AbstractContextManager[Any]:
        """A context entered around ``action``'s handler and :meth:`after` (streams, lanes)."""
        return nullcontext()

    def after(self, action: Action) -> None:
        """After ``action``'s handler, inside :meth:`around`."""

    def end(self) -> None:
        """After the last action (only when every action ran)."""


def range_name(action: Action) -> str:
    """The profiler range of ``action``: ``PP:{partition}{kind}{microbatch}`` (``PP:2B0``, ``PP:1W3``); the
    kind is the schedule's (a split schedule's B computes the input gradients, its W the weights')."""
    return f"PP:{action.partition}{action.kind}{action.microbatch}"


def _profiled(action: Action) -> AbstractContextManager[Any]:
    """A profiler range around ``action`` while a profiler runs (record_function costs microseconds even
    with none running, so none is made then)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(range_name(action))
    return nullcontext()


def _name(executor: object) -> str:
    return type(executor).__name__


def handlers_for(executor: object, kinds: Iterable[str], name: str | None = None) -> dict[str, Handler]:
    """``executor``'s handler of each of ``kinds``; a kind without one (or unknown) raises
    :class:`~seqify.errors.ScheduleError` naming ``name`` (default: the executor's class) and the kind."""
    who = name or _name(executor)
    table: dict[str, Handler] = {}
    for kind in dict.fromkeys(kinds):
        method = HANDLERS.get(kind)
        if method is None:
            raise ScheduleError(f"{who}: an action of kind {kind!r}, which no executor knows; the kinds are "
                                f"{sorted(HANDLERS)} (seqify.schedule.interpreter.HANDLERS)")
        handler = getattr(executor, method, None)
        if not callable(handler):
            raise ScheduleError(f"{who} has no handler for {kind} actions: define {type(executor).__name__}."
                                f"{method}(partition, microbatch)")
        table[kind] = handler
    return table


def interpret(actions: Sequence[Action], executor: object, name: str | None = None) -> None:
    """Run ``actions`` in order through ``executor``'s handlers (one per kind, :data:`HANDLERS`) and, where
    it is a :class:`Hooks`, its hooks. ``name`` names the executor in errors (default: its class)."""
    table = handlers_for(executor, (a.kind for a in actions), name)
    hooks = executor if isinstance(executor, Hooks) else Hooks()
    hooks.begin()
    for a in actions:
        with hooks.around(a), _profiled(a):
            table[a.kind](a.partition, a.microbatch)
            hooks.after(a)
    hooks.end()
