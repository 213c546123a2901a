"""Tracing: torch.fx with a leaf policy, example shapes riding on proxies, and an opaque fallback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import HookError, SeqifyError, StatefulForwardError, UntraceableError
from seqify.frontend.fx.autograd import refusal
from seqify.frontend.fx.binding import bind_forward
from seqify.frontend.fx.checks import attributes, check_decorated, passthrough, writes_since
from seqify.frontend.fx.container_writes import order_container_writes
from seqify.frontend.fx.factories import recording_shape_ops
from seqify.frontend.fx.kept import KeepWhole, Update, keep_reseeding, keep_users, keep_writers
from seqify.frontend.fx.tracer import Tracer
from seqify.frontend.preserve import preserved
from seqify.frontend.real import RealRun, buffers_kept, raises_itself, source_error
from seqify.frontend.reseeds import reseeds
from seqify.frontend.traced import (
    UNKNOWN,
    Opaque,
    Traced,
    attribute,
    caller,
    error_site,
    first_line,
    is_cache,
    value_of,
)
from seqify.model.guard import Guard, check_bool, check_equal
from seqify.model.hooks import HOOK_DICTS
from seqify.model.signature import InputSpec

__all__ = ["Opaque", "Traced", "trace", "UNKNOWN", "value_of", "attribute", "is_cache"]


def _strip_baked(graph: fx.Graph) -> None:
    """Remove the placeholders fx makes for baked arguments, and the checks on them (the binder checks)."""
    for ph in [n for n in graph.nodes if n.op == "placeholder" and n.meta.get("seqify_baked")]:
        doomed: list[fx.Node] = []
        frontier = [ph]
        while frontier:
            n = frontier.pop()
            if n not in doomed:
                doomed.append(n)
                frontier.extend(n.users)
        order = {n: i for i, n in enumerate(graph.nodes)}
        for n in sorted(doomed, key=order.__getitem__, reverse=True):
            graph.erase_node(n)


def _output_structure(graph: fx.Graph, raw: Any, written: dict[fx.Node, fx.Node]) -> Any:
    """The source's own output structure, nodes as leaves (fx's node args turn dicts into immutable dicts);
    a container written in place is read from its last write."""
    out = next(n for n in graph.nodes if n.op == "output")
    info = getattr(graph._codegen, "pytree_info", None)
    if info is not None:
        graph._codegen = fx.graph.CodeGen()
        if info.out_spec is not None:
            structure = pytree.tree_unflatten(list(out.args[0]), info.out_spec)
            out.args = (structure,)
            return structure
        return out.args[0]
    leaves, spec = pytree.tree_flatten(raw)
    if any(isinstance(x, (dict, list, tuple)) for x in leaves):
        return out.args[0]
    return pytree.tree_unflatten([written.get(x.node, x.node) if isinstance(x, fx.Proxy) else x for x in leaves],
                                 spec)


def trace(
    model: nn.Module,
    example_inputs: Any = None,
    *,
    leaf_types: Sequence[type] = (),
    leaf_paths: Sequence[str] = (),
    depth: int | None = None,
) -> Traced:
    """Trace ``model`` into a torch.fx graph without changing it.

    Leaves are torch.nn modules, ``leaf_types``, ``leaf_paths`` and modules deeper than ``depth``. A
    submodule whose forward cannot be traced is kept whole (opaque). With ``example_inputs`` every node
    carries its example value in ``meta['val']`` (fake tensors: no data, no compute), Python control flow
    on shapes is resolved, and each decision becomes a run-time guard node.
    """
    name = type(model).__name__
    hooked = [h for h in HOOK_DICTS if getattr(model, h, None)]
    if hooked:
        raise HookError(
            f"{name} itself has {', '.join(h.strip('_').replace('_', ' ') for h in hooked)}; a converted "
            "model cannot run hooks of the module it flattens. Remove them before converting (hooks on "
            "submodules are fine: those submodules are kept whole so their hooks still run)."
        )
    params, concrete, plan = bind_forward(model, example_inputs)
    kept: dict[str, Opaque] = {}  # submodules kept whole because their forward writes attributes
    # fx traces type(model).forward: under decorators that pass these inputs through unchanged, it traces
    # the function they wrap (the class's own forward is put back before anything runs the model)
    inner = passthrough(model, example_inputs)
    cls, wrapped = type(model), type(model).__dict__.get("forward")
    if inner is not None:
        cls.forward = inner
    try:
        for _ in range(64):
            try:
                tracer, graph, writes = _trace_once(model, example_inputs, concrete, plan, kept, leaf_types, leaf_paths,
                                                    depth)
            except UntraceableError as e:
                check_decorated(model, e)  # a (self, *args, **kwargs) decorator is the cause: say so
                raise
            if not writes and not tracer.autograd.uses:
                break
            keep_users(model, tracer.autograd.uses, kept)
            if writes:
                keep_writers(model, writes, kept, tracer.flattened)
        else:  # pragma: no cover - every round keeps a module whole or raises at the root
            raise StatefulForwardError(f"{name}: attribute writes could not be isolated; convert with depth=1")
    finally:
        if inner is not None:
            if wrapped is None:
                del cls.forward
            else:
                cls.forward = wrapped
    for ph in graph.nodes:
        if ph.op == "placeholder" and str(ph.target).startswith("*") and ph.users:
            raise UntraceableError(
                f"{name}.forward reads {ph.target}: seqify converts forwards whose inputs are named parameters. "
                f"What to do: wrap the model in a module whose forward names each input (def forward(self, x, "
                f"mask): return model(x, mask=mask)) and convert that."
            )
    _strip_baked(graph)
    written = order_container_writes(graph)
    output = _output_structure(graph, tracer.raw_output, written)
    used = {n.target for n in graph.nodes if n.op == "get_attr"}
    constants = {k: v for k, v in tracer.constants.items() if k in used}
    called = {n.target for n in graph.nodes if n.op == "call_module"}
    called |= {n.meta["seqify_method"] for n in graph.nodes if "seqify_method" in n.meta}
    opaque = [o for p, o in tracer.opaque.items() if p in called]
    guards = [
        Guard(n.args[2], n.args[1], n.args[3])
        for n in graph.nodes
        if n.op == "call_function" and n.target in (check_bool, check_equal)
    ]
    return Traced(
        model=model,
        graph=graph,
        constants=constants,
        opaque=opaque,
        inputs=InputSpec(name, params),
        training=model.training,
        has_values=example_inputs is not None,
        guards=guards,
        output=output,
        flattened=[("", model), *((p, m) for p, m in tracer.flattened.items() if p)],
    )


def _trace_once(
    model: nn.Module,
    example_inputs: Any,
    concrete: dict[str, Any],
    plan: list[tuple[str, Any]],
    kept: dict[str, Opaque],
    leaf_types: Sequence[type],
    leaf_paths: Sequence[str],
    depth: int | None,
) -> tuple[Tracer, fx.Graph, list[Update]]:
    """One fx trace; returns the tracer, the graph, and the attributes a traced forward wrote and the state it
    changed in place without fx recording it."""
    name = type(model).__name__
    fake_mode = real = None
    real_plan = plan
    if example_inputs is not None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
        plan = [(kind, fake_mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for kind, v in plan]
        real = RealRun(model, caller(model, example_inputs), lambda: preserved(model))
    tracer = Tracer(
        leaf_types=tuple(leaf_types),
        leaf_paths=frozenset(leaf_paths),
        depth=depth,
        fake_mode=fake_mode,
        placeholders=plan,
        real=real,
        real_inputs=[value for _, value in real_plan],
    )
    tracer.opaque.update(kept)
    with preserved(model) as held_changed, buffers_kept(model) as buffers_changed, \
            torch.random.fork_rng(devices=[]), recording_shape_ops(model), \
            torch.set_grad_enabled(torch.is_grad_enabled()):  # a forward may leave grad mode changed
        before = attributes(model)
        try:
            with reseeds(model, lambda record: keep_reseeding(model, record, tracer.plain)):
                graph = tracer.trace(model, concrete_args=concrete or None)
            tracer.autograd.left_open(0)
        except SeqifyError:
            raise
        except KeepWhole as e:
            raise e.error from None
        except Exception as e:
            if "" in tracer.autograd.uses:
                raise refusal(name, tracer.autograd.uses[""]) from e
            raise untraceable(name, e, examples=example_inputs is not None) from e
        writes = [Update(path, name, "attribute") for path, names in writes_since(model, before).items()
                  for name in names]
        # In-place changes made while tracing that fx did not record (`self.n += 1` on a buffer, a draw from
        # a private generator with fixed sizes): they ran once, at conversion, and no layer repeats them.
        for buffer in buffers_changed():
            owner, _, attr = buffer.rpartition(".")
            writes.append(Update(owner, attr, "buffer"))
        for held in held_changed():
            kind = "generator" if isinstance(held.obj, torch.Generator) else "tensor"
            writes.append(Update(held.owner, held.where, kind))
    if "" in tracer.autograd.uses:
        raise refusal(name, tracer.autograd.uses[""])
    if real is not None and real.error is not None and source_error(
        model, caller(model, example_inputs), lambda: preserved(model)) is not None:
        # An opaque submodule's value came from running the source, and the source raised, outside a trace
        # too: the example inputs are wrong, not the trace (a later "value unknown" error would blame the
        # conversion). A source that raises only while traced (transformers builds masks then) is the
        # trace's divergence, which the self-check names.
        raise raises_itself(name, real.error)
    return tracer, graph, writes


def untraceable(name: str, error: Exception, examples: bool) -> UntraceableError:
    """fx's refusal of ``name``'s forward, with advice fitted to whether the caller gave example inputs (with
    them, shapes were known: what stopped the tracer depends on values or types, not on shapes)."""
    site = error_site(error)
    shapes = ("" if examples else "pass example_inputs=... to seqify.convert so shape-dependent branches are "
              "resolved from example shapes; ")
    return UntraceableError(
        f"{name}.forward cannot be traced: {first_line(error)}\n"
        + (f"  at {site}\n" if site else "")
        + f"What to do: {shapes}move data-dependent code (branches on tensor values, non-torch calls or types) "
        "into a submodule, which seqify then keeps whole as one opaque layer; or list that submodule in "
        "leaf_paths=[...]."
    )
