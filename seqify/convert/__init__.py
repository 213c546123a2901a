"""Convert: any nn.Module becomes an exact, pipeline-ready seqify.Sequential (trace, linearize, build)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from seqify.convert.build import RESERVED, build
from seqify.convert.kinds import module_path
from seqify.convert.linearize import Plan, linearize
from seqify.convert.modes import mode_differences, other_mode_trace
from seqify.convert.splice import EXPORT, FRONTEND, Spliced, candidates, copied, opaque_with, splice
from seqify.convert.twin import check_both_modes, join_modes, join_other_mode
from seqify.convert.verify import check, kept, split_inputs
from seqify.errors import (
    ConversionError,
    DecoratedForwardError,
    OptionError,
    SeqifyError,
    SourceRaisesError,
    SpecializationError,
    StatefulForwardError,
    UnregisteredError,
    UntraceableError,
    VerifyError,
)
from seqify.frontend.fx.trace import trace
from seqify.frontend.preserve import preserved
from seqify.frontend.real import buffers_kept
from seqify.frontend.traced import Opaque, Traced
from seqify.model.sequential import ExportedInfo, Sequential

__all__ = ["convert", "Plan", "linearize", "build"]

log = logging.getLogger("seqify.frontend")


def _unwrapped(model: Any) -> Any:
    """The module a wrapper runs: ``torch.compile``'s, ``DataParallel``'s and ``DistributedDataParallel``'s
    (they compute its function; the conversion shares its parameters and is checked against it)."""
    while True:
        inner = getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else None
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            inner = model.module
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _check_options(
    model: Any, leaf_types: Any, leaf_paths: Any, depth: Any
) -> tuple[tuple[type, ...], tuple[str, ...]]:
    """Validate convert's options; a single type or path is taken as a list of one."""
    if not isinstance(model, nn.Module):
        raise OptionError(
            f"seqify.convert takes an nn.Module, got {type(model).__name__}; wrap the function in a module "
            "whose forward calls it"
        )
    name = type(model).__name__
    if isinstance(model, torch.jit.ScriptModule):
        raise OptionError(
            f"seqify.convert takes a Python nn.Module, got the TorchScript module {name} (its forward is compiled "
            "code that torch.fx and torch.export cannot read); convert the module before torch.jit.script, or "
            "script the converted model's layers"
        )
    types = (leaf_types,) if isinstance(leaf_types, type) else tuple(leaf_types)
    bad = [t for t in types if not isinstance(t, type)]
    if bad:
        raise OptionError(
            f"leaf_types={leaf_types!r}: give module classes (e.g. leaf_types=[Bottleneck]), not {bad[0]!r}"
        )
    paths = (leaf_paths,) if isinstance(leaf_paths, str) else tuple(leaf_paths)
    known = dict(model.named_modules())
    for path in paths:
        if not isinstance(path, str) or path not in known or path == "":
            children = ", ".join(repr(n) for n, _ in model.named_children()) or "none"
            raise OptionError(
                f"leaf_paths names {path!r}, which is not a submodule of {name}; give qualified names as in "
                f"model.named_modules() (its children: {children})"
            )
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise OptionError(f"depth={depth!r}: give a whole number >= 1 (1 keeps the model's children whole), or None")
    return types, paths


def convert(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    leaf_types: Sequence[type] = (),
    leaf_paths: Sequence[str] = (),
    depth: int | None = None,
    check_modes: bool = True,
    frontend: str = "auto",
    verify: bool = True,
) -> Sequential:
    """Flatten ``model`` into a :class:`seqify.Sequential` that computes exactly what ``model`` computes.

    Args:
        model: any ``nn.Module``. It is never modified: the layers share its parameter, buffer and leaf
            module objects.
        example_inputs: a tensor, a tuple of positional arguments or a dict of keyword arguments. With
            them, Python branches on shapes are resolved (and re-checked at run time, see ``seq.guards``)
            and skips are annotated with shapes. Without them, forwards that branch on shapes keep those
            submodules whole (``seq.opaque``).
        leaf_types / leaf_paths: module types or qualified names to keep whole as single layers
            (coarser layers), e.g. ``leaf_types=[torchvision.models.resnet.Bottleneck]``.
        depth: keep every module at this depth whole (1: the model's children).
        check_modes: also trace in the other train/eval mode to detect forwards whose graph depends on
            ``self.training``. Where the two traces differ only inside layers (attention dropout passed as a
            number), each such layer holds the ops of both modes and runs those of the mode it is in
            (``seq.two_mode_layers``); otherwise the conversion refuses to run in the other mode.
        frontend: ``"fx"`` (torch.fx: module-level layers, works without example inputs), ``"export"``
            (non-strict torch.export on ``example_inputs``: transformers, diffusers and other forwards fx
            cannot trace) or ``"auto"``: fx, and export where fx fails, its result fails the self-check, or
            its shape guards refuse a batch on the other side of one that export's graph serves (a micro-batch
            of one; a one-sample example, which export traces twice over so that every batch size runs);
            with ``example_inputs``, also per submodule: one fx would keep whole because it cannot trace
            inside it becomes export-made layers among fx's (``seq.layer_frontends``, ``seq.exported``).
        verify: with ``example_inputs``, run the source and the result once and raise
            :class:`seqify.VerifyError` naming the first layer whose value differs.

    Returns:
        A :class:`seqify.Sequential`; ``seq(*args)`` returns what ``model(*args)`` returns.
    """
    if isinstance(model, Sequential):
        return model
    model = _unwrapped(model)
    leaf_types, leaf_paths = _check_options(model, leaf_types, leaf_paths, depth)
    # Conversion runs the source (traces, the self-check): whatever that draws or writes is put back.
    with torch.random.fork_rng(devices=_accelerators(model)), buffers_kept(model, parameters=True):
        seq = _convert(model, example_inputs, leaf_types, leaf_paths, depth, check_modes, frontend, verify)
        if seq.mode_dependent and check_modes and "fx" in seq.frontend:  # export conversions tried already
            join_other_mode(model, seq, lambda kept: _convert(
                model, example_inputs, leaf_types, kept, depth, False, frontend, False), leaf_paths,
                example_inputs if verify else None)
    _report(model, seq)
    return seq


def _first_line(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _report(model: nn.Module, seq: Sequential) -> None:
    """Log which frontend made the layers and every submodule kept whole (``seq.opaque``), and why."""
    name = type(model).__name__
    log.info("converted %s: %d layers, made by the %s frontend", name, len(seq), seq.frontend)
    for o in seq.opaque:
        log.info("converted %s: %s kept whole as layer %r: %s", name, o.path or "the model", o.layer, o.reason)


def _accelerators(model: nn.Module) -> list[int]:
    """The CUDA devices holding the model's tensors (their generators are forked during conversion)."""
    return sorted({t.device.index or 0 for t in [*model.parameters(), *model.buffers()] if t.device.type == "cuda"})


def _convert(model: nn.Module, example_inputs: Any, leaf_types: tuple[type, ...], leaf_paths: tuple[str, ...],
             depth: int | None, check_modes: bool, frontend: str, verify: bool) -> Sequential:
    """:func:`convert` on checked options."""
    if frontend not in ("auto", "fx", "export"):
        raise OptionError(f"frontend={frontend!r}: choose 'auto', 'fx' or 'export'")
    if frontend == "export":
        if leaf_types or leaf_paths or depth is not None:
            raise OptionError(
                "leaf_types, leaf_paths and depth choose layers of the fx frontend; the export frontend makes "
                "one layer per module call. Drop them, or use frontend='fx'"
            )
        return _via_export(model, example_inputs, check_modes=check_modes, verify=verify)
    try:
        traced, mode_dependent = _trace_fx(model, example_inputs, leaf_types, leaf_paths, depth, check_modes)
        if frontend == "auto" and example_inputs is not None:
            mixed = _via_splice(traced, example_inputs, mode_dependent, leaf_types, leaf_paths, depth,
                                check_modes=check_modes, verify=verify)
            if mixed is not None:
                return mixed
        seq = _assemble(traced, mode_dependent=mode_dependent)
        if verify and example_inputs is not None:
            try:
                check(model, seq, example_inputs, frontend="fx")
            except VerifyError as e:
                fixed = None
                if frontend == "auto" and not (leaf_types or leaf_paths or depth is not None):
                    fixed = _export_the_wrong_part(model, example_inputs, e, check_modes=check_modes)
                if fixed is None:
                    raise
                log.warning("converting %s: the fx frontend's layers fail the self-check (%s); the submodule "
                            "around it is made by the export frontend instead: %s", type(model).__name__,
                            _first_line(e), ", ".join(x.path for x in fixed.exported))
                return fixed
        if frontend == "auto" and verify and example_inputs is not None and not (leaf_types or leaf_paths or
                                                                                  depth is not None):
            return _batch_free(model, seq, example_inputs, check_modes=check_modes)
        return seq
    except SeqifyError as e:
        # Fall back only where fx cannot trace or its result is wrong; other errors teach their own fix.
        if not isinstance(e, (UntraceableError, VerifyError)) or frontend == "fx" or example_inputs is None:
            raise
        if leaf_types or leaf_paths or depth is not None:
            raise
        fx_error: Exception = e
    except Exception as e:
        if frontend == "fx" or example_inputs is None or leaf_types or leaf_paths or depth is not None:
            raise ConversionError(
                f"converting {type(model).__name__} with torch.fx failed: {type(e).__name__}: {e}"
            ) from e
        fx_error = e
    log.info("converting %s: the fx frontend failed (%s); falling back to the export frontend",
             type(model).__name__, _first_line(fx_error))
    try:
        return _via_export(model, example_inputs, check_modes=check_modes, verify=verify)
    except SeqifyError as e:
        if isinstance(fx_error, SeqifyError) and not isinstance(fx_error, DecoratedForwardError) and not (
            isinstance(e, SourceRaisesError)  # the inputs are wrong: that is the fix, not fx's advice
        ):
            # Both failed: fx's error names the line and the fix (a branch on values, say); export adds a note,
            # unless it refuses for the same reason (state held or changed where no layer can keep it)
            if type(e) is not type(fx_error) or not isinstance(e, (UnregisteredError, StatefulForwardError)):
                fx_error.args = (f"{fx_error.args[0] if fx_error.args else fx_error}\n(the export frontend failed "
                                 f"too: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",)
            raise fx_error from e
        e.args = (f"{e.args[0] if e.args else e}\n(the fx frontend failed first: {type(fx_error).__name__}: "
                  f"{str(fx_error).splitlines()[0] if str(fx_error) else ''})",)
        raise


def _batch_size(inputs: Any) -> int | None:
    """The size of dim 0 that every tensor of ``inputs`` shares, or None."""
    sizes = {t.shape[0] for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0}
    return next(iter(sizes)) if len(sizes) == 1 else None


def _other_batch(example_inputs: Any, size: int | None) -> Any:
    """The example inputs (batch ``size``) at another batch size: the first sample alone, or a one-sample example
    twice; None where their tensors share no batch dimension."""
    if not size:
        return None
    if size == 1:
        return pytree.tree_map(lambda t: torch.cat([t, t]) if isinstance(t, torch.Tensor) and t.dim() > 0 else t,
                               example_inputs)
    return pytree.tree_map(lambda t: t[:1] if isinstance(t, torch.Tensor) and t.dim() > 0 else t, example_inputs)


def _refuses(seq: Sequential, inputs: Any) -> bool:
    """Whether ``seq`` raises SpecializationError on ``inputs`` (its buffers, attributes and the RNG left as they
    were)."""
    args, kwargs = split_inputs(inputs)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), kept(seq):
            seq(*args, **kwargs)
    except SpecializationError:
        return True
    except Exception:
        return False  # not a guard: the source may refuse this input too; that is the input's business
    return False


def _batch_free(model: nn.Module, seq: Sequential, example_inputs: Any, *, check_modes: bool) -> Sequential:
    """fx's result, or export's where fx's guards refuse another batch size and export's graph does not.

    A pipeline runs micro-batches, often of one sample, and people trace with one sample and train on many. fx
    resolves ``if batch != position_ids.shape[0]`` (a transformers mask helper) on the example batch and guards
    it, so a batch on the other side of 1 leaves the traced branch; export keeps the batch symbolic and its graph
    (an ``expand`` to the batch) serves both.
    """
    if not seq.guards:
        return seq
    size = _batch_size(example_inputs)
    batch = _other_batch(example_inputs, size)
    if batch is None or not _refuses(seq, batch):
        return seq
    try:
        other = _via_export(model, example_inputs, check_modes=check_modes, verify=True)
        if size != 1:
            check(model, other, batch, frontend="export")  # on the first sample alone
        elif _refuses(other, batch):
            return seq  # exported as given, fixed at one sample (a one-sample example twice over is checked)
    except SeqifyError:
        return seq  # fx's result is right where its guards hold: better than none, or a wrong one
    log.info("converting %s: fx's shape guards refuse a batch of another size (a micro-batch of one, say); the "
             "export frontend's graph, which serves both, is used", type(model).__name__)
    return other


def _scope_key(node: fx.Node) -> Any:
    """Export layers group consecutive ops of one module call."""
    if node.op != "call_function":
        return None
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack)) if stack else None


def _spliced_key(node: fx.Node) -> Any:
    """In an fx graph with export graphs spliced in: export's ops grouped by module call, fx's one a layer."""
    return _scope_key(node) if node.meta.get(FRONTEND) == EXPORT else None


def _assemble(traced: Traced, *, mode_dependent: bool, group: Any = None, frontend: str = "fx") -> Sequential:
    """linearize + build; a crash inside them becomes a ConversionError naming the model."""
    try:
        plan = linearize(traced, reserved=RESERVED, group=group)
        return build(traced, plan, mode_dependent=mode_dependent, frontend=frontend)
    except SeqifyError:
        raise
    except Exception as e:
        raise ConversionError(
            f"seqify failed to assemble layers for {type(traced.model).__name__}: {type(e).__name__}: {e}. "
            "Report this as a seqify bug; meanwhile try the other frontend or keep the failing submodule whole"
        ) from e


def _via_export(model: nn.Module, example_inputs: Any, *, check_modes: bool, verify: bool) -> Sequential:
    if example_inputs is None:
        raise OptionError(
            f"frontend='export' needs example_inputs: torch.export runs {type(model).__name__}.forward on them "
            "(e.g. seqify.convert(model, example_inputs={'input_ids': ids}, frontend='export'))"
        )
    twice = _other_batch(example_inputs, 1) if _batch_size(example_inputs) == 1 else None
    if twice is not None:
        # export keeps a batch dimension symbolic only where the example's is above one: a one-sample example
        # (how people trace) is exported twice over, so other batches and micro-batches run too, and checked
        # on the example itself; a model that fixes its batch at one is exported as given
        try:
            seq = _export_layers(model, twice, check_modes=check_modes)
            if verify:
                check_both_modes(model, seq, twice)
                check(model, seq, example_inputs, frontend="export")
            return seq
        except SeqifyError:
            pass
    seq = _export_layers(model, example_inputs, check_modes=check_modes)
    if verify:
        check_both_modes(model, seq, example_inputs)
    return seq


def _export_layers(model: nn.Module, example_inputs: Any, *, check_modes: bool) -> Sequential:
    """The export conversion; with ``check_modes``, traced in the other mode too: where the two graphs differ
    only inside layers, each such layer runs the ops of the mode it runs in, else the conversion is
    mode-dependent (it refuses the other mode)."""
    from seqify.frontend.export.capture import export_trace

    traced = export_trace(model, example_inputs)
    other = other_mode_trace(model, example_inputs) if check_modes else None
    if isinstance(other, Exception):
        seq = _assemble(traced, mode_dependent=True, group=_scope_key, frontend="export")
        seq.other_mode_error = str(other)
        return seq
    dependent = other is not None and bool(mode_differences(traced.graph, other.graph))
    seq = _assemble(traced, mode_dependent=dependent, group=_scope_key, frontend="export")
    if dependent and other is not None:
        joined = join_modes(seq, _assemble(other, mode_dependent=True, group=_scope_key, frontend="export"))
        if joined is not None:
            seq.mode_dependent = False
            seq.two_mode_layers = joined
    return seq


def _trace_fx(
    model: nn.Module, example_inputs: Any, leaf_types: tuple[type, ...], leaf_paths: tuple[str, ...],
    depth: int | None, check_modes: bool,
) -> tuple[Traced, bool]:
    """The fx trace, with submodules whose ops depend on self.training kept whole; and whether the model's
    own forward does (the conversion then runs only in the mode it was made in)."""
    paths = set(leaf_paths)
    traced = trace(model, example_inputs, leaf_types=leaf_types, leaf_paths=sorted(paths), depth=depth)
    mode_dependent = False
    mode_leaves: set[str] = set()
    for _ in range(4 if check_modes else 0):
        with preserved(model):
            model.train(not traced.training)
            try:
                other = trace(model, example_inputs, leaf_types=leaf_types, leaf_paths=sorted(paths), depth=depth)
            except Exception:
                mode_dependent = True
                break
        differ = mode_differences(traced.graph, other.graph)
        if not differ:
            break
        if "" in differ:
            mode_dependent = True
            break
        # Submodules whose traced ops depend on self.training stay whole: they follow train()/eval() live.
        mode_leaves |= differ
        paths |= differ
        traced = trace(model, example_inputs, leaf_types=leaf_types, leaf_paths=sorted(paths), depth=depth)
    for path in sorted(mode_leaves):
        if path not in {o.path for o in traced.opaque}:
            module = model.get_submodule(path)
            traced.opaque.append(Opaque(path, type(module).__name__, "its forward depends on self.training; kept "
                                        "whole so it follows train()/eval()"))
    return traced, mode_dependent


def _via_splice(
    traced: Traced, example_inputs: Any, mode_dependent: bool, leaf_types: tuple[type, ...],
    leaf_paths: tuple[str, ...], depth: int | None, *, check_modes: bool, verify: bool,
) -> Sequential | None:
    """The fx conversion with each submodule fx could not trace made by the export frontend; None where there
    is none, or export captures none of them, or the result fails the self-check (the caller then keeps
    them opaque). ``traced`` itself is left as it was, except that its opaque entries say why export failed."""
    nodes = candidates(traced, leaf_types, leaf_paths, depth)
    if not nodes:
        return None
    names = {n.name for n in nodes}
    done: list[Spliced] = []
    try:
        mixed = copied(traced)  # node names are kept: the candidates' copies are found by name
        done, failed = splice(mixed, example_inputs, [n for n in mixed.graph.nodes if n.name in names],
                              check_modes=check_modes)
        traced.opaque = opaque_with(traced.opaque, failed)
        if not done:
            return None
        mixed.opaque = opaque_with(mixed.opaque, failed)
        seq = _assemble(mixed, mode_dependent=mode_dependent or any(d.mode_dependent for d in done),
                        group=_spliced_key, frontend="fx")
        seq.exported = _exported(seq, done)
        if verify:
            check(traced.model, seq, example_inputs, frontend=seq.frontend)
        for info in seq.exported:
            log.info("converting %s: %s (%s) is made by the export frontend (%d layers); fx: %s",
                     type(traced.model).__name__, info.path, info.type, len(info.layers), info.reason)
        return seq
    except Exception as e:  # whatever went wrong, the fx conversion with these submodules whole stands
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        what = "fails the self-check" if isinstance(e, VerifyError) else f"could not be assembled ({first})"
        log.warning("converting %s: the fx conversion with export graphs spliced in %s; the submodules %s stay "
                    "whole", type(traced.model).__name__, what, ", ".join(d.path for d in done) or
                    ", ".join(module_path(n) for n in nodes))
        traced.opaque = opaque_with(traced.opaque, {
            d.path: f"the fx conversion with its torch.export graph spliced in {what}" for d in done
        } or {module_path(n): f"splicing its torch.export graph failed ({first})" for n in nodes})
        return None


def _export_the_wrong_part(model: nn.Module, example_inputs: Any, error: VerifyError, *, check_modes: bool,
                           tries: int = 3) -> Sequential | None:
    """Where fx's layers fail the self-check at a source module, the fx conversion with a submodule around
    it (innermost first, at most ``tries``) made by the export frontend instead; None where none passes."""
    path = error.module_path or ""
    wrong = path.split(".")
    for depth in range(len(wrong) - 1, max(0, len(wrong) - 1 - tries), -1):
        around = ".".join(wrong[:depth])
        module = model.get_submodule(around)
        try:
            traced, mode_dependent = _trace_fx(model, example_inputs, (), (around,), None, check_modes)
        except Exception:
            return None
        if any(o.path == around for o in traced.opaque):
            continue  # kept whole for its hooks, attribute writes or modes: export would lose what fx keeps
        traced.opaque.append(Opaque(around, type(module).__name__,
                                    f"its layers fail the self-check (source module {path!r} differs first)",
                                    untraceable=True))
        seq = _via_splice(traced, example_inputs, mode_dependent, (), (), None, check_modes=check_modes, verify=True)
        if seq is not None:
            return seq
    return None


def _exported(seq: Sequential, done: list[Spliced]) -> list[ExportedInfo]:
    """For each spliced submodule (once, however often it is called), the export-made layers that run its code."""
    out = []
    for d in {d.path: d for d in done}.values():
        layers = tuple(
            name for name, paths in seq.layer_paths.items()
            if seq.layer_frontends.get(name) == EXPORT and any(p == d.path or p.startswith(f"{d.path}.") for p in paths)
        )
        mode_dependent = any(e.mode_dependent for e in done if e.path == d.path)
        out.append(ExportedInfo(d.path, d.type, d.reason, layers, mode_dependent))
    return out
