"""A user's reward function (`reward.function: "package.module:function"`), loaded and called in isolation.

The contract (docs/coordinator.md, "Custom reward function"):

    def reward(text: str, answer: str, metadata: dict) -> float      # or: async def reward(...)

`text` is the decoded response, `answer` the prompt's reference answer, `metadata` the sample's
context (`rewards.reward_metadata`). Any real number is a reward (bools count as 1/0).

A rollout worker must survive whatever the function does: each call runs on its own daemon thread
(an `async def` in its own event loop there) and the worker waits at most `timeout_s`; an exception,
a timeout or a non-finite / non-number return raises `RewardCallError` with a `reason` the worker
counts and scores as `reward.on_error`. Python cannot kill a thread, so a call that hangs is
abandoned, still running; after `MAX_ABANDONED` such calls the function is not started again until
one of them returns, which bounds the threads a permanently stuck function can pile up.
"""

import asyncio
import importlib
import inspect
import math
import numbers
import threading
from collections.abc import Callable

REASONS = ("exception", "timeout", "invalid")
"""`RewardCallError.reason` values (the `reason` label of `sparrow_reward_errors_total`)."""

MAX_ABANDONED = 16


class RewardCallError(RuntimeError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def load_user_function(spec: str) -> Callable:
    """`package.module:function` → the callable; ValueError naming what is wrong and the fix."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError('expected "package.module:function", e.g. "my_rewards.math:score"')
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user module can fail to import in any way
        raise ValueError(
            f"cannot import module {module_name!r} ({exc.__class__.__name__}: {exc}); install it or put its folder on "
            "PYTHONPATH (on every node: the rollout workers import it too)"
        ) from None
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"module {module_name!r} has no attribute {attr!r} (callables there: {', '.join(public) or 'none'})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(f"{spec} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("text", "answer", {})
    except TypeError as exc:
        raise ValueError(
            f"{spec} cannot be called as fn(text, answer, metadata) ({exc}); give it exactly those three parameters"
        ) from None
    return fn


class IsolatedCall:
    """`call(*args)` → float within `timeout_s`, or RewardCallError."""

    def __init__(self, fn: Callable, timeout_s: float):
        self.fn, self.timeout_s = fn, timeout_s
        self.abandoned: list[threading.Thread] = []

    def _run(self, args: tuple, box: dict) -> None:
        try:
            result = self.fn(*args)
            if inspect.isawaitable(result):
                result = asyncio.run(self._bounded(result))
            box["value"] = result
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    async def _bounded(self, awaitable):
        """Cancel a coroutine at the deadline (one that blocks its loop is caught by the thread join)."""
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                return await awaitable
        except TimeoutError:
            if deadline.expired():
                raise RewardCallError("timeout", self._late()) from None
            raise

    def _late(self) -> str:
        return f"no result after reward.timeout_s={self.timeout_s:g} s"

    def __call__(self, *args) -> float:
        self.abandoned = [t for t in self.abandoned if t.is_alive()]
        if len(self.abandoned) >= MAX_ABANDONED:
            raise RewardCallError(
                "timeout", f"not called: {len(self.abandoned)} earlier calls are still running past reward.timeout_s"
            )
        box: dict = {}
        thread = threading.Thread(target=self._run, args=(args, box), name="reward-function", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self.abandoned.append(thread)
            raise RewardCallError("timeout", self._late())
        if "error" in box:
            exc = box["error"]
            if isinstance(exc, RewardCallError):
                raise exc
            raise RewardCallError("exception", f"{exc.__class__.__name__}: {exc}") from exc
        value = box["value"]
        if not isinstance(value, numbers.Real):
            raise RewardCallError("invalid", f"returned {type(value).__name__} {value!r:.80}, not a number")
        value = float(value)
        if not math.isfinite(value):
            raise RewardCallError("invalid", f"returned {value}, not a finite number")
        return value
