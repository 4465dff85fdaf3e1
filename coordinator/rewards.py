"""Verifiable rewards, computed by the rollout workers (they hold the prompt's reference answer).

- `arithmetic`: the integer in the last `\\boxed{...}`, or else the last integer in the response,
  must equal the answer exactly.
- `math_verify`: Hugging Face's math-verify parses the reference (LaTeX or plain) and the
  response (`\\boxed{}` first) and checks them for mathematical equivalence.
"""

import re
import threading
from collections.abc import Callable

from .config import RewardConfig

BOXED = re.compile(r"\\boxed\s*\{")
INTEGER = re.compile(r"[-−]?\d[\d,]*")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed), or None."""
    starts = [m.end() for m in BOXED.finditer(text)]
    for start in reversed(starts):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start : i - 1]
    return None


def parse_integer(text: str) -> int | None:
    matches = INTEGER.findall(text)
    if not matches:
        return None
    try:
        return int(matches[-1].replace(",", "").replace("−", "-"))
    except ValueError:
        return None


def arithmetic_answer(response: str) -> int | None:
    boxed = last_boxed(response)
    return parse_integer(boxed if boxed is not None else response)


def arithmetic_correct(response: str, answer: str) -> bool:
    got = arithmetic_answer(response)
    return got is not None and got == int(answer)


def math_verify_correct(response: str, answer: str) -> bool:
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    main = threading.current_thread() is threading.main_thread()
    gold_text = answer if "\\boxed" in answer or answer.strip().startswith("$") else f"${answer}$"
    gold = parse(gold_text, parsing_timeout=5 if main else None)
    pred = parse(response, parsing_timeout=5 if main else None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=5 if main else None))


CHECKS: dict[str, Callable[[str, str], bool]] = {"arithmetic": arithmetic_correct, "math_verify": math_verify_correct}


class RewardFunction:
    """response text, reference answer, finish reason → reward."""

    def __init__(self, config: RewardConfig, source: str):
        self.config = config
        self.kind = config.resolved(source)
        self.check = CHECKS[self.kind]

    def __call__(self, response: str, answer: str, finish_reason: str) -> float:
        c = self.config
        if finish_reason == "length" and c.truncated is not None:
            return c.truncated
        return c.correct if self.check(response, answer) else c.incorrect
