"""The wire protocol of weight updates, shared by both ends: the trainer publishes (`sparrow.trainer.publish`)
and rollout workers receive, without either importing the other.

- `buckets`: the manifest and the flat same-dtype buckets a version travels in;
- `channels`: how buckets move — a standalone collective group (NCCL / gloo broadcast) or Ray's object
  store — with the sending and receiving end of each;
- `shared`: buffers handed over in place to a process on the same GPU (CUDA IPC) or host (shared memory);
- `send`: a versioned state dict through any sender (the trainer's publication; vLLM's engine core fed in memory);
- `receive`: one version into a rollout engine (`WeightReceiver`), refused unless newer and valid;
- `check`: valid = an update that fits the served model whole (names, shapes, floating dtypes, finite values),
  checked by each engine before it loads any of it.
"""

from .buckets import Bucket, Entry, Manifest, pack, plan_buckets, unpack
from .channels import CollectiveGroup, CollectiveSender, CollectiveSource, HandleSource, ObjectStoreSender, WeightHandle
from .receive import ReceiveReport, WeightReceiver, WeightsRefused, receive_state_dict
from .shared import SharedHandle, SharedMappings, SharedSender, SharedSource, SharedStateDict, current_gpu

__all__ = [
    "Bucket",
    "CollectiveGroup",
    "CollectiveSender",
    "CollectiveSource",
    "Entry",
    "HandleSource",
    "Manifest",
    "ObjectStoreSender",
    "ReceiveReport",
    "SharedHandle",
    "SharedMappings",
    "SharedSender",
    "SharedSource",
    "SharedStateDict",
    "current_gpu",
    "WeightHandle",
    "WeightReceiver",
    "WeightsRefused",
    "pack",
    "plan_buckets",
    "receive_state_dict",
    "unpack",
]
