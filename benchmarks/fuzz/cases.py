"""Malformed messages for every RPC, generated with hypothesis, each with the answer it must get.

Field mutations change one field of a valid message (wrong lengths, NaN/inf, negative or huge ids and
versions, bad enums, oversized strings); each mutation names the field the answer must name, so the
oracle is not the validator under test. Stream payloads share a stream and must be acked naming the
field (`Payload`); protocol mutations (no StreamOpen, the wrong kind, an oversized message, random
bytes) and unary requests each get a call of their own (`Call`) and must end with a status whose
details start with the field. ResizePool goes to a coordinator-like control server (`FuzzTargets.control`)
and, valid, to the trajectory server too, which cannot resize (UNIMPLEMENTED). Random bytes that happen
to parse are judged by what they parse to (there the validator is the oracle). Generation only:
`fuzzer.py` sends the cases.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from sparrow.coordinator.transport.config import TransportConfig
from sparrow.coordinator.transport.validate import MAX_ID_CHARS, MAX_POOL_SIZE, MAX_TEXT_CHARS, InvalidMessage, validate_resize_pool, validate_sample
from sparrow.protos import sparrow_v1_pb2 as pb

from .examples import valid_sample

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
STREAMS = {"StreamSamples": (pb.SampleStreamRequest, "sample")}
"""Request type and payload field of each stream RPC."""


def fuzz_config(**overrides) -> TransportConfig:
    """Small limits, so oversized inputs stay cheap to build and send."""
    return TransportConfig(port=0, vocab_size=1000, max_sample_tokens=256, max_top_k=8, max_message_mb=1, **overrides)


@dataclass(frozen=True)
class Answer:
    """What a message got: an ack status (`ack`) or the call's status (`status`), and the field it named."""

    kind: str
    code: str
    field: str | None = None

    def __str__(self) -> str:
        return f"{self.kind} {self.code}" + (f" {self.field}" if self.field else "")


@dataclass
class Payload:
    """A mutated stream payload: acked on a shared stream, INVALID_ARGUMENT naming `field` (None: ACCEPTED)."""

    rpc: str
    label: str
    message: object
    field: str | None

    @property
    def expected(self) -> Answer:
        return Answer("ack", "INVALID_ARGUMENT", self.field) if self.field else Answer("ack", "ACCEPTED")


@dataclass
class Call:
    """A call of its own: raw request messages (built on demand) and the status it must end with."""

    rpc: str
    label: str
    requests: Callable[[], list[bytes]]
    expected: Answer
    after: Callable[[], None] | None = None  # e.g. resume the server after an accepted Drain
    target: str | None = None  # FuzzTargets field to send to; None = the RPC's usual server


# ---------------------------------------------------------------------- field mutations
#
# A mutation is (label, strategy of a parameter, apply(msg, parameter) -> the field the answer must
# name, or None when the mutated message is still valid). Fields are dotted paths, as validation names them.

Apply = Callable[[object, object], str | None]

_index = st.integers(0, 10**6)
_nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])
_positive = st.floats(min_value=0.01, max_value=1e30)
_negative32 = st.integers(INT32[0], -1)
_oversized_id = st.text(min_size=MAX_ID_CHARS + 1, max_size=3 * MAX_ID_CHARS)
_oversized_text = st.integers(MAX_TEXT_CHARS + 1, 2 * MAX_TEXT_CHARS).map(lambda n: "x" * n)


def _owner(msg, path: str):
    """The message holding the last field of `path`, and that field's name."""
    *parents, name = path.split(".")
    for parent in parents:
        msg = getattr(msg, parent)
    return msg, name


def _set(path: str, valid: bool = False) -> Apply:
    """Set `path` to the parameter."""
    def apply(msg, value):
        owner, name = _owner(msg, path)
        setattr(owner, name, value)
        return None if valid else path
    return apply


def _set_pair(valid: bool = False) -> Apply:
    """The parameter is (path, value)."""
    return lambda msg, pair: _set(pair[0], valid)(msg, pair[1])


def _clear(path: str) -> Apply:
    def apply(msg, _):
        owner, name = _owner(msg, path)
        owner.ClearField(name)
        return path
    return apply


def _put(path: str) -> Apply:
    """The parameter is (index, value): overwrite one element (append to an empty array)."""
    def apply(msg, param):
        index, value = param
        owner, name = _owner(msg, path)
        values = getattr(owner, name)
        if values:
            values[index % len(values)] = value
        else:
            values.append(value)
        return path
    return apply


def _resize(values, length: int, fill) -> None:
    del values[length:]
    values.extend([fill] * (length - len(values)))


def _other_length(path: str, fill) -> Apply:
    """The parameter is a length; the array gets it, or one more element if it had that length already."""
    def apply(msg, wanted):
        owner, name = _owner(msg, path)
        values = getattr(owner, name)
        _resize(values, wanted if wanted != len(values) else len(values) + 1, fill)
        return path
    return apply


def _sample_mutations(config: TransportConfig) -> list[tuple[str, st.SearchStrategy, Apply]]:
    vocab, limit, max_k = config.vocab_size, config.max_sample_tokens, config.max_top_k
    out_of_vocab = st.integers(vocab, INT32[1]) | _negative32
    ids = st.sampled_from(["sample_id", "prompt_id", "group_id"])
    versions = st.sampled_from(["policy_version", "schedule_version"])

    def token_count(msg, wanted):  # the first check a changed token count fails depends on the count
        _other_length("token_ids", 1)(msg, wanted)
        n = len(msg.token_ids)
        return "token_ids" if n == 0 or n > limit else "logprobs"

    def nan_padding(msg, index):
        if not msg.top_k:
            msg.top_logprobs.append(math.nan)
        else:
            j = index % len(msg.top_ids)
            msg.top_ids[j], msg.top_logprobs[j] = -1, math.nan
        return "top_logprobs"

    def failed(msg, error):  # ERROR without saying why, or ERROR that still has tokens
        msg.finish_reason, msg.error = pb.FINISH_REASON_ERROR, error
        return "token_ids" if error else "error"

    def valid_failure(msg, error):
        msg.finish_reason, msg.error = pb.FINISH_REASON_ERROR, error
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "blocks_attended"):
            msg.ClearField(name)
        return None

    def metadata(msg, pair):
        key, value = pair
        msg.metadata[key] = value
        return f"metadata[{key}]" if key else "metadata"

    return [
        ("id:empty", ids.map(lambda f: (f, "")), _set_pair()),
        ("id:oversized", st.tuples(ids, _oversized_id), _set_pair()),
        ("worker_id:oversized", _oversized_id, _set("worker_id")),
        ("sample_index:negative", _negative32, _set("sample_index")),
        ("sample_index:huge (valid)", st.integers(2**20, INT32[1]), _set("sample_index", valid=True)),
        ("version:negative", st.tuples(versions, st.integers(INT64[0], -1)), _set_pair()),
        ("version:huge (valid)", st.tuples(versions, st.integers(2**31, INT64[1])), _set_pair(valid=True)),
        ("finish_reason:bad enum", st.integers(*INT32).filter(lambda v: v not in (1, 2, 3)), _set("finish_reason")),
        ("reward:nan/inf", _nonfinite, _set("reward")),
        ("prompt_token_ids:empty", st.none(), _clear("prompt_token_ids")),
        ("prompt_token_ids:too long", st.integers(limit + 1, 2 * limit), _other_length("prompt_token_ids", 1)),
        ("prompt_token_ids:out of vocab", st.tuples(_index, out_of_vocab), _put("prompt_token_ids")),
        ("token_ids:out of vocab", st.tuples(_index, out_of_vocab), _put("token_ids")),
        ("token_ids:wrong length", st.integers(0, 2 * limit), token_count),
        ("logprobs:wrong length", st.integers(0, 64), _other_length("logprobs", -1.0)),
        ("logprobs:nan/inf/positive", st.tuples(_index, _nonfinite | _positive), _put("logprobs")),
        ("blocks_attended:wrong length", st.integers(0, 64), _other_length("blocks_attended", 1)),
        ("blocks_attended:negative", st.tuples(_index, _negative32), _put("blocks_attended")),
        ("top_k:out of range", _negative32 | st.integers(max_k + 1, INT32[1]), _set("top_k")),
        ("top_ids:wrong length", st.integers(0, 64), _other_length("top_ids", 0)),
        ("top_ids:out of range", st.tuples(_index, st.integers(vocab, INT32[1]) | st.integers(INT32[0], -2)), _put("top_ids")),
        ("top_logprobs:wrong length", st.integers(0, 64), _other_length("top_logprobs", -1.0)),
        ("top_logprobs:nan/inf/positive", st.tuples(_index, _nonfinite | _positive), _put("top_logprobs")),
        ("top_logprobs:NaN padding", _index, nan_padding),
        ("error:missing or with tokens", st.sampled_from(["", "engine failed"]), failed),
        ("error:oversized", _oversized_text, _set("error")),
        ("failed sample (valid)", st.text(min_size=1, max_size=40), valid_failure),
        ("metadata:bad key or oversized value",
         st.tuples(st.just(""), st.text(max_size=8)) | st.tuples(st.text(min_size=1, max_size=8), _oversized_text), metadata),
    ]


def _payloads(rpc: str, base: Callable[[int, object], object], shape: st.SearchStrategy, mutations,
              ids: itertools.count) -> st.SearchStrategy:
    """One mutation of a valid message `base(unique id number, shape)`, with the shape drawn too."""
    def payload(label: str, apply: Apply, drawn) -> Payload:
        base_shape, param = drawn
        msg = base(next(ids), base_shape)
        return Payload(rpc, label, msg, apply(msg, param))

    return st.one_of(*(st.tuples(shape, param).map(lambda d, label=label, apply=apply: payload(label, apply, d))
                       for label, param, apply in mutations))


# ---------------------------------------------------------------------- calls of their own


def _decoded_answer(rpc: str, data: bytes, config: TransportConfig) -> Answer:
    """The answer random bytes must get, from what they parse to."""
    request_type = {"Drain": pb.DrainRequest, "Health": pb.HealthRequest, "ResizePool": pb.ResizePoolRequest}[rpc]
    try:
        msg = request_type.FromString(data)
    except DecodeError:
        return Answer("status", "INVALID_ARGUMENT", "request")
    if rpc == "Drain" and not (math.isfinite(msg.timeout_s) and msg.timeout_s >= 0):
        return Answer("status", "INVALID_ARGUMENT", "timeout_s")
    if rpc == "ResizePool":
        try:
            validate_resize_pool(msg)
        except InvalidMessage as exc:
            return Answer("status", "INVALID_ARGUMENT", exc.field)
    return Answer("status", "OK")


def _stream_bytes_answer(rpc: str, data: bytes, config: TransportConfig) -> Answer:
    """The answer random bytes after a StreamOpen must get, from what they parse to."""
    request_type, payload = STREAMS[rpc]
    try:
        msg = request_type.FromString(data)
    except DecodeError:
        return Answer("status", "INVALID_ARGUMENT", "request")
    if msg.WhichOneof("kind") != payload:
        return Answer("status", "FAILED_PRECONDITION", "kind")
    try:
        validate_sample(getattr(msg, payload), config)
    except InvalidMessage as exc:
        return Answer("ack", "INVALID_ARGUMENT", exc.field)
    return Answer("ack", "ACCEPTED")


def _stream_calls(rpc: str, config: TransportConfig, ids: itertools.count) -> st.SearchStrategy:
    request_type, payload = STREAMS[rpc]
    def make(i: int) -> pb.Sample:
        return valid_sample(i, "fz", vocab=config.vocab_size)

    def opening(client_id: str = "fuzz") -> bytes:
        return request_type(open=pb.StreamOpen(client_id=client_id)).SerializeToString()

    def item(i: int) -> bytes:
        return request_type(**{payload: make(i)}).SerializeToString()

    def oversized() -> list[bytes]:
        big = make(next(ids))
        big.worker_id = "z" * (config.max_message_mb * 2**20 + 1024)
        return [opening(), request_type(**{payload: big}).SerializeToString()]

    def call(label, requests, expected):
        return Call(rpc, label, requests, expected)

    return st.one_of(
        st.just(None).map(lambda _: call("no StreamOpen", lambda i=next(ids): [item(i)],
                                         Answer("status", "FAILED_PRECONDITION", "open"))),
        st.just(None).map(lambda _: call("StreamOpen twice", lambda: [opening(), opening()],
                                         Answer("status", "FAILED_PRECONDITION", "kind"))),
        st.just(None).map(lambda _: call("empty request after StreamOpen", lambda: [opening(), b""],
                                         Answer("status", "FAILED_PRECONDITION", "kind"))),
        _oversized_id.map(lambda v: call("StreamOpen: oversized client_id", lambda: [opening(v)],
                                           Answer("status", "INVALID_ARGUMENT", "open.client_id"))),
        st.just(None).map(lambda _: call("message over max_message_mb", oversized, Answer("status", "RESOURCE_EXHAUSTED"))),
        st.just(None).map(lambda _: call("no messages at all", lambda: [], Answer("status", "OK"))),
        st.binary(min_size=1, max_size=64).map(lambda b: call(
            "random bytes after StreamOpen", lambda: [opening(), b], _stream_bytes_answer(rpc, b, config))),
        st.binary(min_size=1, max_size=64).filter(lambda b: _undecodable(request_type, b)).map(lambda b: call(
            "random bytes instead of StreamOpen", lambda: [b], Answer("status", "INVALID_ARGUMENT", "request"))),
    )


def _undecodable(request_type, data: bytes) -> bool:
    try:
        request_type.FromString(data)
    except DecodeError:
        return True
    return False


def _unary_calls(rpc: str, config: TransportConfig, resume: Callable[[], None]) -> st.SearchStrategy:
    def call(label, request, expected: Answer, after=None, target=None) -> Call:
        data = request if isinstance(request, bytes) else request.SerializeToString()
        return Call(rpc, label, lambda: [data], expected, after, target)

    random_bytes = st.binary(max_size=64).map(lambda b: call("random bytes", b, _decoded_answer(rpc, b, config)))
    if rpc == "ResizePool":
        return _resize_calls(call, random_bytes)
    if rpc == "Health":
        return random_bytes | st.none().map(lambda _: call("valid", pb.HealthRequest(), Answer("status", "OK")))
    invalid = _nonfinite | st.floats(max_value=-1e-9, allow_infinity=True, allow_nan=False)
    return st.one_of(
        random_bytes,
        invalid.map(lambda t: call("timeout_s:nan/inf/negative", pb.DrainRequest(timeout_s=t),
                                   Answer("status", "INVALID_ARGUMENT", "timeout_s"))),
        st.floats(0, 0.05).map(lambda t: call("valid (then resumed)", pb.DrainRequest(timeout_s=t), Answer("status", "OK"), resume)),
        st.floats(0, 0.05).map(lambda t: call("valid, to the coordinator (does not drain)", pb.DrainRequest(timeout_s=t),
                                              Answer("status", "UNIMPLEMENTED"), target="control")),
    )


def _resize_calls(call: Callable, random_bytes: st.SearchStrategy) -> st.SearchStrategy:
    """ResizePool to the coordinator-like control target; a valid one to a server that cannot resize."""
    valid_size = st.integers(1, MAX_POOL_SIZE)
    bad_size = st.integers(INT32[0], 0) | st.integers(MAX_POOL_SIZE + 1, INT32[1])
    other_pool = st.text(max_size=40).filter(lambda p: p != "rollout") | _oversized_id
    invalid = Answer("status", "INVALID_ARGUMENT", "pool")

    def unimplemented(size: int) -> Call:
        c = call("valid, to a server that cannot resize", pb.ResizePoolRequest(pool="rollout", size=size),
                 Answer("status", "UNIMPLEMENTED"))
        return Call(c.rpc, c.label, c.requests, c.expected, target="trajectory")

    return st.one_of(
        random_bytes,
        valid_size.map(lambda n: call("valid", pb.ResizePoolRequest(pool="rollout", size=n), Answer("status", "OK"))),
        bad_size.map(lambda n: call("size:out of range", pb.ResizePoolRequest(pool="rollout", size=n),
                                    Answer("status", "INVALID_ARGUMENT", "size"))),
        st.tuples(st.just("trainer"), st.integers(*INT32)).map(lambda p: call(
            "pool:trainer (fixed per run)", pb.ResizePoolRequest(pool=p[0], size=p[1]), invalid)),
        st.tuples(other_pool, st.integers(*INT32)).map(lambda p: call(
            "pool:unknown, empty or oversized", pb.ResizePoolRequest(pool=p[0], size=p[1]), invalid)),
        valid_size.map(unimplemented),
    )


# ---------------------------------------------------------------------- generation and sending

QUOTAS = {  # share of the messages per RPC and kind
    ("StreamSamples", "payload"): 0.55, ("StreamSamples", "call"): 0.12,
    ("Drain", "call"): 0.11, ("Health", "call"): 0.11, ("ResizePool", "call"): 0.11,
}


def generate(strategy: st.SearchStrategy, n: int, random_seed: int) -> list:
    """`n` examples of `strategy` (generation only: no shrinking, no example database)."""
    out: list = []

    @seed(random_seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example):
        out.append(example)

    collect()
    return out


def cases(config: TransportConfig, n: int, random_seed: int, resume: Callable[[], None]) -> list:
    """About `n` cases (`Payload`s and `Call`s) over every RPC in the `QUOTAS` shares; `resume` reopens the
    trajectory server after an accepted Drain."""
    ids = itertools.count()
    strategies = {
        ("StreamSamples", "payload"): _payloads(
            "StreamSamples", lambda i, shape: valid_sample(i, "fz", vocab=config.vocab_size, tokens=shape[0], top_k=shape[1]),
            st.tuples(st.integers(1, 24), st.integers(0, config.max_top_k)), _sample_mutations(config), ids),
        ("StreamSamples", "call"): _stream_calls("StreamSamples", config, ids),
        ("Drain", "call"): _unary_calls("Drain", config, resume),
        ("Health", "call"): _unary_calls("Health", config, resume),
        ("ResizePool", "call"): _unary_calls("ResizePool", config, resume),
    }
    out = []
    for k, (key, strategy) in enumerate(strategies.items()):
        out += generate(strategy, max(1, round(n * QUOTAS[key])), random_seed + k)
    return out
