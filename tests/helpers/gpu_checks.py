"""Shared GPU-test helpers: strict fp32 math (an autouse fixture to import) and relative-error checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

__all__ = ["strict_fp32", "relative"]


@pytest.fixture(autouse=True)
def strict_fp32() -> None:
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def relative(tolerance: float) -> Callable[[torch.Tensor, torch.Tensor, str], None]:
    """A check that ``got`` is within ``tolerance`` of ``want`` in relative (norm) error."""

    def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        error = (got.float().to(want.device) - want.float()).norm() / want.float().norm().clamp_min(1e-12)
        assert error <= tolerance, f"{what}: relative error {error:.2e} > {tolerance:.0e}"

    return check
