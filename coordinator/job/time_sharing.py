"""`TimeSharing`: the colocated placement's turns on each GPU (docs/coordinator.md, Placement).

While the engines generate, the trainer ranks keep their optimizer states, gradients and weights in host
memory (DeepSpeed's `offload_states`); once a step's rollouts are in, the engines give their KV cache back
(`sleep`) and the ranks reload their states for the update; after the new version is handed over, the
ranks offload again and the engines take their memory back (`wake`). Every transition is timed into the
step record; with the disaggregated placement there are none.
"""

import time

from ..fleet import RolloutFleet, settled
from .trainers import TrainerLink


class TimeSharing:
    def __init__(self, fleet: RolloutFleet, trainers: TrainerLink, colocated: bool):
        self.fleet, self.trainers, self.colocated = fleet, trainers, colocated

    def before_engines_start(self) -> None:
        """The engines size their KV pools from the memory free when they start: the trainer's states leave first."""
        if self.colocated:
            self.trainers.pool.call("offload_states")  # no fleet to supervise yet

    def to_training(self) -> dict[str, float]:
        """Engines asleep, trainer states back on the GPU. Seconds of each half, and the KV GB given back."""
        if not self.colocated:
            return {}
        start = time.perf_counter()
        released = self.sleep_engines()
        asleep = time.perf_counter()
        self.trainers.call_all("reload_states")
        return {"engine_sleep": asleep - start, "trainer_reload": time.perf_counter() - asleep,
                "kv_gb_released": released / 1e9}

    def to_rollout(self) -> dict[str, float]:
        """Trainer states to host memory, engines awake (KV pools back, decode graphs recaptured)."""
        if not self.colocated:
            return {}
        start = time.perf_counter()
        self.trainers.call_all("offload_states")
        offloaded = time.perf_counter()
        settled(self.fleet.submit("wake"))
        return {"trainer_offload": offloaded - start, "engine_wake": time.perf_counter() - offloaded}

    def sleep_engines(self) -> int:
        """Every engine's KV memory given back (also before a trainer pool is rebuilt beside them); bytes freed."""
        if not self.colocated:
            return 0
        return sum(s["bytes"] for s in settled(self.fleet.submit("sleep")))
