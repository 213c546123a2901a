"""Frontends: how a model becomes a graph with module metadata (torch.fx in seqify.trace, torch.export here)."""

from .export import export_trace

__all__ = ["export_trace"]
