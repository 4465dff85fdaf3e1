"""`PoolControl`: the coordinator's `ControlService` handler (`sparrow pool status / resize`).

Requests arrive on transport threads; a resize is only recorded there and the driver thread applies it at
its next supervision tick (`apply`), so the fleet is only ever changed by one thread.
"""

from collections.abc import Callable

from sparrow.coordinator.transport import Health, PoolStatus, ResizeRequests

from ..fleet import RolloutFleet
from .trainers import TrainerLink


class PoolControl:
    component = "coordinator"

    def __init__(self, fleet: RolloutFleet, trainers: TrainerLink, progress: Callable[[], tuple[int, int, int]], log):
        """`progress()` gives (step, policy version, schedule version) as the driver has them now."""
        self.fleet, self.trainers, self.progress, self.log = fleet, trainers, progress, log
        self.requests = ResizeRequests()
        self._status: list[PoolStatus] = []

    def resize_pool(self, pool: str, size: int) -> tuple[bool, int, str]:
        """Record the new target; the driver thread applies it at its next supervision tick."""
        was = self.fleet.target
        if self.fleet.pool.shared is not None:
            return False, was, ("the job's placement is colocated: each rollout worker shares its GPU with a trainer "
                                "rank, so the rollout pool keeps their number")
        self.requests.put(pool, size)
        return True, size, (f"was {was}; added workers join once they hold the current weights and schedule, "
                            "a shrink retires the newest workers once they finish what they hold")

    def health(self) -> Health:
        step, policy, schedule = self.progress()
        return Health("serving", self.component, schedule, policy, {"step": float(step)}, list(self._status))

    def drain(self, timeout_s: float):
        raise NotImplementedError("the coordinator does not drain; stop the job instead")

    def apply(self) -> None:
        """A pool size asked for through `sparrow pool resize`, and the pools' status for `sparrow pool status`."""
        size = self.requests.take("rollout")
        if size is not None and size != self.fleet.target:
            step = self.progress()[0]
            self.log(f"step {step + 1}: rollout pool target {self.fleet.target} → {size} (sparrow pool resize)")
            self.fleet.resize(size)
        n = self.trainers.size
        self._status = [self.fleet.status(), PoolStatus("trainer", n, n)]
