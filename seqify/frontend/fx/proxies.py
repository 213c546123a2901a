"""The tracer's proxies: they ask the tracer for concrete values where Python needs them, record in-place
operators as in-place, and read attributes lazily (an attribute read that is only called makes no node)."""

from __future__ import annotations

import operator
from typing import Any, Protocol

import torch.fx as fx

from seqify.frontend.fx.autograd import PROXY_USES
from seqify.frontend.grad_watch import Use
from seqify.frontend.traced import user_frame

__all__ = ["ValueProxy", "AttributeProxy", "ProxyTracer"]


class ProxyTracer(Protocol):
    """What the proxies ask of seqify's tracer."""

    autograd: Any

    def create_proxy(self, kind: str, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> fx.Proxy: ...

    def concrete(self, obj: fx.Proxy, kind: type) -> Any: ...

    def concrete_len(self, obj: fx.Proxy) -> int: ...


class ValueProxy(fx.Proxy):
    """A proxy that asks the tracer for concrete values where Python needs them."""

    tracer: ProxyTracer  # type: ignore[assignment]  # seqify's tracer, which fx.Proxy types as fx's

    def __getattr__(self, k: str) -> AttributeProxy:  # type: ignore[override]  # ours asks for concrete values
        return AttributeProxy(self, k)

    def __len__(self) -> int:
        return self.tracer.concrete_len(self)

    def __int__(self) -> int:
        return self.tracer.concrete(self, int)

    def __index__(self) -> int:
        return self.tracer.concrete(self, int)

    def __float__(self) -> float:
        return self.tracer.concrete(self, float)

    def __setitem__(self, key: Any, value: Any) -> None:
        # ``x[i] = v`` modifies x in place (fx has no proxy for it): record it as the in-place operator.
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


def _inplace(op: Any) -> Any:
    def method(self: ValueProxy, other: Any) -> Any:
        return self.tracer.create_proxy("call_function", op, (self, other), {})

    return method


# fx turns ``x += y`` into ``x = x + y``: a copy, so an alias of x would not see the change. Recording
# the in-place operator keeps the source's semantics (the tensor is modified; aliases see it).
for _name, _op in {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv, "__imod__": operator.imod,
    "__ipow__": operator.ipow, "__imatmul__": operator.imatmul, "__iand__": operator.iand,
    "__ior__": operator.ior, "__ixor__": operator.ixor, "__ilshift__": operator.ilshift,
    "__irshift__": operator.irshift,
}.items():
    setattr(ValueProxy, _name, _inplace(_op))


class AttributeProxy(ValueProxy):
    def __init__(self, root: ValueProxy, attr: str) -> None:
        self.root = root
        self.attr = attr
        self.tracer = root.tracer
        self._node: fx.Node | None = None

    @property
    def node(self) -> fx.Node:  # type: ignore[override]
        if self._node is None:
            self._node = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {}).node
        return self._node

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.attr in PROXY_USES:  # a hook or autograd run on a traced value: no graph op holds it
            kind, what = PROXY_USES[self.attr]
            self.tracer.autograd.use(Use(kind, what, user_frame()))
        return self.tracer.create_proxy("call_method", self.attr, (self.root,) + args, kwargs)
