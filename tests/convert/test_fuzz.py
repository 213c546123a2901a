"""Properties on random DAG nets (chains, long skips, modules called twice, in-place ops and ``x += y`` on
aliased values, dropout, BatchNorm in train mode, several inputs, tuple and dict outputs):

- ``seqify.convert`` is exact: bit-equal forward, gradients allclose(1e-5), equal BatchNorm buffers;
- ``seqify.pipeline`` over 2-3 CPU partitions with 1-4 micro-batches computes what the source computes
  micro-batch by micro-batch, or refuses a balance that splits a shared parameter.

Regressions: when a property fails, hypothesis shrinks the net and prints the falsifying example, e.g.
``program=Program(inputs=(1,), ops=(('conv', 0, 2, 1), ...), outputs=(1,), as_dict=False)`` or
``case=PipeCase(program=Program(...), cuts=(0,), chunks=2, checkpoint='always')``. Paste that repr into
an ``@example(...)`` line above the test (below ``@given``), fix seqify, and keep the line: every run then
replays that net first, whatever hypothesis draws.

The draws are the same on every run (CI must not go red by chance); ``SEQIFY_FUZZ=random`` explores new
nets each run (``SEQIFY_FUZZ=random python -m pytest tests/convert/test_fuzz.py``), to hunt for cases to add.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis.control import currently_in_test_context

from helpers.exactness import assert_exact, by_micro_batch, loss_of
import seqify
from helpers.nets import KINDS, PipeCase, Program, ProgramNet, build, example_inputs, features, pipe_cases, programs

FIXED = os.environ.get("SEQIFY_FUZZ", "fixed") != "random"
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=FIXED)
REPLAY_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=FIXED)
PIPE_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=FIXED)


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
# ``x[:, :1] = v`` in the model's own forward was untraceable (fx has no proxy item assignment).
@example(program=Program(inputs=(1,), ops=(("act", 0, 0), ("setitem", 0, 0), ("bn", 1)), outputs=(1, 3)))
# A constant assigned after a read of the value: with example inputs the assignment ran before the read.
@example(program=Program(inputs=(2,), ops=(("conv", 0, 2, 1), ("act", 1, 1), ("setitem", 1, -1), ("add", 2, 3)),
                         outputs=(4,)))
def test_convert_is_exact_on_random_nets(program: Program) -> None:
    torch.manual_seed(0)
    net = build(program)
    inputs = example_inputs(program)
    assume(runs(net, inputs))
    # Without example inputs (symbolic), and with them (example shapes ride along the trace).
    assert_exact(net, tuple(x.clone() for x in inputs), train=True)
    with_shapes = lambda m: seqify.convert(m, example_inputs=tuple(x.clone() for x in inputs))  # noqa: E731
    assert_exact(net, tuple(x.clone() for x in inputs), train=False, backward=False, convert=with_shapes)


def splits_a_parameter(seq: seqify.Sequential, balance: list[int]) -> bool:
    partition = [j for j, count in enumerate(balance) for _ in range(count)]
    owners: dict[int, set[int]] = {}
    for layer, j in zip(seq, partition):
        for p in layer.parameters():
            owners.setdefault(id(p), set()).add(j)
    return any(len(parts) > 1 for parts in owners.values())


@PIPE_FUZZ
@given(case=pipe_cases())
# A layer after a checkpointed stage's first layer modified the stage's input in place: backward failed
# ("modified by an inplace operation") where the source trains.
@example(case=PipeCase(
    program=Program(inputs=(1,), ops=(("conv", 0, 2, 1), ("act", 1, 1), ("mutate", 1), ("add", 2, 3)), outputs=(4,)),
    cuts=(0,), chunks=2, checkpoint="always",
))
# The model modifies its input in place: micro-batches were views of one tensor, sharing autograd's version
# counter, so one micro-batch's change invalidated what another had saved for backward.
@example(case=PipeCase(
    program=Program(inputs=(1,), ops=(("mutate", 0), ("conv", 0, 1, 1)), outputs=(1, 2)),
    cuts=(0,), chunks=2, checkpoint="never",
))
# One tensor received twice (carried and popped) was copied for checkpointing as two tensors: an in-place
# change through one name was lost to the other.
@example(case=PipeCase(
    program=Program(inputs=(1,), ops=(("mutate", 0), ("mutate", 0), ("conv", 1, 1, 3), ("bn", 2), ("conv", 3, 1, 1)),
                    outputs=(5,)),
    cuts=(0,), chunks=1, checkpoint="always",
))
# InstanceNorm with running statistics in a checkpointed stage: the recomputation updated them a second time.
@example(case=PipeCase(
    program=Program(inputs=(2,), ops=(("conv", 0, 2, 1), ("inorm", 1), ("act", 2, 3), ("conv", 3, 2, 1)), outputs=(4,)),
    cuts=(2,), chunks=2, checkpoint="always",
))
# A module called twice, its calls in different partitions: its weight is tied across them.
@example(case=PipeCase(
    program=Program(inputs=(2,), ops=(("conv", 0, 2, 1), ("act", 1, 0), ("reuse", 2, 0, (2, 2, 1))), outputs=(3,)),
    cuts=(0,), chunks=2, checkpoint="never",
))
def test_pipeline_equals_the_source_micro_batch_by_micro_batch(case: PipeCase) -> None:
    check_pipeline(case, replay=False)


@REPLAY_FUZZ
@given(case=pipe_cases())
def test_replayed_step_equals_the_source_micro_batch_by_micro_batch(case: PipeCase) -> None:
    """The driver of graphs=True (fixed programs, gradients summed per partition, handed over as .grad),
    run with eager programs on CPU partitions."""
    check_pipeline(PipeCase(case.program, case.cuts, case.chunks, "never"), replay=True)


def require(condition: bool) -> None:
    """``assume`` under hypothesis; outside it (a fixed regression case) the case must hold it."""
    if currently_in_test_context():
        assume(condition)
    else:
        assert condition, "a fixed case must be one the property accepts"


def check_pipeline(case: PipeCase, replay: bool) -> None:
    torch.manual_seed(0)
    net = build(case.program)
    inputs = example_inputs(case.program, batch=5)
    require(runs(net, inputs))
    reference = copy.deepcopy(net).train()
    seq = seqify.convert(net.train())
    require(len(seq) >= 2)
    balance = case.balance(len(seq))
    options = dict(devices=["cpu"] * len(balance), balance=balance, chunks=case.chunks, checkpoint=case.checkpoint)
    try:
        pipe = seqify.pipeline(seq, **options)
    except seqify.SharedParameterError as e:  # a parameter split across partitions is tied; only a buffer
        assert splits_a_parameter(seq, balance) and "buffer" in str(e), e  # that changes is refused
        return
    pipe._replay_eager = replay
    got = pipe(*[x.clone() for x in inputs])
    assert (pipe._graphed is not None or pipe.graph_error is not None) == replay  # replayed, or said why not
    loss_of(got).backward()
    expected = by_micro_batch(reference, tuple(x.clone() for x in inputs), case.chunks)
    loss_of(expected).backward()
    assert pytree.tree_structure(got) == pytree.tree_structure(expected)
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ref_params = dict(reference.named_parameters())
    for name, p in net.named_parameters():
        q = ref_params[name]
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    ref_buffers = dict(reference.named_buffers())
    for name, b in net.named_buffers():
        torch.testing.assert_close(b, ref_buffers[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_strategies_reach_every_feature() -> None:
    """A change to a strategy must not silently stop generating a kind of net: 300 draws of each (fixed
    seed, generation only) cover every op kind and structure; pipelined programs never hold dropout."""
    wanted = {*KINDS, "long skip", "multi-use value", "dict output", "several outputs", "several inputs", "input mutated"}
    seen: dict[str, set[str]] = {"convert": set(), "pipeline": set()}

    @settings(max_examples=300, derandomize=True, database=None, phases=[Phase.generate], deadline=None)
    @given(program=programs(), case=pipe_cases())
    def collect(program: Program, case: PipeCase) -> None:
        seen["convert"] |= features(program)
        seen["pipeline"] |= features(case.program)

    collect()
    assert wanted - seen["convert"] == set()
    assert wanted - {"dropout"} - seen["pipeline"] == set()
    assert "dropout" not in seen["pipeline"]


def test_an_in_place_change_reaches_a_later_reader_under_checkpointing() -> None:
    """Found by the pipeline fuzz: partition 1 changes in place (``y += ...``) a value that partition 2 reads
    through another skip. Checkpointing runs a partition on copies of what it changes, which would hide
    the change from that later reader; such a step now runs uncheckpointed instead."""
    program = Program(inputs=(1,), ops=(("conv", 0, 1, 1), ("conv", 0, 1, 1), ("mutate", 1), ("conv", 2, 1, 1),
                                        ("alias_iadd", 3, 3), ("conv", 4, 1, 1)),
                      outputs=(1, 6), as_dict=False, channels=(1,) * 7)
    check_pipeline(PipeCase(program, (2, 5), 1, "always"), replay=False)
