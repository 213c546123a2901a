"""seqify.compat: the APIs of torchgpipe and torch.distributed.pipelining, backed by seqify."""

from seqify.compat import pipelining, torchgpipe

__all__ = ["torchgpipe", "pipelining"]
