"""User reward functions for tests/test_reward_function.py (imported by `reward.function`, as a user's
module would be)."""

import asyncio
import threading

release = threading.Event()
"""Set by the tests at the end, so that a hanging call's abandoned thread finishes."""


def contains_answer(text, answer, metadata):
    """1 when the answer appears in the text, plus 0.5 for a sample cut at max_tokens (to see finish_reason)."""
    return float(answer in text) + (0.5 if metadata["finish_reason"] == "length" else 0.0)


async def async_length(text, answer, metadata):
    await asyncio.sleep(0.01)
    return len(text) / 100 + metadata["sample_index"]


def raises(text, answer, metadata):
    raise KeyError("no verifier for " + metadata["prompt_id"])


def hangs(text, answer, metadata):
    release.wait(30)
    return 1.0


async def async_hangs(text, answer, metadata):
    await asyncio.sleep(30)
    return 1.0


def returns_nan(text, answer, metadata):
    return float("nan")


def returns_text(text, answer, metadata):
    return "1.0"


def two_parameters(text, answer):
    return 1.0


NOT_A_FUNCTION = 3


def flaky(text, answer, metadata):
    """The second sample of every group fails; the others score their length."""
    if metadata["sample_index"] == 1:
        raise ValueError(f"cannot judge {metadata['sample_id']}")
    return len(text) / 100
