"""verify.first_difference names the first layer whose value differs, also where a layer carries values on."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import seqify
from seqify.convert.verify import first_difference


class Source(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + x


class CarryA(nn.Module):
    """A layer standing in for ``a`` that also carries the input on (as a converted layer does for a value a
    later layer reads); ``off`` makes its own value wrong."""

    def __init__(self, a: nn.Linear, off: float) -> None:
        super().__init__()
        self.a, self.off = a, off

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x) + self.off, x


class ThenB(nn.Module):
    def __init__(self, b: nn.Linear) -> None:
        super().__init__()
        self.b = b

    def forward(self, carried: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        y, x = carried
        return self.b(y) + x


def converted(source: Source, off: float) -> nn.Module:
    seq = nn.Sequential()
    seq.add_module("a", CarryA(source.a, off))
    seq.add_module("b", ThenB(source.b))
    return seq


def test_a_layer_that_carries_values_on_is_compared_by_its_module_value() -> None:
    torch.manual_seed(0)
    source = Source()
    x = torch.randn(3, 4)
    assert first_difference(source, converted(source, 0.0), (x,)) is None
    found = first_difference(source, converted(source, 1.0), (x,))
    # the old check skipped layer 'a' (its output is (value, carried), not its module's one tensor)
    assert found is not None and "layer 'a'" in found, found


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_example_inputs_the_source_cannot_run_are_named_as_such_not_as_a_seqify_bug(frontend: str) -> None:
    model = Embed()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(seqify.ExampleInputError, match=r"source Embed itself raises .*IndexError"):
        seqify.convert(model, example_inputs=(torch.tensor([[1, 9]]),), frontend=frontend)  # 9 >= 8 tokens
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    seqify.convert(model, example_inputs=(torch.tensor([[1, 7]]),), frontend=frontend)  # valid ids convert


class _AddsMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + mask


class _MaskOnlyWhenTraced(nn.Module):
    """transformers' masks: built only when traced (outside, an all-ones mask is skipped), here in a shape
    the submodule cannot add (Nystromformer's landmarks)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _AddsMask()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        traced = torch.fx._symbolic_trace.is_fx_tracing()
        mask = torch.zeros(x.shape[0], x.shape[1], 3) if traced else torch.zeros(1)
        return self.inner(x, mask)


def test_a_crash_after_the_trace_diverged_names_the_kept_module_not_a_seqify_bug() -> None:
    x = torch.randn(2, 2, 4)
    with pytest.raises(seqify.VerifyError, match="inner whole because an op in it failed") as info:
        seqify.convert(_MaskOnlyWhenTraced(), x, frontend="fx")
    assert "seqify bug" not in str(info.value) and "leaf_paths" in str(info.value)


class Reshape(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:  # on values: fx keeps this module whole and takes its value from the source's run
            return x.view(x.shape[0], 3, -1)  # fails where the last dimension is not a multiple of 3
        return x


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.reshape = Reshape()

    def forward(self, x: torch.Tensor) -> Any:
        out = self.reshape(self.lin(x)[:, :4])
        return out.sum(1), out.shape[-1]


def test_a_source_that_raises_inside_an_opaque_module_is_named_not_an_unknown_value() -> None:
    # before: "the model returns 'getitem', a Python value computed at run time (UNKNOWN in the example)"
    with pytest.raises(seqify.ExampleInputError, match=r"source Outer itself raises .*RuntimeError"):
        seqify.convert(Outer(), example_inputs=(torch.randn(2, 4),), frontend="fx")


class NeedsToken(nn.Module):
    """BEiT without use_mask_token: given bool_masked_pos, the source itself fails (its mask token is None)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.token: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            x = x + self.token.expand_as(x)  # type: ignore[union-attr]
        return self.lin(x)


@pytest.mark.parametrize("frontend", ["export", "auto"])
def test_a_failed_capture_of_a_source_that_itself_raises_names_the_inputs(frontend: str) -> None:
    # before: ExportError "torch.export cannot capture NeedsToken.forward" with advice about data-dependent code
    example = {"x": torch.randn(2, 4), "mask": torch.ones(2, 4)}
    with pytest.raises(seqify.SourceRaisesError, match=r"source NeedsToken itself raises .*AttributeError"):
        seqify.convert(NeedsToken(), example_inputs=example, frontend=frontend)
    seqify.convert(NeedsToken(), example_inputs={"x": torch.randn(2, 4)}, frontend=frontend)
