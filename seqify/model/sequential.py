"""seqify.Sequential: the converted model, an nn.Sequential that computes exactly what its source did."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from seqify.errors import HookError, MetaDeviceError, ModeError, SeqifyError, StateDictError
from seqify.model.guard import Guard
from seqify.model.hooks import HOOK_DICTS, recording_hook
from seqify.model.signature import InputSpec, OutputSpec
from seqify.skip.namespace import Namespace
from seqify.skip.tracker import SkipTracker, use_tracker

__all__ = ["Sequential", "SkipInfo", "OpaqueInfo", "ExportedInfo", "tied_slots", "retie", "meta_tensor"]

Slot = tuple[nn.Module, str, str]  # (module, "_parameters" or "_buffers", name)


def tied_slots(root: nn.Module) -> list[list[Slot]]:
    """Groups of places that hold one tensor object (two or more per group).

    Converted layers share tensors with each other and with the source's modules (a weight read directly
    in forward, a buffer read by a generated layer). ``Module._apply`` converts every place on its own
    and registers what it makes per place: buffers always, parameters when moving to or from the meta
    device. :func:`retie` makes each group share one tensor again.
    """
    groups: dict[int, list[Slot]] = {}
    for m in root.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(m, kind).items():
                if t is not None:
                    groups.setdefault(id(t), []).append((m, kind, name))
    return [g for g in groups.values() if len(g) > 1]


def retie(groups: list[list[Slot]]) -> None:
    """Point every place of each group at the tensor its first place holds now."""
    for (m, kind, name), *rest in groups:
        t = getattr(m, kind)[name]
        for m2, kind2, name2 in rest:
            getattr(m2, kind2)[name2] = t


def meta_tensor(module: nn.Module) -> str | None:
    """The qualified name of the first parameter or buffer of ``module`` on the meta device, if any."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.is_meta:
            return name
    return None


@dataclass(frozen=True)
class SkipInfo:
    """A value that skips ahead: stashed by layer ``stash``, popped by layer ``pop``."""

    name: str
    stash: str
    pop: str
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    kind: str = "tensor"

    def __str__(self) -> str:
        what = f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}" if self.shape is not None else self.kind
        return f"{self.name}: {self.stash} -> {self.pop} [{what}]"


@dataclass(frozen=True)
class OpaqueInfo:
    """A submodule kept whole as one layer, and why."""

    layer: str
    path: str
    type: str
    reason: str
    diverged: bool = False  # an op in it failed on the example values while tracing (another path than the source's)

    def __str__(self) -> str:
        return f"{self.layer} <- {self.path} ({self.type}): {self.reason}"


@dataclass(frozen=True)
class ExportedInfo:
    """A submodule of an fx conversion that fx could not trace (or whose fx layers failed the self-check),
    made into layers by the export frontend."""

    path: str
    type: str
    reason: str  # what went wrong with fx there
    layers: tuple[str, ...]
    mode_dependent: bool = False  # its export graph differs between train and eval mode

    def __str__(self) -> str:
        span = self.layers[0] if len(self.layers) == 1 else f"{self.layers[0]} .. {self.layers[-1]}"
        mode = "; its graph differs between train and eval (mode-dependent)" if self.mode_dependent else ""
        return f"{self.path} ({self.type}) -> {len(self.layers)} layers {span}; fx: {self.reason}{mode}"


class _Unused(nn.Module):
    """Parameters and buffers of the source that its forward never reads (kept for checkpoints)."""


class Sequential(nn.Sequential):
    """A converted model: layers that each take and return a tensor or a tuple of tensors.

    Calling it binds the arguments like the source's ``forward``, runs the layers in order with a
    fresh skip tracker, and rebuilds the source's output structure. ``skips``, ``opaque`` and ``guards``
    describe the conversion; ``original_state_dict`` and ``load_original_state_dict`` speak the source's
    checkpoint keys.
    """

    _unused: _Unused  # a plain attribute (set with object.__setattr__), not a submodule

    def __init__(
        self,
        layers: OrderedDict[str, nn.Module],
        *,
        inputs: InputSpec,
        entry: list[int],
        outputs: OutputSpec,
        namespace: Namespace,
        skips: list[SkipInfo],
        opaque: list[OpaqueInfo],
        guards: list[Guard],
        state_map: OrderedDict[str, tuple[tuple[str, str], ...]],
        unused: _Unused,
        training: bool,
        mode_dependent: bool,
        source: str,
        flattened: Sequence[tuple[str, nn.Module]] = (),
    ) -> None:
        super().__init__(layers)
        self.input_spec = inputs
        self.entry = entry
        self.output_spec = outputs
        self.namespace = namespace
        self.skips = skips
        self.opaque = opaque
        self.guards = guards
        self._state_map = state_map
        object.__setattr__(self, "_unused", unused)
        self.converted_training = training
        self.mode_dependent = mode_dependent
        #: the layers whose ops differ between train and eval mode: each runs those of the mode it runs in
        self.two_mode_layers: tuple[str, ...] = ()
        #: why the other mode could not be traced, where it could not (the error's message)
        self.other_mode_error = ""
        self.source = source
        self.training = training
        #: per layer, the source module paths whose code it runs (set by conversion; empty when unknown)
        self.layer_paths: dict[str, tuple[str, ...]] = {}
        #: per layer, the frontend that made it ("fx" or "export"); ``frontend`` names them all ("fx+export")
        self.layer_frontends: dict[str, str] = {}
        self.frontend = "fx"
        #: submodules fx could not trace that the export frontend made into layers (frontend="auto")
        self.exported: list[ExportedInfo] = []
        # The hook dicts of the source modules conversion flattened (their forwards became layers): a hook
        # registered there after conversion would never run, so calls check that they stay empty.

        self._flattened = tuple((path or "", type(m).__name__) for path, m in flattened)
        self._hook_dicts = tuple(tuple(getattr(m, h) for h in HOOK_DICTS) for _, m in flattened)
        self._any_hooks = tuple(d for ds in self._hook_dicts for d in ds)

    # -- running -------------------------------------------------------------------------------------

    def flatten_inputs(self, *args: Any, **kwargs: Any) -> Any:
        """What the first layer receives for ``self(*args, **kwargs)``: a tensor or a tuple of tensors."""
        self._check_mode()
        if any(getattr(self, "_any_hooks", ())):
            self._hooks_added()
        flat = self.input_spec.flatten(args, kwargs)
        if len(self.entry) == 1:
            return flat[self.entry[0]]
        return tuple(flat[i] for i in self.entry)

    def input_names(self) -> list[str] | None:
        """The source's name for each tensor :meth:`flatten_inputs` returns, for messages; None where unknown."""
        try:
            names = self.input_spec.tensor_names()
            return [names[i] for i in self.entry]
        except IndexError:  # names and flat inputs disagree: no names rather than wrong ones
            return None

    def unflatten_outputs(self, carried: Any) -> Any:
        """The source's output structure from what the last layer returns."""
        return self.output_spec.unflatten(carried)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = self.flatten_inputs(*args, **kwargs)
        inputs = x
        name = ""  # the layer running, for the error note
        try:
            with use_tracker(SkipTracker()):
                for name, layer in self._modules.items():  # noqa: B007  (name: read where a layer fails)
                    x = layer(x)
        except Exception as e:
            self._failed(e, name, inputs)
            raise
        return self.output_spec.unflatten(x)

    def _failed(self, error: Exception, name: str, inputs: Any) -> None:
        """A layer raised: a model on the meta device gets a MetaDeviceError; anything else keeps its
        type and gains a note naming the layer (Python >= 3.11)."""
        if isinstance(error, SeqifyError):
            return
        meta = meta_tensor(self)
        given = [t for t in (inputs if isinstance(inputs, tuple) else (inputs,)) if isinstance(t, torch.Tensor)]
        if meta is not None and any(not t.is_meta for t in given):
            raise MetaDeviceError(
                f"layer {name!r} of the converted {self.source} failed: {meta} is on the meta device (shapes, no "
                f"data) and the inputs are on {given[0].device}. Materialise the weights first: "
                "seq.to_empty(device='cpu') (or 'cuda'), then initialise them (reset_parameters() on the source's "
                "modules, which seq shares) or load a checkpoint (seq.load_original_state_dict(torch.load(path)) "
                "or seq.load_state_dict(...)). Inputs on the meta device run it for shapes only."
            ) from error
        if hasattr(error, "add_note"):
            error.add_note(f"in layer {name!r} of the converted {self.source} (seqify.Sequential)")

    def _hooks_added(self) -> None:

        for (path, kind), dicts in zip(self._flattened, self._hook_dicts):
            if any(not recording_hook(f) for d in dicts for f in d.values()):
                where = f"submodule {path!r} ({kind})" if path else f"the source model itself ({kind})"
                raise HookError(
                    f"a hook was registered on {where} after conversion; seqify.convert flattened that module's "
                    "forward into layers, so the hook would never run. Remove the hook, or register it before "
                    "converting (a submodule with hooks is kept whole as one layer and its hooks run), or hook "
                    "the converted layers themselves (seq.<layer>.register_forward_hook(...))."
                )

    def _check_mode(self) -> None:
        if self.mode_dependent and self.training != self.converted_training:
            now, then = ("train", "eval") if self.training else ("eval", "train")
            why = getattr(self, "other_mode_error", "")
            if why:
                raise ModeError(
                    f"this conversion of {self.source} was made in {then} mode and runs in {now} mode, which "
                    f"cannot be traced: {why}"
                )
            raise ModeError(
                f"{self.source}'s forward computes different ops in train and eval mode (it reads "
                f"self.training in traced code), and this conversion was made in {then} mode but runs in "
                f"{now} mode. Convert a second time with the source in {now} mode: both conversions share "
                "the same parameters."
            )

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Sequential:
        groups = tied_slots(self)
        super()._apply(fn, recurse)
        self._unused._apply(fn)
        retie(groups)  # .double(), .to(), .to_empty() keep shared tensors shared
        return self

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict`` with the converted model's own keys (``seq.state_dict()``); a
        mismatch raises :class:`StateDictError` (a ``RuntimeError``) that points to
        :meth:`load_original_state_dict` when the keys are the source model's."""
        groups = tied_slots(self) if assign else []
        try:
            result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        except RuntimeError as e:
            if isinstance(e, SeqifyError):
                raise
            source_keys = len((set(state_dict) & set(self._state_map)) - set(super().state_dict(keep_vars=True)))
            hint = (
                f"{source_keys} of the checkpoint's keys are the source {self.source}'s, not the converted layers': "
                "load a checkpoint of the source model with seq.load_original_state_dict(state_dict)"
                if source_keys else
                "seq.state_dict() keys are the converted layers' names; a checkpoint of the source model loads "
                "with seq.load_original_state_dict(state_dict)"
            )
            raise StateDictError(f"{e}\n{hint}") from e
        retie(groups)
        return result

    # -- checkpoints -----------------------------------------------------------------------------------

    def _locate(self, key: str) -> list[tuple[nn.Module, str]]:
        places: Any = self._state_map[key]
        if isinstance(places[0], str):  # saved by seqify 0.1.0: one place per key
            places = (places,)
        return [(self._unused if path == "<unused>" else self.get_submodule(path), name) for path, name in places]

    def _tensors(self, key: str) -> list[torch.Tensor]:
        """The tensor of source key ``key`` (several when a pipeline gave other devices copies of it)."""
        found: dict[int, torch.Tensor] = {}
        for module, name in self._locate(key):
            t: torch.Tensor | None = module._parameters.get(name)
            t = module._buffers[name] if t is None else t
            assert t is not None  # the state map names only slots that hold a tensor
            found.setdefault(id(t), t)
        return list(found.values())

    def _tensor(self, key: str) -> torch.Tensor:
        return self._tensors(key)[0]

    def original_state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The state under the source model's key names, as ``source.state_dict()`` would give it."""
        return OrderedDict((k, self._tensor(k).detach()) for k in self._state_map)

    def original_keys(self) -> list[str]:
        return list(self._state_map)

    def load_original_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load a checkpoint written for the source model (e.g. torchvision weights)."""
        expected = set(self._state_map)
        given = set(state_dict)
        odd = sorted(k for k in expected & given if not isinstance(state_dict[k], torch.Tensor))
        if odd:
            raise StateDictError(
                f"checkpoint values must be tensors; {odd[0]!r} is a {type(state_dict[odd[0]]).__name__}"
                f"{f' (and {len(odd) - 1} more)' if len(odd) > 1 else ''}: pass the state dict itself "
                "(torch.load(path) of a torch.save(model.state_dict(), path))"
            )
        missing = sorted(expected - given)
        unexpected = sorted(given - expected)
        if strict and (missing or unexpected):
            raise StateDictError(
                f"checkpoint does not match {self.source}: "
                + (f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}; " if missing else "")
                + (f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}; " if unexpected else "")
                + "pass strict=False to load the keys that match"
            )
        shapes = [
            f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(self._tensor(k).shape)}"
            for k in sorted(expected & given)
            if self._tensor(k).shape != state_dict[k].shape
        ]
        if shapes:
            raise StateDictError("checkpoint shapes do not match the model: " + "; ".join(shapes[:8]))
        with torch.no_grad():
            for k in expected & given:
                for t in self._tensors(k):
                    t.copy_(state_dict[k])

    # -- description -------------------------------------------------------------------------------------

    def summary(self) -> str:
        """A readable account of the conversion: layers, skips, opaque parts and guards."""
        params = sum(p.numel() for p in self.parameters())
        lines = [
            f"seqify.Sequential from {self.source}: {len(self)} layers, {len(self.skips)} skips, "
            f"{len(self.opaque)} opaque, {params:,} parameters",
            _made_by(getattr(self, "frontend", "fx"), getattr(self, "layer_frontends", {})),
        ]
        exported = getattr(self, "exported", [])
        if exported:
            lines.append("layers made by the export frontend (submodules fx could not trace or got wrong):")
            lines += [f"  {e}" for e in exported]
        if self.opaque:
            lines.append("opaque layers (kept whole):")
            lines += [f"  {o}" for o in self.opaque]
        if self.guards:
            lines.append("valid for inputs where:")
            lines += [f"  {g}" for g in self.guards]
        if self.mode_dependent:
            mode = "train" if self.converted_training else "eval"
            lines.append(f"mode-dependent: converted in {mode} mode, runs only in {mode} mode")
        elif self.two_mode_layers:
            names = ", ".join(self.two_mode_layers[:4]) + (", ..." if len(self.two_mode_layers) > 4 else "")
            lines.append(f"train and eval: {len(self.two_mode_layers)} layer(s) hold the ops of each mode, traced "
                         f"in each ({names})")
        return "\n".join(lines)

    def named_layers(self) -> Iterator[tuple[str, nn.Module]]:
        return iter(self._modules.items())


def _made_by(frontend: str, layers: Mapping[str, str]) -> str:
    """Which frontend made the layers: one, or each with its count ("fx" for 5 layers, "export" for 40)."""
    names = frontend.split("+")
    if len(names) == 1:
        return f"made by the {frontend} frontend"
    counts = {n: sum(1 for f in layers.values() if f == n) for n in names}
    return "made by the " + " and ".join(names) + " frontends (" + ", ".join(
        f"{n}: {c} layer{'s' * (c != 1)}" for n, c in counts.items()) + ")"
