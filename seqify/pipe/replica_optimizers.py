"""One optimizer per data-parallel replica, stepped together as one: each replica updates its own copy."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from seqify.errors import OptionError

__all__ = ["OptimizerFactory", "ReplicaOptimizers", "built_on"]

#: What ``pipe.optimizer`` takes: a function (or an optimizer class) that builds an optimizer on the parameters it
#: is given, ``lambda params: torch.optim.AdamW(params, lr=3e-4)``.
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_HOW = ("give pipe.optimizer a function that builds the optimizer on the parameters it is given, "
        "lambda params: torch.optim.AdamW(params, lr=3e-4), or the optimizer's class")


class Replicas(Protocol):
    """What steps the replicas' optimizers: a :class:`~seqify.ReplicatedPipeline`."""

    def _step_optimizers(self, optimizers: Sequence[torch.optim.Optimizer]) -> None: ...

    def _forget_gradients(self) -> None: ...


def built_on(factory: OptimizerFactory, params: Sequence[nn.Parameter], where: str) -> torch.optim.Optimizer:
    """``factory(params)``, checked to be an optimizer over exactly ``params``, in their order (``where``: whose
    parameters, for the error)."""
    if isinstance(factory, torch.optim.Optimizer) or not callable(factory):
        raise OptionError(f"pipe.optimizer got {type(factory).__name__}, not a function that builds an optimizer: "
                          f"{_HOW}")
    built = factory(iter(params))
    if not isinstance(built, torch.optim.Optimizer):
        raise OptionError(f"pipe.optimizer's factory built a {type(built).__name__}, not a torch.optim.Optimizer: "
                          f"{_HOW}")
    mine = {id(p) for p in params}
    stepped = [p for group in built.param_groups for p in group["params"]]
    if any(id(p) not in mine for p in stepped):
        raise OptionError(f"pipe.optimizer's factory built an optimizer over parameters it was not given ({where}): "
                          "build it on the parameters the function receives, not on the model's or a list kept "
                          "elsewhere")
    return built


class ReplicaOptimizers(torch.optim.Optimizer):
    """The optimizer of a replicated pipeline whose replicas each step their own copy of the model, as DDP's
    processes do: one optimizer per replica, built by the same factory on that replica's parameters.

    It is an optimizer like the one it stands for: ``param_groups``, ``state``, ``state_dict()`` and ``defaults``
    are the first replica's (the model's; the others equal them), so schedulers, checkpoints and clipping see one
    model. ``load_state_dict`` loads every replica's, and the groups' settings (a scheduler's learning rate) reach
    every replica's before each step. :meth:`step` steps each replica on its own devices, with every replica's
    ``.grad`` holding the whole batch's gradients: the step's all-reduce leaves them so, and where anything
    changed the first replica's gradients since (clipping, a gradient scaler unscaling them, a backward outside
    ``pipe.step``), they are copied from the first before the step. A step that fails on some replica (out of
    memory on one GPU) leaves the replicas apart; before the next, every replica takes the first's parameters
    and optimizer state again."""

    def __init__(self, pipe: Replicas, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers: list[torch.optim.Optimizer] = []
        # torch's own setup (hooks, the step's profiling range); its placeholder groups are not kept
        super().__init__([torch.empty(0)], {})
        self._pipe = pipe
        self._optimizers = list(optimizers)
        self._apart = False  # a step failed on some replica: the others take the first's state before the next
        _check_alike(self._optimizers)

    # the model's optimizer stands for all of them
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every replica's optimizer, the first replica's first."""
        return list(self._optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizers[0].param_groups if self._optimizers else self.__dict__["_groups"]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if self._optimizers:
            raise OptionError("set the values inside the optimizer's param_groups (group['lr'] = ...), not the list "
                              "itself: every replica's optimizer follows the first's groups")
        self.__dict__["_groups"] = groups

    @property
    def state(self) -> Any:
        return self._optimizers[0].state if self._optimizers else self.__dict__["_state"]

    @state.setter
    def state(self, state: Any) -> None:
        self.__dict__["_state"] = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self._optimizers[0].defaults if self._optimizers else self.__dict__["_defaults"]

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.__dict__["_defaults"] = defaults

    def __repr__(self) -> str:
        return f"ReplicaOptimizers({len(self._optimizers)} x {self._optimizers[0]!r})"

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._optimizers:  # torch's setup adding its placeholder
            super().add_param_group(param_group)
            return
        raise OptionError("a replicated pipeline's optimizer steps the parameters its factory was given: build "
                          "every group in the factory (lambda params: ...) instead of add_param_group")

    def state_dict(self) -> dict[str, Any]:
        """The first replica's optimizer's state (the others hold the same)."""
        return self._optimizers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` into every replica's optimizer, each with tensors of its own."""
        self._optimizers[0].load_state_dict(state_dict)
        self._realign()

    def _realign(self) -> None:
        """Every other replica's optimizer takes the first's state, with tensors of its own."""
        state_dict = self._optimizers[0].state_dict()
        for opt in self._optimizers[1:]:
            opt.load_state_dict(_own_copy(state_dict, opt))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=set_to_none)
        self._pipe._forget_gradients()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Step every replica's optimizer on its own devices, with the first's groups' settings."""
        if closure is not None:
            raise OptionError("a replicated pipeline's optimizer takes no closure (it would run the model again on "
                              "one replica): compute the loss with pipe.step(...) and call opt.step()")
        first = self._optimizers[0]
        if self._apart:
            self._realign()
        for opt in self._optimizers[1:]:
            _follow(first.param_groups, opt.param_groups)
        try:
            self._pipe._step_optimizers(self._optimizers)
        except BaseException:
            self._apart = True
            raise
        self._apart = False


def _check_alike(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Refuse replicas' optimizers that differ in kind or groups: the factory must build the same for each."""
    first = optimizers[0]
    shape = [len(g["params"]) for g in first.param_groups]
    for r, opt in enumerate(optimizers[1:], 1):
        if type(opt) is not type(first) or [len(g["params"]) for g in opt.param_groups] != shape:
            raise OptionError(f"pipe.optimizer's factory built a {type(opt).__name__} with groups of "
                              f"{[len(g['params']) for g in opt.param_groups]} parameters for replica {r}, and a "
                              f"{type(first).__name__} with {shape} for the first: it must build the same optimizer "
                              "on whichever replica's parameters it is given")


def _follow(groups: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    """Give ``theirs`` every setting of ``groups`` (all but the parameters), tensors copied in place."""
    for group, other in zip(groups, theirs):
        for key, value in group.items():
            if key == "params":
                continue
            mine = other.get(key)
            if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) and mine.shape == value.shape:
                mine.copy_(value)
            else:
                other[key] = value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _own_copy(state_dict: dict[str, Any], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``state_dict`` with every state tensor that loading into ``opt`` would keep as it is (one on a parameter's
    device, a step count on the CPU) cloned, so no two replicas' optimizers share one."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state = {}
    for k, values in state_dict["state"].items():
        device = params[k].device if isinstance(k, int) and k < len(params) else None
        state[k] = {name: v.clone() if isinstance(v, torch.Tensor) and (v.device == device or v.device.type == "cpu")
                    else v for name, v in values.items()}
    return {**state_dict, "state": state}
