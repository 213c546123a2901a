"""seqify: any PyTorch net becomes an exact, pipeline-ready nn.Sequential that runs across GPUs."""

from . import skip
from .convert import convert
from .errors import *  # noqa: F403
from .errors import __all__ as _errors
from .guard import Guard
from .layer import Layer
from .sequential import OpaqueInfo, Sequential, SkipInfo

__version__ = "0.1.0"

__all__ = ["convert", "Sequential", "Layer", "SkipInfo", "OpaqueInfo", "Guard", "skip", *_errors]
