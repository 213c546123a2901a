"""Skippable layers: ``@skippable`` with ``yield stash(...)`` / ``yield pop(...)``, as in torchgpipe."""

from __future__ import annotations

import types
from collections.abc import Callable, Generator, Iterable
from typing import Any, TypeVar

from torch import nn

from seqify.errors import SkipError
from seqify.skip.namespace import DEFAULT, Namespace, SkipKey
from seqify.skip.tracker import current_tracker

__all__ = ["Skippable", "skippable", "stash", "pop", "stash_keys", "pop_keys"]


class stash:
    """``yield stash(name, value)`` inside a skippable forward stores ``value`` for a later ``pop``."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.value = value


class pop:
    """``value = yield pop(name)`` inside a skippable forward takes what an earlier layer stashed."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """A layer that stashes and/or pops skip values.

    Subclasses declare the names they stash and pop; :meth:`stash_keys` and :meth:`pop_keys` give them
    with their namespaces, which is all an executor needs to route skips between devices.
    """

    stashable_names: frozenset[str] = frozenset()
    poppable_names: frozenset[str] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.namespaces: dict[str, Namespace] = {}

    def namespaced(self, name: str) -> SkipKey:
        return (self.namespaces.get(name, DEFAULT), name)

    def stash_keys(self) -> tuple[SkipKey, ...]:
        return tuple(self.namespaced(n) for n in sorted(self.stashable_names))

    def pop_keys(self) -> tuple[SkipKey, ...]:
        return tuple(self.namespaced(n) for n in sorted(self.poppable_names))

    def isolate(self, ns: Namespace, *, only: Iterable[str] | None = None) -> Skippable:
        """Put this layer's skip names (or just ``only``) into ``ns``; returns ``self``."""
        names = set(self.stashable_names | self.poppable_names) if only is None else set(only)
        unknown = names - self.stashable_names - self.poppable_names
        if unknown:
            raise SkipError(
                f"{type(self).__name__} neither stashes nor pops {sorted(unknown)}; "
                f"it declares stash={sorted(self.stashable_names)} pop={sorted(self.poppable_names)}"
            )
        for name in names:
            self.namespaces[name] = ns
        return self


def stash_keys(layer: nn.Module) -> tuple[SkipKey, ...]:
    """The skips ``layer`` stashes (none for plain modules)."""
    return layer.stash_keys() if isinstance(layer, Skippable) else ()


def pop_keys(layer: nn.Module) -> tuple[SkipKey, ...]:
    """The skips ``layer`` pops (none for plain modules)."""
    return layer.pop_keys() if isinstance(layer, Skippable) else ()


M = TypeVar("M", bound=type[nn.Module])


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[M], M]:
    """Class decorator: the module's ``forward`` may ``yield stash(name, v)`` and ``v = yield pop(name)``.

    Every declared name must be stashed (or popped) exactly once per call; stash ``None`` when a skip
    is conditional. Isolate repeated instances with ``layer.isolate(Namespace())``.
    """
    stashable = frozenset(stash)
    poppable = frozenset(pop)

    def decorate(cls: M) -> M:
        if not issubclass(cls, nn.Module):
            raise SkipError(f"@skippable decorates nn.Module subclasses, not {cls.__name__}")
        user_forward = cls.forward

        def forward(self: Skippable, *args: Any, **kwargs: Any) -> Any:
            result = user_forward(self, *args, **kwargs)
            if not isinstance(result, types.GeneratorType):
                if stashable or poppable:
                    raise SkipError(
                        f"{cls.__name__}.forward declares skips but is not a generator: "
                        "use `yield stash(name, value)` and `value = yield pop(name)`"
                    )
                return result
            return _drive(self, result)

        body = {
            "forward": forward,
            "stashable_names": stashable,
            "poppable_names": poppable,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
        }
        return type(cls.__name__, (Skippable, cls), body)  # type: ignore[return-value]

    return decorate


def _drive(layer: Skippable, gen: Generator[Any, Any, Any]) -> Any:
    tracker = current_tracker()
    stashed: set[str] = set()
    popped: set[str] = set()
    name = type(layer).__name__
    try:
        command = next(gen)
        while True:
            if isinstance(command, stash):
                if command.name not in layer.stashable_names:
                    raise SkipError(f"{name} stashes {command.name!r} but does not declare it in @skippable(stash=...)")
                if command.name in stashed:
                    raise SkipError(f"{name} stashes {command.name!r} twice in one call")
                stashed.add(command.name)
                tracker.stash(layer.namespaced(command.name), command.value)
                command = gen.send(None)
            elif isinstance(command, pop):
                if command.name not in layer.poppable_names:
                    raise SkipError(f"{name} pops {command.name!r} but does not declare it in @skippable(pop=...)")
                if command.name in popped:
                    raise SkipError(f"{name} pops {command.name!r} twice in one call")
                popped.add(command.name)
                command = gen.send(tracker.pop(layer.namespaced(command.name)))
            else:
                raise SkipError(f"{name}.forward yielded {command!r}; yield only stash(...) or pop(...)")
    except StopIteration as stop:
        output = stop.value
    missing = (layer.stashable_names - stashed) | (layer.poppable_names - popped)
    if missing:
        raise SkipError(
            f"{name} declared {sorted(missing)} but did not stash/pop them in this call; "
            "stash None for a skip that is absent"
        )
    return output
