"""The rollout pool and the trainer pool: Ray actors on their own placement groups.

Each pool reserves `size` bundles of `{"CPU": cpus, "GPU": gpus, <node_label>: label_amount}` and
puts one actor in each. A node label is a custom resource that only the intended nodes declare
(`ray start --resources '{"rollout_node": 1}'`), so a pool lands exactly there; the pools share
nothing, so resizing one leaves the other's placement group and actors as they are.
"""

import os
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sparrow.coordinator.transport import JobCredentials

from .config import PoolConfig, SparrowConfig, TrainerSection

ACTOR_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0"}


class PlacementError(RuntimeError):
    """A pool that cannot be placed on the cluster, with what it asked for and what exists."""


def _check_feasible(name: str, pool: PoolConfig) -> None:
    total = ray.cluster_resources()
    need = {r: v * pool.size for r, v in pool.bundle().items() if v}
    short = {r: (v, total.get(r, 0.0)) for r, v in need.items() if total.get(r, 0.0) + 1e-9 < v}
    if short:
        parts = ", ".join(f"{r}: needs {v:g}, cluster has {have:g}" for r, (v, have) in short.items())
        hint = (f"; start the intended nodes with --resources '{{\"{pool.node_label}\": 1}}'"
                if pool.node_label and pool.node_label in short else "")
        raise PlacementError(f"{name} pool ({name}.pool: size {pool.size} × {pool.bundle()}) cannot fit: {parts}{hint}")


class Pool:
    """`size` actors of `cls` (already `ray.remote`), actor i built with `args(i)`; `name` is also the
    pool's config section (`rollout` / `trainer`)."""

    def __init__(self, name: str, pool: PoolConfig, cls, args):
        _check_feasible(name, pool)
        self.name, self.config = name, pool
        self.placement_group = placement_group([pool.bundle()] * pool.size, strategy=pool.strategy, name=f"sparrow-{name}")
        if not self.placement_group.wait(pool.ready_timeout_s):
            remove_placement_group(self.placement_group)
            raise PlacementError(
                f"{name} pool: placement group of {pool.size} × {pool.bundle()} ({pool.strategy}) not ready after "
                f"{pool.ready_timeout_s:g} s; available now: {ray.available_resources()}. Free resources, "
                f"lower {name}.pool.size / cpus / gpus, or raise {name}.pool.ready_timeout_s"
            )
        resources = {pool.node_label: pool.label_amount} if pool.node_label else {}
        self.actors = [
            cls.options(
                num_cpus=pool.cpus, num_gpus=pool.gpus, resources=resources, name=f"sparrow-{name}-{i}-{os.getpid()}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
                runtime_env={"env_vars": ACTOR_ENV},
            ).remote(*args(i))
            for i in range(pool.size)
        ]

    @property
    def size(self) -> int:
        return len(self.actors)

    def call(self, method: str, *args, **kwargs) -> list:
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        remove_placement_group(self.placement_group)


def rollout_pool(config: SparrowConfig, model: str, credentials: JobCredentials) -> Pool:
    from .rollout_worker import RolloutWorker

    cls = ray.remote(concurrency_groups={"monitor": 1})(RolloutWorker)
    payload = config.worker_payload()
    pool = config.rollout.pool
    return Pool("rollout", pool, cls, lambda i: (payload, model, i, pool.torch_threads, credentials))


class TrainerPool(Pool):
    """DeepSpeed ranks (`TrainerHost`) with their torch.distributed rendezvous done."""

    def __init__(self, section: TrainerSection, model: str):
        from .trainer_host import TrainerHost

        trainer = section.trainer_config(model)
        payload = trainer.model_dump(mode="json")
        pool = section.pool
        super().__init__("trainer", pool, ray.remote(TrainerHost),
                         lambda i: (payload, i, pool.size, pool.torch_threads))
        self.trainer_config = trainer
        addr, port = ray.get(self.actors[0].address.remote())
        self.setup_info = self.call("setup", addr, port)
        self.exporting: list = []

    def export_hf(self, directory: Path, wait: bool) -> None:
        """Every rank runs `export_hf` (ZeRO-3 gathers are collective); rank 0 writes `directory`,
        replacing an earlier export there (a resumed run redoes steps).

        Without `wait` the caller goes on at once: each rank runs the export before its next call (an
        actor runs its calls in order), so rollouts continue and only the next trainer call queues
        behind it. A failed export raises at the next one (or here, with `wait`).
        """
        ray.get(self.exporting)
        self.exporting = [a.export_hf.remote(str(directory), True) for a in self.actors]
        if wait:
            ray.get(self.exporting)
            self.exporting = []

    @property
    def rank0(self):
        return self.actors[0]
