"""`TrainerLink`: the driver's side of the trainer pool — start it, call it under supervision, notice a lost rank."""

from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from sparrow.architecture import read_model_config

from ..config import SparrowConfig
from ..fleet import describe
from ..pools import SharedBundles, TrainerPool

POLL_S = 0.25
"""How often the driver supervises the rest of the job while it waits."""


class TrainerLost(RuntimeError):
    """A trainer rank died (or its collective broke because another did); the pool is rebuilt."""


class TrainerLink:
    """The trainer ranks as the driver sees them. Calls wait while `tick` supervises everything else (async mode
    generates while the trainer works); a failure while a rank is dead is `TrainerLost`."""

    def __init__(self, config: SparrowConfig, model: str, credentials, tick: Callable[[], None],
                 bundles: SharedBundles | None = None):
        self.config, self.model, self.credentials, self.tick, self.bundles = config, model, credentials, tick, bundles
        self.pool: TrainerPool | None = None
        self.metrics_urls: list[str] = []
        self.trajectory_address: str | None = None
        """Rank 0's TrajectoryServer, where the rollout workers stream samples."""

    def start(self, scrape_targets=None) -> None:
        """Create the ranks, their metrics endpoints and rank 0's TrajectoryServer."""
        cfg = self.config
        self.pool = TrainerPool(cfg.trainer.pool, cfg.trainer_config(self.model), self.credentials, self.bundles)
        vocab = read_model_config(self.model)["vocab_size"]
        transport = cfg.transport.model_copy(update={"vocab_size": vocab})
        self.metrics_urls = self.pool.call("start_metrics", cfg.metrics.model_dump(mode="json"))
        if scrape_targets is not None:
            for rank, url in enumerate(self.metrics_urls):
                scrape_targets.set(f"trainer-{rank}", "trainer", url)
        self.trajectory_address = ray.get(self.pool.rank0.start_ingest.remote(transport.model_dump(mode="json")))

    def restart(self, scrape_targets=None) -> None:
        """A fresh pool (after a lost rank): the old actors are killed first."""
        self.pool.shutdown()
        self.start(scrape_targets)

    def close(self) -> None:
        if self.pool is not None:
            try:
                ray.get(self.pool.rank0.stop_ingest.remote(), timeout=30)
            finally:
                self.pool.shutdown()
                self.pool = None

    @property
    def actors(self) -> list:
        return self.pool.actors

    @property
    def rank0(self):
        return self.pool.rank0

    @property
    def size(self) -> int:
        return self.pool.size

    @property
    def on_gpu(self) -> bool:
        return self.pool.setup_info[0]["device"].startswith("cuda")

    def call_all(self, method: str, *args) -> list:
        """`method(*args)` on every rank (a collective), supervised."""
        return self.call([getattr(a, method).remote(*args) for a in self.actors])

    def call(self, refs: list) -> list:
        """Results of calls on the trainer ranks, supervising the job meanwhile. Any failure while a rank is dead
        is `TrainerLost`: a surviving rank's collective error counts too, and nobody waits for a peer that is gone."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as exc:
                    raise TrainerLost(describe(exc)) from exc
                except Exception as exc:
                    if dead := self.dead_ranks():
                        raise TrainerLost(f"{describe(exc)} (ranks {dead} are gone)") from exc
                    raise
            self.tick()
        return ray.get(refs)

    def dead_ranks(self) -> list[int]:
        dead = []
        for rank, actor in enumerate(self.actors):
            try:
                ray.get(actor.node.remote(), timeout=10)
            except Exception:
                dead.append(rank)
        return dead
