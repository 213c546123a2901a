"""seqify.compat: the APIs of torchgpipe and torch.distributed.pipelining, backed by seqify."""

__all__ = ["torchgpipe", "pipelining"]
