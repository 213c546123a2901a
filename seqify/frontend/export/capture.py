"""torch.export frontend: a non-strict export graph in the traced form that convert's linearize and build consume."""

from __future__ import annotations

import copyreg
import functools
import inspect
import io
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import ExportError, HookError, SeqifyError
from seqify.frontend.export.autograd import Watch, refuse_autograd
from seqify.frontend.export.binding import bind_inputs
from seqify.frontend.export.cleanup import clean, module_calls, shape_guards
from seqify.frontend.export.devices import at_device_of, on_device_of, rewrite_devices
from seqify.frontend.export.hf_masks import causal_skip
from seqify.frontend.export.host_draws import HostDraws, host_draws, random_train_steps, refuse_host_draws
from seqify.frontend.export.refusals import (
    cache_error,
    recording_writes,
    refuse_cache,
    refuse_cache_output,
    refuse_reseeds,
    refuse_scripted,
    refuse_writes,
)
from seqify.frontend.export.regions import graphs as regions
from seqify.frontend.export.regions import neutral_autocast, prepare_regions
from seqify.frontend.grad_watch import watching
from seqify.frontend.outside import Held, generator_error, outside
from seqify.frontend.preserve import preserved
from seqify.frontend.real import raises_itself, source_error
from seqify.frontend.reseeds import reseeds
from seqify.frontend.traced import Traced, error_site, first_line
from seqify.model.hooks import user_hooks
from seqify.model.signature import InputSpec

__all__ = ["export_trace", "aten_op", "on_device_of", "at_device_of"]


_aten = torch.ops.aten


def aten_op(name: str, overload: str, namespace: str = "aten") -> Any:
    """The ATen operator ``namespace::name.overload``: how a saved converted model finds its ops again."""
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _reduce_op(op: torch._ops.OpOverload) -> tuple[Any, tuple[str, str, str]]:
    return aten_op, (op._schema.name.split("::")[1], op._overloadname, op.namespace)


# Layers made from export graphs call ATen operators, which torch cannot pickle: save them by name.
copyreg.pickle(torch._ops.OpOverload, _reduce_op)


@contextmanager
def _quiet() -> Iterator[None]:
    """torch.export logs each failed guard with the graph so far; seqify's own error says what matters."""
    names = [n for n in logging.root.manager.loggerDict if n == "torch" or n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    _set_levels(loggers, [logging.ERROR] * len(loggers))
    try:
        with redirect_stderr(io.StringIO()):  # a failed export also prints its partial graph to stderr
            yield
    finally:
        _set_levels(loggers, levels)


def _set_levels(loggers: list[logging.Logger], levels: list[int]) -> None:
    """``Logger.setLevel`` for many loggers, clearing the loggers' level caches once: ``setLevel`` clears every
    logger's cache at each call, quadratic in the few hundred loggers torch registers."""
    for lg, level in zip(loggers, levels):
        lg.level = level
    logging.root.manager._clear_cache()  # type: ignore[attr-defined]


def _export(model: nn.Module, kwargs: dict[str, Any], dynamic: dict[str, Any]) -> torch.export.ExportedProgram:
    with host_draws() as host:
        return _export_watched(model, kwargs, dynamic, host)


def _capture(model: nn.Module, kwargs: dict[str, Any], shapes: Any) -> torch.export.ExportedProgram:
    # captured with gradients on, as the source trains: export records the regions that turn them off (and the
    # layers run them so), whatever the mode convert is called in
    with _quiet(), _no_stack_traces(), neutral_autocast(model, kwargs), causal_skip(kwargs), torch.enable_grad():
        return torch.export.export(model, (), kwargs, strict=False, dynamic_shapes=shapes)


@contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Export without a Python stack trace per graph node: layers run operators and never read them, and
    collecting them is a few percent of an export (torch >= 2.10; older versions collect them)."""
    config = torch.fx.config
    before = getattr(config, "do_not_emit_stack_traces", None)
    if before is None:
        yield
        return
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _again(model: nn.Module, kwargs: dict[str, Any], shapes: Any) -> torch.export.ExportedProgram:
    """A second capture, as the first was made (the model and torch's generators left as they were)."""
    with preserved(model), torch.random.fork_rng(devices=[]):
        return _capture(model, kwargs, shapes)


def _export_watched(model: nn.Module, kwargs: dict[str, Any], dynamic: dict[str, Any],
                    host: HostDraws) -> torch.export.ExportedProgram:
    name = type(model).__name__
    last: Exception | None = None
    for shapes in (dynamic, None):  # a batch dimension the model fixes falls back to static shapes (guarded)
        watch = Watch()
        with preserved(model), torch.random.fork_rng(devices=[]), recording_writes(model) as seen, \
                reseeds(model) as seeded:
            try:
                with watching(watch):
                    ep = _capture(model, kwargs, shapes)
            except SeqifyError:
                raise
            except Exception as e:
                refuse_autograd(model, watch)
                last = e
                continue
        refuse_reseeds(model, seeded)
        refuse_autograd(model, watch)
        refuse_writes(model, kwargs, seen)
        refuse_host_draws(model, host.drawn(), ep, functools.partial(_again, model, kwargs, shapes))
        return ep
    assert last is not None
    failed = source_error(model, lambda: model(**kwargs), lambda: preserved(model))
    if failed is not None:  # the example inputs are wrong (BEiT's bool_masked_pos without a mask token)
        raise raises_itself(name, failed) from failed
    config = getattr(model, "config", None)
    takes_use_cache = "use_cache" in inspect.signature(model.forward).parameters
    if "use_cache" not in kwargs and getattr(config, "use_cache", False) and takes_use_cache:
        raise cache_error(name, "model.config.use_cache") from last
    site = error_site(last)
    drawn = _generator_on(model, site)
    if drawn is not None:  # export fails on the draw itself (sizes from a symbolic batch): say what is wrong
        raise generator_error(model, drawn, drawn.obj) from last
    raise ExportError(
        f"torch.export cannot capture {name}.forward: {first_line(last)}"
        + (f"\n  at {site}" if site else "")
        + "\nWhat to do: pass example_inputs the model accepts as a whole (a dict of keyword arguments "
        "works for transformers models); keep data-dependent code (branches on tensor values) in a submodule "
        "and use frontend='fx', which keeps such submodules whole"
        + _hints(model, kwargs, site, last)
    ) from last


def _generator_on(model: nn.Module, site: str) -> Held | None:
    """A private generator the model holds whose attribute the failing line reads (``generator=self.gen``)."""
    code = site.partition(" (")[2]
    for held in outside(model):
        attr = held.where.rpartition(".")[2]
        if isinstance(held.obj, torch.Generator) and re.search(rf"\.{re.escape(attr)}\b", code):
            return held
    return None


def _hints(model: nn.Module, kwargs: dict[str, Any], site: str, error: Exception) -> str:
    """What a failed capture's own site suggests: an example input read on the failing line (a check or loss
    on labels=) can stay out of the converted model; a data-dependent branch in train mode may be a random
    draw (LayerDrop) that eval mode skips."""
    code = site.partition(" (")[2]
    read = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and re.search(rf"\b{re.escape(k)}\b", code)]
    hints = []
    if read:
        hints.append(f"the failing line reads the example input {read[0]}=: leave it out of example_inputs and "
                     "compute what needs it (a loss from labels=) on the converted model's output")
    if model.training and "data-dependent" in str(error):
        steps = random_train_steps(model)
        if steps:
            what, fix = " and ".join(s for s, _ in steps), " and ".join(o for _, o in steps)
            hints.append(f"in train mode {what} draw at random and branch on the draw, which cannot be captured: "
                         f"to train the converted model set {fix} before converting; to evaluate it, convert in "
                         "eval mode")
        else:
            hints.append("in train mode, a branch on a random draw (LayerDrop: config.layerdrop > 0) cannot be "
                         "captured: convert in eval mode, or set the drop probability to 0 to train")
    return "".join(f"; {h}" for h in hints)


def export_trace(model: nn.Module, example_inputs: Any) -> Traced:
    """Capture ``model`` with non-strict ``torch.export`` on ``example_inputs`` and return it in the traced form.

    Graph nodes carry their module path (``nn_module_stack``) and example value (``val``, symbolic in the
    batch dimension); ``get_attr`` nodes name the source's own parameters and buffers, so in-place buffer
    updates (BatchNorm statistics) land in the source's buffers.
    """
    name = type(model).__name__
    hooked = user_hooks(model)
    if hooked:
        raise HookError(f"{name} itself has hooks ({', '.join(hooked)}); remove them before converting")
    inner = next(((p, m) for p, m in model.named_modules() if p and user_hooks(m)), None)
    if inner is not None:
        path, module = inner
        raise HookError(
            f"submodule {path!r} ({type(module).__name__}) of {name} has hooks ({', '.join(user_hooks(module))}); "
            "the torch.export frontend flattens every submodule into graph ops, so its hooks would never run in "
            "the converted model. Convert with frontend='fx', which keeps a hooked submodule whole as one layer "
            "whose hooks run, or remove the hooks before converting (and register them on the converted layers)"
        )
    refuse_scripted(model)
    params, kwargs, dynamic = bind_inputs(model, example_inputs)
    refuse_cache(model, kwargs)
    ep = _export(model, kwargs, dynamic)
    try:
        gm = ep.module()
    except Exception as e:
        raise ExportError(f"torch.export captured {name} but could not unlift it: {first_line(e)}") from e
    graph = gm.graph
    constants, inputs = clean(gm, model, kwargs)
    example = next((t for t in pytree.tree_leaves(kwargs) if isinstance(t, torch.Tensor)), None)
    prepare_regions(graph, constants, example.device.type if example is not None else None)
    module_calls(graph, model)
    if example is not None:
        # Also inside the regions the graph calls (a no_grad or autocast block such as a rotary embedding's):
        # a device baked there would pin a layer to the example's device wherever the layer runs.
        # The model's own devices too: a model on the meta device makes its values on meta, whatever the example's.
        devices = dict.fromkeys([example.device, *(t.device for t in (*model.parameters(), *model.buffers()))])
        for region in regions(graph, constants):
            if any([rewrite_devices(region, d) for d in devices]) and region is not graph:
                owner = region.owning_module
                if isinstance(owner, fx.GraphModule):
                    owner.recompile()
    input_names = [k for k, v in kwargs.items() for x in pytree.tree_leaves(v) if isinstance(x, torch.Tensor)]
    guards = shape_guards(graph, inputs, input_names)
    out = next(n for n in graph.nodes if n.op == "output")
    spec = ep.module_call_graph[0].signature.out_spec if ep.module_call_graph[0].signature else None
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    structure = pytree.tree_unflatten(flat, spec) if spec is not None else out.args[0]
    refuse_cache_output(model, structure, spec)
    graph._codegen = fx.graph.CodeGen()
    out.args = (structure,)
    called = {str(n.target) for n in graph.nodes if n.op == "call_module"}
    return Traced(
        model=model,
        graph=graph,
        constants=constants,
        opaque=[],
        inputs=InputSpec(name, params),
        training=model.training,
        has_values=True,
        guards=guards,
        output=structure,
        flattened=[(p, m) for p, m in model.named_modules() if p not in called],
    )
