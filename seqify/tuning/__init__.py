"""tuning: pick a pipeline's chunks, loops, balance, checkpointing, graphs and schedule from measured costs
(seqify.tune).

::

    cfg = seqify.tune(seq, x, gpus=2)             # measure, predict every candidate, time the best few
    print(cfg)                                    # the choice, with predicted and measured step times
    pipe = seqify.pipeline(seq, config=cfg)       # or config="cfg.json" after cfg.save("cfg.json")
    pipe = seqify.pipeline(seq, gpus=2, sample=x) # the same: chunks="auto" when chunks is not given

The method: profile every layer's forward+backward at two batch sizes (a line per layer), calibrate the
executor's per-task and per-launch overhead and the copy cost between the devices, predict each
candidate's step time by simulating its schedule (:mod:`seqify.tuning.predict`), then confirm the ``top`` best
predictions with a few timed training steps and keep the fastest. Choices are cached on disk per (model
fingerprint, input shapes and dtypes, devices, options) in ``$SEQIFY_CACHE_DIR/tune.json`` (default
``~/.cache/seqify``).

One concept a module: :mod:`~seqify.tuning.measure` (timed steps, overheads, peak memory),
:mod:`~seqify.tuning.profile` (the layer model), :mod:`~seqify.tuning.space` (the candidates),
:mod:`~seqify.tuning.predict` (a candidate's predicted step), :mod:`~seqify.tuning.search` (:func:`tune`),
:mod:`~seqify.tuning.choice` (which candidates are timed, the memory bounds, ties),
:mod:`~seqify.tuning.memory_bounds` (the optimizer's state and the GPUs' memory in the bounds),
:mod:`~seqify.tuning.cache` (choices on disk). The other modules call :mod:`~seqify.tuning.measure` through
the module (``measure.step_seconds``), so one patch of a measurement there reaches every caller.
"""
from __future__ import annotations

from seqify.pipe.config import PipeConfig, Trial
from seqify.tuning.cache import cache_path, fingerprint
from seqify.tuning.choice import RESERVED_TIE, RUNOFF
from seqify.tuning.measure import calibrate, step_seconds
from seqify.tuning.memory_bounds import ROOM, optimizer_ratio, state_ratio, step_ratio
from seqify.tuning.profile import fit_host, layer_model
from seqify.tuning.search import tune
from seqify.tuning.space import TIME_SLACK

__all__ = ["tune", "PipeConfig", "Trial", "cache_path", "fingerprint", "calibrate", "layer_model", "step_seconds",
           "fit_host", "state_ratio", "step_ratio", "optimizer_ratio", "ROOM", "TIME_SLACK", "RUNOFF",
           "RESERVED_TIE"]
