"""`sparrow bench tail-model`: a model of sync RL steps with variable lengths, to choose partial rollouts'
`extra_groups` before spending GPU time on it.

A model, not a measurement. One colocated engine decodes every sample in flight at once, a decode step taking
`decode_s + decode_s_per_seq * batch` (the weight-bound regime of a GPU decode step); each sample's length is
geometric with the given mean, capped at `max_tokens` (what `bench rl-step --stop-at-eos` gives a random-weight
model); the update takes a fixed `update_s` with the engine asleep, so carried groups pause through it. Which
groups a step trains, which carry over and which hold a step open for the staleness bound are the job's own
`WorkQueue` rules, driven by a simulated clock; tail share and busy-batch fraction are the step record's
(`batch_shape`). Its terms come from measurements: `bench decode-step` for the decode step, a `bench rl-step`
run's update and mean length.
"""

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from sparrow.coordinator.data import PromptRecord
from sparrow.coordinator.metrics import BatchOccupancy, batch_shape
from sparrow.coordinator.step_record import GroupReport
from sparrow.coordinator.work_queue import WorkQueue
from sparrow.tables import format_table

WORKER = "engine"


@dataclass(frozen=True)
class TailModel:
    prompts: int
    samples: int
    mean_tokens: float
    max_tokens: int
    decode_s: float
    """A decode step's fixed time (weight reads), seconds."""
    decode_s_per_seq: float
    """What each sample in the batch adds to a decode step, seconds."""
    update_s: float
    max_num_seqs: int = 256
    carry_staleness: int = 1
    """`run.partial_rollout.max_staleness` (sync mode's default)."""

    def __post_init__(self):
        for name in ("prompts", "samples", "max_tokens", "max_num_seqs", "carry_staleness"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("mean_tokens", "decode_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        for name in ("decode_s_per_seq", "update_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.max_num_seqs < self.samples:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} < samples={self.samples}: a group never fits the engine")


@dataclass(frozen=True)
class ModelStep:
    rollout_s: float
    wall_s: float
    trained_groups: int
    trained_tokens: int
    tail_share: float | None
    busy_batch_fraction: float | None
    carried_out: int
    trained_ids: tuple[str, ...]


@dataclass
class _Running:
    lease_id: int
    left: list[int]
    tokens: int


def simulate(model: TailModel, extra_groups: int, steps: int, seed: int = 0, carry: str = "resume") -> list[ModelStep]:
    """`steps` sync steps, `extra_groups` spare groups in flight (0: no partial rollouts). `carry="finish"`: the
    engine may not interrupt the carried groups, so its sleep for the update waits until they are done."""
    if extra_groups < 0 or steps < 1:
        raise ValueError(f"extra_groups={extra_groups} must be >= 0 and steps={steps} >= 1")
    if carry not in ("resume", "finish"):
        raise ValueError(f"carry={carry!r}: one of 'resume', 'finish'")
    rng = random.Random(seed)
    queue = WorkQueue(max_staleness=0, lease_timeout_s=math.inf,
                      carry_staleness=model.carry_staleness if extra_groups else None)
    running: list[_Running] = []
    clock = {"now": 0.0}
    occupancy = BatchOccupancy()

    def records(prefix: str, count: int) -> list[PromptRecord]:
        return [PromptRecord(f"{prefix}-p{i}", (), "", i) for i in range(count)]

    def length() -> int:
        return min(model.max_tokens, 1 + int(rng.expovariate(1.0 / model.mean_tokens)))

    def decode_to_next_finish() -> None:
        batch = sum(1 for g in running for n in g.left if n)
        tokens = min(n for g in running for n in g.left if n)
        seconds = tokens * (model.decode_s + model.decode_s_per_seq * batch)
        occupancy.add(batch, seconds)
        clock["now"] += seconds
        for g in list(running):
            g.left = [max(n - tokens, 0) for n in g.left]
            if not any(g.left):
                running.remove(g)
                ids = [f"{g.lease_id}#{j}" for j in range(model.samples)]
                queue.complete(WORKER, g.lease_id, GroupReport(WORKER, model.samples, 0, g.tokens, model.samples, 0,
                                                               [], 1, ids, seconds=0.0), clock["now"])

    queue.add_step(0, records("s0", model.prompts) + records("x0", extra_groups), needed=model.prompts)
    out: list[ModelStep] = []
    version, started = 0, 0.0
    while len(out) < steps:
        if queue.step_complete(version):
            work = queue.take_step(version)
            while carry == "finish" and running:
                decode_to_next_finish()
            reports = [report for _, report in work.done.values()]
            shape = batch_shape({}, {WORKER: occupancy.seconds}, model.max_num_seqs)
            rollout = clock["now"] - started
            out.append(ModelStep(rollout, rollout + model.update_s, len(reports), sum(r.tokens for r in reports),
                                 shape.tail_share, shape.busy_batch_fraction, work.carried_out,
                                 tuple(i for r in reports for i in r.sample_ids)))
            version += 1
            clock["now"] += model.update_s
            started, occupancy = clock["now"], BatchOccupancy()
            queue.add_step(version, records(f"s{version}", model.prompts), needed=model.prompts)
            continue
        room = (model.max_num_seqs - sum(1 for g in running for n in g.left if n)) // model.samples
        if room:
            for lease in queue.lease(WORKER, version, room, clock["now"]):
                left = [length() for _ in range(model.samples)]
                running.append(_Running(lease.lease_id, left, sum(left)))
        if not running:
            raise RuntimeError(f"step {version}: nothing to decode and the step is not complete")
        decode_to_next_finish()
    return out


def steady(steps: list[ModelStep], warmup: int) -> dict:
    """Means over the steps after `warmup` (the first steps fill the pipeline of carried groups)."""
    rest = steps[warmup:] or steps
    wall = sum(s.wall_s for s in rest)
    return {"steps": len(rest), "wall_s": wall / len(rest), "rollout_s": sum(s.rollout_s for s in rest) / len(rest),
            "trained_groups": sum(s.trained_groups for s in rest) / len(rest),
            "tokens_per_s": sum(s.trained_tokens for s in rest) / wall,
            "tail_share": _mean_known([s.tail_share for s in rest]),
            "busy_batch_fraction": _mean_known([s.busy_batch_fraction for s in rest]),
            "carried_out": sum(s.carried_out for s in rest) / len(rest)}


def _mean_known(values: list) -> float:
    """Over the steps that decoded (one whose groups were all done before it began has no batch shape)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else 0.0


def register(actions) -> None:
    p = actions.add_parser("tail-model", help="a model of sync RL steps with variable lengths: step time and tail "
                                              "share against run.partial_rollout.extra_groups (a model, not a run)")
    p.add_argument("--prompts", type=int, default=4, help="prompts (GRPO groups) a step trains")
    p.add_argument("--samples", type=int, default=8, help="samples a group")
    p.add_argument("--mean-tokens", type=float, default=3000.0, help="mean generated length (geometric)")
    p.add_argument("--max-tokens", type=int, default=8192, help="length cap")
    p.add_argument("--decode-ms", type=float, default=3.5, help="a decode step's fixed time, ms")
    p.add_argument("--decode-ms-per-seq", type=float, default=0.03, help="what each sample in flight adds, ms")
    p.add_argument("--update-s", type=float, default=8.0, help="seconds of an update (engine asleep)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch limit")
    p.add_argument("--carry-staleness", type=int, default=1, help="run.partial_rollout.max_staleness")
    p.add_argument("--carry", choices=("resume", "finish"), default="resume",
                   help="run.partial_rollout.carry: finish = the update waits for the carried groups")
    p.add_argument("--extra-groups", type=int, nargs="+", default=[0, 2, 4, 8], help="spare groups to compare")
    p.add_argument("--steps", type=int, default=40, help="steps a seed (the first 3 are left out)")
    p.add_argument("--seeds", type=int, default=5, help="length draws averaged")
    p.add_argument("--out", type=Path, help="write the table as JSON")
    p.set_defaults(handler=run)


def run(args) -> int:
    model = TailModel(args.prompts, args.samples, args.mean_tokens, args.max_tokens, args.decode_ms / 1000,
                      args.decode_ms_per_seq / 1000, args.update_s, args.max_num_seqs, args.carry_staleness)
    if args.steps < 4 or args.seeds < 1:
        raise ValueError(f"--steps {args.steps} must be >= 4 (3 are warm-up) and --seeds {args.seeds} >= 1")
    rows = []
    for extra in args.extra_groups:
        per_seed = [steady(simulate(model, extra, args.steps, seed, args.carry), warmup=3) for seed in range(args.seeds)]
        rows.append({"extra_groups": extra, **{k: sum(s[k] for s in per_seed) / len(per_seed) for k in per_seed[0]}})
    base = next((r for r in rows if r["extra_groups"] == 0), None)
    head = ["extra groups", "step s", "rollout s", "groups trained", "trained tok/s", "tail %", "busy batch %",
            "carried", "step vs sync", "tok/s vs sync"]
    body = [[str(r["extra_groups"]), f"{r['wall_s']:.1f}", f"{r['rollout_s']:.1f}", f"{r['trained_groups']:.2f}",
             f"{r['tokens_per_s']:.0f}", f"{100 * r['tail_share']:.1f}", f"{100 * r['busy_batch_fraction']:.1f}",
             f"{r['carried_out']:.1f}"]
            + (["-", "-"] if base is None else [f"{base['wall_s'] / r['wall_s']:.2f}x",
                                                f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"]) for r in rows]
    print(f"model (not a run): {args.prompts} prompts x {args.samples} samples, lengths geometric mean "
          f"{args.mean_tokens:.0f} capped at {args.max_tokens}, decode step {args.decode_ms} ms + "
          f"{args.decode_ms_per_seq} ms a sample, update {args.update_s} s, carry {args.carry}; {args.seeds} seeds x "
          f"{args.steps - 3} steps")
    print(format_table(head, body))
    if args.out:
        args.out.write_text(json.dumps({"kind": "tail-model", "model": asdict(model), "rows": rows}, indent=1) + "\n")
    return 0
