"""Replica layers: the other replicas' layers follow the first's modes, plain settings and trained parameters.

The first replica is the model a user holds (``pipe.model``): a layer put in eval mode there (a BatchNorm frozen
while the rest trains), a setting changed (a dropout's ``p``, a BatchNorm's ``momentum``) or a parameter frozen
must hold for the whole batch, so every other replica's copy of that layer takes it before the next step or
forward. The first's state is read once per step (a pass over its layers) and copied only when it changed.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from seqify.pipe.executors.layer_settings import named, values

__all__ = ["ReplicaLayers"]


class ReplicaLayers:
    """Every replica's layers and parameters, in the same order, and the first's state the others last took."""

    def __init__(self, models: Sequence[nn.Module]) -> None:
        self.layers = [list(m.modules()) for m in models]
        self.params = [list(m.parameters()) for m in models]
        self.settings = named(self.layers[0])
        self.position = {id(m): k for k, m in enumerate(self.layers[0])}
        self.state = self._state()  # the replicas are copies of the first when built

    def _state(self) -> tuple[object, ...]:
        first = self.layers[0]
        return (tuple(m.training for m in first), values(self.settings),
                tuple(p.requires_grad for p in self.params[0]))

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
            for source, names in self.settings:
                layer = layers[self.position[id(source)]]
                for name in names:
                    setattr(layer, name, getattr(source, name, None))
            for source_param, param in zip(self.params[0], params):
                param.requires_grad_(source_param.requires_grad)
