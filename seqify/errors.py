"""SeqifyError and its subclasses: every failure a user can cause, each saying what to do."""

from __future__ import annotations

__all__ = [
    "SeqifyError",
    "UntraceableError",
    "ConversionError",
    "ExampleInputError",
    "HookError",
    "EmptyModelError",
    "InputError",
    "SpecializationError",
    "ModeError",
    "StateDictError",
    "CheckpointError",
    "SkipError",
    "BalanceError",
    "DeviceError",
    "SharedParameterError",
    "BoundaryError",
    "StageError",
    "GraphError",
    "MetaDeviceError",
    "OptionError",
    "ZooError",
    "PlotError",
    "SpecError",
    "SampleError",
    "ScheduleError",
    "LossError",
    "MicroBatchError",
    "MemoryCapError",
    "PeerError",
    "TuneError",
    "CompatError",
    "CompatDeviceError",
    "SplitPointError",
    "TiedParameterError",
    "ConfigError",
    "CompatSkipError",
    "ExportError",
    "VerifyError",
    "DecoratedForwardError",
    "StatefulForwardError",
    "KeywordArgumentsError",
    "SourceRaisesError",
    "UnregisteredError",
    "AutogradContextError",
]


class SeqifyError(Exception):
    """Base class of every error seqify raises on bad input or misuse."""


class UntraceableError(SeqifyError):
    """The top level of a model cannot be traced, even with example inputs."""


class ConversionError(SeqifyError):
    """A traced graph could not be turned into pipeline-ready layers."""


class ExampleInputError(SeqifyError):
    """``example_inputs`` do not fit the model's forward signature or shapes."""


class HookError(SeqifyError):
    """A hook would be dropped by conversion."""


class EmptyModelError(SeqifyError):
    """The model computes nothing, so there is nothing to convert or pipeline."""


class InputError(SeqifyError):
    """A converted model was called with arguments its conversion does not cover."""


class SpecializationError(InputError):
    """An input leaves the shapes a shape-specialised conversion is valid for."""


class ModeError(SeqifyError):
    """A model whose graph depends on ``training`` runs in the mode it was not converted in."""


class StateDictError(SeqifyError, RuntimeError):
    """A checkpoint does not match the model's keys, shapes or value types (a ``RuntimeError`` too, as
    torch's ``load_state_dict`` raises)."""


class CheckpointError(StateDictError):
    """A checkpoint that cannot be written or read as asked: a folder that holds none, a format this seqify
    does not read, state missing that the call asks for (optimizer, scheduler), a value
    ``torch.load(weights_only=True)`` would refuse, or a folder of other files in the way."""


class SkipError(SeqifyError):
    """Skip connections are stashed or popped in an invalid order or number."""


class BalanceError(SeqifyError):
    """A balance does not split the layers into non-empty partitions."""


class DeviceError(SeqifyError):
    """A device that does not exist, fewer devices than partitions, an input on the meta device, or a move
    (``pipe.to(device)``, ``.cuda()``, ``.cpu()``) of a built pipeline to devices other than its own."""


class SharedParameterError(SeqifyError):
    """A parameter is used by layers that land in different partitions."""


class BoundaryError(SeqifyError):
    """A value that cannot cross a partition boundary (not a tensor or tuple of tensors)."""


class StageError(SeqifyError):
    """An exception inside a pipeline stage, re-raised with the partition and layer (Python < 3.11)."""


class GraphError(SeqifyError):
    """A pipeline step replayed from captured CUDA graphs was used out of order (the backward of an
    older forward), or a distributed partition cannot run as fixed programs (it returns non-tensors)."""


class MetaDeviceError(SeqifyError):
    """The model holds parameters or buffers on the meta device (shapes, no data) where data is needed:
    running it on real inputs, moving it to a device, or profiling it. Materialise the weights first:
    ``seq.to_empty(device=...)``, then initialise them or load a checkpoint."""


class OptionError(SeqifyError):
    """An argument of ``convert`` (``leaf_paths``, ``leaf_types``, ``depth``, the model itself) or of
    ``clip_grad_norm_`` (the model, ``norm_type``) has the wrong type or names something the model does not have."""


class ZooError(SeqifyError):
    """A zoo name that does not exist, weights that do not fit the model, a preset it does not have, or a
    transformers model asked for without transformers installed."""


class PlotError(SeqifyError):
    """matplotlib is missing, or there is nothing to draw."""


class SpecError(SeqifyError):
    """A SPEC (``torchvision:NAME``, ``zoo:NAME``, ``FILE.py:FACTORY``) that names no model, or a builder that fails."""


class SampleError(SeqifyError):
    """The input the command line builds (``--size``, ``--batch``, ``--shape``) does not fit the model."""


class CompatError(SeqifyError, ValueError):
    """A torchgpipe-style argument (balance, chunks, checkpoint) that ``seqify.compat`` cannot accept (a
    ``ValueError`` too, as torchgpipe raises)."""


class CompatDeviceError(DeviceError, IndexError):
    """Fewer devices than partitions for ``seqify.compat.torchgpipe.GPipe`` (an ``IndexError`` too, as
    torchgpipe raises)."""


class SplitPointError(SeqifyError, ValueError):
    """A torch.distributed.pipelining-style split point that names no module of the source, or none that
    starts or ends at a layer of the converted model."""


class TiedParameterError(SharedParameterError):
    """A parameter shared across partitions that cannot be kept exact as a copy per partition: the forward
    changes it in place, ``graphs=True`` reads it at a fixed address, or stages run in separate processes."""


class ConfigError(SeqifyError, ValueError):
    """A pipeline configuration (``seqify.PipeConfig``) or run file (``seqify.Config``) with a missing, unknown,
    ill-typed or out-of-range entry, or a file that cannot be read."""


class CompatSkipError(SkipError, TypeError):
    """``seqify.compat.torchgpipe.verify_skippables`` found skips stashed or popped in an invalid order or
    number (a ``TypeError`` too, as torchgpipe raises)."""


class ScheduleError(SeqifyError):
    """A pipeline schedule that is unknown, does not fit the placement, or breaks an ordering rule."""


class LossError(ScheduleError):
    """``pipe.step`` cannot weigh the micro-batch losses so that they add up to one device's loss: a loss that
    divides by a count the data decides (a mask) without ``denominator=``, a declared reduction the loss
    contradicts, a loss that mixes samples, or an undeclared loss whose reduction its probe cannot tell."""


class MicroBatchError(BalanceError, ValueError):
    """Micro-batches too small for a layer: ``chunks`` leaves one sample per micro-batch and a BatchNorm
    computing batch statistics gets one value per channel (a ``ValueError`` too, as torch raises)."""


class MemoryCapError(SeqifyError):
    """No schedule and checkpointing choice fits ``memory_cap``; the message gives the smallest cap that does."""


class PeerError(SeqifyError):
    """A distributed pipeline's peer rank died or stopped answering within the process-group timeout."""


class TuneError(SeqifyError):
    """The tuner cannot pick or apply a pipeline configuration: no candidate fits ``memory_cap``, no sample
    to measure, or a saved configuration that does not fit the model or the devices."""


class ExportError(UntraceableError):
    """``torch.export`` could not capture the model's forward on the example inputs (the export frontend)."""


class VerifyError(ConversionError):
    """The converted model does not compute what its source computes on the example inputs (convert's
    self-check); the message names the first layer whose value differs."""

    #: the source module whose output differs first, where the check could name one
    module_path: str | None = None


class DecoratedForwardError(UntraceableError):
    """The model's forward is wrapped by a decorator taking ``(self, *args, **kwargs)`` (transformers 5's
    ``can_return_tuple``, ``check_model_inputs``): torch.fx cannot see the parameters it binds."""


class StatefulForwardError(UntraceableError):
    """The model's own forward changes a Python attribute (``self.calls += 1``): a converted model would
    bake the first value in."""


class KeywordArgumentsError(ExampleInputError, UntraceableError):
    """example_inputs pass values through the forward's ``**kwargs`` (transformers 5 takes
    ``output_hidden_states`` so): torch.fx binds named parameters only; the export frontend bakes such
    non-tensor values (``frontend='auto'`` falls back to it)."""


class SourceRaisesError(ExampleInputError):
    """The source model itself raises on the example inputs (an id past the vocabulary, an option its
    config does not support): the inputs are wrong, not the conversion."""


class UnregisteredError(UntraceableError):
    """The forward uses a module or a tensor requiring grad that the model keeps outside its module tree (a
    plain list, dict, tuple or helper object): ``parameters()``, ``.to()`` and ``state_dict`` do not see it,
    and converted layers cannot hold it as the source does."""


class AutogradContextError(UntraceableError):
    """The forward sets or uses autograd context a frontend cannot keep: a tensor hook it registers, autograd it
    runs (``torch.autograd.grad``, ``.backward()``), ``requires_grad_``/``detach_``, a custom
    ``autograd.Function`` or an ``inference_mode`` region under torch.export, grad mode left changed. The
    message names the module path, the line and the frontend or change that keeps it."""
