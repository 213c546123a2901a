"""Verify: does a converted model compute what its source computes (bit-equal outputs, first differing layer)."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from seqify.errors import ExampleInputError, VerifyError
from seqify.frontend.real import buffers_kept, raises_itself, same_values

__all__ = ["bit_equal", "close", "split_inputs", "first_difference", "check"]


def bit_equal(a: Any, b: Any) -> bool:
    """Same structure, same types, and tensors equal bit for bit (dtype, shape, values; NaNs in the same places)."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape or x.device != y.device:
                return False
            if x.layout != torch.strided or y.layout != torch.strided:
                if not same_values(x.detach(), y.detach()):
                    return False
            elif not torch.equal(x, y) and not torch.equal(torch.nan_to_num(x.detach(), 1.0),
                                                           torch.nan_to_num(y.detach(), 1.0)):
                return False
        elif type(x) is not type(y) or (x != y and x == x):
            return False
    return True


def close(a: Any, b: Any, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Same structure and types, tensors allclose: the test off the CPU, where kernels picked for other
    shapes or strides (a fused op split into views, say) may round differently and bits are not promised."""
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            if x.is_floating_point() or x.is_complex():
                if not torch.allclose(x.detach().float(), y.detach().float(), rtol=rtol, atol=atol, equal_nan=True):
                    return False
            elif not torch.equal(x, y):
                return False
        elif not bit_equal(x, y):
            return False
    return True


def _on_cpu(values: Any) -> bool:
    return all(t.device.type == "cpu" for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor))


def split_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for a call from example inputs given as a tensor, a tuple or a dict of keywords."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _fresh(x: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _snapshot(x: Any) -> Any:
    """Detached copies of the tensors in ``x`` (a record that holds no autograd graph)."""
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, x)


@contextmanager
def kept(model: nn.Module) -> Iterator[None]:
    """Parameters, buffers (BatchNorm statistics) and attributes restored on exit: a check leaves the model as
    it found it, also where its forward writes its own weights."""
    from seqify.frontend.preserve import preserved  # Python attributes too (a step counter the forward bumps)

    with buffers_kept(model, parameters=True), preserved(model):
        yield


def state(model: nn.Module) -> dict[str, Any]:
    """What a forward can change that a converted model cannot carry, by ``module.path.attribute``: each plain
    attribute's object (a tensor's in-place version too) and the items of dict and list attributes.
    Parameters and buffers are left out: a converted model updates the source's own."""
    found: dict[str, Any] = {}
    for path, m in model.named_modules():
        for name, value in m.__dict__.items():
            if name.startswith("_") or name == "training":
                continue
            where = f"{path}.{name}".lstrip(".")
            if isinstance(value, torch.Tensor):
                found[where] = (id(value), value._version)
            elif type(value) is dict:
                found[where] = (id(value), tuple((k, id(v)) for k, v in value.items()))
            elif type(value) is list:
                found[where] = (id(value), tuple(id(v) for v in value))
            else:
                found[where] = id(value)
    return found


def _changed(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """The first attribute whose value a call changed (None: none did)."""
    return next((k for k in after if before.get(k, _NONE) != after[k]), None)


_NONE = object()


def _run(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], seed: int, grad: bool = False) -> Any:
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(grad):
        torch.manual_seed(seed)
        return fn(*_fresh(args), **_fresh(kwargs))


def _leaf_outputs(
    model: nn.Module, modules: dict[int, str], call: Callable[[], Any]
) -> tuple[Any, dict[str, list[Any]]]:
    """Run ``call`` recording the outputs of the given modules (by path, in call order)."""
    seen: dict[str, list[Any]] = defaultdict(list)
    handles = []
    for m in model.modules():
        if id(m) in modules and not isinstance(m, torch.jit.ScriptModule):  # TorchScript takes no hooks
            path = modules[id(m)]
            handles.append(m.register_forward_hook(lambda _m, _i, out, path=path: seen[path].append(_snapshot(out))))
    try:
        out = call()
    finally:
        for h in handles:
            h.remove()
    return out, seen


def first_difference(source: nn.Module, seq: nn.Module, example_inputs: Any, seed: int = 0) -> str | None:
    """None when ``seq`` computes bit-equal outputs to ``source`` on the example; else a sentence naming the
    first source module (and the layer holding it) whose output differs, or the output itself."""
    found = _difference(source, seq, example_inputs, seed)
    return None if found is None else found[0]


SECOND = "<second call>"  # _difference's path when only a second call differs
UPDATED = "<buffer update>"  # ... and the first call changed a buffer of the source's own code


def _difference(source: nn.Module, seq: nn.Module, example_inputs: Any, seed: int,
                twice: bool = False) -> tuple[str, str | None] | None:
    """:func:`first_difference`'s sentence and the path of the source module it names (None: the output);
    with ``twice``, where a first call changes Python state, a second call of each is compared too (path
    :data:`SECOND` when only that differs; :data:`UPDATED` where the first call updated a buffer)."""
    args, kwargs = split_inputs(example_inputs)
    layers = dict(seq.named_children())
    by_name = {p.replace(".", "_"): p for p, _ in source.named_modules() if p}
    # Source modules a layer is named after (the layer is that module, or stands in for it).
    paths = {id(m): p for p, m in source.named_modules() if p and not any(True for _ in m.children())}
    watched = {id(layer): name for name, layer in layers.items() if name in by_name}
    trains = _trainable(source, seq)
    mode = False  # values compared without gradients; with them where the source needs them (autograd.grad)
    with kept(source):
        before = state(source) if twice else {}
        held = _own_buffers(source) if twice else {}
        try:
            expected, want = _leaf_outputs(source, paths, lambda: _run(source, args, kwargs, seed))
        except Exception as e:
            if not trains:  # the inputs are wrong, not the conversion: say so, not "report a seqify bug"
                raise raises_itself(type(source).__name__, e) from e
            mode = True
            expected, want = _source_values(source, paths, args, kwargs, seed, grad=True)
        # a call that changed Python state (a counter, a value kept in a dict or list): the next call may differ
        changed = _changed(before, state(source)) if twice else None
        buffers = {n: b.detach().clone() for n, b in source.named_buffers()}  # as the source's call left them
        # a buffer the forward updates itself: an update the conversion lost may be invisible in a first call
        # (``avg.mul_(0.9)`` on zeros), never in the second
        updated = None if changed else next((n for n, b in held.items() if not bit_equal(b, buffers[n])), None)
        changed = changed or (f"buffer {updated}" if updated else None)
        again = _run(source, args, kwargs, seed, grad=mode) if changed else None
    with kept(source), _grads_aside(trains if mode else []):
        got, have = _leaf_outputs(seq, watched, lambda: _run(seq, args, kwargs, seed, grad=mode))
        got = _snapshot(got)
        left = {n: b.detach().clone() for n, b in source.named_buffers()}  # as the result's call left them
        got_again = _run(seq, args, kwargs, seed, grad=mode) if changed else None
    same = bit_equal if _on_cpu(expected) else close  # bit-equal on the CPU; allclose on accelerators
    if same(expected, got):
        moved = next((n for n in buffers if n in left and not same(buffers[n], left[n])), None)
        if moved is not None:  # a BatchNorm counter or statistic the conversion does not update as the source
            owner = moved.rpartition(".")[0] or None
            return f"the outputs are equal but buffer {moved!r} is not after the call (BatchNorm statistics?)", owner
        if changed and not same(again, got_again):
            return (f"the first call is equal, the second is not: the source's first call changed {changed!r}, "
                    "and its second call computes with that (state kept between calls), which the converted "
                    "model does not carry; it would match a first call only"), UPDATED if updated else SECOND
        return _gradient_pass(source, seq, args, kwargs, seed, trains, same) if trains else None
    for name in layers:
        path = by_name.get(name)
        if name not in have or path not in want:
            continue
        if pytree.tree_structure(want[path]) != pytree.tree_structure(have[name]):
            # the layer returns more than its module (values it carries on): its module's values are among them
            if _carries(want[path], have[name], same) is False:
                return f"layer {name!r} (source module {path!r}) computes a different value", path
            continue
        if not same(want[path], have[name]):
            return f"layer {name!r} (source module {path!r}) computes a different value", path
    last = next(reversed(layers)) if layers else "?"
    return f"the output differs (no layer named after a source module differs before it; last layer {last!r})", None


def _own_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the buffers a model's own code may update (normalisation layers' statistics left out: torch
    updates those inside one module call, which every conversion keeps whole)."""
    norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    return {f"{path}.{n}".lstrip("."): b.detach().clone() for path, m in model.named_modules()
            if not isinstance(m, norms) for n, b in m.named_buffers(recurse=False) if not b.is_meta}


def _trainable(source: nn.Module, seq: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a backward reaches, by name (the source's names first, then any the result holds beside
    them); none where gradients cannot be taken here (inference mode, or no parameter requires them)."""
    if torch.is_inference_mode_enabled():
        return []
    named: dict[int, tuple[str, nn.Parameter]] = {}
    for model, owner in ((source, ""), (seq, "the converted model's ")):
        for name, p in model.named_parameters(remove_duplicate=False):
            if p.requires_grad and not p.is_meta:
                named.setdefault(id(p), (f"{owner}{name}", p))
    return list(named.values())


@contextmanager
def _grads_aside(params: list[tuple[str, nn.Parameter]]) -> Iterator[None]:
    """Each parameter's ``.grad`` set aside on entry and put back on exit: a check accumulates nothing."""
    saved = [(p, p.grad) for _, p in params]
    for p, _ in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in saved:
            p.grad = grad


def _source_values(source: nn.Module, paths: dict[int, str], args: tuple[Any, ...], kwargs: dict[str, Any],
                   seed: int, grad: bool) -> tuple[Any, dict[str, list[Any]]]:
    """The source's outputs (its inputs are wrong if it raises even so)."""
    try:
        return _leaf_outputs(source, paths, lambda: _snapshot(_run(source, args, kwargs, seed, grad=grad)))
    except Exception as e:
        raise raises_itself(type(source).__name__, e) from e


def _gradient_pass(source: nn.Module, seq: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], seed: int,
                   params: list[tuple[str, nn.Parameter]], same: Callable[[Any, Any], bool],
                   ) -> tuple[str, str | None] | None:
    """Source and result run again with gradients, each followed by a backward: their outputs must still agree
    (a forward may branch on ``torch.is_grad_enabled()``) and so must every parameter's gradient."""
    runs = []
    for model in (source, seq):
        with kept(source), _grads_aside(params):
            try:
                out = _run(model, args, kwargs, seed, grad=True)
            except Exception:
                if model is source:
                    return None  # the source runs only without gradients (inference code): nothing to train
                raise
            runs.append((_snapshot(out), _gradients(out, params)))
    (expected, wanted), (got, made) = runs
    if wanted is None:
        return None  # the source's own backward raises on this output: it does not train this way
    if not same(expected, got):
        return ("the outputs are equal without gradients and differ with them (a branch on "
                "torch.is_grad_enabled() that the conversion resolved for one mode?)"), None
    return _gradient_difference(source, seq, params, wanted, made)


def _projection(out: Any) -> torch.Tensor | None:
    """A scalar that every floating output element reaches with its own weight (fixed random weights, so that
    no gradient cancels by symmetry); None where no output requires a gradient."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return None
    draw = torch.Generator().manual_seed(0)
    total = None
    for t in leaves:
        w = torch.rand(t.shape, generator=draw, dtype=torch.float64).to(device=t.device, dtype=t.dtype) + 0.5
        term = (t * w).sum().to(torch.float64) if not t.is_complex() else (t * w).real.sum().to(torch.float64)
        total = term if total is None else total + term
    return total


def _gradients(out: Any, params: list[tuple[str, nn.Parameter]]) -> list[torch.Tensor | None] | None:
    """Each parameter's gradient of :func:`_projection` of ``out`` (None where it gets none), taken by an
    ordinary backward (hooks run, ``.grad`` accumulates, as in training) and set aside again; None where
    nothing requires a gradient or the backward itself raises (the source then cannot train on this)."""
    if not params:
        return None
    loss = _projection(out)
    if loss is None:
        return [None] * len(params)
    try:
        loss.backward()
    except Exception:
        return None
    grads = [p.grad for _, p in params]
    for _, p in params:
        p.grad = None
    return grads


def _agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Gradients equal within float tolerance (relative to the gradient's largest element: a sum taken in
    another order rounds differently, a lost region or hook changes it by a factor)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    x, y = a.detach().to_dense().double(), b.detach().to_dense().double()
    tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(a.dtype, 2e-2)
    scale = float(x.abs().max()) if x.numel() else 0.0
    return bool(((x - y).abs().max() <= tol * scale + 1e-30).item()) if x.numel() else True


def _gradient_difference(source: nn.Module, seq: nn.Module, params: list[tuple[str, nn.Parameter]],
                         wanted: list[torch.Tensor | None], made: list[torch.Tensor | None] | None,
                         ) -> tuple[str, str | None] | None:
    """The first parameter whose gradient differs between the source's backward and the result's."""
    if made is None:
        return ("the outputs are equal but the converted model's backward raises where the source's runs "
                "(an in-place update of a value its backward needs?)"), None
    for (name, _), a, b in zip(params, wanted, made):
        owner = name.rpartition(".")[0] or None
        if a is None and b is None:
            continue
        if a is None or b is None:
            has, lacks = ("the converted model", "the source") if a is None else ("the source", "the converted model")
            return (f"the outputs are equal but parameter {name!r} gets a gradient in {has} and none in {lacks} "
                    "(a no_grad region, detach, hook or requires_grad_ call that the conversion does not keep?)"), owner
        if not _agree(a, b):
            ratio = float(b.double().norm() / a.double().norm()) if float(a.double().norm()) else float("inf")
            return (f"the outputs are equal but the gradient of parameter {name!r} differs (norm ratio "
                    f"{ratio:.4g}: a tensor hook, a no_grad region or a detach the conversion does not keep?)"), owner
    return None


def _carries(expected: Any, got: Any, same: Callable[[Any, Any], bool]) -> bool | None:
    """Whether a layer's outputs ``got`` (its module's values and values it carries on) hold each tensor its
    source module returned (``expected``): False when some such tensor has candidates of its shape and dtype
    among them and none is the same; None when one has no candidate (not comparable)."""
    mine = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    for e in pytree.tree_leaves(expected):
        if not isinstance(e, torch.Tensor):
            continue
        candidates = [t for t in mine if t.shape == e.shape and t.dtype == e.dtype]
        if not candidates:
            return None
        if not any(same(e, t) for t in candidates):
            return False
    return True


def check(source: nn.Module, seq: nn.Module, example_inputs: Any, *, frontend: str = "", seed: int = 0) -> None:
    """Raise :class:`VerifyError` unless ``seq`` matches ``source`` bit for bit on ``example_inputs``
    (a model or inputs on the meta device hold no values: it warns that nothing was checked)."""
    tensors = list(source.parameters()) + list(source.buffers()) + [
        t for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)
    ]
    if any(t.is_meta for t in tensors):
        warnings.warn(
            f"the {type(source).__name__} or its example inputs are on the meta device (shapes, no values), so "
            "seqify.convert could not check the converted model's outputs against the source's: this conversion "
            "is not verified. Convert a real instance of the same code once to check it; pass verify=False to "
            "say that you know", stacklevel=3)
        return
    try:
        found = _difference(source, seq, example_inputs, seed, twice=True)
    except (VerifyError, ExampleInputError):
        raise
    except Exception as e:
        note = f" (from the {frontend} frontend)" if frontend else ""
        diverged = [o for o in getattr(seq, "opaque", ()) if o.diverged]
        cause = (
            f". The trace kept {diverged[0].path} whole because an op in it failed on the example values: the "
            "traced code before it took a path the source does not take on this example (transformers builds "
            "attention masks differently when traced), so it gets inputs the source never gives it. Keep the "
            f"module that makes its inputs whole too (leaf_paths=[{diverged[0].path.rpartition('.')[0]!r}, or "
            "an outer one]) or try the other frontend (frontend='fx' or 'export')"
        ) if diverged else (
            ". Report this as a seqify bug; meanwhile try the other frontend (frontend='fx' or 'export') or keep "
            "the failing submodule whole (leaf_paths=[...])"
        )
        raise VerifyError(
            f"the converted {type(source).__name__}{note} crashes on the example inputs where the source runs: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{cause}"
        ) from e
    if found is not None and found[1] == UPDATED:
        note = f" made by the {frontend} frontend" if frontend else ""
        raise VerifyError(
            f"the converted {type(source).__name__}{note} does not compute what the source computes on a second call "
            f"with the example inputs: {found[0]}. The conversion lost part of the forward's in-place update of that "
            "buffer; convert with frontend='export' (or 'auto'), which records in-place updates, or keep the module "
            "that updates it whole (leaf_paths=[...])"
        )
    if found is not None and found[1] == SECOND:
        note = f" made by the {frontend} frontend" if frontend else ""
        raise VerifyError(
            f"the converted {type(source).__name__}{note} does not compute what the source computes on a second call "
            f"with the example inputs: {found[0]}. Keep such state in a buffer updated in place (the converted "
            "model updates the source's buffers) or inside a submodule that changes it (the fx frontend keeps "
            "such a submodule whole, as one layer), or reset it at the start of forward; pass verify=False to "
            "accept a model that matches a first call only"
        )
    if found is not None:
        difference, path = found
        note = f" made by the {frontend} frontend" if frontend else ""
        trains = "gradient" in difference or "backward" in difference
        accept = ("; verify=False would return a model that trains differently from the source: use it only for "
                  "inference") if trains else ", or pass verify=False to accept it"
        error = VerifyError(
            f"the converted {type(source).__name__}{note} does not compute what the source computes on the example "
            f"inputs: {difference}. Try the other frontend (frontend='fx' or 'export') or keep that module whole "
            f"(leaf_paths=[...]){accept}"
        )
        error.module_path = path
        raise error
