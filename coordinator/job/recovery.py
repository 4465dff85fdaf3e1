"""Back to the last checkpoint after a lost trainer rank or refused (NaN/Inf) weights, and redo the steps after it.

The rollout pool keeps running throughout: leases of the steps being redone are discarded in the dispatcher
(their samples are never trained), the workers are pointed at the (new) TrajectoryServer and get the
checkpoint's weights, which may be older than theirs (a rollback).
"""

import time
from typing import TYPE_CHECKING

import ray

from ..fleet import JobFailed, describe
from ..step_record import FaultEvent

if TYPE_CHECKING:
    from ..driver import TrainingJob


def recover_trainer(job: "TrainingJob", error: BaseException, rebuild: bool) -> None:
    """`rebuild`: a rank was lost, so the trainer pool is new; otherwise the same ranks reload the checkpoint."""
    job.trainer_restarts += 1
    limit = job.config.run.recovery.max_trainer_restarts
    first = describe(error)
    if job.trainer_restarts > limit:
        raise JobFailed(f"the trainer pool failed {job.trainer_restarts} times (run.recovery.max_trainer_restarts="
                        f"{limit}); last error: {first}") from error
    started, failed_step = time.monotonic(), job.step
    what = "trainer lost" if rebuild else "weights refused"
    job.log(f"step {failed_step + 1}: {what} ({first}); back to the last checkpoint "
            f"(restart {job.trainer_restarts} of {limit})")
    job.time_sharing.sleep_engines()  # colocated: the rebuilt or reloading ranks take the GPU
    if rebuild or job.run_dir.latest_tag() is None:  # without a checkpoint only fresh ranks hold the initial weights
        job.trainers.restart(job.scrape_targets)
    if job.run_dir.latest_tag() is not None:
        job.restore()
    else:
        job.step, job.version = 0, 0
        job.sparsity.restart()
        job.run_dir.truncate_after(0)
        job.ledger.load()
    discarded = ray.get(job.dispatcher.discard_from.remote(job.step))
    job.steps.forget_from(job.step)
    job.publication.loads = []
    job.fleet.setup.trajectory_address = job.trajectory_address
    job.fleet.broadcast("connect", job.trajectory_address)
    if job.publication.channel == "collective":
        job.publication.join_group()
    if job.version:
        job.publication.publish(job.version, wait=True, rollback=True)
    else:
        job.publication.reset_workers()
    job.time_sharing.to_rollout()
    job.sparsity.push(job.schedule)
    event = FaultEvent("trainer_lost" if rebuild else "publish_refused", "trainer",
                       f"{first}; redoing steps {job.step + 1}..{failed_step + 1}, {discarded} leases discarded",
                       time.monotonic() - started, failed_step)
    job.fleet.resolved.append(event)
    job.log(f"trainer pool restored at step {job.step} (policy version {job.version}) in {event.recovery_seconds:.1f} s")
