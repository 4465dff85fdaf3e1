"""Verifiable rewards, computed by the rollout workers (they hold the prompt's reference answer).

- `arithmetic`: the integer in the last `\\boxed{...}`, or else the last integer in the response,
  must equal the answer exactly.
- `math_verify`: Hugging Face's math-verify parses the reference (LaTeX or plain) and the
  response (`\\boxed{}` first) and checks them for mathematical equivalence.
- `function`: the user's `reward.function` (`user_reward.py` loads it and calls it in isolation).
"""

import logging
import re
import threading
from collections.abc import Callable

from .config import RewardConfig
from .data import PromptRecord
from .user_reward import IsolatedCall, RewardCallError, load_user_function

log = logging.getLogger(__name__)

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


def reward_metadata(record: PromptRecord, step: int, sample_index: int, finish_reason: str, sample_id: str) -> dict:
    """What a `reward.function` gets besides the text and the answer: the prompt record's fields
    (`prompt_id`, `messages` as a list of {role, content}, `answer`, `index` in the data source), the
    `step`, the sample's `sample_index` in its group and `sample_id` (`<request_id>#<sample_index>`: the
    prompt id, with `.r<attempt>` when the group was generated again after a lost worker; the id the
    trainer and the logs use), and its `finish_reason` ("stop" or "length")."""
    return {
        "prompt_id": record.prompt_id, "messages": [dict(m) for m in record.messages], "answer": record.answer,
        "index": record.index, "step": step, "sample_index": sample_index,
        "sample_id": sample_id, "finish_reason": finish_reason,
    }


class RewardFunction:
    """response text, reference answer, finish reason (and, for a user function, metadata) → reward.

    A user function (`reward.function`) runs isolated: when it raises, times out or returns no finite
    number, the sample scores `reward.on_error`, the failure is logged with the sample id and
    `on_error(reason)` is told (the rollout worker counts it in `sparrow_reward_errors_total`).
    """

    def __init__(self, config: RewardConfig, source: str, on_error: Callable[[str], None] = lambda reason: None):
        self.config, self.on_error = config, on_error
        self.kind = config.resolved(source)
        if self.kind == "function":
            self.user = IsolatedCall(load_user_function(config.function), config.timeout_s)
        else:
            self.check = CHECKS[self.kind]

    def __call__(self, response: str, answer: str, finish_reason: str, metadata: dict | None = None) -> float:
        c = self.config
        if finish_reason == "length" and c.truncated is not None:
            return c.truncated
        if self.kind != "function":
            return c.correct if self.check(response, answer) else c.incorrect
        metadata = {**(metadata or {}), "finish_reason": finish_reason}
        try:
            return self.user(response, answer, metadata)
        except RewardCallError as exc:
            sample = metadata.get("sample_id", "?")
            log.warning("reward.function %s failed on sample %s (%s, scored %g): %s", c.function, sample, exc.reason,
                        c.on_error, exc, exc_info=exc.__cause__)
            self.on_error(exc.reason)
            return c.on_error
