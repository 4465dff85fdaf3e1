"""`TrainerGroup`: N `TrainerRank`s as Ray actors, with the rendezvous and the fan-out done.

The caller owns Ray (`ray.init` / `ray.shutdown`); this module only creates and calls actors.
"""

import ray

from .batch import TrajectoryBatch
from .config import TrainerConfig
from .hf_export import DEFAULT_MAX_SHARD_SIZE
from .rank import TrainerRank
from .results import RecomputeResult, StepResult


class TrainerGroup:
    """`num_ranks` ranks of one trainer. `actor_options` go to `.options()` of every actor
    (default: one GPU each when the config runs on CUDA — or on "auto" in a cluster with GPUs —
    else one CPU)."""

    def __init__(self, config: TrainerConfig | dict, num_ranks: int, actor_options: dict | None = None):
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig.model_validate(config)
        if num_ranks < 1:
            raise ValueError(f"num_ranks={num_ranks}: must be >= 1")
        if actor_options is None:
            device = self.config.device
            gpus = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
            actor_options = {"num_gpus": 1} if gpus else {"num_cpus": 1}
        cls = ray.remote(TrainerRank)
        payload = self.config.model_dump()
        self.actors = [cls.options(**actor_options).remote(payload, r, num_ranks) for r in range(num_ranks)]
        self.master_addr, self.master_port = ray.get(self.actors[0].address.remote())
        self.setup_info = ray.get([a.setup.remote(self.master_addr, self.master_port) for a in self.actors])

    @property
    def num_ranks(self) -> int:
        return len(self.actors)

    def submit(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every rank with the same arguments; returns the object refs."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def call(self, method: str, *args, **kwargs) -> list:
        return ray.get(self.submit(method, *args, **kwargs))

    def _shards(self, batch: TrajectoryBatch):
        return batch.shard(self.num_ranks)

    def prepare(self, batch: TrajectoryBatch) -> TrajectoryBatch:
        """GRPO advantages over the whole batch (groups may span ranks), unless every trajectory has one.
        A batch with some advantages set is refused rather than having them overwritten."""
        given = sum(t.advantage is not None for t in batch)
        if given == len(batch):
            return batch
        if given:
            raise ValueError(f"batch: {given} of {len(batch)} trajectories have an advantage; set it on all of them "
                             "or on none (then GRPO advantages are computed over the whole batch)")
        loss = self.config.loss
        return batch.with_grpo_advantages(loss.advantage_std_norm, loss.advantage_eps)

    def train_step(self, batch: TrajectoryBatch, return_gradients: bool = False) -> StepResult:
        batch = self.prepare(batch)
        batch.validate(need_advantages=True)
        refs = [a.train_step.remote(shard, return_gradients) for a, (_, shard) in zip(self.actors, self._shards(batch))]
        return ray.get(refs)[0]

    def recompute(self, batch: TrajectoryBatch) -> RecomputeResult:
        shards = self._shards(batch)
        parts = ray.get([a.recompute.remote(shard) for a, (_, shard) in zip(self.actors, shards)])
        return RecomputeResult.merge([(idx, part) for (idx, _), part in zip(shards, parts)], len(batch))

    def distill_step(self, batch: TrajectoryBatch, dense_logprobs: list) -> dict:
        refs = [
            a.distill_step.remote(shard, [dense_logprobs[i] for i in idx])
            for a, (idx, shard) in zip(self.actors, self._shards(batch))
        ]
        return ray.get(refs)[0]

    def measure_sparse_alpha(self, batch: TrajectoryBatch):
        return ray.get([a.measure_sparse_alpha.remote(s) for a, (_, s) in zip(self.actors, self._shards(batch))])[0]

    def set_schedule(self, schedule) -> None:
        self.call("set_schedule", schedule)

    def publish_weights(self, version: int, channel: str = "object_store"):
        """Rank 0's `PublishReport`. For channel "collective", use `submit("publish_weights", ...)`
        together with the workers' receive calls instead (a broadcast needs both sides at once)."""
        return self.call("publish_weights", version, channel)[0]

    def save_checkpoint(self, directory: str, tag: str | None = None) -> str:
        return self.call("save_checkpoint", directory, tag)[0]

    def load_checkpoint(self, directory: str, tag: str | None = None) -> dict:
        return self.call("load_checkpoint", directory, tag)[0]

    def export_hf(self, directory: str, replace: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> dict:
        return self.call("export_hf", directory, replace, max_shard_size)[0]

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
