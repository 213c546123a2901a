"""Frontends: how a model becomes a graph with module metadata (torch.fx in seqify.frontend.fx, torch.export here)."""

from seqify.frontend.export.capture import export_trace

__all__ = ["export_trace"]
