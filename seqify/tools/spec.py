"""spec: the model a command-line SPEC names (torchvision:NAME, zoo:NAME, FILE.py:FACTORY, MODULE:FACTORY)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqify.errors import SpecError

__all__ = ["SpecError", "Model", "parse_args", "load", "sample_shape", "random_input", "SPEC_HELP"]

SPEC_HELP = """\
SPEC names a model:
  torchvision:NAME     a torchvision model without weights, e.g. torchvision:resnet101, torchvision:vit_b_16
  zoo:NAME             a seqify.zoo model, e.g. zoo:unet, zoo:amoebanet_d, zoo:resnet50, zoo:llama
                       (--arg preset='0.89b'; list: seqify zoo)
  FILE.py:FACTORY      a function (or class) in a Python file that returns an nn.Module, e.g. nets.py:build
  MODULE:FACTORY       the same from an importable module, e.g. mypackage.models:make_net
  transformers:CLASS   a Hugging Face transformers model from its config (no download), e.g.
                       transformers:LlamaForCausalLM --arg num_hidden_layers=2 --arg hidden_size=64
Keyword arguments for the builder go in --arg KEY=VALUE (Python literals: --arg num_classes=10)."""


@dataclass
class Model:
    """What a SPEC built: the module, a description, and the input shape it expects by default."""

    module: nn.Module
    spec: str
    channels: int = 3
    size: int = 224
    sample_kwargs: dict[str, Any] | None = None
    vocab: int | None = None  # token-id input (batch x sequence of ids below vocab) instead of an image
    example: bool = False  # converted on the sample input (the export frontend needs one), as with --example


def parse_args(items: Sequence[str] | None) -> dict[str, Any]:
    """``['depth=5', 'name=x']`` -> ``{'depth': 5, 'name': 'x'}`` (values are Python literals, else strings)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise SpecError(f"--arg {item!r}: write KEY=VALUE, e.g. --arg num_classes=10")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _fail(spec: str, why: str) -> SpecError:
    return SpecError(f"cannot use SPEC {spec!r}: {why}\n{SPEC_HELP}")


def _torchvision(spec: str, name: str, kwargs: dict[str, Any]) -> Model:
    import torchvision
    from torchvision import models

    known = models.list_models()
    if name not in known:
        import difflib

        close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
        raise _fail(spec, f"torchvision {torchvision.__version__} has no model {name!r}"
                    + (f" (did you mean {', '.join(close)}?)" if close else ""))
    segmentation = name in models.list_models(module=models.segmentation)
    detection = name in models.list_models(module=models.detection)
    if segmentation or detection:
        kwargs.setdefault("weights_backbone", None)  # never download behind the user's back
    kwargs.setdefault("weights", None)
    try:
        module = models.get_model(name, **kwargs)
    except TypeError as e:
        raise _fail(spec, f"torchvision's {name} builder refused the arguments: {e}") from e
    size = 520 if segmentation else 224
    if "image_size" in kwargs:
        size = int(kwargs["image_size"])
    return Model(module, spec, 3, size)


def _zoo(spec: str, name: str, kwargs: dict[str, Any]) -> Model:
    from seqify import zoo

    try:
        entry = zoo.entry(name)
    except zoo.ZooError as e:
        raise _fail(spec, str(e)) from None
    try:
        module = zoo.build(name, **kwargs)
    except TypeError as e:
        raise _fail(spec, f"the zoo's {name} builder refused the arguments: {e}") from e
    if entry.vocab is not None:  # a language model: token ids of the entry's sequence length
        return Model(module, spec, size=entry.size, vocab=entry.vocab(**kwargs), example=True)
    size = int(kwargs.get("image_size", entry.size))
    return Model(module, spec, int(kwargs.get("in_channels", entry.in_channels)), size)


def _factory(spec: str, where: str, attr: str) -> Any:
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise _fail(spec, f"file {where!r} does not exist")
        name = f"seqify_spec_{abs(hash(path))}"
        loader = importlib.util.spec_from_file_location(name, path)
        if loader is None or loader.loader is None:
            raise _fail(spec, f"cannot import {where!r} as Python")
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        sys.path.insert(0, os.path.dirname(path))  # its own imports of neighbouring files
        try:
            loader.loader.exec_module(module)
        except Exception as e:
            raise _fail(spec, f"importing {where!r} failed: {type(e).__name__}: {e}") from e
        finally:
            sys.path.remove(os.path.dirname(path))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise _fail(spec, f"cannot import module {where!r} ({e})") from e
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise _fail(spec, f"{where!r} defines no {attr!r}; callables there: {', '.join(public[:12]) or 'none'}")
    return fn


def _transformers(spec: str, name: str, kwargs: dict[str, Any]) -> Model:
    """A transformers model class built from its own config class with ``kwargs`` (random weights)."""
    try:
        import transformers
    except ImportError:
        raise _fail(spec, "transformers is not installed: pip install 'seqify[hf]'") from None
    cls = getattr(transformers, name, None)
    config_class = getattr(cls, "config_class", None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module) or config_class is None:
        raise _fail(spec, f"transformers has no model class {name!r} "
                          "(e.g. LlamaForCausalLM, BertModel, GPT2LMHeadModel)")
    kwargs.setdefault("use_cache", False)
    try:
        config = config_class(**kwargs)
        module = cls(config)
    except Exception as e:
        built = f"{name}({config_class.__name__}(**{kwargs}))"
        raise _fail(spec, f"building {built} failed: {type(e).__name__}: {e}") from e
    vocab = getattr(config, "vocab_size", None) if getattr(config, "image_size", None) is None else None
    size = 16 if vocab else int(getattr(config, "image_size", 224))
    return Model(module, spec, channels=int(getattr(config, "num_channels", 3)), size=size, vocab=vocab)


def load(spec: str, kwargs: dict[str, Any] | None = None) -> Model:
    """Build the model ``spec`` names, passing ``kwargs`` to its builder. Raises :class:`SpecError`
    (a SeqifyError) that says what a SPEC looks like when it names nothing."""
    kwargs = dict(kwargs or {})
    kind, colon, rest = spec.partition(":")
    if not colon or not kind or not rest:
        raise _fail(spec, "expected SOURCE:NAME")
    if kind == "torchvision":
        return _torchvision(spec, rest, kwargs)
    if kind == "zoo":
        return _zoo(spec, rest, kwargs)
    if kind == "transformers":
        return _transformers(spec, rest, kwargs)
    where, attr = spec.rsplit(":", 1)  # FILE.py:FACTORY (a Windows drive letter stays in the path)
    fn = _factory(spec, where, attr)
    try:
        module = fn(**kwargs)
    except TypeError as e:
        raise _fail(spec, f"calling {attr}(**{kwargs}) failed: {e}") from e
    if not isinstance(module, nn.Module):
        raise _fail(spec, f"{attr}() returned a {type(module).__name__}, not an nn.Module")
    return Model(module, spec)


def sample_shape(model: Model, batch: int, size: int | None, shape: str | None) -> tuple[int, ...]:
    """``--shape 2x3x64x64`` if given, else ``batch x channels x size x size``."""
    if shape:
        try:
            dims = tuple(int(d) for d in shape.lower().replace(",", "x").split("x"))
        except ValueError:
            raise SpecError(f"--shape {shape!r}: write the input's dimensions like 1x3x224x224") from None
        if not dims or any(d < 1 for d in dims):
            raise SpecError(f"--shape {shape!r}: every dimension must be at least 1")
        return dims
    side = size or model.size
    if model.vocab:
        return (batch, side)  # token ids: batch x sequence length (--size sets the length)
    return (batch, model.channels, side, side)


def random_input(shape: tuple[int, ...], seed: int = 0, vocab: int | None = None) -> torch.Tensor:
    """Random normal values, or random token ids below ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    if vocab:
        return torch.randint(0, vocab, shape, generator=g)
    return torch.randn(shape, generator=g)
