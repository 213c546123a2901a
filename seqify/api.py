"""The public entry point that builds on every layer: seqify.pipeline converts, tunes and builds a pipeline."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.convert import convert
from seqify.errors import BalanceError, EmptyModelError, TuneError, UntraceableError
from seqify.pipe.assemble import build, capped, from_config
from seqify.pipe.config import PipeConfig
from seqify.pipe.executors.options import ReplayOptions
from seqify.pipe.memory import parse_bytes
from seqify.pipe.pipeline import Pipeline, resolve_devices
from seqify.pipe.placement import _check_meta
from seqify.pipe.replicated import ReplicatedPipeline, replicated
from seqify.schedule.actions import Schedule
from seqify.tuning import tune
from seqify.tuning.memory_bounds import OptimizerSpec

__all__ = ["pipeline"]


def pipeline(
    model: nn.Module,
    *,
    gpus: int | None = None,
    devices: Sequence[Any] | None = None,
    chunks: int | str | None = None,
    balance: Sequence[int] | str | None = None,
    checkpoint: str = "except_last",
    deferred_batch_norm: bool = False,
    graphs: bool = False,
    loops: int = 1,
    example_inputs: Any = None,
    sample: Any = None,
    schedule: str | Schedule | None = None,
    memory_cap: int | float | str | None = None,
    config: PipeConfig | str | os.PathLike[str] | None = None,
    overlap: bool | None = None,
    replay_options: ReplayOptions | None = None,
    replicas: int | None = None,
    optimizer: OptimizerSpec = None,
    **convert_options: Any,
) -> Pipeline | ReplicatedPipeline:
    """Run ``model`` as a GPipe pipeline over GPUs (or CPU devices).

    Args:
        model: a seqify.Sequential, any nn.Sequential (hand-written skippable layers included), or any
            other module, which is converted first (``example_inputs`` and ``convert_options`` are passed
            to :func:`seqify.convert`).
        gpus / devices: ``gpus=N`` takes cuda:0..N-1; ``devices=[...]`` names one device per partition
            (CUDA or CPU; repeat a device to put several partitions on it). Default: every GPU, else
            one CPU device per partition of a ``balance`` list.
        chunks: micro-batches per mini-batch. A batch that does not divide evenly gets micro-batches
            whose sizes differ by one; more chunks than samples are clamped to the batch size.
            ``'auto'`` runs :func:`seqify.tune` on ``sample`` (or ``example_inputs``) and builds what it
            picks: chunks, loops, balance, checkpointing, graphs and schedule (a ``balance``, a
            ``schedule``, or a non-default ``checkpoint``, ``graphs`` or ``loops``, stays fixed);
            ``pipe.config`` reports the choice.
            Not given: ``'auto'`` when ``gpus`` or ``devices`` and a sample are given and ``balance`` is
            not, else 1.
        balance: layers per partition, or a strategy: 'time', 'memory', 'flops' or 'params' (see
            :func:`seqify.balance`). Default 'params'.
        checkpoint: 'except_last' (default), 'always' or 'never': which micro-batches recompute their
            activations in backward instead of keeping them. Only while gradients are enabled.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch, from all of its
            micro-batches, as training on one device would.
        graphs: on CUDA, capture each stage's forward and backward per micro-batch as CUDA graphs on the
            first training step of a given input shape, then replay them: no per-op launch overhead.
            Needs checkpoint='never'; inference and eval mode run eagerly. The whole step is then driven
            as fixed programs (no autograd per micro-batch); gradients reach ``.grad`` (not
            ``torch.autograd.grad``), and each forward's backward must come before the next forward.
        loops: partitions per device, placed round-robin: ``gpus=2, loops=2`` puts four partitions on
            cuda:0, cuda:1, cuda:0, cuda:1. With ``graphs=True`` each device runs all micro-batches of its
            first partition, then of its second (breadth-first), which shrinks the pipeline's idle time
            from one of ``chunks + 1`` slots to one of ``loops * chunks + 1``, at the cost of more
            transfers. A ``balance`` list then has ``loops`` entries per device.
        sample: an input batch (or micro-batch) for the 'time', 'memory' and 'flops' strategies;
            defaults to ``example_inputs``. With ``chunks='auto'``, the training mini-batch to tune for.
        schedule: the order of forward and backward work in :meth:`Pipeline.step`: 'gpipe'
            (fill-drain), '1f1b', 'interleaved' (several partitions per device: ``loops > 1``), 'zb-h1'
            (zero bubble: backward split into input and weight gradients; with ``loops=2`` the partitions
            are placed in a V: cuda:0, cuda:1, cuda:1, cuda:0), or a
            :class:`~seqify.schedule.actions.Schedule`. ``pipe(x)`` followed by ``loss.backward()``
            always runs fill-drain. Default: 'gpipe', or with ``chunks='auto'`` the tuner's choice.
        memory_cap: bytes (or a size such as '40GiB') every device may use: the pipeline switches to the
            fastest schedule and checkpointing whose predicted peak (parameters + gradients + the
            activations the schedule keeps in flight, measured on ``sample`` or ``example_inputs``)
            fits, or raises :class:`~seqify.MemoryCapError` naming the smallest cap that works.
            ``pipe.plan_memory(sample)`` gives the prediction per device.
        config: a :class:`PipeConfig` (``seqify.tune(...)``, ``pipe.config``, or written by hand) or the path
            of a TOML or JSON file holding one (``cfg.to_file(path)``, or a run file's ``[pipeline]`` table):
            its options replace these keywords. One that fixes chunks, balance and devices (as the tuner's
            do) builds exactly that pipeline; ``gpus``/``devices``, ``schedule``, ``overlap`` and
            ``memory_cap``, when given, override it.
        overlap: with ``graphs=True``, :meth:`Pipeline.step` replays each GPU's forwards on one CUDA stream
            and its backwards on another, issuing each forward before the backwards it would follow, so
            one micro-batch's forward runs beside another's backward. It pays where one micro-batch's
            kernels do not fill a GPU (many chunks, small layers) and costs memory: one more
            micro-batch's activations per GPU (``plan_memory`` counts it) and backward memory kept apart
            from forward memory. Partitions that draw random numbers (dropout) keep one stream.
            Default: off, except with ``chunks='auto'``, where the tuner times its best candidate both
            ways and keeps the faster, and with ``config``, which says (``True`` or ``False`` fixes it).
        replay_options: how graphs (and their eager replay) are built: a
            :class:`~seqify.pipe.executors.options.ReplayOptions` (``share_buffers``, ``cast_once``; both on by
            default), for measuring what each buys. Applies to pipelines built by hand (a fixed ``chunks``).
        optimizer: with ``chunks='auto'``, the optimizer training will use (its class, a function that builds
            it from parameters, or its state bytes per parameter byte): the tuner counts its state in each
            candidate's memory (see :func:`seqify.tune`), so Adam's moments do not push the chosen pipeline
            out of memory at the first ``opt.step()``. Build the optimizer itself on ``pipe.parameters()``.

    Note: the pipeline moves the model's layers to their devices. Converted layers share modules with
    the source model, so its parameters move too; pipeline a ``copy.deepcopy`` to keep the source.
    """
    if not isinstance(model, nn.Sequential):
        model = _converted(model, example_inputs, sample, convert_options)
    elif convert_options:
        raise BalanceError(f"options {sorted(convert_options)} apply to conversion, but the model is already a "
                           "Sequential")
    layers = len(model)
    if layers == 0:
        raise EmptyModelError(f"the {type(model).__name__} has no layers; there is nothing to pipeline")
    _check_meta([model])
    probe = sample if sample is not None else example_inputs
    if config is not None:
        cfg = config if isinstance(config, PipeConfig) else PipeConfig.load(config)
        if cfg.fixed and cfg.replicas > 1:
            return _replicated_config(model, cfg, gpus, devices, deferred_batch_norm, schedule, overlap, probe)
        if cfg.fixed:
            return capped(from_config(model, cfg, gpus, devices, deferred_batch_norm, schedule, overlap), memory_cap,
                          probe)
        given = dict(gpus=gpus, devices=devices, schedule=schedule, overlap=overlap, memory_cap=memory_cap,
                     deferred_batch_norm=deferred_batch_norm, replicas=replicas, optimizer=optimizer)
        pipe = pipeline(model, example_inputs=example_inputs, sample=sample, replay_options=replay_options,
                        **_options(cfg, given))
        pipe.config = pipe.config or cfg
        return pipe
    fixed_schedule = schedule
    schedule = "gpipe" if schedule is None else schedule
    if chunks is None:
        auto = (gpus is not None or devices is not None) and balance is None and probe is not None
        chunks = "auto" if auto else 1
    if chunks == "auto":
        cfg = tune(model, probe, gpus=gpus, devices=devices, balance=balance,
                   checkpoint=None if checkpoint == "except_last" else checkpoint, graphs=True if graphs else None,
                   overlap=overlap,
                   loops=None if loops == 1 else loops,
                   schedule=fixed_schedule if isinstance(fixed_schedule, str) else None,
                   memory_cap=None if memory_cap is None else float(parse_bytes(memory_cap)), replicas=replicas,
                   optimizer=optimizer)
        if cfg.replicas > 1:
            return _replicated_config(model, cfg, None, None, deferred_batch_norm,
                                      fixed_schedule if isinstance(fixed_schedule, Schedule) else None, None, probe)
        return from_config(model, cfg, None, None, deferred_batch_norm,
                            fixed_schedule if isinstance(fixed_schedule, Schedule) else None)
    options = dict(gpus=gpus, devices=devices, chunks=chunks, balance=balance, checkpoint=checkpoint,
                   deferred_batch_norm=deferred_batch_norm, graphs=graphs, loops=loops, sample=probe,
                   schedule=schedule, memory_cap=memory_cap, overlap=overlap, replay_options=replay_options)
    if replicas is not None and replicas != 1:
        return replicated(model, replicas, **options)
    return build(model, **options)


def _replicated_config(model: nn.Sequential, cfg: PipeConfig, gpus: int | None, devices: Sequence[Any] | None,
                       deferred_batch_norm: bool, schedule: str | Schedule | None, overlap: bool | None,
                       sample: Any) -> ReplicatedPipeline:
    """The replicated pipeline a fixed configuration with ``replicas > 1`` describes (on ``gpus`` or ``devices``
    when given: as many as it names)."""
    placed = list(cfg.devices)
    if gpus is not None or devices is not None:
        mine = resolve_devices(gpus, devices, None)
        if len(mine) != len(placed):
            raise TuneError(f"the configuration is for {len(placed)} devices ({', '.join(placed)}) but {len(mine)} "
                            f"were given; give {len(placed)}, or tune for these")
        placed = [str(d) for d in mine]
    if sum(cfg.balance) != len(model):
        raise TuneError(f"the configuration's balance {list(cfg.balance)} covers {sum(cfg.balance)} layers but this "
                        f"model has {len(model)}; it was tuned for another model: tune this one")
    pipe = replicated(model, cfg.replicas, devices=placed, chunks=int(cfg.chunks), balance=list(cfg.balance),
                      checkpoint=cfg.checkpoint, deferred_batch_norm=deferred_batch_norm or cfg.deferred_batch_norm,
                      graphs=cfg.graphs, loops=cfg.loops, sample=sample,
                      schedule=schedule if schedule is not None else (cfg.schedule or "gpipe"),
                      overlap=cfg.overlap if overlap is None else overlap)
    pipe.config = cfg
    return pipe


def _options(cfg: PipeConfig, given: dict[str, Any]) -> dict[str, Any]:
    """``cfg``'s options with those given to ``seqify.pipeline`` beside it in their place (``gpus`` and
    ``devices`` replace both; ``deferred_batch_norm`` holds if either says it)."""
    options = {**cfg.options(), **{k: v for k, v in given.items() if v is not None}}
    if given["gpus"] is not None or given["devices"] is not None:
        options.update(gpus=given["gpus"], devices=given["devices"])
    options["deferred_batch_norm"] = cfg.deferred_batch_norm or given["deferred_batch_norm"]
    return options


def _converted(model: nn.Module, example_inputs: Any, sample: Any, options: dict[str, Any]) -> nn.Sequential:
    """``model`` converted for :func:`pipeline`: with ``example_inputs`` where given; else without, and where
    that cannot trace it (a forward fx cannot follow without values, a transformers model), with the first two
    samples of ``sample`` as example inputs (two: the batch stays dynamic)."""
    if example_inputs is not None or sample is None:
        return convert(model, example_inputs, **options)
    try:
        return convert(model, None, **options)
    except UntraceableError as e:
        first = pytree.tree_map(lambda t: t[:2] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, sample)
        logging.getLogger("seqify").info("converting %s with the first samples of sample= as example inputs: "
                                         "without them %s", type(model).__name__, str(e).splitlines()[0])
        return convert(model, first, **options)
