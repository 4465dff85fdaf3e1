"""Start (or join) Ray for a job, and always shut it down again.

Local mode uses `address="local"`: a fresh cluster every time, so neither `RAY_ADDRESS` nor a stale
`ray_current_cluster` file left by a killed CLI cluster is picked up by accident. Without a CPU
count, the local cluster declares the machine's cores, or what the two pools reserve where that is
more (logical CPUs), and Ray detects the GPUs. A Ray already initialised by the caller (tests,
notebooks) is used as is and left running.
"""

import math
import os

import ray

from .config import SparrowConfig


def local_cpus(config: SparrowConfig, cores: int | None = None) -> int:
    """Declaring only what the pools reserve at start left no room to grow: on 4 GPUs a rollout pool resized
    from 1 to 3 workers waited for CPUs the machine had (seen on 4 x H200)."""
    pools = (config.rollout.pool, config.trainer.pool)
    reserved = math.ceil(sum(p.cpus * p.size for p in pools))
    if cores is None:
        cores = os.cpu_count() or 1
    return max(1, reserved, cores)


class RaySession:
    def __init__(self, config: SparrowConfig):
        self.config = config
        self.owned = False

    def start(self) -> "RaySession":
        if ray.is_initialized():
            return self
        r = self.config.run.ray
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        kwargs = dict(namespace=r.namespace, log_to_driver=r.log_to_driver, include_dashboard=False)
        if r.address is None:
            kwargs.update(address="local", num_cpus=r.num_cpus or local_cpus(self.config), resources=r.resources or None)
            if r.num_gpus is not None:
                kwargs["num_gpus"] = r.num_gpus
        else:
            kwargs["address"] = r.address
        ray.init(**kwargs)
        self.owned = True
        return self

    def stop(self) -> None:
        if self.owned and ray.is_initialized():
            ray.shutdown()
        self.owned = False
