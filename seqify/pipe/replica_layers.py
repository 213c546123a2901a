"""Replica layers: the other replicas' layers follow the first's modes, plain settings and trained parameters.

The first replica is the model a user holds (``pipe.model``): a layer put in eval mode there (a BatchNorm frozen
while the rest trains), a setting changed (a dropout's ``p``, a BatchNorm's ``momentum``) or a parameter frozen
must hold for the whole batch, so every other replica's copy of that layer takes it before the next step or
forward. The first's state is read once per step (a pass over its layers) and copied only when it changed.
Hooks are not copied (a hook's Python may hold the first's layer): a hook only the first replica has sees its
share of the batch, and a warning says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from seqify.model.hooks import user_hooks
from seqify.pipe.executors.layer_settings import named
from seqify.pipe.executors.user_hooks import built_for, hooked

__all__ = ["ReplicaLayers"]


class ReplicaLayers:
    """Every replica's layers and parameters, in the same order, and the first's state the others last took."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.layers = [list(m.modules()) for m in models]
        self.params = [list(m.parameters()) for m in models]
        self.names = ([n or type(models[0]).__name__ for n, _ in models[0].named_modules()],
                      [n for n, _ in models[0].named_parameters()])
        self.settings = named(self.layers[0])
        at = {id(m): k for k, m in enumerate(self.layers[0])}
        self.slots = [(at[id(m)], names) for m, names in self.settings]  # (layer position, its settings' names)
        self.state = self._state()  # the replicas are copies of the first when built

    def _state(self) -> tuple[object, ...]:
        """The first's modes, settings, trainable parameters and hooks (what replayed programs are built for)."""
        return built_for(self.params[0], self.layers[0], self.settings)

    def follow(self) -> None:
        """Give every other replica's layers the first's modes, settings and ``requires_grad`` where they
        changed since the last time."""
        now = self._state()
        if now == self.state:
            return
        self.state = now
        for layers, params in zip(self.layers[1:], self.params[1:]):
            for source, layer in zip(self.layers[0], layers):
                layer.training = source.training
            for k, names in self.slots:
                for name in names:
                    setattr(layers[k], name, getattr(self.layers[0][k], name, None))
            for source_param, param in zip(self.params[0], params):
                param.requires_grad_(source_param.requires_grad)
        self._warn_unshared_hooks()

    def _warn_unshared_hooks(self) -> None:
        """Say so where a hook on the model (the first replica) has no counterpart on another replica's copy: it
        runs on the first replica's share of the batch only."""
        for k, (source, layer) in enumerate(zip(self.layers[0], self.layers[1])):
            if user_hooks(source) and not user_hooks(layer):
                _warn(f"layer {self.names[0][k]!r} of pipe.model has hooks")
                return
        for k, (source_param, param) in enumerate(zip(self.params[0], self.params[1])):
            if any(hooked(source_param)) and not any(hooked(param)):
                _warn(f"parameter {self.names[1][k]!r} of pipe.model has gradient hooks")
                return


def _warn(what: str) -> None:
    warnings.warn(f"{what} that only the first replica runs: the other replicas run copies of the model, so the "
                  "hook sees the first replica's share of each batch, not the whole batch. Register it on every "
                  "replica's copy as well (for r in pipe.replicas: r.model ...) where it must see every sample",
                  UserWarning, stacklevel=5)  # the caller of pipe.step or pipe(x)
