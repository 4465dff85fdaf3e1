"""`Publication`: each policy version from the trainer to the serving rollout workers.

Channels: "shared" hands each trainer rank's version to the rollout worker on its own GPU in place
(colocated placement: CUDA IPC buffers on a GPU, shared memory on a CPU; `sparrow.weight_sync.shared`);
"collective" broadcasts over a weight group of trainer rank 0 and the serving workers (sync mode on GPU:
the workers are idle between steps); "object_store" puts the buckets in Ray's object store as a
`WeightHandle` that each worker loads at its next barrier. The trainer refuses to send NaN/Inf weights
(`PublishRefused`); the job then goes back to its last checkpoint. A worker that joins mid-run outside
the broadcast group or without a GPU of the trainer's gets the current version through the object store.
"auto" is chosen once the ranks and workers are placed (`choose_channel`): a disaggregated job whose pools
share GPUs (0.5 + 0.5 of one) hands over in place too, since NCCL cannot put two ranks of a group on one GPU.
"""

import ray

from ..config import RunConfig
from ..fleet import RolloutFleet, settled
from ..step_record import PublishStats
from .trainers import TrainerLink


class PublishRefused(RuntimeError):
    """The trainer's new weights hold NaN/Inf: nothing was sent; the trainer goes back to its last checkpoint."""


def choose_channel(run: RunConfig, trainer_gpus: list[str | None], worker_gpus: list[str | None]) -> str:
    """The channel `run.weights_channel` means where trainer rank i computes on `trainer_gpus[i]` and rollout worker
    j on `worker_gpus[j]` (GPU UUIDs; None on a CPU). "auto": shared when colocated, or when every worker sits on a
    trainer rank's GPU (sync GPU jobs); collective for sync GPU jobs whose group members have GPUs of their own;
    the object store otherwise. An explicit "collective" over a shared GPU is refused here, before any step."""
    members = [("trainer rank 0", trainer_gpus[0] if trainer_gpus else None)]
    members += [(f"rollout-{j}", gpu) for j, gpu in enumerate(worker_gpus)]
    first: dict[str, str] = {}
    clash = None
    for name, gpu in members:
        if gpu is None:
            continue
        if gpu in first and clash is None:
            clash = (first[gpu], name, gpu)
        first.setdefault(gpu, name)
    requested = run.weights_channel
    if requested == "collective" and clash:
        raise ValueError(f"run.weights_channel='collective': {clash[0]} and {clash[1]} share GPU {clash[2]}, and NCCL "
                         "cannot put two ranks of the weight group on one GPU; use 'auto' (hands the weights over in "
                         "place there) or 'object_store'")
    if requested != "auto":
        return requested
    if run.placement == "colocated":
        return "shared"
    on_gpu = bool(trainer_gpus) and all(trainer_gpus)
    if not (on_gpu and run.synchronous):
        return "object_store"
    if worker_gpus and set(worker_gpus) <= set(trainer_gpus):
        return "shared"
    return "object_store" if clash else "collective"


class Publication:
    def __init__(self, run: RunConfig, trainers: TrainerLink, fleet: RolloutFleet):
        self.run, self.trainers, self.fleet = run, trainers, fleet
        self.channel = run.weights_channel
        """Resolved from "auto" by `start`, once the pools are placed."""
        self.group_members: list = []
        self.loads: list = []
        """Object-store loads submitted to the workers and not yet settled (async mode does not wait for them)."""

    def start(self) -> None:
        """Choose the channel for where the trainer ranks and the (started) workers compute; form the group."""
        trainer_gpus = [info.get("gpu") for info in self.trainers.pool.setup_info]
        self.channel = choose_channel(self.run, trainer_gpus, [info.get("gpu") for info in self.fleet.workers])
        if self.channel == "collective":
            self.join_group()

    def join_group(self) -> None:
        """(Re)form the broadcast group: trainer rank 0 and the serving workers. With none serving (every worker
        lost and being replaced) there is no group: publications go through the object store until one serves."""
        workers = self.fleet.live
        if not workers:
            self.group_members = []
            return  # membership_changed stays set: the group forms at the next publication with a worker in it
        host, port = ray.get(self.trainers.rank0.address.remote())
        world = 1 + len(workers)
        backend = "nccl" if self.trainers.on_gpu else "gloo"
        timeout = self.trainers.pool.trainer_config.publish.timeout_s
        refs = [self.trainers.rank0.init_weight_group.remote(host, port, world, backend)]
        refs += [s.actor.join_weight_group.remote(host, port, i + 1, world, backend, timeout) for i, s in enumerate(workers)]
        ray.get(refs)
        self.group_members = workers
        self.fleet.membership_changed = False

    def publish(self, version: int, wait: bool, rollback: bool = False) -> PublishStats:
        """Send policy `version` to every serving worker (`rollback`: it may be older than theirs); it becomes the
        version a joining worker must hold before it counts as joined."""
        stats = self._hand_over(version, rollback) if self.channel == "shared" else self._send(version, wait, rollback)
        self.fleet.setup.version = version
        return stats

    def _send(self, version: int, wait: bool, rollback: bool) -> PublishStats:
        """The collective or object-store channels (no hand-over in place)."""
        if self.channel == "collective" and self.fleet.membership_changed:
            self.join_group()
        channel = "collective" if self.channel == "collective" and self.group_members else "object_store"
        if channel == "collective":
            trainer = [a.publish_weights.remote(version, "collective") for a in self.trainers.actors]
            workers = self.fleet.submit("receive_weights", rollback, slots=self.group_members)
            report = self.trainers.call(trainer)[0]
            loads = settled(workers)
            if report.refused:
                raise PublishRefused(report.refused)
            self.fleet.setup.weights = None  # a worker joining later gets an object-store copy (`for_joiners`)
        else:
            report = self.trainers.call_all("publish_weights", version, "object_store")[0]
            if report.refused:
                raise PublishRefused(report.refused)
            self.loads = self._load_from_object_store(report, rollback)
            loads = self.settle_loads() if wait else []
        seconds = report.seconds + max((x["seconds"] for x in loads), default=0.0)
        return PublishStats(version=version, seconds=seconds, send_seconds=report.seconds, bytes=report.nbytes,
                            channel=channel, waited=wait)

    def _hand_over(self, version: int, rollback: bool) -> PublishStats:
        """Every rank packs the version into its shared buffers; worker i reads rank i's in place. The loads are
        settled here: a rank rewrites its buffers at the next publication."""
        reports = self.trainers.call_all("publish_weights", version, "shared")
        if reports[0].refused:
            raise PublishRefused(reports[0].refused)
        loads = settled(self.fleet.submit("load_shared_weights", [r.handle for r in reports], rollback))
        elsewhere = {x["worker"] for x in loads if x["version"] is None}
        if elsewhere:  # replacements placed on a GPU without a trainer rank
            report = self.trainers.call_all("publish_weights", version, "object_store")[0]
            slots = [s for s in self.fleet.reachable if s.index in elsewhere]
            loads = [x for x in loads if x["version"] is not None]
            loads += settled(self._load_from_object_store(report, rollback, slots))
        self.fleet.setup.weights = None  # a worker joining later gets an object-store copy (`for_joiners`)
        send = max(r.seconds for r in reports)
        seconds = send + max((x["seconds"] for x in loads), default=0.0)
        return PublishStats(version=version, seconds=seconds, send_seconds=send, bytes=reports[0].nbytes,
                            channel="shared", waited=True)

    def _load_from_object_store(self, report, rollback: bool, slots: list | None = None) -> list:
        """`slots` (default: every reachable worker) load rank 0's object-store `report`, which becomes the version a
        worker starting later is set up with; the load refs. One path for a publication, the joiners, replacements
        off a trainer's GPU and a reset; the callers differ in how the report was made and when the loads settle."""
        self.fleet.setup.weights = report.handle
        refs = self.fleet.submit("load_weights", report.handle, rollback, slots=slots)
        report.handle = None
        return refs

    def for_joiners(self, version: int) -> None:
        """A worker that joins mid-run is not in the broadcast group yet (collective channel) or holds no mapping
        of a trainer's buffers (shared), so it gets the current version once through the object store (the
        next publication takes it in)."""
        joining = self.fleet.joining
        if self.channel == "object_store" or not version or self.fleet.setup.weights is not None or not joining:
            return
        report = self.trainers.call_all("publish_weights", version, "object_store")[0]
        self.loads += self._load_from_object_store(report, False, joining)

    def settle_loads(self) -> list[dict]:
        loads, self.loads = settled(self.loads), []
        return loads

    def reset_workers(self) -> None:
        """Back to version 0 (no checkpoint yet): the initial weights, published from a fresh trainer pool."""
        report = self.trainers.pool.call("publish_weights", 0, "object_store")[0]
        settled(self._load_from_object_store(report, True))
        self.fleet.setup.version = 0
