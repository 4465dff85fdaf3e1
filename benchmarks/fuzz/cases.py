"""Requests for every RPC, generated with hypothesis, each with the answer the oracle (`oracle.py`) says it
must get. Generation only: `fuzzer.py` sends them.

Samples are drawn field by field. Each field is valid (boundaries included: empty where allowed, exactly
at a limit, multi-byte characters at a character limit, every finish reason) or, now and then, not; so
one sample may break several rules at once, on any finish reason, which is how a rule skipped on one
path shows. Array contents come from a seeded generator (hypothesis draws their sizes, the seed and the
odd bad value: drawing every token would be slow). A share of the requests is then rewritten on the wire
(`_rewrites`: a field with the wrong wire type, a scalar twice, a packed field unpacked, unknown fields,
invalid UTF-8, truncated or flipped bytes). Samples that parse share streams (`Payload`); everything else
is a call of its own (`Call`): protocol breaches, unparsable or oversized requests, and every unary
request, each sent to one of the two servers.
"""

import itertools
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from sparrow.coordinator.transport.config import TransportConfig
from sparrow.protos import sparrow_v1_pb2 as pb

from . import oracle
from .examples import valid_sample
from .oracle import CONTROL_REQUEST_BYTES, ERROR, ID_CHARS, LENGTH, POOL_SIZES, STOP, TEXT_CHARS, Expected, Limits
from .protowire import I32, I64, LEN, VARINT, record, unpacked, wrapped

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
SAMPLE_FIELD = {f.name: f.number for f in pb.Sample.DESCRIPTOR.fields}
OPEN, SAMPLE = 1, 2
"""Field numbers of SampleStreamRequest.open and .sample."""


def fuzz_config(**overrides) -> TransportConfig:
    """Small limits, so oversized inputs stay cheap to build and send."""
    return TransportConfig(port=0, vocab_size=1000, max_sample_tokens=256, max_top_k=8, max_message_mb=1, **overrides)


@dataclass
class Payload:
    """One sample for a shared stream: its raw SampleStreamRequest, the ack it must get, and what it was
    drawn as (its finish reason, the fields that break a rule, the wire rewrite if any)."""

    request: bytes
    expected: Expected
    finish_reason: int
    broken: frozenset[str]
    label: str
    rpc: str = "StreamSamples"


@dataclass
class Call:
    """A call of its own: raw request messages, the server it goes to and how it must end."""

    rpc: str
    label: str
    target: str  # "trajectory" or "control" (a coordinator-like server that resizes and does not drain)
    requests: list[bytes]
    expected: Expected


# ---------------------------------------------------------------------- field values

NONFINITE = [math.nan, math.inf, -math.inf]
ABOVE_ROUNDING = float(np.nextafter(np.float32(oracle.LOGPROB_ROUNDING), np.float32(np.inf)))
BAD_LOGPROBS = [*NONFINITE, ABOVE_ROUNDING, 0.5, 3.0e38, 1e39]  # 1e39 is inf once in float32
EDGE_LOGPROBS = [0.0, -0.0, oracle.LOGPROB_ROUNDING, -3.0e38]   # valid, at the edges
CHARS = "aé€😀"
"""One character of 1, 2, 3 and 4 UTF-8 bytes: limits count characters, not bytes."""


def _text(length: int, char: str, prefix: str = "") -> str:
    return (prefix + char * length)[:length] if length >= len(prefix) else char * length


KNOBS = ("finish_reason", "token count", "top_k", "token_ids", "logprobs", "blocks_attended", "top_ids",
         "top_logprobs", "prompt_token_ids", "error", "metadata", "sample_id", "prompt_id", "group_id",
         "sample_index", "policy_version", "schedule_version", "worker_id", "reward", "wire", "wire", "wire")
"""What a sample's draw may break ("wire", thrice as likely: rewrite it on the wire, `_rewrites`); each sample
draws up to four of them (about a third of the samples none)."""


POSITION = st.integers(0, 2**16 - 1)
"""Every choice among n is this draw modulo n: one strategy for all (building one per draw costs more than the
draw), and constraints that never depend on the seeded generator's values, so hypothesis can replay a draw."""


PLANS = st.sets(st.sampled_from(KNOBS), max_size=4) | st.sets(st.sampled_from(KNOBS), min_size=1, max_size=4)


class _Draws:
    """Draw helpers. `plan` is the set of knobs this sample breaks: how each is broken is drawn by hypothesis
    (`one`, `text`, `draw`); valid values, boundaries included, come from `rng` (one draw per value would make
    each sample cost tens of draws), seeded by a draw and the request's serial `number` (hypothesis repeats its
    draws often; the serial keeps contents and ids distinct, and it never changes what is drawn)."""

    def __init__(self, draw, limits: Limits, plan: frozenset[str], number: int):
        self.draw, self.limits, self.plan = draw, limits, plan
        self.rng = random.Random(f"{draw(st.integers(0, 2**32 - 1))}/{number}")

    def off(self, knob: str) -> bool:
        return knob in self.plan

    def one(self, values: list):
        return values[self.draw(POSITION) % len(values)]

    def text(self, lengths: list[int], prefix: str = "") -> str:
        return _text(self.one(lengths), self.one(list(CHARS)), prefix)

    def valid(self, values: list):
        return self.rng.choice(values)


def _ids(d: _Draws, knob: str, unique: str) -> str:
    if d.off(knob):
        return d.text([0, ID_CHARS + 1, 3 * ID_CHARS], unique)
    return d.valid([unique] * 9 + [_text(ID_CHARS, d.valid(CHARS), unique)])


def _sample(d: _Draws, unique: str) -> pb.Sample:
    limits, rng = d.limits, d.rng
    vocab, limit, max_k = limits.vocab_size, limits.max_sample_tokens, limits.max_top_k
    finish = d.one([0, 4, -1, *INT32]) if d.off("finish_reason") else d.valid([STOP, LENGTH, ERROR])
    failed = finish == ERROR
    if d.off("token count"):
        n = d.one([1, 3, limit + 1]) if failed else d.one([0, limit + 1])
    else:
        n = 0 if failed else d.valid([1, 2, limit - 1, limit] + [rng.randint(1, 24)] * 12)
    k = d.one([-1, max_k + 1, 100_000, *INT32]) if d.off("top_k") else rng.randint(0, max_k)
    width = min(max(k, 0), max_k + 1)  # values per token the top-k arrays get (a huge k cannot be built)

    def array(knob: str, expected: int, make: Callable[[int], object], bad: list) -> list:
        """`expected` values from `make(i)`; when `knob` is broken, a wrong count or one value from `bad`."""
        if not d.off(knob):
            return [make(i) for i in range(expected)]
        delta, position, value = d.one([1, -1, 0]), d.draw(POSITION), d.one(bad)  # drawn whatever `expected` is
        length = expected + delta if expected else 1
        values = [make(i) for i in range(length)]
        if length == expected:
            values[position % length] = value
        return values

    def token(_):
        return rng.choice((0, vocab - 1)) if rng.random() < 0.05 else rng.randrange(vocab)

    def logprob(_):
        return rng.choice(EDGE_LOGPROBS) if rng.random() < 0.05 else -rng.expovariate(1.0)

    bad_tokens = [vocab, vocab + 1, -1, *INT32]
    top_ids = array("top_ids", n * width, lambda _: -1 if rng.random() < 0.1 else rng.randrange(vocab), [vocab, -2, *INT32])
    padding = [rng.choice((-math.inf, 0.0)) for _ in top_ids]  # what a padding entry (id -1) holds
    if d.off("prompt_token_ids"):
        prompt = array("prompt_token_ids", d.one([0, limit + 1, 4]), token, bad_tokens)
    else:
        prompt = array("prompt_token_ids", d.valid([limit] + [rng.randint(1, 8)] * 9), token, bad_tokens)
    if failed:
        error = d.text([0, TEXT_CHARS + 1]) if d.off("error") else d.valid(["engine crashed"] * 9 + ["x" * TEXT_CHARS])
    else:
        error = d.text([TEXT_CHARS + 1]) if d.off("error") else d.valid(["", "a warning"])
    if d.off("metadata"):
        metadata = d.one([{"": "v"}, {_text(ID_CHARS + 1, "é"): "v"}, {"k": "é" * (TEXT_CHARS + 1)}])
    else:
        metadata = d.valid([{}, {"dataset": "aime"}] * 4 + [{_text(ID_CHARS, "😀"): "é" * TEXT_CHARS}])
    msg = pb.Sample(
        sample_id=_ids(d, "sample_id", unique),
        prompt_id=_ids(d, "prompt_id", "p" + unique),
        group_id=_ids(d, "group_id", "g" + unique),
        sample_index=d.one([-1, INT32[0]]) if d.off("sample_index") else d.valid([0, INT32[1], rng.randrange(INT32[1])]),
        prompt_token_ids=prompt,
        token_ids=array("token_ids", n, token, bad_tokens),
        logprobs=array("logprobs", n, logprob, BAD_LOGPROBS),
        top_k=k,
        top_ids=top_ids,
        top_logprobs=array("top_logprobs", n * width,
                           lambda i: padding[i] if i < len(top_ids) and top_ids[i] == -1 else logprob(i),
                           [*BAD_LOGPROBS, -math.inf]),
        blocks_attended=array("blocks_attended", n, lambda _: rng.randrange(64), [-1, INT32[0]]),
        policy_version=_version(d, "policy_version"),
        schedule_version=_version(d, "schedule_version"),
        finish_reason=finish,
        error=error,
        metadata=metadata,
        worker_id=d.text([ID_CHARS + 1]) if d.off("worker_id") else d.valid(["", "rollout-3", _text(ID_CHARS, "€")]),
    )
    reward = d.one(NONFINITE) if d.off("reward") else d.valid([None, 0.0, -0.0, 5e-324, 1.7976931348623157e308,
                                                                 -1.7976931348623157e308, rng.uniform(-2, 2)])
    if reward is not None:
        msg.reward = reward
    return msg


def _version(d: _Draws, knob: str) -> int:
    if d.off(knob):
        return d.one([-1, INT64[0], INT32[0] - 1])
    return d.valid([0, 1, INT32[1] + 1, INT64[1], d.rng.randrange(INT64[1])])


# ---------------------------------------------------------------------- wire rewrites

NATURAL_WIRE_TYPES = {
    **{f.name: {VARINT} for f in pb.Sample.DESCRIPTOR.fields if f.type in (f.TYPE_INT32, f.TYPE_INT64, f.TYPE_ENUM)},
    **{f.name: {LEN} for f in pb.Sample.DESCRIPTOR.fields if f.type in (f.TYPE_STRING, f.TYPE_MESSAGE)},
    "reward": {I64},
    **{name: {LEN, VARINT} for name in ("prompt_token_ids", "token_ids", "top_ids", "blocks_attended")},
    **{name: {LEN, I32} for name in ("logprobs", "top_logprobs")},
}
"""Wire types a parser takes for each Sample field (packed repeated fields also come one record per value)."""
GARBAGE = {VARINT: 5, I64: 1.5, LEN: b"ab", I32: -0.25}


def _rewrites(d: _Draws, msg: pb.Sample) -> tuple[str, bytes]:
    """`msg` rewritten on the wire in one of several ways a generated class would not write it."""
    how = d.one(["wrong wire type", "scalar twice", "packed field unpacked", "unknown field", "invalid UTF-8",
                 "truncated", "byte flipped"])
    raw = msg.SerializeToString()
    if how == "wrong wire type":
        name = d.one(sorted(NATURAL_WIRE_TYPES))
        wire_type = d.one(sorted({VARINT, I64, LEN, I32} - NATURAL_WIRE_TYPES[name]))
        without = pb.Sample()
        without.CopyFrom(msg)
        without.ClearField(name)
        return f"{how}: {name}", without.SerializeToString() + record(SAMPLE_FIELD[name], wire_type, GARBAGE[wire_type])
    if how == "scalar twice":
        name, wire_type, value = d.one([
            ("top_k", VARINT, d.one([0, 1, -1, 1 << 20])), ("finish_reason", VARINT, d.one([STOP, LENGTH, ERROR, 0])),
            ("sample_index", VARINT, d.one([0, -1])), ("sample_id", LEN, d.one([b"", b"again"])),
            ("reward", I64, d.one([0.5, math.nan])),
        ])
        return f"{how}: {name}", raw + record(SAMPLE_FIELD[name], wire_type, value)
    if how == "packed field unpacked":
        name = d.one(["prompt_token_ids", "token_ids", "blocks_attended"])
        without = pb.Sample()
        without.CopyFrom(msg)
        without.ClearField(name)
        return f"{how}: {name}", without.SerializeToString() + unpacked(SAMPLE_FIELD[name], list(getattr(msg, name)))
    if how == "unknown field":
        number = d.draw(st.integers(len(SAMPLE_FIELD) + 1, 2**29 - 1))
        wire_type = d.one([VARINT, I64, LEN, I32])
        return how, raw + record(number, wire_type, GARBAGE[wire_type])
    if how == "invalid UTF-8":
        name = d.one(["sample_id", "prompt_id", "group_id", "error", "worker_id"])
        return f"{how}: {name}", raw + record(SAMPLE_FIELD[name], LEN, b"\xff\xfe")
    position, mask = d.draw(POSITION), d.draw(st.integers(1, 255))
    if how == "truncated" or not raw:
        return how, raw[:position % max(len(raw), 1)]
    flipped = bytearray(raw)
    flipped[position % len(raw)] ^= mask
    return how, bytes(flipped)


# ---------------------------------------------------------------------- strategies


def _sample_requests(limits: Limits, prefix: str, serial: Iterator[int]) -> st.SearchStrategy:
    """A sample (maybe rewritten) as a Payload, or as a Call when it cannot share a stream."""

    @st.composite
    def draw_one(draw):
        number = next(serial)
        d = _Draws(draw, limits, frozenset(draw(PLANS)), number)
        msg = _sample(d, f"{prefix}-{number}")
        label, raw = ("field values", msg.SerializeToString())
        if d.off("wire"):
            label, raw = _rewrites(d, msg)
        request = wrapped(SAMPLE, raw)
        opening = pb.SampleStreamRequest(open=pb.StreamOpen(client_id="fuzz")).SerializeToString()
        expected = oracle.stream_answer([opening, request], limits)
        if expected.kind == "status":  # the request ends its stream: it cannot share one
            return Call("StreamSamples", f"sample: {label}", "trajectory", [opening, request], expected)
        finish_reason = pb.SampleStreamRequest.FromString(request).sample.finish_reason
        return Payload(request, expected, finish_reason, expected.fields, label)  # a refusal's fields: the rules broken

    return draw_one()


STREAM_SHAPES = ("no StreamOpen", "empty first message", "StreamOpen twice", "StreamOpen after a sample",
                 "empty request after StreamOpen", "no messages at all", "message over max_message_mb",
                 "client_id at its limit", "random bytes first", "random bytes after StreamOpen")


def _stream_calls(limits: Limits, prefix: str, serial: Iterator[int]) -> st.SearchStrategy:
    """Calls that break the stream protocol (or keep to it at its edges)."""

    def opening(client_id: str = "fuzz") -> bytes:
        return pb.SampleStreamRequest(open=pb.StreamOpen(client_id=client_id)).SerializeToString()

    def sample(number: int, worker_id: str = "") -> bytes:
        msg = valid_sample(number, prefix, vocab=limits.vocab_size)
        msg.worker_id = worker_id
        return pb.SampleStreamRequest(sample=msg).SerializeToString()

    @st.composite
    def draw_one(draw):
        label, number = draw(st.sampled_from(STREAM_SHAPES)), next(serial)
        requests = {
            "no StreamOpen": lambda: [sample(number)],
            "empty first message": lambda: [b""],
            "StreamOpen twice": lambda: [opening(), opening()],
            "StreamOpen after a sample": lambda: [opening(), sample(number), opening()],
            "empty request after StreamOpen": lambda: [opening(), b""],
            "no messages at all": lambda: [],
            "message over max_message_mb": lambda: [opening(), sample(number, "z" * (limits.max_message_bytes + 1024))],
            "client_id at its limit": lambda: [opening(_text(draw(st.sampled_from([ID_CHARS, ID_CHARS + 1])),
                                                             draw(st.sampled_from(CHARS))))],
            "random bytes first": lambda: [draw(st.binary(max_size=64))],
            "random bytes after StreamOpen": lambda: [opening(), draw(st.binary(max_size=64))],
        }[label]()
        return Call("StreamSamples", label, "trajectory", requests, oracle.stream_answer(requests, limits))

    return draw_one()


def _padded(data: bytes, total: int) -> bytes:
    """`data` plus an unknown length-delimited field bringing it to `total` bytes (one less where the length's
    varint grows a byte)."""
    room = total - len(data)
    for filler in range(max(room - 2, 0), -1, -1):
        extra = record(1000, LEN, b"x" * filler)
        if len(extra) <= room:
            return data + extra
    return data


def _control_bytes(fields: st.SearchStrategy) -> st.SearchStrategy:
    """A control request: the serialized message, or that message rewritten (random bytes, a field of the wrong
    wire type, a field twice, an unknown field bringing it to the size limit or just past it)."""
    size = st.sampled_from([CONTROL_REQUEST_BYTES - 1, CONTROL_REQUEST_BYTES, CONTROL_REQUEST_BYTES + 1, 60_000])
    return st.one_of(
        fields, fields, fields,
        st.tuples(fields, size).map(lambda p: ("padded to its size limit", _padded(p[0][1], p[1]))),
        st.tuples(fields, st.sampled_from([VARINT, I64, LEN, I32])).map(
            lambda p: ("a field of the wrong wire type", p[0][1] + record(1, p[1], GARBAGE[p[1]]))),
        st.binary(max_size=64).map(lambda b: ("random bytes", b)),
    )


def _unary_calls(rpc: str) -> st.SearchStrategy:
    if rpc == "Drain":
        timeouts = st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 0.01, -1.0, 1e300, *NONFINITE]) | st.floats(-1, 0.05)
        fields = timeouts.map(lambda t: ("timeout_s", pb.DrainRequest(timeout_s=t).SerializeToString()))
        judge = lambda data, target: oracle.drain_answer(data, drains=target == "trajectory")  # noqa: E731
    elif rpc == "Health":
        fields = st.integers(0, 2**32).map(lambda _: ("empty", b""))  # a draw of its own: not exhausted after one
        judge = lambda data, target: oracle.health_answer(data)  # noqa: E731
    else:
        pools = st.one_of(st.just("rollout"), st.sampled_from(["trainer", "", "Rollout", "rollout ", _text(ID_CHARS + 1, "😀")]),
                          st.text(max_size=12))
        sizes = st.one_of(st.integers(*POOL_SIZES), st.sampled_from([1, 1024, 0, 1025, -1, *INT32]), st.integers(*INT32))
        fields = st.tuples(pools, sizes).map(lambda p: ("pool and size", pb.ResizePoolRequest(pool=p[0], size=p[1]).SerializeToString()))
        judge = lambda data, target: oracle.resize_answer(data, resizes=target == "control")  # noqa: E731
    targets = st.sampled_from(["trajectory", "control"])
    return st.tuples(_control_bytes(fields), targets).map(
        lambda p: Call(rpc, p[0][0], p[1], [p[0][1]], judge(p[0][1], p[1])))


# ---------------------------------------------------------------------- generation

QUOTAS = {"payload": 0.6, "stream calls": 0.1, "Drain": 0.1, "Health": 0.08, "ResizePool": 0.12}
"""Share of the messages per kind of request."""


BATCH = 16
"""Requests drawn per hypothesis example: its engine's cost per example is several times a request's."""


def generate(strategy: st.SearchStrategy, n: int, random_seed: int) -> list:
    """`n` examples of `strategy`, drawn `BATCH` at a time (generation only: no shrinking, no example database)."""
    out: list = []

    @seed(random_seed)
    @settings(max_examples=-(-n // BATCH), database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(strategy, min_size=BATCH, max_size=BATCH))
    def collect(examples):
        out.extend(examples)

    collect()
    return out[:n]


def cases(config: TransportConfig, n: int, random_seed: int, prefix: str = "fz") -> list[Payload | Call]:
    """About `n` requests over every RPC in the `QUOTAS` shares; sample ids start with `prefix` (one per round,
    so rounds do not answer each other's samples DUPLICATE)."""
    limits, serial = Limits.of(config), itertools.count()
    strategies: dict[str, Callable[[], st.SearchStrategy]] = {
        "payload": lambda: _sample_requests(limits, prefix, serial),
        "stream calls": lambda: _stream_calls(limits, prefix, serial),
        "Drain": lambda: _unary_calls("Drain"),
        "Health": lambda: _unary_calls("Health"),
        "ResizePool": lambda: _unary_calls("ResizePool"),
    }
    out: list[Payload | Call] = []
    for k, (kind, strategy) in enumerate(strategies.items()):
        out += generate(strategy(), max(1, round(n * QUOTAS[kind])), random_seed + k)
    return out
