"""Versioned, bucketed weight publishing from trainer rank 0 to rollout workers (`WeightPublisher`); sending a
state dict's buckets through a channel, the wire protocol and the receiving side are `sparrow.weight_sync`."""

from .publisher import WeightPublisher

__all__ = ["WeightPublisher"]
