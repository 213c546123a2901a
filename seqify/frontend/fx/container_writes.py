"""Writes into Python containers a traced forward reads later (torchvision's ``result[i]["boxes"] = boxes``):
made into a node that returns the written container, so every later read depends on the write."""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
import torch.utils._pytree as pytree

from seqify.frontend.traced import UNKNOWN, value_of

__all__ = ["assigned", "order_container_writes"]


def assigned(root: Any, path: tuple[Any, ...], key: Any, value: Any) -> Any:
    """``root[path...][key] = value``, then ``root`` itself (the same object, written in place)."""
    target = root
    for index in path:
        target = target[index]
    target[key] = value
    return root


def _is_container(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(value_of(node), (dict, list))


def _root(node: fx.Node) -> tuple[fx.Node, tuple[Any, ...]]:
    """The outermost container ``node`` was picked out of by constant indices, and the indices."""
    path: list[Any] = []
    while (node.op == "call_function" and node.target is operator.getitem and _is_container(node.args[0])
           and not isinstance(node.args[1], fx.Node)):
        path.append(node.args[1])
        node = node.args[0]  # type: ignore[assignment]  # checked by _is_container
    return node, tuple(reversed(path))


def _written(value: Any, path: tuple[Any, ...], key: Any, new: Any) -> Any:
    """A copy of example value ``value`` (its containers copied, its leaves shared) with the write made."""
    copy = pytree.tree_map(lambda x: x, value)
    assigned(copy, path, key, new)
    return copy


def order_container_writes(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Replace each ``operator.setitem`` on a Python dict or list by ``assigned`` on the outermost container's
    latest version, and make every later read of any version read the write instead; returns each written
    container's last write (what the output reads in its place)."""
    versions: dict[fx.Node, list[fx.Node]] = {}  # an outermost container's writes, in order
    origin: dict[fx.Node, fx.Node] = {}  # a write: the container it writes
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is operator.setitem and _is_container(node.args[0])):
            continue
        receiver, key, value = node.args
        root, path = _root(receiver)
        original = origin.get(root, root)
        written = versions.setdefault(original, [])
        current = written[-1] if written else original
        with graph.inserting_after(node):
            write = graph.call_function(assigned, (current, path, key, value))
        write.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        new = value_of(value) if isinstance(value, fx.Node) else value
        if value_of(current) is not UNKNOWN and new is not UNKNOWN:
            write.meta["val"] = _written(value_of(current), path, key, new)
        at = order[node]
        for old in (original, *written):
            for user in list(old.users):
                if user is not write and order.get(user, len(order)) > at:
                    user.replace_input_with(old, write)
        graph.erase_node(node)
        order[write] = at
        origin[write] = original
        written.append(write)
    return {original: written[-1] for original, written in versions.items()}
