"""Versioned, bucketed weight publishing from trainer rank 0 to rollout workers (the wire protocol and the
receiving side are `sparrow.weight_sync`)."""

from .send import PublishReport, publish_state_dict, send_buckets

__all__ = ["PublishReport", "publish_state_dict", "send_buckets"]
