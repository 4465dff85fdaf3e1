"""What a running job prints: a bar of steps, a bar of rollout tokens, and one line per step."""

import sys

from tqdm import tqdm


def fmt(value, spec: str = ".3f") -> str:
    """`value` formatted with `spec`, or "-" when it is missing."""
    return "-" if value is None else format(value, spec)


def bin_values(values: list[float | None], tokens: list[int]) -> str:
    """A per-bin tail as `0.931 - 0.874`: "-" where a bin measured no tokens."""
    return " ".join(fmt(p, ".3f") if n else "-" for p, n in zip(values, tokens))


def step_line(record, target: float, total_steps: int) -> str:
    """`step 3/6 reward 0.44 len 41 | α5 b0 0.93 b1 0.85< | blocks 5 5 6 7 | 88 tok/s | 61 s` from a `StepRecord`."""
    r, alpha, sched = record.rollout, record.alpha, record.schedule
    tails = [f"b{b} {p:.3f}{'<' if p < target else ''}" for b, (p, n) in enumerate(zip(alpha.p5, alpha.tokens)) if n and p is not None]
    blocks = " ".join("d" if b is None else str(b) for b in sched.blocks)
    changed = f" (v{sched.version}, {record.controller.changes} changed)" if record.controller.changes else ""
    faults = f" | {len(record.faults)} recovered" if record.faults else ""
    exact = record.alpha_exact
    exact_tails = "" if exact is None else " | exact " + bin_values(exact.p5, exact.tokens)
    return (
        f"step {record.step + 1}/{total_steps} reward {fmt(r.reward_mean)} len {fmt(r.response_length_mean, '.0f')} "
        f"| α p5 vs τ={target:g}: {' '.join(tails) or 'no tokens'}{exact_tails} | blocks {blocks}{changed} "
        f"| {fmt(r.tokens_per_s, '.0f')} tok/s | {record.timing.step:.0f} s{faults}"
    )


class Progress:
    def __init__(self, enabled: bool, total_steps: int, start_step: int):
        disable = None if enabled else True  # None: bars only when stderr is a terminal
        self.steps = tqdm(total=total_steps, initial=start_step, desc="steps", unit="step", position=0,
                          disable=disable, file=sys.stderr, dynamic_ncols=True)
        self.tokens = tqdm(desc="rollout tokens", unit="tok", position=1, disable=disable, file=sys.stderr,
                           dynamic_ncols=True)

    def add_tokens(self, n: int) -> None:
        if n > 0:
            self.tokens.update(n)

    def step_done(self, line: str) -> None:
        self.write(line)
        self.steps.update(1)

    def write(self, line: str) -> None:
        tqdm.write(line, file=sys.stderr)

    def close(self) -> None:
        self.tokens.close()
        self.steps.close()
