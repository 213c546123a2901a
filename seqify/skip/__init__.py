"""Skip connections between non-adjacent layers: stash, pop, Namespace, tracker and layout."""

from seqify.skip.layout import SkipRoute, routes, verify
from seqify.skip.namespace import Namespace, SkipKey
from seqify.skip.skippable import Skippable, pop, pop_keys, skippable, stash, stash_keys
from seqify.skip.tracker import SkipTracker, current_tracker, use_tracker

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
