"""Namespace: isolates the skip names of repeated layers."""

from __future__ import annotations

import uuid

__all__ = ["Namespace", "SkipKey"]


class Namespace:
    """A scope for skip names, so that repeated layers can stash and pop the same name.

    Two namespaces never compare equal unless one is a pickled or deep-copied image of the other.
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace {self.id.hex[:8]}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and self.id == other.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __lt__(self, other: Namespace) -> bool:
        return self.id < other.id

    def __getstate__(self) -> uuid.UUID:
        return self.id

    def __setstate__(self, state: uuid.UUID) -> None:
        self.id = state

    def __copy__(self) -> Namespace:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Namespace:
        return self


#: The namespace of skip names in layers that were never isolated.
DEFAULT = Namespace()

#: A skip is identified by its namespace and its name.
SkipKey = tuple[Namespace, str]
