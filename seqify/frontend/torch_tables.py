"""torch.overrides' tables of torch's functions, built from torch's own functions before a conversion patches any."""

from __future__ import annotations

import functools

import torch
import torch.overrides

__all__ = ["settle_torch_tables"]


@functools.cache
def settle_torch_tables() -> None:
    """Build torch.overrides' cached tables of torch's functions (ignored, overridable, testing, tensor methods,
    no-wrap) now, while every function is torch's own. torch builds each table once per process, at its first use;
    a first use inside a conversion (torch.fx asks for the tensor methods when the model calls a torch function on
    a traced value) would fill them with the reseed, shape and autograd watches patched in for the trace: torch would
    then miss ``torch.manual_seed`` or ``Tensor.view`` in its own tables for the life of the process, and the
    patches' closures would keep the model being converted (its parameters and, once trained, its gradients)
    alive."""
    torch.overrides.get_ignored_functions()
    torch.overrides.get_overridable_functions()
    torch.overrides.get_testing_overrides()
    torch.overrides.get_default_nowrap_functions()
    torch.overrides.is_tensor_method_or_property(torch.Tensor.add)
