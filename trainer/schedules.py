"""The schedules a trainer rank knows: the one in force (α length bins, DistillSparse budgets) and the last few
versions, so exact α can replay a trajectory under the schedule it was decoded with."""

from sparrow.schedule import SPARROW_EDGES, SparsitySchedule, load_schedule

from .batch import Trajectory

DENSE_BINS = SparsitySchedule(name="dense-bins", topk_blocks=(None,) * (len(SPARROW_EDGES) + 1))
"""Length bins for α when no schedule is set: Sparrow's 2000-token bins."""

KNOWN_SCHEDULES = 16
"""Schedule versions a rank remembers."""


class KnownSchedules:
    def __init__(self):
        self.in_force: SparsitySchedule | None = None
        self.by_version: dict[int, SparsitySchedule] = {}

    def set(self, schedule: SparsitySchedule | dict | str | None) -> None:
        """The schedule in force: a `SparsitySchedule`, its dict, a name or file, or None (dense)."""
        if isinstance(schedule, dict):
            schedule = SparsitySchedule.from_dict(schedule)
        elif isinstance(schedule, str):
            schedule = load_schedule(schedule)
        self.in_force = schedule
        if schedule is not None:
            self.by_version[schedule.version] = schedule
            while len(self.by_version) > KNOWN_SCHEDULES:
                del self.by_version[min(self.by_version)]

    @property
    def bins(self) -> SparsitySchedule:
        """α's length bins: those of the schedule in force, Sparrow's without one."""
        return self.in_force or DENSE_BINS

    def of(self, trajectory: Trajectory) -> SparsitySchedule | None:
        """The schedule `trajectory` was decoded with: by its version, the one in force if it has none; None
        when this rank no longer knows that version."""
        if trajectory.schedule_version < 0:
            return self.in_force
        return self.by_version.get(trajectory.schedule_version)
