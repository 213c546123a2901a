"""Skip connections between non-adjacent layers: stash, pop, Namespace, tracker and layout."""

from .layout import SkipRoute, routes, verify
from .namespace import Namespace, SkipKey
from .skippable import Skippable, pop, pop_keys, skippable, stash, stash_keys
from .tracker import SkipTracker, current_tracker, use_tracker

__all__ = [
    "Namespace",
    "SkipKey",
    "SkipRoute",
    "SkipTracker",
    "Skippable",
    "current_tracker",
    "pop",
    "pop_keys",
    "routes",
    "skippable",
    "stash",
    "stash_keys",
    "use_tracker",
    "verify",
]
