"""Converting leaves the process as it found it: torch's tables of its own functions hold torch's functions, and
nothing keeps the source model or its conversion alive once the caller lets them go. Each case runs in a fresh
interpreter, since torch builds those tables once per process, at their first use."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(180)

CONVERT_IN_A_FRESH_PROCESS = textwrap.dedent("""
    import gc, json, sys, weakref
    import torch
    import torch.overrides as overrides
    from torch import nn
    import seqify

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(torch.flatten(self.a(x).relu(), 1) + x)  # a torch function on a traced value

    model = Net()
    seq = seqify.convert(model, example_inputs=(torch.randn(4, 8),), frontend=sys.argv[1])
    seq(torch.randn(4, 8)).sum().backward()  # gradients on the shared parameters, as after training
    alive = weakref.ref(model), weakref.ref(seq)
    del model, seq
    gc.collect()

    def seqifys(functions):
        return sorted({getattr(f, "__qualname__", repr(f)) for f in functions
                       if str(getattr(f, "__module__", "")).startswith("seqify")})

    print(json.dumps(dict(
        ignored=seqifys(overrides.get_ignored_functions()),
        overridable=seqifys(f for fs in overrides.get_overridable_functions().values() for f in fs),
        testing=seqifys(overrides.get_testing_overrides()),
        manual_seed_ignored=torch.manual_seed in overrides.get_ignored_functions(),
        view_is_a_tensor_method=overrides.is_tensor_method_or_property(torch.Tensor.view),
        model_alive=alive[0]() is not None, conversion_alive=alive[1]() is not None,
    )))
""")


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_converting_leaves_torchs_tables_and_keeps_nothing_of_the_model_alive(frontend: str) -> None:
    got = subprocess.run([sys.executable, "-c", CONVERT_IN_A_FRESH_PROCESS, frontend], capture_output=True,
                         text=True, timeout=150)
    assert got.returncode == 0, got.stderr[-3000:]
    found = json.loads(got.stdout.strip().splitlines()[-1])
    assert found == dict(ignored=[], overridable=[], testing=[], manual_seed_ignored=True,
                         view_is_a_tensor_method=True, model_alive=False, conversion_alive=False), found
