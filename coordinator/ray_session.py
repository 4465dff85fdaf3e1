"""Start (or join) Ray for a job, and always shut it down again.

Local mode uses `address="local"`: a fresh cluster every time, so neither `RAY_ADDRESS` nor a stale
`ray_current_cluster` file left by a killed CLI cluster is picked up by accident. Without a CPU
count, the local cluster declares what the two pools reserve (at least 1). A Ray already
initialised by the caller (tests, notebooks) is used as is and left running.
"""

import math
import os

import ray

from .config import SparrowConfig


def local_cpus(config: SparrowConfig) -> int:
    pools = (config.rollout.pool, config.trainer.pool)
    return max(1, math.ceil(sum(p.cpus * p.size for p in pools)))


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
