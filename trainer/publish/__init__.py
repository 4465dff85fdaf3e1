"""Versioned, bucketed weight publishing from trainer rank 0 to rollout workers: the rank's side
(`WeightPublisher`) and sending a manifest's buckets through a channel (`send_buckets`); the wire protocol and
the receiving side are `sparrow.weight_sync`."""

from .publisher import WeightPublisher
from .send import PublishReport, publish_state_dict, send_buckets

__all__ = ["PublishReport", "WeightPublisher", "publish_state_dict", "send_buckets"]
