"""Config: a pipeline run described in a JSON or TOML file (model spec, devices, balance, chunks, ...)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

from seqify.errors import ConfigError

__all__ = ["Config", "pipeline_from_config"]


@dataclass(frozen=True)
class Config:
    """What ``seqify.pipeline`` needs, as a file can say it::

        model = "torchvision:resnet18"      # a SPEC, as on the command line (seqify --help)
        model_args = { num_classes = 10 }   # keyword arguments for its builder
        devices = ["cuda:0", "cuda:1"]      # or gpus = 2; neither: every GPU, else CPU per partition
        balance = [30, 32]                  # layers per partition; or by = "time" with sample_shape
        chunks = 4
        checkpoint = "except_last"
        loops = 1
        sample_shape = [8, 3, 224, 224]     # the input for by = "time" | "memory" | "flops"
    """

    model: str
    model_args: dict[str, Any] = field(default_factory=dict)
    gpus: int | None = None
    devices: list[str] | None = None
    balance: list[int] | None = None
    by: str | None = None
    chunks: int = 1
    checkpoint: str = "except_last"
    loops: int = 1
    deferred_batch_norm: bool = False
    sample_shape: list[int] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "the config") -> Config:
        """Check names and types; an unknown or ill-typed entry raises :class:`ConfigError` saying which."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown entries {unknown}; the entries are {sorted(known)}")
        if "model" not in data:
            raise ConfigError(f'{where}: no model; add model = "torchvision:resnet18" (or zoo:NAME, FILE.py:FACTORY)')
        checks: dict[str, Any] = {
            "model": str, "model_args": dict, "gpus": int, "devices": list, "balance": list, "by": str,
            "chunks": int, "checkpoint": str, "loops": int, "deferred_batch_norm": bool, "sample_shape": list,
        }
        for name, value in data.items():
            kind = checks[name]
            if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                raise ConfigError(f"{where}: {name} = {value!r} should be of type {kind.__name__}")
        if data.get("balance") is not None and data.get("by") is not None:
            raise ConfigError(f"{where}: give balance = [layer counts] or by = \"time\" (a strategy), not both")
        if data.get("by") in ("time", "memory", "flops") and not data.get("sample_shape"):
            raise ConfigError(f"{where}: by = {data['by']!r} measures the model on an input; "
                              "add sample_shape = [8, 3, 224, 224]")
        return cls(**data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Config:
        """Read a ``.json`` or ``.toml`` file."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            if path.endswith(".toml"):
                import tomllib

                with open(path, "rb") as f:
                    data = tomllib.load(f)
            elif path.endswith(".json"):
                with open(path) as f:
                    data = json.load(f)
            else:
                raise ConfigError(f"config file {path!r}: name it .json or .toml so seqify knows how to read it")
        except (ValueError, UnicodeDecodeError) as e:  # json and toml decode errors are ValueErrors
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config file {path!r} is not valid {path.rsplit('.', 1)[-1].upper()}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a table of entries, not a {type(data).__name__}")
        return cls.from_dict(data, where=path)

    def build(self) -> Any:
        """The model the spec names, converted and pipelined as described: a :class:`seqify.Pipeline`."""
        from seqify.api import pipeline
        from seqify.tools.spec import load as load_spec
        from seqify.tools.spec import random_input

        built = load_spec(self.model, self.model_args)
        sample = random_input(tuple(self.sample_shape)) if self.sample_shape else None
        balance: Any = self.balance if self.balance is not None else (self.by or None)
        return pipeline(
            built.module, gpus=self.gpus, devices=self.devices, chunks=self.chunks, balance=balance,
            checkpoint=self.checkpoint, deferred_batch_norm=self.deferred_batch_norm, loops=self.loops,
            example_inputs=sample, sample=sample,
        )


def pipeline_from_config(path: str | os.PathLike[str]) -> Any:
    """``seqify.Config.load(path).build()``: the pipeline a JSON or TOML run description names."""
    return Config.load(path).build()
