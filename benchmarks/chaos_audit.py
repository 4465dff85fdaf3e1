"""What the chaos soak (`chaos_soak.py`) concludes from a run: exactly-once from RUN_DIR/ledger.jsonl, the
continuity of the coordinator's metric series, and whether each injected fault was recovered from. Pure
functions of what the soak recorded, so each rule is tested on its own numbers (tests/test_chaos_soak.py).

**Continuous**, precisely. A series is one metric name with one label set, as the coordinator's Prometheus
text lists it (`_created` samples left out: they are timestamps). Over the scrapes taken from the job's
first step until the soak asks the job to stop, the coordinator's series stayed continuous when

1. the coordinator answered every scrape;
2. a series, once it appeared, is in every later scrape (none disappears);
3. no sample of a counter or histogram (`_total`, `_bucket`, `_count`, `_sum`) ever decreases;
4. `sparrow_train_step` never decreases, except after a trainer recovery redid steps: each drop is at most
   `run.checkpoint_every` steps (the most a rollback redoes), and there are no more drops than trainer
   recoveries (`trainer_lost` or `publish_refused` events).
"""

import re
from collections import Counter
from dataclasses import dataclass, field

TRAIN_STEP = "sparrow_train_step"
TRAINER_RECOVERIES = ("trainer_lost", "publish_refused")
_MONOTONE_SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def logical_id(sample_id: str) -> str:
    """The sample an attempt stands for: `s3-p1.r2#0` -> `s3-p1#0` (a retry replaces its prompt's sample)."""
    return re.sub(r"\.r\d+(?=#)", "", sample_id)


def expected_ids(config, steps: int) -> list[str]:
    """Every sample id steps 0..steps-1 dispatch: the prompts are a pure function of seed and step."""
    from sparrow.coordinator.data import PromptSource

    source, n = PromptSource(config.data, config.run.seed), config.rollout.sampling.n
    return [f"{r.prompt_id}#{i}" for k in range(steps) for r in source.batch(k, config.run.prompts_per_step)
            for i in range(n)]


@dataclass
class LedgerAudit:
    steps: int
    """Steps in the ledger (its lines must be steps 0, 1, ... once each)."""
    dispatched: int
    trained: int
    lost: list[str]
    duplicated: list[str]
    unexpected: list[str]
    """Trained ids that no step dispatched."""
    misordered: bool
    """The ledger's steps are not 0..steps-1 in order, once each."""
    abandoned_attempts: int
    dropped_samples: int

    @property
    def exactly_once(self) -> bool:
        return not (self.lost or self.duplicated or self.unexpected or self.misordered)


def audit_ledger(lines: list[dict], expected: list[str]) -> LedgerAudit:
    """`lines`: RUN_DIR/ledger.jsonl; `expected`: `expected_ids` for as many steps as the ledger holds."""
    trained = [logical_id(i) for line in lines for rank in line["trained_ids"] for i in rank]
    counts = Counter(trained)
    wanted = set(expected)
    return LedgerAudit(
        steps=len(lines), dispatched=len(expected), trained=len(trained),
        lost=[i for i in expected if i not in counts], duplicated=sorted(i for i, c in counts.items() if c > 1),
        unexpected=sorted(i for i in counts if i not in wanted),
        misordered=[line["step"] for line in lines] != list(range(len(lines))),
        abandoned_attempts=sum(len(line["abandoned_attempts"]) for line in lines),
        dropped_samples=sum(len(line["dropped_samples"]) for line in lines),
    )


def parse_metrics(text: str) -> dict[tuple, float]:
    """Prometheus text -> {(sample name, sorted labels): value}, `_created` samples left out."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if not s.name.endswith("_created")}


@dataclass
class Continuity:
    scrapes: int
    unanswered: int
    series: int
    """Series in the last answered scrape."""
    disappeared: list[str] = field(default_factory=list)
    decreased: list[str] = field(default_factory=list)
    """Counter or histogram samples that went down, with the scrape times."""
    step_drops: list[str] = field(default_factory=list)
    """Drops of sparrow_train_step, each `a -> b at t s`."""
    unexplained_drops: list[str] = field(default_factory=list)

    @property
    def continuous(self) -> bool:
        return not (self.unanswered or self.disappeared or self.decreased or self.unexplained_drops)


def _name(key: tuple) -> str:
    name, labels = key
    return name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")


def check_continuity(scrapes: list[tuple[float, dict | None]], events: list[dict], checkpoint_every: int) -> Continuity:
    """`scrapes`: (seconds, `parse_metrics` of the answer, or None when the scrape failed), oldest first;
    `events`: the run's events.jsonl; the rules are the module's."""
    trainer_recoveries = sum(e["kind"] in TRAINER_RECOVERIES for e in events)
    answered = [(t, s) for t, s in scrapes if s is not None]
    result = Continuity(scrapes=len(scrapes), unanswered=len(scrapes) - len(answered),
                        series=len(answered[-1][1]) if answered else 0)
    for (t0, before), (t1, after) in zip(answered, answered[1:]):
        result.disappeared += [f"{_name(k)} at {t1:.0f} s" for k in before if k not in after]
        result.decreased += [f"{_name(k)} {v:g} -> {after[k]:g} at {t1:.0f} s" for k, v in before.items()
                             if k in after and k[0].endswith(_MONOTONE_SUFFIXES) and after[k] < v]
        a, b = before.get((TRAIN_STEP, ())), after.get((TRAIN_STEP, ()))
        if a is not None and b is not None and b < a:
            drop = f"{a:g} -> {b:g} at {t1:.0f} s"
            result.step_drops.append(drop)
            if a - b > checkpoint_every or len(result.step_drops) > trainer_recoveries:
                result.unexplained_drops.append(drop)
    return result


@dataclass
class Fault:
    """One injected fault, as the soak did it and saw it resolved."""

    kind: str
    """kill-rollout, kill-trainer, stall-rollout or stall-trainer."""
    target: str
    """The worker id (rollout-1, trainer-0)."""
    pid: int
    at: float
    """Seconds since the job's first step."""
    step: int | None
    """sparrow_train_step (steps completed) when it was injected."""
    stall_s: float | None = None
    events: list[dict] = field(default_factory=list)
    """The job's events (events.jsonl) recorded after it and before the next fault."""
    recovered_after: float | None = None
    """Seconds from injection until the soak saw it resolved (None: never)."""

    @property
    def recovered(self) -> bool:
        return self.recovered_after is not None


def resolving_event(fault: Fault, events: list[tuple[float, dict]]) -> tuple[float, dict] | None:
    """The job's record that a kill was recovered from: an event of the matching kind and subject, with a recovery
    time, written after the fault (`events`: (seconds first seen, events.jsonl line))."""
    kind, subject = {"kill-rollout": ("rollout_worker_lost", fault.target),
                     "kill-trainer": ("trainer_lost", "trainer")}[fault.kind]
    return next(((t, e) for t, e in events if t > fault.at and e["kind"] == kind and e["subject"] == subject
                 and e["recovery_seconds"] is not None), None)


def resolving_step(fault: Fault, records: list[tuple[float, dict]], resumed_at: float) -> tuple[float, dict] | None:
    """A stall is over once a step completes after the process was continued (`resumed_at`, seconds) — for a
    rollout worker, a step with groups from its slot (it, or its replacement, serves again)."""
    for t, r in records:
        if t > resumed_at and (fault.kind == "stall-trainer" or fault.target in r["rollout"]["groups"]):
            return t, r
    return None
