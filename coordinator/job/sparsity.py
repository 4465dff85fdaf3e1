"""`SparsityLoop`: the schedule in force, and the controller that changes it from each step's α (docs/controller.md).

A new schedule goes to every rollout worker (each applies it at its next barrier, so every sample carries
exactly one schedule version; sync mode waits for that) and to every trainer rank (its α length bins).
"""

from sparrow.acceptance import AlphaHistogram
from sparrow.cost import CostModel, ModelShape, RolloutSpec
from sparrow.schedule import SparsitySchedule

from ..config import SparrowConfig
from ..controller import ControllerConfig, SparsityController, initial_schedule
from ..fleet import RolloutFleet, settled
from ..trainer_host import ShardResult
from .trainers import TrainerLink


class SparsityLoop:
    def __init__(self, config: SparrowConfig, metrics, fleet: RolloutFleet, trainers: TrainerLink):
        self.config, self.metrics, self.fleet, self.trainers = config, metrics, fleet, trainers
        self.controller_config = ControllerConfig(**config.controller.model_dump(exclude={"enabled"}))
        self.pushes: list = []
        self.restart()

    def restart(self) -> None:
        """The job's initial schedule (rollout.schedule, or a calibration's), and a fresh controller if it is on."""
        cfg = self.config
        template = cfg.schedule_template()
        start = initial_schedule(self.controller_config, template) if cfg.controller.calibration else template
        self.controller = SparsityController(self.controller_config, start) if cfg.controller.enabled else None
        self.schedule = self.controller.schedule if self.controller else start

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.to_dict(),
                "controller": None if self.controller is None else self.controller.state_dict()}

    def load_state_dict(self, state: dict, origin: str) -> None:
        if self.controller is not None:
            self.controller = SparsityController.from_state_dict(self.controller_config, state["controller"])
            self.schedule = self.controller.schedule
        else:
            self.schedule = SparsitySchedule.from_dict(state["schedule"], origin=origin)

    def push(self, schedule: SparsitySchedule) -> None:
        """The schedule to every rollout worker and every trainer rank. A worker applies it at its next barrier;
        sync mode waits for that (the workers are idle between steps), async mode does not."""
        self.fleet.setup.schedule = schedule
        settled(self.pushes)
        self.pushes = self.fleet.submit("set_schedule", schedule)
        if self.config.run.synchronous:
            settled(self.pushes)
            self.pushes = []
        self.trainers.pool.call("set_schedule", schedule.to_dict())
        self.metrics.set_schedule(schedule, self.controller_config.target)

    def control(self, step: int, rank0: ShardResult) -> tuple[AlphaHistogram, AlphaHistogram, dict | None]:
        """Step `step`'s α → the controller → a new schedule if a budget changed. Returns α's lower and upper
        histograms and the decision record (None with the controller off)."""
        report = rank0.alpha
        empty = AlphaHistogram.empty(self.schedule.num_bins)
        alpha, upper = report.combined() if report.lower else (empty, empty)
        self.metrics.observe_alpha(alpha)
        if self.controller is None:
            return alpha, upper, None
        if self.controller_config.statistic == "exact":  # α itself, the trainer's measurement (trainer.exact_alpha)
            report = rank0.alpha_exact
        versions = sorted(report.lower) or [max(self.schedule.version, 0)]
        for v in versions:
            self.controller.observe(report.lower.get(v, empty), v, report.upper.get(v, empty))
        result = self.controller.decide()
        self.metrics.record_control_step(result, self.controller_config.target)
        if result.changed:
            self.schedule = result.schedule
            self.push(result.schedule)
        decision = {
            "step": step, "schedule_version": result.schedule.version, "changed": result.changed,
            "topk_blocks": list(result.schedule.topk_blocks), "notes": result.notes,
            "decisions": [{"bin": d.bin, "old": d.old, "new": d.new, "reason": d.reason, "stats": d.stats}
                          for d in result.decisions],
        }
        return alpha, upper, decision

    def predicted_speedup(self, summary, shape: ModelShape, hardware) -> float | None:
        """sparrow.cost's roofline speedup of the schedule in force at this step's measured lengths."""
        if not summary.response_lengths:
            return None
        engine = self.config.rollout.engine_config()
        spec = RolloutSpec(
            prompt_len=round(sum(summary.prompt_lengths) / len(summary.prompt_lengths)),
            gen_len=max(1, round(sum(summary.response_lengths) / len(summary.response_lengths))),
            samples=self.config.rollout.sampling.n, batch=self.config.run.prompts_per_step,
            dense_layers=len(engine.dense_layers), landmark=engine.landmark,
        )
        return self.metrics.set_predicted_speedup(CostModel(shape, hardware, spec), self.schedule)
