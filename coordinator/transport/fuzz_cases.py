"""Malformed messages for every RPC, generated with hypothesis, each with the answer it must get.

Field mutations change one field of a valid message (wrong lengths, NaN/inf, negative or huge ids and
versions, bad enums, oversized strings); each mutation names the field the answer must name, so the
oracle is not the validator under test. Stream payloads share a stream and must be acked naming the
field (`Payload`); protocol mutations (no StreamOpen, the wrong kind, an oversized message, random
bytes) and unary requests each get a call of their own (`Call`) and must end with a status whose
details start with the field. Random bytes that happen to parse are judged by what they parse to
(there the validator is the oracle). Generation only: `fuzz.py` sends the cases.
"""

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from sparrow.protos import sparrow_v1_pb2 as pb

from .config import TransportConfig
from .convert import schedule_from_proto
from .examples import valid_report, valid_sample, valid_schedule
from .validate import MAX_HISTOGRAM_BINS, MAX_HISTOGRAM_RESOLUTION, MAX_ID_CHARS, MAX_TEXT_CHARS, InvalidMessage
from .validate import validate_sample, validate_stats_report

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
STREAMS = {"StreamSamples": (pb.SampleStreamRequest, "sample"), "StreamStats": (pb.StatsStreamRequest, "report")}
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


# ---------------------------------------------------------------------- field mutations

_index = st.integers(0, 10**6)
_nonfinite = st.sampled_from([math.nan, math.inf, -math.inf])
_positive = st.floats(min_value=0.01, max_value=1e30)
_negative32 = st.integers(INT32[0], -1)


def _oversized_id():
    return st.text(min_size=MAX_ID_CHARS + 1, max_size=3 * MAX_ID_CHARS)


def _oversized_text():
    return st.integers(MAX_TEXT_CHARS + 1, 2 * MAX_TEXT_CHARS).map(lambda n: "x" * n)


def _new_length(n: int, wanted: int) -> int:
    return wanted if wanted != n else n + 1


def _resize(values, length: int, fill) -> None:
    del values[length:]
    values.extend([fill] * (length - len(values)))


def _sample_mutations(config: TransportConfig) -> list[tuple[str, st.SearchStrategy, Callable]]:
    """(label, strategy of a parameter, apply(msg, parameter) -> field the answer must name, or None if valid)."""
    vocab, limit, max_k = config.vocab_size, config.max_sample_tokens, config.max_top_k
    out_of_vocab = st.integers(vocab, INT32[1]) | _negative32

    def token_length(m, wanted):
        n = len(m.token_ids)
        length = _new_length(n, wanted)
        _resize(m.token_ids, length, 1)
        return "token_ids" if length == 0 or length > limit else "logprobs"

    def top_logprob_padding(m, i):
        if not m.top_k:
            m.top_logprobs.append(math.nan)
            return "top_logprobs"
        j = i % len(m.top_ids)
        m.top_ids[j], m.top_logprobs[j] = -1, math.nan
        return "top_logprobs"

    def at(array: str, i, value, m):
        values = getattr(m, array)
        if values:
            values[i % len(values)] = value
        else:
            values.append(value)
        return array

    def failed(m, error):
        m.finish_reason, m.error = pb.FINISH_REASON_ERROR, error
        return "token_ids" if error else "error"

    def valid_failure(m, error):
        m.finish_reason, m.error = pb.FINISH_REASON_ERROR, error
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "blocks_attended"):
            m.ClearField(name)
        return None

    def metadata(m, kv):
        key, value = kv
        m.metadata[key] = value
        return f"metadata[{key}]" if key else "metadata"

    ids = st.sampled_from(["sample_id", "prompt_id", "group_id"])
    versions = st.sampled_from(["policy_version", "schedule_version"])
    return [
        ("id:empty", ids, lambda m, f: (setattr(m, f, ""), f)[1]),
        ("id:oversized", st.tuples(ids, _oversized_id()), lambda m, p: (setattr(m, p[0], p[1]), p[0])[1]),
        ("worker_id:oversized", _oversized_id(), lambda m, v: (setattr(m, "worker_id", v), "worker_id")[1]),
        ("sample_index:negative", _negative32, lambda m, v: (setattr(m, "sample_index", v), "sample_index")[1]),
        ("sample_index:huge (valid)", st.integers(2**20, INT32[1]), lambda m, v: setattr(m, "sample_index", v)),
        ("version:negative", st.tuples(versions, st.integers(INT64[0], -1)), lambda m, p: (setattr(m, *p), p[0])[1]),
        ("version:huge (valid)", st.tuples(versions, st.integers(2**31, INT64[1])), lambda m, p: setattr(m, *p)),
        ("finish_reason:bad enum", st.integers(*INT32).filter(lambda v: v not in (1, 2, 3)),
         lambda m, v: (setattr(m, "finish_reason", v), "finish_reason")[1]),
        ("reward:nan/inf", _nonfinite, lambda m, v: (setattr(m, "reward", v), "reward")[1]),
        ("prompt_token_ids:empty", st.just(None), lambda m, _: (m.ClearField("prompt_token_ids"), "prompt_token_ids")[1]),
        ("prompt_token_ids:too long", st.integers(limit + 1, 2 * limit),
         lambda m, n: (_resize(m.prompt_token_ids, n, 1), "prompt_token_ids")[1]),
        ("prompt_token_ids:out of vocab", st.tuples(_index, out_of_vocab), lambda m, p: at("prompt_token_ids", *p, m)),
        ("token_ids:out of vocab", st.tuples(_index, out_of_vocab), lambda m, p: at("token_ids", *p, m)),
        ("token_ids:wrong length", st.integers(0, 2 * limit), token_length),
        ("logprobs:wrong length", st.integers(0, 64),
         lambda m, n: (_resize(m.logprobs, _new_length(len(m.token_ids), n), -1.0), "logprobs")[1]),
        ("logprobs:nan/inf/positive", st.tuples(_index, _nonfinite | _positive), lambda m, p: at("logprobs", *p, m)),
        ("blocks_attended:wrong length", st.integers(0, 64),
         lambda m, n: (_resize(m.blocks_attended, _new_length(len(m.token_ids), n), 1), "blocks_attended")[1]),
        ("blocks_attended:negative", st.tuples(_index, _negative32), lambda m, p: at("blocks_attended", *p, m)),
        ("top_k:out of range", _negative32 | st.integers(max_k + 1, INT32[1]), lambda m, k: (setattr(m, "top_k", k), "top_k")[1]),
        ("top_ids:wrong length", st.integers(0, 64),
         lambda m, n: (_resize(m.top_ids, _new_length(len(m.top_ids), n), 0), "top_ids")[1]),
        ("top_ids:out of range", st.tuples(_index, st.integers(vocab, INT32[1]) | st.integers(INT32[0], -2)),
         lambda m, p: at("top_ids", *p, m)),
        ("top_logprobs:wrong length", st.integers(0, 64),
         lambda m, n: (_resize(m.top_logprobs, _new_length(len(m.top_logprobs), n), -1.0), "top_logprobs")[1]),
        ("top_logprobs:nan/inf/positive", st.tuples(_index, _nonfinite | _positive), lambda m, p: at("top_logprobs", *p, m)),
        ("top_logprobs:NaN padding", _index, top_logprob_padding),
        ("error:missing or with tokens", st.sampled_from(["", "engine failed"]), failed),
        ("error:oversized", _oversized_text(), lambda m, v: (setattr(m, "error", v), "error")[1]),
        ("failed sample (valid)", st.text(min_size=1, max_size=40), valid_failure),
        ("metadata:bad key or oversized value",
         st.tuples(st.just(""), st.text(max_size=8)) | st.tuples(st.text(min_size=1, max_size=8), _oversized_text()), metadata),
    ]


def _histogram_mutations(prefix: str) -> list[tuple[str, st.SearchStrategy, Callable]]:
    def h(m):
        return getattr(m, prefix)

    def cell_not_increasing(m, i):
        cells = h(m).cells
        cells.append(cells[i % len(cells)])
        h(m).counts.append(1)
        return f"{prefix}.cells"

    def sums_out_of_range(m, p):
        i, value = p
        h(m).sums[i % len(h(m).sums)] = value
        return f"{prefix}.sums"

    return [
        (f"{prefix}.num_length_bins:out of range", st.integers(INT32[0], 0) | st.integers(MAX_HISTOGRAM_BINS + 1, INT32[1]),
         lambda m, v: (setattr(h(m), "num_length_bins", v), f"{prefix}.num_length_bins")[1]),
        (f"{prefix}.resolution:out of range", st.integers(INT32[0], 0) | st.integers(MAX_HISTOGRAM_RESOLUTION + 1, INT32[1]),
         lambda m, v: (setattr(h(m), "resolution", v), f"{prefix}.resolution")[1]),
        (f"{prefix}.counts:wrong length", st.integers(1, 2**32 - 1),
         lambda m, v: (h(m).counts.append(v), f"{prefix}.counts")[1]),
        (f"{prefix}.counts:zero", _index, lambda m, i: (h(m).counts.__setitem__(i % len(h(m).counts), 0), f"{prefix}.counts")[1]),
        (f"{prefix}.cells:not increasing", _index, cell_not_increasing),
        (f"{prefix}.cells:out of range", st.integers(0, 2**32 - 1),
         lambda m, v: (h(m).cells.append(max(v, h(m).num_length_bins * h(m).resolution)), h(m).counts.append(1),
                       f"{prefix}.cells")[2]),
        (f"{prefix}.sums:wrong length", st.booleans(),
         lambda m, more: (h(m).sums.append(0.0) if more else h(m).sums.pop(), f"{prefix}.sums")[1]),
        (f"{prefix}.sums:nan/inf/out of range", st.tuples(_index, _nonfinite | st.floats(1e6, 1e300) | st.floats(-1e300, -1e-3)),
         sums_out_of_range),
    ]


def _report_mutations() -> list[tuple[str, st.SearchStrategy, Callable]]:
    ids = st.sampled_from(["report_id", "trainer_id"])
    versions = st.sampled_from(["policy_version", "schedule_version"])

    def other_shape(m, extra_bins):
        m.alpha_upper.num_length_bins += extra_bins
        m.alpha_upper.sums.extend([0.0] * extra_bins)
        return "alpha_upper"

    def metric(m, kv):
        key, value = kv
        m.metrics[key] = value
        return f"metrics[{key}]" if 0 < len(key) <= MAX_ID_CHARS else "metrics"

    return [
        ("id:empty", ids, lambda m, f: (setattr(m, f, ""), f)[1]),
        ("id:oversized", st.tuples(ids, _oversized_id()), lambda m, p: (setattr(m, *p), p[0])[1]),
        ("step:negative", st.integers(INT64[0], -1), lambda m, v: (setattr(m, "step", v), "step")[1]),
        ("step:huge (valid)", st.integers(2**31, INT64[1]), lambda m, v: setattr(m, "step", v)),
        ("version:negative", st.tuples(versions, st.integers(INT64[0], -1)), lambda m, p: (setattr(m, *p), p[0])[1]),
        ("alpha:missing", st.just(None), lambda m, _: (m.ClearField("alpha"), "alpha")[1]),
        *_histogram_mutations("alpha"),
        *_histogram_mutations("alpha_upper"),
        ("alpha_upper:other shape", st.integers(1, 64), other_shape),
        ("alpha_upper:other counts", _index,
         lambda m, i: (m.alpha_upper.counts.__setitem__(i % len(m.alpha_upper.counts), m.alpha_upper.counts[i % len(m.alpha_upper.counts)] + 1),
                       "alpha_upper")[1]),
        ("metrics:nan/inf or bad key", st.tuples(st.text(min_size=1, max_size=12), _nonfinite)
         | st.tuples(st.just("") | _oversized_id(), st.floats(-1, 1)), metric),
    ]


def _payloads(rpc: str, base: Callable[[int], object], mutations, ids: itertools.count) -> st.SearchStrategy:
    def apply(label, apply_fn, param):
        msg = base(next(ids))
        return Payload(rpc, label, msg, apply_fn(msg, param))

    return st.one_of(*(param.map(lambda p, label=label, fn=fn: apply(label, fn, p)) for label, param, fn in mutations))


# ---------------------------------------------------------------------- calls of their own


def _decoded_answer(rpc: str, data: bytes, config: TransportConfig) -> Answer:
    """The answer random bytes must get, from what they parse to."""
    request_type = {"UpdateSchedule": pb.UpdateScheduleRequest, "Drain": pb.DrainRequest, "Health": pb.HealthRequest}[rpc]
    try:
        msg = request_type.FromString(data)
    except DecodeError:
        return Answer("status", "INVALID_ARGUMENT", "request")
    if rpc == "UpdateSchedule":
        if not msg.HasField("schedule"):
            return Answer("status", "INVALID_ARGUMENT", "schedule")
        try:
            schedule_from_proto(msg.schedule)
        except InvalidMessage as exc:
            return Answer("status", "INVALID_ARGUMENT", exc.field)
    if rpc == "Drain" and not (math.isfinite(msg.timeout_s) and msg.timeout_s >= 0):
        return Answer("status", "INVALID_ARGUMENT", "timeout_s")
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
        if payload == "sample":
            validate_sample(msg.sample, config)
        else:
            validate_stats_report(msg.report)
    except InvalidMessage as exc:
        return Answer("ack", "INVALID_ARGUMENT", exc.field)
    return Answer("ack", "ACCEPTED")


def _stream_calls(rpc: str, config: TransportConfig, ids: itertools.count) -> st.SearchStrategy:
    request_type, payload = STREAMS[rpc]
    make = (lambda i: valid_sample(i, "fz", vocab=config.vocab_size)) if rpc == "StreamSamples" else (lambda i: valid_report(i, "fz"))

    def opening(client_id: str = "fuzz") -> bytes:
        return request_type(open=pb.StreamOpen(client_id=client_id)).SerializeToString()

    def item(i: int) -> bytes:
        return request_type(**{payload: make(i)}).SerializeToString()

    def oversized() -> list[bytes]:
        big = make(next(ids))
        setattr(big, "worker_id" if rpc == "StreamSamples" else "trainer_id", "z" * (config.max_message_mb * 2**20 + 1024))
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
        _oversized_id().map(lambda v: call("StreamOpen: oversized client_id", lambda: [opening(v)],
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


def _unary_calls(rpc: str, config: TransportConfig, versions: itertools.count, resume: Callable[[], None]) -> st.SearchStrategy:
    def call(label, request: bytes, expected: Answer, after=None):
        return Call(rpc, label, lambda: [request], expected, after)

    random_bytes = st.binary(max_size=64).map(lambda b: call("random bytes", b, _decoded_answer(rpc, b, config)))
    if rpc == "Health":
        return random_bytes | st.just(None).map(lambda _: call("valid", pb.HealthRequest().SerializeToString(), Answer("status", "OK")))
    if rpc == "Drain":
        def drain(t, label, expected, after=None):
            return call(label, pb.DrainRequest(timeout_s=t).SerializeToString(), expected, after)
        return st.one_of(
            random_bytes,
            (_nonfinite | st.floats(max_value=-1e-9, allow_infinity=True, allow_nan=False)).map(
                lambda t: drain(t, "timeout_s:nan/inf/negative", Answer("status", "INVALID_ARGUMENT", "timeout_s"))),
            st.floats(0, 0.05).map(lambda t: drain(t, "valid (then resumed)", Answer("status", "OK"), resume)),
        )

    def schedule_case(label, mutate, expected_field):
        msg = valid_schedule(next(versions))
        request = pb.UpdateScheduleRequest(schedule=msg)
        field = mutate(request.schedule) if callable(mutate) else expected_field
        answer = Answer("status", "INVALID_ARGUMENT", field) if field else Answer("status", "OK")
        return call(label, request.SerializeToString(), answer)

    def topk_below(s, p):
        i, v = p
        s.topk_blocks[i % len(s.topk_blocks)] = v
        return f"schedule.topk_blocks[{i % len(s.topk_blocks)}]"

    def edges_not_increasing(s, i):
        j = 1 + i % (len(s.edges) - 1)
        s.edges[j] = s.edges[j - 1]
        return "schedule"

    mutations = [
        ("valid", st.integers(-1, 64), lambda s, v: (s.topk_blocks.__setitem__(0, v), None)[1]),
        ("schedule.topk_blocks:below -1", st.tuples(_index, st.integers(INT32[0], -2)), topk_below),
        ("schedule.version:negative", st.integers(INT64[0], -1), lambda s, v: (setattr(s, "version", v), "schedule.version")[1]),
        ("schedule.name:oversized", _oversized_id(), lambda s, v: (setattr(s, "name", v), "schedule.name")[1]),
        ("schedule.notes:oversized", _oversized_text(), lambda s, v: (s.notes.append(v), f"schedule.notes[{len(s.notes) - 1}]")[1]),
        ("schedule:bin count", st.booleans(), lambda s, more: (s.topk_blocks.append(1) if more else s.topk_blocks.pop(), "schedule")[1]),
        ("schedule:edges not increasing", _index, edges_not_increasing),
        ("schedule:edges not positive", st.tuples(_index, st.integers(INT32[0], 0)),
         lambda s, p: (s.edges.__setitem__(p[0] % len(s.edges), p[1]), "schedule")[1]),
        ("schedule:block_size/sink/recent out of range",
         st.sampled_from(["block_size", "recent"]).flatmap(lambda f: st.tuples(st.just(f), st.integers(INT32[0], 0)))
         | st.tuples(st.just("sink"), _negative32), lambda s, p: (setattr(s, *p), "schedule")[1]),
    ]
    missing = st.just(None).map(lambda _: call("schedule:missing", pb.UpdateScheduleRequest().SerializeToString(),
                                               Answer("status", "INVALID_ARGUMENT", "schedule")))
    return st.one_of(random_bytes, missing,
                     *(param.map(lambda p, label=label, fn=fn: schedule_case(label, lambda s: fn(s, p), None))
                       for label, param, fn in mutations))


# ---------------------------------------------------------------------- generation and sending

QUOTAS = {  # share of the messages per RPC and kind
    ("StreamSamples", "payload"): 0.40, ("StreamSamples", "call"): 0.08,
    ("StreamStats", "payload"): 0.22, ("StreamStats", "call"): 0.06,
    ("UpdateSchedule", "call"): 0.12, ("Drain", "call"): 0.06, ("Health", "call"): 0.06,
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
    ids, versions = itertools.count(), itertools.count(1)
    strategies = {
        ("StreamSamples", "payload"): _payloads(
            "StreamSamples",
            lambda i: valid_sample(i, "fz", vocab=config.vocab_size, tokens=1 + i % 24, top_k=i % (config.max_top_k + 1)),
            _sample_mutations(config), ids),
        ("StreamSamples", "call"): _stream_calls("StreamSamples", config, ids),
        ("StreamStats", "payload"): _payloads("StreamStats", lambda i: valid_report(i, "fz"), _report_mutations(), ids),
        ("StreamStats", "call"): _stream_calls("StreamStats", config, ids),
        ("UpdateSchedule", "call"): _unary_calls("UpdateSchedule", config, versions, resume),
        ("Drain", "call"): _unary_calls("Drain", config, versions, resume),
        ("Health", "call"): _unary_calls("Health", config, versions, resume),
    }
    out = []
    for k, (key, strategy) in enumerate(strategies.items()):
        out += generate(strategy, max(1, round(n * QUOTAS[key])), random_seed + k)
    return out
