"""The rollout pool and the trainer pool: Ray actors on placement groups of their own.

A bundle is `{"CPU": cpus, "GPU": gpus, <node_label>: label_amount}`. A node label is a custom
resource that only the intended nodes declare (`ray start --resources '{"rollout_node": 1}'`), so a
pool lands exactly there; the pools share nothing.

- **Rollout pool: elastic.** One single-bundle placement group per worker slot, so workers can be
  added, retired and replaced one at a time. A replacement goes into its slot's placement group:
  when a node dies Ray re-places the bundle wherever the resources exist, and when none do the slot
  waits (the pool runs smaller) until capacity returns.
- **Trainer pool: fixed size per run** (one placement group, `strategy` applies); after a rank dies
  the whole group is rebuilt (`TrainerPool` again) and restored from the last checkpoint.
- **Colocated placement** (`run.placement: colocated`): one placement group of the job (`SharedBundles`) whose
  bundle i holds both rollout worker i and trainer rank i — the sum of the two pools' bundles, so a GPU
  split 0.5 / 0.5 is one GPU the two take turns on. Both pools keep their own actors and restart rules; the
  bundles outlive them (a rebuilt trainer pool or a replaced worker goes back into its bundle), and the
  rollout pool cannot grow past them.
"""

import os
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sparrow.schedule import SparsitySchedule
from sparrow.trainer import TrainerConfig

from .config import PoolConfig, SparrowConfig

ACTOR_ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0"}


class PlacementError(RuntimeError):
    """A pool that cannot be placed on the cluster, with what it asked for and what exists."""


def check_feasible(name: str, pool: PoolConfig, size: int, bundle: dict[str, float] | None = None) -> None:
    """Raise unless the cluster has `size` × `bundle` (default: the pool's own bundle) in all."""
    bundle = bundle or pool.bundle()
    total = ray.cluster_resources()
    need = {r: v * size for r, v in bundle.items() if v}
    short = {r: (v, total.get(r, 0.0)) for r, v in need.items() if total.get(r, 0.0) + 1e-9 < v}
    if short:
        parts = ", ".join(f"{r}: needs {v:g}, cluster has {have:g}" for r, (v, have) in short.items())
        hint = (f"; start the intended nodes with --resources '{{\"{pool.node_label}\": 1}}'"
                if pool.node_label and pool.node_label in short else "")
        raise PlacementError(f"{name} pool ({name}.pool: size {size} × {bundle}) cannot fit: {parts}{hint}")


@dataclass
class SharedBundles:
    """The colocated placement's bundles: bundle i is rollout worker i's and trainer rank i's together."""

    group: PlacementGroup
    size: int

    @classmethod
    def create(cls, config: SparrowConfig) -> "SharedBundles":
        rollout, trainer = config.rollout.pool, config.trainer.pool
        bundle = {k: rollout.bundle().get(k, 0.0) + trainer.bundle().get(k, 0.0)
                  for k in rollout.bundle().keys() | trainer.bundle().keys()}
        check_feasible("colocated", trainer, trainer.size, bundle)
        group = placement_group([bundle] * trainer.size, strategy=trainer.strategy, name=f"sparrow-colocated-{os.getpid()}")
        _wait_ready(group, "colocated", trainer, trainer.size, trainer.ready_timeout_s)
        return cls(group, trainer.size)

    def remove(self) -> None:
        remove_placement_group(self.group)


def _actor_options(name: str, pool: PoolConfig, group: PlacementGroup, index: int) -> dict:
    return dict(
        num_cpus=pool.cpus, num_gpus=pool.gpus, name=f"sparrow-{name}-{os.getpid()}",
        resources={pool.node_label: pool.label_amount} if pool.node_label else {},
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        runtime_env={"env_vars": ACTOR_ENV},
    )


def _wait_ready(group: PlacementGroup, name: str, pool: PoolConfig, size: int, timeout_s: float) -> None:
    if not group.wait(timeout_s):
        remove_placement_group(group)
        raise PlacementError(
            f"{name} pool: placement group of {size} × {pool.bundle()} ({pool.strategy}) not ready after "
            f"{timeout_s:g} s; available now: {ray.available_resources()}. Free resources, "
            f"lower {name}.pool.size / cpus / gpus, or raise {name}.pool.ready_timeout_s"
        )


@dataclass
class WorkerSlot:
    """One rollout worker's place in the pool; it outlives the actors that fill it."""

    index: int
    group: PlacementGroup
    bundle: int = 0
    """The slot's bundle in `group` (its own single-bundle group, or bundle `index` of the shared one)."""
    owns_group: bool = True
    actor: object | None = None
    serving: object | None = None
    """The ObjectRef of the actor's `serve` call: it fails as soon as the actor dies."""
    restarts: int = 0
    last_error: str = ""
    generation: int = 0

    @property
    def worker_id(self) -> str:
        return f"rollout-{self.index}"


@dataclass
class RolloutPool:
    """The rollout workers by slot. Creating actors is `spawn`'s job; the driver decides when."""

    config: SparrowConfig
    model: str
    credentials: object
    shared: SharedBundles | None = None
    """Colocated placement: slot i lives in bundle i of these, beside trainer rank i."""
    slots: dict[int, WorkerSlot] = field(default_factory=dict)

    def __post_init__(self):
        from .rollout_worker import RolloutWorker

        pool = self.config.rollout.pool
        check_feasible("rollout", pool, pool.size)
        self.cls = ray.remote(concurrency_groups={"loop": 1})(RolloutWorker)
        self.payload = self.config.worker_payload()

    @property
    def pool(self) -> PoolConfig:
        return self.config.rollout.pool

    def add_slot(self, wait_s: float | None = None) -> WorkerSlot:
        index = max(self.slots, default=-1) + 1
        if self.shared is not None:
            if index >= self.shared.size:
                raise PlacementError(f"colocated placement: rollout worker {index} has no bundle (there are "
                                     f"{self.shared.size}, one per trainer rank)")
            slot = WorkerSlot(index, self.shared.group, bundle=index, owns_group=False)
            self.slots[index] = slot
            return slot
        group = placement_group([self.pool.bundle()], strategy="PACK", name=f"sparrow-rollout-{index}-{os.getpid()}")
        if wait_s is not None:
            _wait_ready(group, "rollout", self.pool, 1, wait_s)
        slot = WorkerSlot(index, group)
        self.slots[index] = slot
        return slot

    def spawn(self, slot: WorkerSlot, schedule: SparsitySchedule):
        """A new actor in the slot's bundle (Ray starts it when the bundle is placed); its engine starts with
        `schedule`, the job's in force."""
        options = _actor_options(f"rollout-{slot.index}.{slot.generation}", self.pool, slot.group, slot.bundle)
        slot.actor = self.cls.options(max_concurrency=8, **options).remote(
            self.payload, self.model, slot.index, self.pool.torch_threads, self.credentials, schedule.to_dict())
        slot.generation += 1
        return slot.actor

    def ready(self, slot: WorkerSlot) -> bool:
        """The slot's bundle is placed. Asked of the GCS's table: `PlacementGroup.wait(0)` answers False while
        its reply is in flight (12 of 50 calls on an idle machine for a placed group), so on a busy head a
        lost worker's replacement could wait for a placement it already had."""
        return placement_group_table(slot.group)["state"] == "CREATED"

    def kill(self, slot: WorkerSlot) -> None:
        if slot.actor is not None:
            ray.kill(slot.actor, no_restart=True)
        slot.actor = slot.serving = None

    def remove(self, slot: WorkerSlot) -> None:
        self.kill(slot)
        if slot.owns_group:
            remove_placement_group(slot.group)
        del self.slots[slot.index]

    @property
    def live(self) -> list[WorkerSlot]:
        return [s for s in self.slots.values() if s.serving is not None]

    def shutdown(self) -> None:
        for slot in list(self.slots.values()):
            self.remove(slot)


class TrainerPool:
    """DeepSpeed ranks (`TrainerHost`) on one placement group, with their torch.distributed rendezvous done."""

    def __init__(self, pool: PoolConfig, trainer_config: TrainerConfig, credentials, shared: SharedBundles | None = None):
        """`shared`: the colocated placement's bundles (rank i in bundle i); otherwise a placement group of its own."""
        from .trainer_host import TrainerHost

        self.config = pool
        self.trainer_config = trainer_config
        self.owns_group = shared is None
        if shared is None:
            check_feasible("trainer", pool, pool.size)
            self.placement_group = placement_group([pool.bundle()] * pool.size, strategy=pool.strategy,
                                                   name=f"sparrow-trainer-{os.getpid()}")
            _wait_ready(self.placement_group, "trainer", pool, pool.size, pool.ready_timeout_s)
        else:
            self.placement_group = shared.group
        payload = self.trainer_config.model_dump(mode="json")
        cls = ray.remote(TrainerHost)
        self.actors = [
            cls.options(**_actor_options(f"trainer-{i}", pool, self.placement_group, i)).remote(
                payload, i, pool.size, pool.torch_threads, credentials)
            for i in range(pool.size)
        ]
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
    def size(self) -> int:
        return len(self.actors)

    @property
    def rank0(self):
        return self.actors[0]

    def call(self, method: str, *args, **kwargs) -> list:
        return ray.get([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def shutdown(self) -> None:
        try:  # the shared weight buffers (colocated placement) are released by their rank, not by its death
            ray.get([a.close_publication.remote() for a in self.actors], timeout=10)
        except RayError:
            pass  # a rank that is gone already: a later sender removes its files (`remove_orphans`)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.owns_group:
            remove_placement_group(self.placement_group)
