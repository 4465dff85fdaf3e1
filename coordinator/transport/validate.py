"""Validation of every incoming message, before anything is queued.

Each check raises `InvalidMessage(field, message)`; the server answers INVALID_ARGUMENT naming the
field and keeps serving. Array checks run in numpy: a 38K-token sample with top-20 is ~800K values.
"""

import math

import numpy as np

from sparrow.protos import sparrow_v1_pb2 as pb

from .config import TransportConfig

LOGPROB_TOLERANCE = 1e-3
"""Largest log-probability accepted: > 0 is impossible, tiny positives are float rounding."""
MAX_ID_CHARS = 256
"""Longest id or name accepted (sample, prompt, group, worker and client ids; pool names; metadata keys)."""
MAX_TEXT_CHARS = 65_536
"""Longest free text accepted (an error message, a metadata value): a bound, since answers may quote it."""
RESIZABLE_POOLS = ("rollout",)
"""Pools ResizePool may change. The trainer pool is fixed for a run: its DeepSpeed ranks shard the model
and optimizer state, and the data-parallel world size is part of every checkpoint."""
MAX_POOL_SIZE = 1024
"""Largest pool size ResizePool accepts (a bound against typos; the coordinator may refuse less)."""


class InvalidMessage(ValueError):
    """A message field that fails validation; `field` is its proto name (dotted for nested fields)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidMessage(field, message)


def _array(values, dtype) -> np.ndarray:
    return np.fromiter(values, dtype=dtype, count=len(values))


def _check_id(value: str, field: str) -> None:
    _check(bool(value), field, "must be a non-empty string")
    _check_text(value, field, MAX_ID_CHARS)


def _check_metadata(metadata) -> None:
    for key, value in metadata.items():
        _check(0 < len(key) <= MAX_ID_CHARS, "metadata", f"keys must have 1 to {MAX_ID_CHARS} characters (one has {len(key)})")
        _check_text(value, f"metadata[{key}]", MAX_TEXT_CHARS)


def _check_text(value: str, field: str, limit: int) -> None:
    _check(len(value) <= limit, field, f"has {len(value)} characters; at most {limit} are allowed")


def _check_version(value: int, field: str) -> None:
    _check(value >= 0, field, f"={value} must be >= 0")


def _check_token_ids(ids: np.ndarray, field: str, vocab_size: int | None, allow_padding: bool = False) -> None:
    if ids.size == 0:
        return
    low = -1 if allow_padding else 0
    bad = ids < low
    if vocab_size is not None:
        bad |= ids >= vocab_size
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        pad = " or -1 (padding)" if allow_padding else ""
        raise InvalidMessage(field, f"[{i}]={int(ids[i])} is out of range; token ids must be in {allowed}{pad}")


def _check_logprobs(values: np.ndarray, field: str) -> None:
    bad = ~np.isfinite(values) | (values > LOGPROB_TOLERANCE)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidMessage(field, f"[{i}]={float(values[i])} must be a finite log-probability <= 0")


def check_finish_reason(value: int) -> None:
    _check(
        value in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ERROR),
        "finish_reason",
        f"={value} must be FINISH_REASON_STOP, FINISH_REASON_LENGTH or FINISH_REASON_ERROR",
    )


def check_rows(field: str, count: int, n: int, k: int) -> None:
    """`count` values of a flattened top-k array make `n` rows of `k`."""
    _check(count == n * k, field, f"has {count} values; expected num_tokens*top_k = {n}*{k} = {n * k} (row-major)")


def validate_stream_open(msg: pb.StreamOpen) -> None:
    _check_text(msg.client_id, "open.client_id", MAX_ID_CHARS)


def validate_sample(msg: pb.Sample, config: TransportConfig) -> None:
    """Shapes, id ranges, finiteness, versions and the finish reason of one sample."""
    _check_id(msg.sample_id, "sample_id")
    _check_id(msg.prompt_id, "prompt_id")
    _check_id(msg.group_id, "group_id")
    _check_text(msg.worker_id, "worker_id", MAX_ID_CHARS)
    _check_text(msg.error, "error", MAX_TEXT_CHARS)
    _check_metadata(msg.metadata)
    _check(msg.sample_index >= 0, "sample_index", f"={msg.sample_index} must be >= 0")
    _check_version(msg.policy_version, "policy_version")
    _check_version(msg.schedule_version, "schedule_version")
    check_finish_reason(msg.finish_reason)
    if msg.HasField("reward"):
        _check(math.isfinite(msg.reward), "reward", f"={msg.reward} must be finite")

    limit = config.max_sample_tokens
    n_prompt, n = len(msg.prompt_token_ids), len(msg.token_ids)
    _check(n_prompt > 0, "prompt_token_ids", "is empty; every sample comes from a non-empty prompt")
    _check(n_prompt <= limit, "prompt_token_ids", f"has {n_prompt} tokens; at most max_sample_tokens={limit}")
    _check(n <= limit, "token_ids", f"has {n} tokens; at most max_sample_tokens={limit}")
    _check_token_ids(_array(msg.prompt_token_ids, np.int64), "prompt_token_ids", config.vocab_size)
    k = msg.top_k
    _check(0 <= k <= config.max_top_k, "top_k", f"={k} must be in [0, max_top_k={config.max_top_k}]")

    if msg.finish_reason == pb.FINISH_REASON_ERROR:  # every rule that protects the server is checked above
        _check(bool(msg.error), "error", "must say why the sample failed when finish_reason is FINISH_REASON_ERROR")
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "blocks_attended"):
            _check(len(getattr(msg, name)) == 0, name, "must be empty for a failed sample (finish_reason ERROR)")
        return

    _check(n > 0, "token_ids", "is empty; a finished sample has at least one generated token")
    _check(len(msg.logprobs) == n, "logprobs", f"has {len(msg.logprobs)} values for {n} tokens; give one per token")
    _check(
        len(msg.blocks_attended) == n,
        "blocks_attended",
        f"has {len(msg.blocks_attended)} values for {n} tokens; give one per token",
    )
    for name in ("top_ids", "top_logprobs"):
        check_rows(name, len(getattr(msg, name)), n, k)

    _check_token_ids(_array(msg.token_ids, np.int64), "token_ids", config.vocab_size)
    _check_logprobs(_array(msg.logprobs, np.float32), "logprobs")
    blocks = _array(msg.blocks_attended, np.int64)
    if (blocks < 0).any():
        i = int(np.flatnonzero(blocks < 0)[0])
        raise InvalidMessage("blocks_attended", f"[{i}]={int(blocks[i])} must be >= 0")
    if k:
        top_ids = _array(msg.top_ids, np.int64)
        _check_token_ids(top_ids, "top_ids", config.vocab_size, allow_padding=True)
        top_lp = _array(msg.top_logprobs, np.float32)
        listed = top_ids >= 0
        _check_logprobs(np.where(listed, top_lp, 0.0), "top_logprobs")
        if np.isnan(top_lp[~listed]).any() or (top_lp[~listed] > 0).any():
            raise InvalidMessage("top_logprobs", "padding entries (top_ids -1) must hold a value <= 0 or -inf, not NaN")


def validate_resize_pool(msg: pb.ResizePoolRequest) -> None:
    """The pool is one that can be resized and the size is in [1, MAX_POOL_SIZE]."""
    _check_text(msg.pool, "pool", MAX_ID_CHARS)
    if msg.pool == "trainer":
        raise InvalidMessage(
            "pool", "'trainer' cannot be resized while the job runs (its DeepSpeed ranks shard the model and optimizer "
            "state): resume the run on another size with sparrow train --resume RUN_DIR --set trainer.pool.size=N; "
            "resize 'rollout'",
        )
    _check(msg.pool in RESIZABLE_POOLS, "pool", f"={msg.pool!r} is not a resizable pool; give {' or '.join(map(repr, RESIZABLE_POOLS))}")
    _check(1 <= msg.size <= MAX_POOL_SIZE, "size", f"={msg.size} must be in [1, {MAX_POOL_SIZE}] (workers in the pool)")
