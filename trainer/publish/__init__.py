"""Versioned, bucketed weight publishing from trainer rank 0 to rollout workers."""

from .buckets import Bucket, Entry, Manifest, pack, plan_buckets, unpack
from .channels import CollectiveGroup, CollectiveSender, CollectiveSource, HandleSource, ObjectStoreSender, WeightHandle
from .transfer import PublishReport, ReceiveReport, WeightReceiver, WeightsRefused, publish_state_dict, receive_state_dict, send_buckets

__all__ = [
    "Bucket",
    "CollectiveGroup",
    "CollectiveSender",
    "CollectiveSource",
    "Entry",
    "HandleSource",
    "Manifest",
    "ObjectStoreSender",
    "PublishReport",
    "ReceiveReport",
    "WeightHandle",
    "WeightReceiver",
    "WeightsRefused",
    "pack",
    "plan_buckets",
    "publish_state_dict",
    "receive_state_dict",
    "send_buckets",
    "unpack",
]
