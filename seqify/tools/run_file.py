"""Config: a pipeline run in a TOML or JSON file: the model, its input, and a [pipeline] table that is a PipeConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from seqify.errors import ConfigError
from seqify.pipe.config import OPTIONS, PipeConfig
from seqify.pipe.files import read_table, refuse_unknown

__all__ = ["Config", "Input", "pipeline_from_config"]

#: The ``dtype`` names an input may give, per kind; the first is the default.
DTYPES: dict[str, dict[str, torch.dtype]] = {
    "float": {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
              "bfloat16": torch.bfloat16},
    "tokens": {"long": torch.long, "int64": torch.int64, "int32": torch.int32},
}


@dataclass(frozen=True)
class Input:
    """The sample a run measures and tunes on, as an ``[input]`` table says it::

        [input]
        kind = "tokens"        # token ids below vocab_size; or "float": random normal values (the default)
        shape = [8, 128]       # batch x length for tokens (or batch = 8 with length = 128)
        vocab_size = 32000     # default: the model's vocabulary (zoo and transformers models)
        dtype = "long"         # tokens: long (int64) or int32; float: float32, float64, float16, bfloat16
        seed = 0
    """

    shape: tuple[int, ...]
    kind: str = "float"
    vocab_size: int | None = None
    dtype: str | None = None
    seed: int = 0

    @classmethod
    def from_dict(cls, data: Any, where: str = "[input]") -> Input:
        """Check names, types and values; ``batch`` with ``length`` may stand for a token ``shape``."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a table such as {{ shape = [8, 3, 224, 224] }}, not {data!r}")
        refuse_unknown(data, [*(f.name for f in fields(cls)), "batch", "length"], where)
        data = dict(data)
        kind = data.get("kind", "float")
        if kind not in DTYPES:
            raise ConfigError(f'{where}: kind = {kind!r}: choose "float" (random values) or "tokens" (token ids)')
        shape = _shape(data, where)
        dtype = data.get("dtype")
        if dtype is not None and dtype not in DTYPES[kind]:
            raise ConfigError(f"{where}: dtype = {dtype!r} for {kind} inputs: choose one of {list(DTYPES[kind])}")
        for name in ("vocab_size", "seed"):
            value = data.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"{where}: {name} = {value!r}: give a whole number >= 0")
        if kind == "float" and data.get("vocab_size") is not None:
            raise ConfigError(f'{where}: vocab_size applies to token inputs: add kind = "tokens" or remove it')
        return cls(shape, kind, data.get("vocab_size"), dtype, data.get("seed", 0))

    def tensor(self, vocab: int | None = None) -> torch.Tensor:
        """The sample: token ids below ``vocab_size`` (else ``vocab``, the model's), or random normal values."""
        dtype = DTYPES[self.kind][self.dtype or next(iter(DTYPES[self.kind]))]
        g = torch.Generator().manual_seed(self.seed)
        if self.kind == "float":
            return torch.randn(self.shape, generator=g).to(dtype)
        size = self.vocab_size or vocab
        if not size:
            raise ConfigError("[input]: token inputs need vocab_size = N (the model does not say its vocabulary)")
        return torch.randint(0, size, self.shape, generator=g, dtype=dtype)


def _shape(data: dict[str, Any], where: str) -> tuple[int, ...]:
    """``shape``, or ``[batch, length]``: whole numbers >= 1."""
    if "shape" in data and ("batch" in data or "length" in data):
        raise ConfigError(f"{where}: give shape = [...] or batch and length, not both")
    shape = data.get("shape", [data.get("batch"), data.get("length")] if "length" in data else None)
    if shape is None:
        raise ConfigError(f"{where}: no shape; add shape = [8, 3, 224, 224] (or batch = 8 and length = 128 for "
                          'kind = "tokens")')
    if not isinstance(shape, list) or not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1
                                                       for d in shape):
        raise ConfigError(f"{where}: shape = {shape!r}: give the sizes as whole numbers >= 1, e.g. [8, 128] "
                          "(batch and length both, for batch = ... with length = ...)")
    return tuple(shape)


#: Run-file entries outside the [pipeline] table (its OPTIONS may sit at the top level too).
_ENTRIES = ("model", "model_args", "input", "pipeline", "sample_shape")


@dataclass(frozen=True)
class Config:
    """A pipeline run as a TOML or JSON file says it::

        model = "torchvision:resnet18"      # a SPEC, as on the command line (seqify --help)
        model_args = { num_classes = 10 }   # keyword arguments for its builder

        [input]                             # the sample (seqify.tools.run_file.Input): for balance by
        shape = [8, 3, 224, 224]            # time, memory or flops, chunks = "auto" and memory_cap

        [pipeline]                          # a seqify.PipeConfig: seqify.pipeline's options
        devices = ["cuda:0", "cuda:1"]      # or gpus = 2; neither: every GPU, else CPU per partition
        chunks = "auto"                     # or a number
        schedule = "1f1b"

    The ``[pipeline]`` table's entries may also be written at the top level (not both); ``sample_shape =
    [...]`` stands for an ``[input]`` of that shape. An unknown or wrong entry raises :class:`ConfigError`
    naming it.
    """

    model: str
    model_args: dict[str, Any] = field(default_factory=dict)
    input: Input | None = None
    pipeline: PipeConfig = field(default_factory=PipeConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "the config") -> Config:
        """Check names, types and values; an unknown or wrong entry raises :class:`ConfigError` saying which."""
        refuse_unknown(data, [*_ENTRIES, *OPTIONS], where)
        model, model_args = data.get("model"), data.get("model_args", {})
        if model is None:
            raise ConfigError(f'{where}: no model; add model = "torchvision:resnet18" (or zoo:NAME, FILE.py:FACTORY)')
        if not isinstance(model, str):
            raise ConfigError(f'{where}: model = {model!r} should be a SPEC string, e.g. "torchvision:resnet18"')
        if not isinstance(model_args, dict):
            raise ConfigError(f"{where}: model_args = {model_args!r} should be a table, e.g. {{ num_classes = 10 }}")
        pipeline = PipeConfig.from_dict(_pipeline_table(data, where), f"{where} [pipeline]")
        sample = _input_table(data, where)
        found = Input.from_dict(sample, f"{where} [input]") if sample is not None else None
        if found is None:
            _refuse_sampleless(pipeline, where)
        return cls(model, dict(model_args), found, pipeline)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Config:
        """Read a ``.json`` or ``.toml`` file."""
        path = os.fspath(path)
        if not path.endswith((".toml", ".json")):
            raise ConfigError(f"config file {path!r}: name it .json or .toml so seqify knows how to read it")
        return cls.from_dict(read_table(path, "config"), where=path)

    def build(self) -> Any:
        """The model the spec names, converted and pipelined as described: a :class:`seqify.Pipeline`."""
        return self.build_with_input()[0]

    def build_with_input(self) -> tuple[Any, torch.Tensor | None]:
        """:meth:`build`'s pipeline and the sample it was measured on (``None`` without an ``[input]``)."""
        from seqify.api import pipeline
        from seqify.tools.spec import load as load_spec

        built = load_spec(self.model, self.model_args)
        sample = self.input.tensor(built.vocab) if self.input is not None else None
        return pipeline(built.module, config=self.pipeline, example_inputs=sample, sample=sample), sample


def _pipeline_table(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``[pipeline]`` table with the options written at the top level merged in."""
    table = data.get("pipeline", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: pipeline = {table!r} should be a table: write [pipeline] above its entries")
    flat = {k: v for k, v in data.items() if k in OPTIONS}
    both = sorted(set(flat) & set(table))
    if both:
        raise ConfigError(f"{where}: {both} given at the top level and in [pipeline]: keep the [pipeline] ones")
    return {**flat, **table}


def _input_table(data: dict[str, Any], where: str) -> Any:
    """The ``[input]`` table, or one made of ``sample_shape``."""
    if "sample_shape" not in data:
        return data.get("input")
    if "input" in data:
        raise ConfigError(f"{where}: sample_shape and [input] both give the input: keep [input] (shape = [...])")
    return {"shape": data["sample_shape"]}


def _refuse_sampleless(cfg: PipeConfig, where: str) -> None:
    """A configuration that measures the model needs an input to measure it on."""
    needs = [why for why, needed in (
        (f"balance by {cfg.by!r}", not cfg.balance and cfg.by in ("time", "memory", "flops")),
        ('chunks = "auto"', cfg.chunks == "auto"),
        ("memory_cap", cfg.memory_cap is not None),
    ) if needed]
    if needs:
        raise ConfigError(f"{where}: {needs[0]} measures the model on an input; add an [input] table, e.g. "
                          "[input] shape = [8, 3, 224, 224]")


def pipeline_from_config(path: str | os.PathLike[str]) -> Any:
    """``seqify.Config.load(path).build()``: the pipeline a JSON or TOML run description names."""
    return Config.load(path).build()
