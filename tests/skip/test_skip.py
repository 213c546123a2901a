"""seqify.skip: hand-written skippable layers (torchgpipe's API), namespaces and the verifier."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import seqify
from seqify.skip import Namespace, pop, routes, skippable, stash, verify


@skippable(stash=["skip"])
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash("skip", x)
        return self.f(x)


@skippable(pop=["skip"])
class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop("skip")
        return self.f(x) + skip


def unet_like() -> nn.Sequential:
    ns = [Namespace() for _ in range(3)]
    return nn.Sequential(
        Encoder().isolate(ns[0]),
        Encoder().isolate(ns[1]),
        Encoder().isolate(ns[2]),
        nn.ReLU(),
        Decoder().isolate(ns[2]),
        Decoder().isolate(ns[1]),
        Decoder().isolate(ns[0]),
    )


def reference(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    e = [m.f for m in model[:3]]
    d = [m.f for m in model[4:]]
    s0 = x
    h = e[0](x)
    s1 = h
    h = e[1](h)
    s2 = h
    h = torch.relu(e[2](h))
    h = d[0](h) + s2
    h = d[1](h) + s1
    return d[2](h) + s0


def test_skippable_sequential_runs_outside_any_pipeline() -> None:
    model = unet_like()
    x = torch.randn(2, 4)
    assert torch.allclose(model(x), reference(model, x))
    found = routes(model)
    assert [(r.stash, r.pop) for r in found] == [(2, 4), (1, 5), (0, 6)]


def test_verify_names_the_layers() -> None:
    with pytest.raises(seqify.SkipError, match="pops skip 'skip' but no earlier layer stashes it"):
        verify(nn.Sequential(Decoder(), Encoder()))
    with pytest.raises(seqify.SkipError, match="never popped"):
        verify(nn.Sequential(Encoder(), nn.ReLU()))
    with pytest.raises(seqify.SkipError, match="already stashes"):
        verify(nn.Sequential(Encoder(), Encoder(), Decoder(), Decoder()))
    verify(unet_like())


def test_undeclared_and_missing_skips_are_errors() -> None:
    @skippable(stash=["a"])
    class Forgets(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            if False:
                yield stash("a", x)
            return x

    @skippable(stash=["a"])
    class Undeclared(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            yield stash("b", x)
            return x

    with pytest.raises(seqify.SkipError, match="did not stash/pop"):
        Forgets()(torch.zeros(1))
    with pytest.raises(seqify.SkipError, match="does not declare"):
        Undeclared()(torch.zeros(1))
    with pytest.raises(seqify.SkipError, match="neither stashes nor pops"):
        Encoder().isolate(Namespace(), only=["other"])


def test_conditional_skip_stashes_none() -> None:
    @skippable(stash=["maybe"])
    class MaybeStash(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            yield stash("maybe", None)
            return x * 2

    @skippable(pop=["maybe"])
    class MaybePop(nn.Module):
        def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
            skip = yield pop("maybe")
            return x if skip is None else x + skip

    model = nn.Sequential(MaybeStash(), MaybePop())
    assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))


def test_converted_layers_are_skippables_with_one_namespace() -> None:
    seq = seqify.convert(seqify.zoo.unet(depth=3, blocks=1, channels=4))
    keys = [k for layer in seq for k in seqify.skip.stash_keys(layer)]
    assert len(keys) == 3 and {ns for ns, _ in keys} == {seq.namespace}
    assert [(seq.skips[i].stash, seq.skips[i].pop) for i in range(3)] == [
        (s.stash, s.pop) for s in seq.skips
    ]


def test_namespace_identity_survives_pickling() -> None:
    import pickle

    ns = Namespace()
    assert pickle.loads(pickle.dumps(ns)) == ns
    assert Namespace() != ns
