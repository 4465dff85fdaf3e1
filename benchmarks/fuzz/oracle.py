"""The fuzzer's oracle: the answer every request must get, written from docs/grpc_api.md alone (the
"Validation" rules table, "What ends a stream instead", the Control section's order and the message
size limits). It never calls the validation under test (coordinator/transport/validate.py), so a rule
that code skips shows up as a message accepted against the table.

Requests are judged as the server will see them: bytes are parsed with protobuf (the wire format is not
under test), then the documented rules are applied. A sample breaking several rules may be rejected
naming any of them: a verdict lists every broken field and the server must name one.
"""

import math
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from sparrow.protos import sparrow_v1_pb2 as pb

ID_CHARS = 256
TEXT_CHARS = 65_536
LOGPROB_ROUNDING = float(np.float32(1e-3))
"""'<= 0 (1e-3 rounding allowed)', compared in float32, the type of every log-probability on the wire."""
CONTROL_REQUEST_BYTES = 4096
POOL_SIZES = (1, 1024)
STOP, LENGTH, ERROR = 1, 2, 3
TOKEN_ARRAYS = ("token_ids", "logprobs", "top_ids", "top_logprobs", "blocks_attended")
"""The arrays a failed sample (ERROR) leaves empty."""


@dataclass(frozen=True)
class Limits:
    """The server settings the rules depend on."""

    vocab_size: int | None
    max_sample_tokens: int
    max_top_k: int
    max_message_bytes: int

    @classmethod
    def of(cls, config) -> "Limits":
        return cls(config.vocab_size, config.max_sample_tokens, config.max_top_k, config.max_message_mb * 2**20)


@dataclass(frozen=True)
class Expected:
    """An ack status (`kind="ack"`) or the call's final status (`"status"`); for a refusal, the fields one of
    which the answer must name (empty: any, or none)."""

    kind: str
    code: str
    fields: frozenset[str] = frozenset()

    def __str__(self) -> str:
        return f"{self.kind} {self.code}" + (f" naming one of {sorted(self.fields)}" if self.fields else "")


ACCEPTED = Expected("ack", "ACCEPTED")
OK = Expected("status", "OK")


def refused(code: str, *fields: str, kind: str = "status") -> Expected:
    return Expected(kind, code, frozenset(fields))


def _token_ok(token: int, limits: Limits, padding: bool = False) -> bool:
    if padding and token == -1:
        return True
    return token >= 0 and (limits.vocab_size is None or token < limits.vocab_size)


def _logprob_ok(value: float) -> bool:
    return math.isfinite(value) and value <= LOGPROB_ROUNDING


def sample_violations(s: pb.Sample, limits: Limits) -> frozenset[str]:
    """The fields of `s` that break a rule of the table; empty: `s` must be accepted."""
    broken: set[str] = set()

    def rule(holds: bool, field: str) -> None:
        if not holds:
            broken.add(field)

    for name in ("sample_id", "prompt_id", "group_id"):
        rule(1 <= len(getattr(s, name)) <= ID_CHARS, name)
    rule(len(s.worker_id) <= ID_CHARS, "worker_id")
    rule(len(s.error) <= TEXT_CHARS, "error")
    for key, value in s.metadata.items():
        rule(1 <= len(key) <= ID_CHARS, "metadata")
        rule(len(value) <= TEXT_CHARS, f"metadata[{key}]")
    for name in ("sample_index", "policy_version", "schedule_version"):
        rule(getattr(s, name) >= 0, name)
    rule(s.finish_reason in (STOP, LENGTH, ERROR), "finish_reason")
    rule(not s.HasField("reward") or math.isfinite(s.reward), "reward")

    limit, n, k = limits.max_sample_tokens, len(s.token_ids), s.top_k
    prompt = s.prompt_token_ids
    rule(1 <= len(prompt) <= limit and all(_token_ok(t, limits) for t in prompt), "prompt_token_ids")
    if s.finish_reason == ERROR:
        rule(bool(s.error), "error")
        for name in TOKEN_ARRAYS:
            rule(len(getattr(s, name)) == 0, name)
    rule((n <= limit if s.finish_reason == ERROR else 1 <= n <= limit), "token_ids")
    rule(all(_token_ok(t, limits) for t in s.token_ids), "token_ids")
    rule(len(s.logprobs) == n and all(_logprob_ok(v) for v in s.logprobs), "logprobs")
    rule(len(s.blocks_attended) == n and all(b >= 0 for b in s.blocks_attended), "blocks_attended")
    rule(0 <= k <= limits.max_top_k, "top_k")
    rule(len(s.top_ids) == n * k and all(_token_ok(t, limits, padding=True) for t in s.top_ids), "top_ids")
    listed_ok = all(_logprob_ok(v) if t >= 0 else (t != -1 or v <= 0) for t, v in zip(s.top_ids, s.top_logprobs))
    rule(len(s.top_logprobs) == n * k and listed_ok, "top_logprobs")
    return frozenset(broken)


def _parsed(message_type, data: bytes):
    try:
        return message_type.FromString(data)
    except DecodeError:
        return None


UNPARSABLE = refused("INVALID_ARGUMENT", "request")


def stream_answer(requests: list[bytes], limits: Limits) -> Expected:
    """What a StreamSamples call of these raw requests ends with: the last ack, or the status that ended it."""
    answer = OK
    for position, data in enumerate(requests):
        if len(data) > limits.max_message_bytes:
            return refused("RESOURCE_EXHAUSTED")
        request = _parsed(pb.SampleStreamRequest, data)
        if request is None:
            return UNPARSABLE
        kind = request.WhichOneof("kind")
        if position == 0:
            if kind != "open":
                return refused("FAILED_PRECONDITION", "open")
            if len(request.open.client_id) > ID_CHARS:
                return refused("INVALID_ARGUMENT", "open.client_id")
            continue
        if kind != "sample":
            return refused("FAILED_PRECONDITION", "kind")
        answer = payload_answer(request.sample, limits)
    return answer


def payload_answer(sample: pb.Sample, limits: Limits) -> Expected:
    """The ack of one sample on an open stream."""
    broken = sample_violations(sample, limits)
    return refused("INVALID_ARGUMENT", *broken, kind="ack") if broken else ACCEPTED


def _control_request(message_type, data: bytes):
    """The parsed control request, or the answer that refuses it first: over the size limit, or unparsable."""
    if len(data) > CONTROL_REQUEST_BYTES:
        return refused("RESOURCE_EXHAUSTED", "request")
    request = _parsed(message_type, data)
    return UNPARSABLE if request is None else request


def drain_answer(data: bytes, drains: bool) -> Expected:
    """`drains`: the server drains (the trajectory server); the coordinator answers UNIMPLEMENTED."""
    request = _control_request(pb.DrainRequest, data)
    if isinstance(request, Expected):
        return request
    if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
        return refused("INVALID_ARGUMENT", "timeout_s")
    return OK if drains else refused("UNIMPLEMENTED")


def health_answer(data: bytes) -> Expected:
    request = _control_request(pb.HealthRequest, data)
    return request if isinstance(request, Expected) else OK


def resize_answer(data: bytes, resizes: bool) -> Expected:
    """In the documented order: size, parse, UNIMPLEMENTED where the server cannot resize, pool, size, handler."""
    request = _control_request(pb.ResizePoolRequest, data)
    if isinstance(request, Expected):
        return request
    if not resizes:
        return refused("UNIMPLEMENTED")
    if request.pool != "rollout":  # the only resizable pool (and within ID_CHARS)
        return refused("INVALID_ARGUMENT", "pool")
    if not POOL_SIZES[0] <= request.size <= POOL_SIZES[1]:
        return refused("INVALID_ARGUMENT", "size")
    return OK
