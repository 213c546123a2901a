"""An optimizer's state keyed by source parameter names, so that it loads into another partitioning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from seqify.errors import CheckpointError, StateDictError

__all__ = ["NamedState", "named_state", "check_named_state", "load_named_state"]


@dataclass
class NamedState:
    """``optimizer.state_dict()`` with parameter numbers replaced by source keys: the tensors per (key, state
    name), the other per-parameter values, and the groups with their keys."""

    tensors: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    plain: dict[str, dict[str, Any]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _keys(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[str]:
    """The source key of each parameter the optimizer holds, in its order; one it cannot name is refused."""
    params = _params(optimizer)
    stray = [i for i, p in enumerate(params) if id(p) not in names]
    if stray:
        raise CheckpointError(
            f"the optimizer holds {len(stray)} parameter(s) that are not the model's (first: parameter number "
            f"{stray[0]}, shape {tuple(params[stray[0]].shape)}): build it over the pipeline's own parameters, "
            "torch.optim.SGD(pipe.parameters(), ...)"
        )
    keys = [names[id(p)] for p in params]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise CheckpointError(f"the optimizer holds the parameter(s) {twice[:4]} more than once: list each once")
    return keys


def named_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> NamedState:
    """The optimizer's state under source keys (``names``: ``id(parameter)`` -> key)."""
    keys = _keys(optimizer, names)
    saved = optimizer.state_dict()
    named = NamedState(groups=[dict(g, params=[keys[i] for i in g["params"]]) for g in saved["param_groups"]])
    for i, values in saved["state"].items():
        for name, v in values.items():
            if isinstance(v, torch.Tensor):
                named.tensors[keys[i], name] = v
            else:
                named.plain.setdefault(keys[i], {})[name] = v
    return named


def load_named_state(optimizer: torch.optim.Optimizer, named: NamedState, names: dict[int, str], where: str) -> None:
    """Load state saved by :func:`named_state` into ``optimizer``, whatever the order of its parameters."""
    keys = _keys(optimizer, names)
    check_named_state(optimizer, named, names, where)
    state: dict[int, dict[str, Any]] = {}
    number = {k: i for i, k in enumerate(keys)}
    for k, values in named.plain.items():
        state.setdefault(number[k], {}).update(values)
    for (k, name), t in named.tensors.items():
        state.setdefault(number[k], {})[name] = t
    groups, start = [], 0
    for g, saved in zip(optimizer.param_groups, named.groups):
        groups.append(dict(saved, params=list(range(start, start + len(g["params"])))))
        start += len(g["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def check_named_state(optimizer: torch.optim.Optimizer, named: NamedState, names: dict[int, str], where: str) -> None:
    """Each of the optimizer's parameter groups must hold the keys of the saved group in its place."""
    _keys(optimizer, names)
    if len(named.groups) != len(optimizer.param_groups):
        raise StateDictError(
            f"{where} holds an optimizer with {len(named.groups)} parameter group(s) and this one has "
            f"{len(optimizer.param_groups)}: build the optimizer with the same groups as when saving"
        )
    for j, (g, saved) in enumerate(zip(optimizer.param_groups, named.groups)):
        mine = {names[id(p)] for p in g["params"]}
        theirs = set(saved["params"])
        if mine != theirs:
            raise StateDictError(
                f"{where}: parameter group {j} of the saved optimizer holds other parameters than this one's "
                f"(saved, absent here: {sorted(theirs - mine)[:4]}; here, not saved: {sorted(mine - theirs)[:4]}): "
                "build the optimizer over the same parameters and groups as when saving "
                "(pipe.parameters() of a pipeline of the same model, any balance)"
            )
    known = {k for g in named.groups for k in g["params"]}
    odd = sorted(({k for k, _ in named.tensors} | set(named.plain)) - known)
    if odd:
        raise CheckpointError(f"{where}: the optimizer state names parameters no group holds: {odd[:4]}")
