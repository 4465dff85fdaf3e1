"""`sparrow bench tail-model`: a model of RL steps with variable lengths, to choose between sync, async and partial
rollouts (`run.partial_rollout.extra_groups`, `carry`) before spending GPU time on them.

A model, not a measurement. One engine decodes every sample in flight at once, a decode step taking
`decode_s + decode_s_per_seq * batch` (the weight-bound regime of a GPU decode step) plus, with `kv_s_per_token`,
that much for every token of context the samples in flight attend (the KV reads of long sequences: their prompt and
what they generated so far, at most `kv_cap_tokens` each under a sparse schedule); each sample's length is
geometric with the given mean, capped at `max_tokens` (what `bench rl-step --stop-at-eos` gives a random-weight
model); an update takes a fixed `update_s`. Colocated, the engine sleeps through the update (carried groups pause;
with `carry: finish` the sleep first waits for them) and the new version is in place when it wakes. Disaggregated,
the engine goes on decoding while the trainer updates; at each new version it interrupts its groups and resumes
them (`carry: resume`) or stops leasing until its groups are done (any other case, as the rollout worker's barrier
does), then pauses `load_s` to load the weights; with `staleness` > 0 (async) the steps up to the version plus the
staleness are queued, so the engine has work while the trainer updates. Which groups a step trains, which carry over,
admission by staleness and the staleness bound are the job's own `WorkQueue` rules, driven by a simulated clock; tail
share and busy-batch fraction are the step record's (`batch_shape`). Its terms come from measurements:
`bench decode-step` for the decode step, a `bench rl-step` run's update and mean length.
"""

import json
import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from sparrow.coordinator.config import budget_carry_limit
from sparrow.coordinator.data import PromptRecord
from sparrow.coordinator.metrics import BatchOccupancy, batch_shape
from sparrow.coordinator.step_record import GroupReport, mean_known
from sparrow.coordinator.work_queue import WorkQueue
from sparrow.tables import format_table


WORKER = "engine"
KV_SPAN = 256
"""With KV reads, a decode span is at most this many tokens: the context grows through it, and the span is charged
the context at its middle."""
CARRY = ("off", "resume", "finish")


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
    placement: str = "colocated"
    staleness: int = 0
    """`run.max_staleness`: async when > 0 (disaggregated only; a colocated job is synchronous)."""
    carry_staleness: int = 1
    """`run.partial_rollout.max_staleness` (default: staleness + 1)."""
    load_s: float = 0.0
    """Seconds a disaggregated engine pauses to load a new version."""
    kv_s_per_token: float = 0.0
    """What each token of context a sample in flight attends adds to a decode step (its KV reads), seconds."""
    prompt_tokens: int = 0
    kv_cap_tokens: int | None = None
    """Most tokens of context a sample attends (a sparse schedule's budget); None: all of it (dense)."""
    close_after_s: float | None = None
    """`run.partial_rollout.close_after_s`: the trainer waits at most this long for a step (then it closes with the
    groups done, within the job's carry limit); None: no time budget."""

    def __post_init__(self):
        for name in ("prompts", "samples", "max_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        for name in ("mean_tokens", "decode_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        if self.placement not in ("colocated", "disaggregated"):
            raise ValueError(f"placement={self.placement!r}: one of 'colocated', 'disaggregated'")
        if self.placement == "colocated" and self.staleness:
            raise ValueError(f"staleness={self.staleness} with placement='colocated': a colocated engine sleeps "
                             "through every update, so the job is synchronous; use placement='disaggregated'")
        if self.staleness < 0 or self.carry_staleness <= self.staleness:
            raise ValueError(f"staleness={self.staleness} must be >= 0 and carry_staleness={self.carry_staleness} "
                             "above it (a carried group trains at least one step later)")
        for name in ("decode_s_per_seq", "update_s", "load_s", "kv_s_per_token", "prompt_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 0")
        if self.kv_cap_tokens is not None and self.kv_cap_tokens < 1:
            raise ValueError(f"kv_cap_tokens={self.kv_cap_tokens}: must be >= 1 (or None: dense attention)")
        if self.close_after_s is not None and self.close_after_s <= 0:
            raise ValueError(f"close_after_s={self.close_after_s}: must be > 0 (or None: no time budget)")
        if self.max_num_seqs < self.samples:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} < samples={self.samples}: a group never fits the engine")


@dataclass(frozen=True)
class ModelStep:
    rollout_s: float
    """The trainer's wait from the end of its previous update (the version hand-over included) to this step."""
    wall_s: float
    """From the previous step's start of training to this one's."""
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
    made: int = 0
    """Tokens each of its samples still running has generated (they start together and advance together)."""


def simulate(model: TailModel, extra_groups: int, steps: int, seed: int = 0, carry: str = "resume") -> list[ModelStep]:
    """The first `steps` trained steps with `extra_groups` spare groups in flight. `carry` is partial rollouts'
    (`resume`: groups generating at a new version are interrupted and resumed; `finish`: waited for), or `off`."""
    if extra_groups < 0 or steps < 1:
        raise ValueError(f"extra_groups={extra_groups} must be >= 0 and steps={steps} >= 1")
    if carry not in CARRY:
        raise ValueError(f"carry={carry!r}: one of {', '.join(map(repr, CARRY))}")
    if carry == "off" and extra_groups:
        raise ValueError(f"extra_groups={extra_groups} with carry='off': spare groups are partial rollouts")
    if carry == "off" and model.close_after_s is not None:
        raise ValueError(f"close_after_s={model.close_after_s} with carry='off': a time budget is partial rollouts")
    return _Simulation(model, extra_groups, carry, random.Random(seed)).run(steps)


class _Simulation:
    """The job's clock: the engine's decode, the trainer's update and the version hand-over between them."""

    def __init__(self, model: TailModel, extra_groups: int, carry: str, rng: random.Random):
        self.model, self.extra, self.rng = model, extra_groups, rng
        self.colocated = model.placement == "colocated"
        self.interrupts = carry == "resume"
        self.finish_before_sleep = carry == "finish"
        self.queue = WorkQueue(max_staleness=model.staleness, lease_timeout_s=math.inf,
                               carry_staleness=None if carry == "off" else model.carry_staleness)
        self.running: list[_Running] = []
        self.now, self.version, self.queued = 0.0, 0, -1
        self.update_end: float | None = None
        """The trainer is updating until then."""
        self.version_due = False
        """An update ended; its version waits for the engine (its groups to finish, or the load)."""
        self.occupancy = BatchOccupancy()

    def run(self, steps: int) -> list[ModelStep]:
        out: list[ModelStep] = []
        last_take = trainer_idle = 0.0
        self._queue_steps()
        while len(out) < steps:
            if self.update_end is not None and self.now >= self.update_end:
                self.update_end, self.version_due, trainer_idle = None, True, self.now
            if self.version_due and (self.colocated or self.interrupts or not self.running):
                self.now += 0.0 if self.colocated else self.model.load_s
                self.version, self.version_due = self.version + 1, False
                self._queue_steps()
            budget = self._budget_carry(trainer_idle)
            if self.update_end is None and not self.version_due and self.queue.step_complete(len(out), budget):
                work = self.queue.take_step(len(out), budget)
                while self.colocated and self.finish_before_sleep and self.running:
                    self._decode(until=None)
                out.append(self._record(work, rollout=self.now - trainer_idle, wall=self.now - last_take))
                last_take = self.now
                self.update_end = self.now + self.model.update_s
                continue
            asleep = self.colocated and self.update_end is not None
            if not asleep and not self.version_due:
                self._lease()
            if self.running and not asleep:
                self._decode(until=self._next_event(trainer_idle))
            elif self.update_end is not None:
                self.now = self.update_end
            else:
                raise RuntimeError(f"step {len(out)}: nothing to decode, no update running and the step is not complete")
        return out

    def _budget_carry(self, waiting_since: float) -> int | None:
        """The job's carry limit once the trainer has waited `close_after_s` for the step, else None."""
        budget = self.model.close_after_s
        if budget is None or self.update_end is not None or self.now - waiting_since < budget:
            return None
        return budget_carry_limit(self.model.prompts, self.extra)

    def _next_event(self, waiting_since: float) -> float | None:
        """When the decode must stop to look: the update's end, or the time budget running out."""
        if self.update_end is not None:
            return self.update_end
        budget = self.model.close_after_s
        return None if budget is None or self.now >= waiting_since + budget else waiting_since + budget

    def _queue_steps(self) -> None:
        """Steps up to the engine's version plus the staleness, as the job queues them ahead (the spares with
        the first)."""
        while self.queued < self.version + self.model.staleness:
            self.queued += 1
            k, p = self.queued, self.model.prompts
            spares = self.extra if k == 0 else 0
            records = [PromptRecord(f"s{k}-p{i}", (), "", i) for i in range(p)]
            records += [PromptRecord(f"x{k}-p{i}", (), "", p + i) for i in range(spares)]
            self.queue.add_step(k, records, needed=p)

    def _lease(self) -> None:
        """As the rollout worker leases: whole groups, up to max_num_seqs // samples held at once."""
        room = self.model.max_num_seqs // self.model.samples - len(self.running)
        if room > 0:
            for lease in self.queue.lease(WORKER, self.version, room, self.now):
                left = [min(self.model.max_tokens, 1 + int(self.rng.expovariate(1.0 / self.model.mean_tokens)))
                        for _ in range(self.model.samples)]
                self.running.append(_Running(lease.lease_id, left, sum(left)))

    def _decode(self, until: float | None) -> None:
        """Decode to the next sample's end, or to `until` (the update's end, the time budget's) if that comes first."""
        m = self.model
        active = [(g, sum(1 for n in g.left if n)) for g in self.running]
        batch = sum(count for _, count in active)
        tokens = min(n for g in self.running for n in g.left if n)
        if m.kv_s_per_token:
            tokens = min(tokens, KV_SPAN)
        context = sum(count * self._attended(g.made + (tokens - 1) / 2) for g, count in active)
        per_token = m.decode_s + m.decode_s_per_seq * batch + m.kv_s_per_token * context
        if until is not None:
            tokens = max(1, min(tokens, math.ceil((until - self.now) / per_token)))
        self.occupancy.add(batch, tokens * per_token)
        self.now += tokens * per_token
        for g in list(self.running):
            g.left = [max(n - tokens, 0) for n in g.left]
            g.made += tokens
            if not any(g.left):
                self.running.remove(g)
                ids = [f"{g.lease_id}#{j}" for j in range(m.samples)]
                self.queue.complete(WORKER, g.lease_id, GroupReport(WORKER, m.samples, 0, g.tokens, m.samples, 0, [], 1,
                                                                    ids, seconds=0.0), self.now)

    def _attended(self, made: float) -> float:
        """Tokens of context a sample that has generated `made` attends at a decode step."""
        context = self.model.prompt_tokens + made
        return context if self.model.kv_cap_tokens is None else min(context, self.model.kv_cap_tokens)

    def _record(self, work, rollout: float, wall: float) -> ModelStep:
        reports = [report for _, report in work.done.values()]
        shape = batch_shape({}, {WORKER: self.occupancy.seconds}, self.model.max_num_seqs)
        self.occupancy = BatchOccupancy()
        return ModelStep(rollout, wall, len(reports), sum(r.tokens for r in reports), shape.tail_share,
                         shape.busy_batch_fraction, work.carried_out, tuple(i for r in reports for i in r.sample_ids))


def steady(steps: list[ModelStep], warmup: int) -> dict:
    """Means over the steps after `warmup` (the first steps fill the pipeline of carried groups); the batch shape's
    over the steps that decoded (one whose groups were all done before it began has none)."""
    rest = steps[warmup:] or steps
    wall = sum(s.wall_s for s in rest)
    return {"steps": len(rest), "wall_s": wall / len(rest), "rollout_s": sum(s.rollout_s for s in rest) / len(rest),
            "trained_groups": sum(s.trained_groups for s in rest) / len(rest),
            "tokens_per_s": sum(s.trained_tokens for s in rest) / wall,
            "tail_share": mean_known([s.tail_share for s in rest]) or 0.0,
            "busy_batch_fraction": mean_known([s.busy_batch_fraction for s in rest]) or 0.0,
            "carried_out": sum(s.carried_out for s in rest) / len(rest)}


def register(actions) -> None:
    p = actions.add_parser("tail-model", help="a model of RL steps with variable lengths: step time and tail share, "
                                              "sync or async, against run.partial_rollout (a model, not a run)")
    p.add_argument("--prompts", type=int, default=4, help="prompts (GRPO groups) a step trains")
    p.add_argument("--samples", type=int, default=8, help="samples a group")
    p.add_argument("--mean-tokens", type=float, default=3000.0, help="mean generated length (geometric)")
    p.add_argument("--max-tokens", type=int, default=8192, help="length cap")
    p.add_argument("--decode-ms", type=float, default=3.5, help="a decode step's fixed time, ms")
    p.add_argument("--decode-ms-per-seq", type=float, default=0.03, help="what each sample in flight adds, ms")
    p.add_argument("--kv-ms-per-ktoken", type=float, default=0.0, help="what each 1K tokens of context the samples "
                   "in flight attend add to a decode step, ms (their KV reads: KV bytes a token / memory bandwidth); "
                   "0: the decode step does not depend on the lengths")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (context a sample attends at its start)")
    p.add_argument("--kv-cap-tokens", type=int, default=None, help="most tokens of context a sample attends (a sparse "
                   "schedule's budget x block size); default: all (dense)")
    p.add_argument("--update-s", type=float, default=8.0, help="seconds of an update")
    p.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch limit")
    p.add_argument("--placement", choices=("colocated", "disaggregated"), default="colocated", help="run.placement")
    p.add_argument("--staleness", type=int, default=0, help="run.max_staleness: async when > 0 (disaggregated)")
    p.add_argument("--load-s", type=float, default=0.0, help="seconds a disaggregated engine pauses to load a version")
    p.add_argument("--carry-staleness", type=int, default=None,
                   help="run.partial_rollout.max_staleness (default: --staleness + 1)")
    p.add_argument("--carry", choices=("resume", "finish"), default="resume",
                   help="run.partial_rollout.carry: finish = the update waits for the carried groups")
    p.add_argument("--extra-groups", type=int, nargs="+", default=[2, 4], help="spare groups to compare with partial "
                   "rollouts off (0 with --carry resume: no spares, groups interrupted and resumed at each version)")
    p.add_argument("--close-after-s", type=float, nargs="*", default=[], help="run.partial_rollout.close_after_s: "
                   "each spare-group row again with these time budgets (the trainer's most wait for a step)")
    p.add_argument("--steps", type=int, default=40, help="steps a seed (the first 3 are left out)")
    p.add_argument("--seeds", type=int, default=5, help="length draws averaged")
    p.add_argument("--out", type=Path, help="write the table as JSON")
    p.set_defaults(handler=run)


def _case(row: dict) -> str:
    if row["carry"] == "off":
        return "off"
    budget = "" if row["close_after_s"] is None else f", close after {row['close_after_s']:g} s"
    return f"{row['extra_groups']} spares, {row['carry']}{budget}"


def _kv_terms(args) -> str:
    if not args.kv_ms_per_ktoken:
        return ""
    cap = "dense" if args.kv_cap_tokens is None else f"at most {args.kv_cap_tokens} tokens a sample"
    return f" + {args.kv_ms_per_ktoken} ms per 1K tokens of context attended ({cap}, {args.prompt_tokens}-token prompts)"


def run(args) -> int:
    carry_staleness = args.staleness + 1 if args.carry_staleness is None else args.carry_staleness
    model = TailModel(args.prompts, args.samples, args.mean_tokens, args.max_tokens, args.decode_ms / 1000,
                      args.decode_ms_per_seq / 1000, args.update_s, args.max_num_seqs, args.placement, args.staleness,
                      carry_staleness, args.load_s, args.kv_ms_per_ktoken / 1e6, args.prompt_tokens, args.kv_cap_tokens)
    if args.steps < 4 or args.seeds < 1:
        raise ValueError(f"--steps {args.steps} must be >= 4 (3 are warm-up) and --seeds {args.seeds} >= 1")
    rows = []
    cases = [(0, "off", None)] + [(e, args.carry, b) for e in args.extra_groups for b in [None, *args.close_after_s]]
    for extra, carry, budget in cases:
        case = replace(model, close_after_s=budget)
        per_seed = [steady(simulate(case, extra, args.steps, seed, carry), warmup=3) for seed in range(args.seeds)]
        rows.append({"extra_groups": extra, "carry": carry, "close_after_s": budget,
                     **{k: sum(s[k] for s in per_seed) / len(per_seed) for k in per_seed[0]}})
    base = rows[0]
    head = ["partial rollouts", "step s", "rollout wait s", "groups trained", "trained tok/s", "tail %", "busy batch %",
            "carried", "step vs off", "tok/s vs off"]
    body = [[_case(r), f"{r['wall_s']:.1f}", f"{r['rollout_s']:.1f}", f"{r['trained_groups']:.2f}",
             f"{r['tokens_per_s']:.0f}", f"{100 * r['tail_share']:.1f}", f"{100 * r['busy_batch_fraction']:.1f}",
             f"{r['carried_out']:.1f}", f"{base['wall_s'] / r['wall_s']:.2f}x",
             f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"] for r in rows]
    mode = "sync" if not args.staleness else f"async (staleness {args.staleness})"
    print(f"model (not a run): {args.placement}, {mode}, {args.prompts} prompts x {args.samples} samples, lengths geometric mean "
          f"{args.mean_tokens:.0f} capped at {args.max_tokens}, decode step {args.decode_ms} ms + "
          f"{args.decode_ms_per_seq} ms a sample{_kv_terms(args)}, update {args.update_s} s, load {args.load_s} s, carry {args.carry} "
          f"(bound {carry_staleness}); {args.seeds} seeds x "
          f"{args.steps - 3} steps")
    print(format_table(head, body))
    if args.out:
        args.out.write_text(json.dumps({"kind": "tail-model", "model": asdict(model), "rows": rows}, indent=1) + "\n")
    return 0
