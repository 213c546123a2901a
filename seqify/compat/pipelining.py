"""torch.distributed.pipelining's way in (split points by module name, ScheduleGPipe/Schedule1F1B.step) on seqify."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.api import pipeline as make_pipeline
from seqify.errors import SplitPointError
from seqify.pipe.microbatch import scatter
from seqify.pipe.pipeline import Pipeline

__all__ = ["SplitPoint", "split_balance", "pipeline", "ScheduleGPipe", "Schedule1F1B"]


class SplitPoint(Enum):
    """Where a stage starts: before a module runs (``BEGINNING``) or after it (``END``); torch's
    ``torch.distributed.pipelining.SplitPoint`` is accepted too."""

    BEGINNING = 1
    END = 2


SplitSpec = Mapping[str, Any] | Iterable[str]


def _paths(model: nn.Sequential) -> list[tuple[str, ...]]:
    """Per layer, the source module paths it runs: recorded by conversion, else the layer's own name."""
    recorded = getattr(model, "layer_paths", None) or {}
    return [recorded.get(name, (name,)) for name in model._modules]


def _inside(path: str, name: str) -> bool:
    return path == name or path.startswith(name + ".")


def _unknown(name: str, paths: list[tuple[str, ...]], converted: bool) -> SplitPointError:
    known = sorted({q for ps in paths for p in ps for q in _prefixes(p)})
    close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
    where = "module of the source model" if converted else "layer of this nn.Sequential"
    hint = (
        "convert the model with seqify.convert (or pass the model itself to seqify.compat.pipelining.pipeline) "
        "to split inside a layer"
        if not converted else "use a name from model.named_modules()"
    )
    return SplitPointError(
        f"split point {name!r} names no {where} that runs code"
        + (f" (did you mean {', '.join(map(repr, close))}?)" if close else "")
        + f"; {hint}"
    )


def _prefixes(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def split_balance(model: nn.Sequential, split_spec: SplitSpec) -> list[int]:
    """Layers per stage for torch-pipelining-style split points.

    ``split_spec`` is ``{"layer3": SplitPoint.BEGINNING, "layer4.1": SplitPoint.END}`` or a list of module
    names (each a ``BEGINNING``). A converted model maps each source module to the layers that run its
    code (``seq.layer_paths``): ``BEGINNING`` cuts before the first of them, ``END`` after the last. A
    plain ``nn.Sequential`` splits at its children's names.
    """
    spec = dict(split_spec) if isinstance(split_spec, Mapping) else {n: SplitPoint.BEGINNING for n in split_spec}
    paths = _paths(model)
    names = list(model._modules)
    converted = bool(getattr(model, "layer_paths", None))
    cuts: dict[int, str] = {}
    for name, point in spec.items():
        kind = getattr(point, "name", point)
        if not isinstance(name, str) or not name:
            raise SplitPointError(f"split point {name!r}: name a submodule, e.g. 'layer3' or 'layer4.1'")
        if kind not in ("BEGINNING", "END"):
            raise SplitPointError(f"split point {name!r}: {point!r} is not SplitPoint.BEGINNING or SplitPoint.END")
        hits = [i for i, ps in enumerate(paths) if any(_inside(p, name) for p in ps)]
        if not hits:
            raise _unknown(name, paths, converted)
        cut = hits[0] if kind == "BEGINNING" else hits[-1] + 1
        if cut in (0, len(names)):
            raise SplitPointError(
                f"split point {name!r} ({kind}) falls at the {'start' if cut == 0 else 'end'} of the model and "
                "would leave a stage with no layers; drop it, or split at another module"
            )
        if cut in cuts:
            raise SplitPointError(
                f"split points {cuts[cut]!r} and {name!r} both cut before layer {names[cut]!r} and would leave a "
                "stage with no layers; drop one of them"
            )
        cuts[cut] = name
    bounds = [0, *sorted(cuts), len(names)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def pipeline(
    module: nn.Module,
    mb_args: tuple[Any, ...] = (),
    mb_kwargs: dict[str, Any] | None = None,
    split_spec: SplitSpec | None = None,
    *,
    split_points: Iterable[str] | None = None,
    devices: Sequence[Any] | None = None,
    checkpoint: str = "never",
    **options: Any,
) -> Pipeline:
    """torch's ``pipeline(module, mb_args, mb_kwargs, split_spec)`` for one process: the model converted by
    seqify (``mb_args``/``mb_kwargs``: an example micro-batch), split at ``split_spec`` and placed one stage
    per device (default: one GPU each, or CPU). Returns a :class:`seqify.Pipeline` for
    :class:`ScheduleGPipe` / :class:`Schedule1F1B`. ``split_points=["layer3", "layer4.1"]`` is
    ``split_spec`` as a list (a stage begins at each). Without checkpointing by default, as in torch."""
    if mb_kwargs is not None and not isinstance(mb_kwargs, dict):
        raise SplitPointError(
            f"mb_kwargs={mb_kwargs!r}: the third argument is the example's keyword arguments (a dict), as in torch's "
            "pipeline(module, mb_args, mb_kwargs, split_spec); pass split points as split_spec=... or "
            "split_points=[...]"
        )
    if split_points is not None:
        if split_spec is not None:
            raise SplitPointError("give split_spec or split_points, not both")
        split_spec = list(split_points)
    if isinstance(module, nn.Sequential):
        model = module
    else:
        from seqify.convert import convert

        example = mb_kwargs if mb_kwargs and not mb_args else (tuple(mb_args) if mb_args else None)
        if mb_args and mb_kwargs:
            raise SplitPointError("give the example micro-batch as mb_args or as mb_kwargs, not both")
        model = convert(module, example)
    balance = split_balance(model, split_spec or {})
    pipe = make_pipeline(model, devices=devices, balance=balance, checkpoint=checkpoint, **options)
    assert isinstance(pipe, Pipeline)  # no replicas were asked for
    return pipe


class ScheduleGPipe:
    """torch's ``ScheduleGPipe(stage, n_microbatches, loss_fn)`` over a :class:`seqify.Pipeline`.

    ``step(x, target=y, losses=losses)`` splits the mini-batch into ``n_microbatches``, runs them
    through the pipeline, computes ``loss_fn(output, target)`` per micro-batch (into ``losses``, detached,
    one per micro-batch, as torch fills it) and accumulates their gradients into ``.grad``, divided by
    ``n_microbatches`` when ``scale_grads`` (torch's default). It returns the merged output (detached).
    Training runs through ``pipe.step`` in the schedule's order; eval mode or keyword inputs run the
    pipeline's forward, then the losses.
    """

    def __init__(
        self,
        pipe: Pipeline,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        scale_grads: bool = True,
    ) -> None:
        if not isinstance(pipe, Pipeline):
            raise SplitPointError(
                f"{type(self).__name__} runs a seqify.Pipeline (from seqify.compat.pipelining.pipeline or "
                f"seqify.pipeline), not {type(pipe).__name__}"
            )
        pipe.chunks = n_microbatches
        self.pipe = pipe
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads

    kind = "gpipe"  # the seqify schedule pipe.step runs this in

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[torch.Tensor] | None = None,
        return_outputs: bool = True,
        **kwargs: Any,
    ) -> Any:
        """One training step: forward of every micro-batch, loss per micro-batch, backward."""
        return self._run(args, kwargs, target, losses, return_outputs, backward=self.loss_fn is not None)

    def eval(self, *args: Any, target: Any = None, losses: list[torch.Tensor] | None = None, **kwargs: Any) -> Any:
        """A forward-only step (losses still filled when there is a target and a loss_fn)."""
        with torch.no_grad():
            return self._run(args, kwargs, target, losses, True, backward=False)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any, losses: list[torch.Tensor] | None,
             return_outputs: bool, backward: bool) -> Any:
        self.pipe.chunks = self.n_microbatches
        if backward and target is None:
            raise SplitPointError(f"{type(self).__name__}.step needs target=... to compute loss_fn per micro-batch")
        if backward and not kwargs and self.pipe.training and torch.is_grad_enabled():
            return self._scheduled(args[0] if len(args) == 1 else args, target, losses, return_outputs)
        if backward:
            out = self.pipe(*args, **kwargs)
        else:
            with torch.no_grad():
                out = self.pipe(*args, **kwargs)
        if self.loss_fn is not None and target is not None:
            per = self._losses(out, target)
            if losses is not None:
                losses.clear()
                losses.extend(loss.detach() for loss in per)
            if backward:
                total = torch.stack(per).sum()
                (total / len(per) if self.scale_grads else total).backward()
        return out if return_outputs else None

    def _scheduled(self, x: Any, target: Any, losses: list[torch.Tensor] | None, return_outputs: bool) -> Any:
        """The step run by ``pipe.step`` in this schedule's order (``kind``), each micro-batch's loss
        weighed 1 / n_microbatches (``scale_grads``) or 1, as torch's schedules weigh them."""
        pipe = self.pipe
        if pipe.schedule != self.kind:
            pipe.schedule = self.kind
            pipe._schedules.clear()  # schedules are built per micro-batch count, for pipe.schedule
        seen: list[tuple[torch.Tensor, Any]] = []
        n = self.n_microbatches
        loss_fn = self.loss_fn

        def per_micro_batch(out: Any, tgt: Any) -> torch.Tensor:
            loss = loss_fn(out, tgt)  # type: ignore[misc]
            detached = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            seen.append((loss.detach(), detached))
            return loss / n if self.scale_grads else loss

        pipe.step(x, target, per_micro_batch, reduction="sum")
        if losses is not None:
            losses.clear()
            losses.extend(loss for loss, _ in seen)
        if not return_outputs:
            return None
        outs = [o for _, o in seen]
        leaves = [pytree.tree_flatten(o)[0] for o in outs]
        spec = pytree.tree_flatten(outs[0])[1]
        joined = [torch.cat(ts) if isinstance(ts[0], torch.Tensor) else ts[0] for ts in zip(*leaves)]
        return pytree.tree_unflatten(joined, spec)

    def _losses(self, out: Any, target: Any) -> list[torch.Tensor]:
        """``loss_fn`` of each micro-batch's output and target, split as the pipeline split the input."""
        device = self.pipe.output_device
        targets = scatter(target.to(device) if isinstance(target, torch.Tensor) else target, self.n_microbatches)
        sizes = [(t if isinstance(t, torch.Tensor) else t[0]).size(0) for t in targets]
        leaves, spec = pytree.tree_flatten(out)
        pieces = [t.split(sizes) if isinstance(t, torch.Tensor) else [t] * len(sizes) for t in leaves]
        outs = [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(len(sizes))]
        return [self.loss_fn(o, t) for o, t in zip(outs, targets)]  # type: ignore[misc]


class Schedule1F1B(ScheduleGPipe):
    """torch's ``Schedule1F1B``: the same losses and gradients as :class:`ScheduleGPipe`, run in 1F1B order
    (a backward after each forward once the pipeline is full, which bounds the activations each stage
    keeps) by ``pipe.step``; one process per stage: ``seqify.distributed.stage(..., schedule='1f1b')``."""

    kind = "1f1b"
