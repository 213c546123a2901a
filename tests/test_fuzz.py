"""Property: convert is exact on random DAG nets (chains, long skips, reuse, in-place, dropout, dicts)."""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, assume, given, settings

from exactness import assert_exact, loss_of
import seqify
from nets import Program, ProgramNet, build, example_inputs, programs

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False)


def runs(net: ProgramNet, inputs: tuple[torch.Tensor, ...]) -> bool:
    """Whether the source itself runs forward and backward (random in-place ops may break autograd)."""
    probe = copy.deepcopy(net)
    try:
        loss_of(probe(*[x.clone() for x in inputs])).backward()
    except RuntimeError:
        return False
    return True


@FUZZ
@given(program=programs())
def test_convert_is_exact_on_random_nets(program: Program) -> None:
    torch.manual_seed(0)
    net = build(program)
    inputs = example_inputs(program)
    assume(runs(net, inputs))
    # Without example inputs (symbolic), and with them (example shapes ride along the trace).
    assert_exact(net, tuple(x.clone() for x in inputs), train=True)
    with_shapes = lambda m: seqify.convert(m, example_inputs=tuple(x.clone() for x in inputs))  # noqa: E731
    assert_exact(net, tuple(x.clone() for x in inputs), train=False, backward=False, convert=with_shapes)
