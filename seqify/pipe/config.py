"""PipeConfig: seqify.pipeline's options as one value (what seqify.tune picks, what a run file says), TOML or JSON."""

from __future__ import annotations

import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any

from seqify.errors import ConfigError, MemoryCapError
from seqify.pipe.files import read_table, refuse_unknown, write_table
from seqify.pipe.memory import parse_bytes
from seqify.pipe.placement import CHECKPOINT, STRATEGIES
from seqify.schedule.actions import SCHEDULES, round_robin, v_shape

__all__ = ["Trial", "PipeConfig", "OPTIONS", "trial_table", "megabytes"]

#: The entries a person sets (the others are what the tuner adds); a run file may write them at its top level.
OPTIONS = ("chunks", "loops", "balance", "by", "checkpoint", "graphs", "devices", "gpus", "schedule", "overlap",
           "memory_cap", "deferred_batch_norm", "replicas")


@dataclass(frozen=True)
class Trial:
    """One candidate the tuner considered: its options (``schedule``: one of
    :data:`~seqify.schedule.actions.SCHEDULES`; ``None`` in files from before schedules were tuned means
    GPipe), predicted step seconds, measured step seconds (``None`` when it was not confirmed by timed
    steps), predicted peak bytes on the fullest device and on each pipeline device, and the peak bytes each
    CUDA device allocated and reserved while it was built and timed (empty where not measured);
    ``optimizer_bytes``: what the optimizer holds on each of those devices at the peak of its step in training,
    its state and its step's temporaries (``seqify.tune(..., optimizer=)``; counted in the predicted peaks and,
    beside the measured ones, in the memory bounds);
    ``overlap``: ``pipe.step``'s graphs on two streams per GPU (``seqify.pipeline(overlap=True)``);
    ``replicas``: data-parallel copies of the pipeline (its devices are the whole set's ``1 / replicas``)."""

    chunks: int
    loops: int
    by: str
    checkpoint: str
    graphs: bool
    schedule: str | None
    balance: tuple[int, ...]
    predicted_s: float
    measured_s: float | None = None
    memory_bytes: int = 0
    memory_per_device: tuple[int, ...] = ()
    measured_peak: tuple[int, ...] = ()
    measured_reserved: tuple[int, ...] = ()
    overlap: bool = False
    replicas: int = 1
    optimizer_bytes: tuple[int, ...] = ()

    def held(self) -> tuple[int, ...]:
        """The timed step's allocated peak per CUDA device plus the optimizer state it will hold there in
        training (``optimizer_bytes``, where the tuner was told the optimizer): what training allocates."""
        return self._with_optimizer(self.measured_peak)

    def occupied(self) -> tuple[int, ...]:
        """What the step and the optimizer take of each CUDA device: :meth:`held`, but with CUDA graphs the
        timed step's reserved peak for its allocated one. A replayed step runs in its graphs' memory pools,
        which stay taken while the optimizer steps, and which the allocated peak does not count."""
        return self._with_optimizer(self.measured_reserved if self.graphs else self.measured_peak)

    def _with_optimizer(self, peaks: tuple[int, ...]) -> tuple[int, ...]:
        """``peaks`` per CUDA device plus what the optimizer holds there (``optimizer_bytes``; none when unset)."""
        extra = self.optimizer_bytes or (0,) * len(peaks)
        return tuple(b + o for b, o in zip(peaks, extra))

    def layout(self) -> str:
        """The options but the schedule: ``2 x 2, chunks 4, loops 1, by time, checkpoint never`` (stages x
        replicas first where there are replicas; graphs and overlap last)."""
        text = f"chunks {self.chunks}, loops {self.loops}, by {self.by}, checkpoint {self.checkpoint}"
        if self.replicas > 1:
            text = f"{len(self.balance) // self.loops} x {self.replicas}, {text}"
        return text + (", graphs" if self.graphs else "") + (", overlap" if self.overlap else "")

    def label(self) -> str:
        """A short name: :meth:`layout` and the schedule."""
        return f"{self.layout()}, {self.schedule or 'gpipe'}"


@dataclass(frozen=True)
class PipeConfig:
    """How to run a model as a pipeline: ``seqify.pipeline``'s options, as ``seqify.tune`` chose them or as a
    file says them. Pass it as ``seqify.pipeline(model, config=cfg)``.

    Options (each means what the keyword of :func:`seqify.pipeline` means): ``chunks`` (a number, or
    ``"auto"``: tune the rest); ``loops``; ``balance``: layers per partition (``len(devices) * loops``
    entries), empty to balance ``by`` a strategy ('params' when ``None``); ``checkpoint``; ``graphs``;
    ``devices``: one per device (partitions are placed round-robin ``loops`` times over them), or ``gpus``,
    or neither (every GPU, else CPU); ``schedule``: the order ``pipe.step`` runs (``None``: GPipe's, or the
    tuner's choice with ``chunks="auto"``); ``overlap``; ``memory_cap``; ``deferred_batch_norm``; ``replicas``:
    data-parallel copies of the pipeline, each on ``len(devices) / replicas`` consecutive devices (1: one
    pipeline over every device; as many as devices: plain data parallelism).

    What the tuner adds: ``batch``: the mini-batch the choice was made for (0 when written by hand);
    ``predicted_s`` / ``measured_s``: the chosen candidate's step time; ``memory_per_device``: its predicted
    peak bytes per pipeline device; ``trials``: every candidate confirmed by timed steps plus the best
    predicted ones that were not (the chosen one included); ``key``: the cache key it is stored under.

    Every entry is checked when the configuration is made: a wrong one raises :class:`~seqify.ConfigError`
    naming it. :meth:`to_file` and :meth:`from_file` write and read TOML (``.toml``) or JSON.
    """

    chunks: int | str = 1
    loops: int = 1
    balance: tuple[int, ...] = ()
    by: str | None = None
    checkpoint: str = "except_last"
    graphs: bool = False
    devices: tuple[str, ...] = ()
    batch: int = 0
    predicted_s: float = 0.0
    measured_s: float | None = None
    schedule: str | None = None
    memory_per_device: tuple[int, ...] = ()
    overlap: bool = False
    trials: tuple[Trial, ...] = field(default=(), compare=False)
    key: str = field(default="", compare=False)
    gpus: int | None = None
    memory_cap: int | float | str | None = None
    deferred_batch_norm: bool = False
    replicas: int = 1

    def __post_init__(self) -> None:
        for name, value in _normalized(self).items():
            object.__setattr__(self, name, value)

    @property
    def fixed(self) -> bool:
        """Whether it names one pipeline outright (chunks, balance and devices given; no memory cap to fit),
        as the tuner's choices do: ``seqify.pipeline`` then builds it without measuring anything."""
        return isinstance(self.chunks, int) and bool(self.balance) and bool(self.devices) and self.gpus is None \
            and self.memory_cap is None

    @property
    def placement(self) -> tuple[int, ...]:
        """Each partition's device number: round-robin ``loops`` times over ``devices``, or a V (down the
        devices and back) for ZB-H1 with two partitions per device, as :func:`seqify.pipeline` places them."""
        if not self.devices:
            raise ConfigError("this configuration names no devices, so its placement is not known yet; add "
                              "devices = [...] or build it with seqify.pipeline(model, config=cfg)")
        stages = len(self.devices) // self.replicas
        if self.schedule == "zb-h1" and self.loops == 2:
            return v_shape(stages)
        return round_robin(stages, self.loops)

    @property
    def partitions(self) -> list[str]:
        """The device of every partition of the first replica (see :attr:`placement`)."""
        return [self.devices[d] for d in self.placement]

    def options(self) -> dict[str, Any]:
        """Keyword arguments of ``seqify.pipeline`` that build this configuration. With ``chunks="auto"``,
        options at their defaults (no ``schedule``, ``overlap`` off) are left to the tuner, as there."""
        auto = self.chunks == "auto"
        return dict(gpus=self.gpus, devices=list(self.devices) or None, loops=self.loops,
                    balance=list(self.balance) or self.by, chunks=self.chunks, checkpoint=self.checkpoint,
                    graphs=self.graphs, schedule=self.schedule if auto else self.schedule or "gpipe",
                    overlap=(self.overlap or None) if auto else self.overlap, memory_cap=self.memory_cap,
                    deferred_batch_norm=self.deferred_batch_norm,
                    replicas=(None if self.replicas == 1 else self.replicas) if auto else self.replicas)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "the pipeline configuration") -> PipeConfig:
        """The inverse of :meth:`to_dict`, from any subset of the entries (the rest take their defaults);
        ``balance`` may name a strategy (``"time"``) as in ``seqify.pipeline``. An unknown or wrong entry
        raises :class:`~seqify.ConfigError` naming it and ``where``."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a table of entries, not a {type(data).__name__}")
        refuse_unknown(data, [f.name for f in fields(cls)], where)
        try:
            return cls(**data)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write the configuration: TOML to a ``.toml`` path, else JSON. :meth:`from_file` reads it back equal."""
        write_table(path, self.to_dict())

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PipeConfig:
        """Read a configuration from TOML (a ``.toml`` path) or JSON: what :meth:`to_file` wrote, one written by
        hand, or a run file's ``[pipeline]`` table (``seqify.Config``)."""
        data = read_table(path, "pipeline configuration")
        where = os.fspath(path)
        if isinstance(data.get("pipeline"), dict) and "model" in data:  # a run file: its pipeline table
            data, where = data["pipeline"], f"{where} [pipeline]"
        return cls.from_dict(data, where)

    def save(self, path: str | os.PathLike[str]) -> None:
        """:meth:`to_file`."""
        self.to_file(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PipeConfig:
        """:meth:`from_file`."""
        return cls.from_file(path)

    def without_trials(self) -> PipeConfig:
        return replace(self, trials=())

    def __str__(self) -> str:
        where = f"{len(self.devices)} devices ({', '.join(self.devices)})" if self.devices else \
            f"{self.gpus} GPUs" if self.gpus else "default devices"
        if self.replicas > 1:
            where += f" as {self.replicas} replicas of a pipeline"
        balance = f"balance by {self.by or 'params'}" + (f" {list(self.balance)}" if self.balance else "")
        head = (f"PipeConfig: {where}, chunks {self.chunks}, loops {self.loops}, {balance}, "
                f"checkpoint {self.checkpoint!r}, graphs {self.graphs}{', overlap' if self.overlap else ''}, "
                f"schedule {self.schedule or 'gpipe'!r}"
                + (f", memory cap {self.memory_cap}" if self.memory_cap is not None else "")
                + (", deferred batch norm" if self.deferred_batch_norm else ""))
        if self.batch:
            measured = f", measured {self.measured_s * 1e3:.2f} ms" if self.measured_s is not None else ""
            head += (f"; batch {self.batch}: predicted {self.predicted_s * 1e3:.2f} ms per step{measured}"
                     + (f", peak {megabytes(self.memory_per_device)} MiB per device" if self.memory_per_device
                        else ""))
        if not self.trials:
            return head
        return head + "\n" + trial_table(self.trials, chosen=self)


#: Each entry's type: what a file may give for it (``None`` only where the default is ``None``).
_TYPES: dict[str, tuple[type, ...]] = {
    "chunks": (int, str), "loops": (int,), "balance": (list, tuple, str), "by": (str,), "checkpoint": (str,),
    "graphs": (bool,), "devices": (list, tuple), "batch": (int,), "predicted_s": (int, float),
    "measured_s": (int, float), "schedule": (str,), "memory_per_device": (list, tuple), "overlap": (bool,),
    "trials": (list, tuple), "key": (str,), "gpus": (int,), "memory_cap": (int, float, str),
    "deferred_batch_norm": (bool,), "replicas": (int,),
}


def _normalized(cfg: PipeConfig) -> dict[str, Any]:
    """``cfg``'s entries checked (:class:`ConfigError` naming the first wrong one) and in their stored form:
    tuples for lists, a strategy given as ``balance`` moved to ``by``, trials as :class:`Trial`."""
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    for f in fields(cfg):
        if out[f.name] is not None or f.default is not None:
            _check_type(f.name, out[f.name])
    if isinstance(out["balance"], str):
        out["by"], out["balance"] = _strategy(out["balance"], out["by"]), ()
    out["balance"] = _counts("balance", out["balance"], 1)
    out["memory_per_device"] = _counts("memory_per_device", out["memory_per_device"], 0)
    out["devices"] = tuple(out["devices"])
    out["predicted_s"] = float(out["predicted_s"])
    out["measured_s"] = None if out["measured_s"] is None else float(out["measured_s"])
    out["trials"] = tuple(t if isinstance(t, Trial) else _trial(t) for t in out["trials"])
    _check_choices(out)
    return out


def _check_type(name: str, value: Any) -> None:
    kinds = _TYPES[name]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ConfigError(f"{name} = {value!r} should be of type {' or '.join(k.__name__ for k in kinds)}")


def _strategy(balance: str, by: str | None) -> str:
    """A strategy given as ``balance``, as ``seqify.pipeline`` takes it: the configuration's ``by``."""
    if balance not in STRATEGIES:
        raise ConfigError(f"balance = {balance!r}: give layer counts per partition or one of {list(STRATEGIES)}")
    if by not in (None, balance):
        raise ConfigError(f"balance = {balance!r} and by = {by!r} name two strategies: keep one")
    return balance


def _counts(name: str, values: Any, least: int) -> tuple[int, ...]:
    if any(isinstance(v, bool) or not isinstance(v, int) or v < least for v in values):
        raise ConfigError(f"{name} = {list(values)!r}: give whole numbers >= {least}")
    return tuple(values)


def _check_choices(out: dict[str, Any]) -> None:
    """Entries whose value must be one of a few, or in a range."""
    chunks = out["chunks"]
    if chunks != "auto" and (isinstance(chunks, str) or chunks < 1):
        raise ConfigError(f'chunks = {chunks!r}: give micro-batches per mini-batch (a whole number >= 1) or "auto"')
    for name, least in (("loops", 1), ("gpus", 1), ("batch", 0), ("replicas", 1)):
        if out[name] is not None and out[name] < least:
            raise ConfigError(f"{name} = {out[name]!r}: give a whole number >= {least}")
    given = ("given",) if out["balance"] else ()  # the tuner's name for a balance it was handed
    for name, choices in (("by", STRATEGIES + given), ("checkpoint", CHECKPOINT), ("schedule", SCHEDULES)):
        if out[name] is not None and out[name] not in choices:
            raise ConfigError(f"{name} = {out[name]!r}: choose one of {list(choices)}")
    if not all(isinstance(d, str) and d for d in out["devices"]):
        raise ConfigError(f"devices = {list(out['devices'])!r}: give device names such as \"cuda:0\" or \"cpu\"")
    if out["gpus"] is not None and out["devices"]:
        raise ConfigError(f"gpus = {out['gpus']} and devices = {list(out['devices'])}: give one of them")
    width = len(out["devices"]) or out["gpus"]
    if width and width % out["replicas"]:
        raise ConfigError(f"replicas = {out['replicas']} does not divide the {width} devices: each replica takes an "
                          "equal group of them")
    if out["memory_cap"] is not None:
        try:
            parse_bytes(out["memory_cap"])
        except MemoryCapError as e:
            raise ConfigError(str(e)) from None


def _trial(data: Any) -> Trial:
    """A :class:`Trial` from its :func:`dataclasses.asdict` form."""
    if not isinstance(data, dict):
        raise ConfigError(f"trials: each trial is a table of entries, not {data!r}")
    names = [f.name for f in fields(Trial)]
    refuse_unknown(data, names, "a trial")
    missing = sorted(f.name for f in fields(Trial) if f.name not in data and f.default is MISSING)
    if missing:
        raise ConfigError(f"a trial lacks {missing}: trials are written by seqify.tune; leave them out of a "
                          "configuration written by hand")
    tuples = ("balance", "memory_per_device", "measured_peak", "measured_reserved", "optimizer_bytes")
    entries: dict[str, Any] = {k: tuple(v) if k in tuples else v for k, v in data.items()}
    return Trial(**entries)


def trial_table(trials: tuple[Trial, ...] | list[Trial], chosen: PipeConfig | None = None) -> str:
    """The candidates as a table: options, schedule, predicted and measured ms per step, predicted peak
    MiB per pipeline device, and the peak MiB allocated in the timed steps where measured (CUDA)."""
    rows = [("", "candidate", "schedule", "predicted ms", "measured ms", "error", "peak MiB per device",
             "measured peak MiB")]
    for t in trials:
        mark = "*" if chosen is not None and _same(t, chosen) else ""
        measured = f"{t.measured_s * 1e3:.2f}" if t.measured_s is not None else "-"
        error = f"{(t.predicted_s / t.measured_s - 1) * 100:+.0f}%" if t.measured_s else "-"
        peak = megabytes(t.memory_per_device or (t.memory_bytes,))
        held = megabytes(t.measured_peak) if t.measured_peak else "-"
        rows.append((mark, t.layout(), t.schedule or "gpipe", f"{t.predicted_s * 1e3:.2f}", measured, error, peak,
                     held))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows)


def megabytes(per_device: tuple[int, ...] | list[int]) -> str:
    """Bytes per device as MiB: ``12.3 / 4.5``."""
    return " / ".join(f"{b / 2**20:.1f}" for b in per_device)


def _same(t: Trial, c: PipeConfig) -> bool:
    return (t.chunks, t.loops, t.by, t.checkpoint, t.graphs, t.schedule or "gpipe", tuple(t.balance), t.overlap,
            t.replicas) == (c.chunks, c.loops, c.by, c.checkpoint, c.graphs, c.schedule or "gpipe",
                            tuple(c.balance), c.overlap, c.replicas)
