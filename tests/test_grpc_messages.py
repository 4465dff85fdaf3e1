"""Protobuf conversions round-trip exactly, and validation names the offending field."""

import math

import pytest
import torch
from pydantic import ValidationError

from sparrow.acceptance import AlphaHistogram
from sparrow.coordinator.transport import (
    InvalidMessage,
    RetryConfig,
    StatsRecord,
    Trajectory,
    TransportConfig,
    histogram_from_proto,
    histogram_to_proto,
    schedule_from_proto,
    schedule_to_proto,
    stats_from_proto,
    stats_to_proto,
    trajectory_from_proto,
    trajectory_to_proto,
    validate_sample,
    validate_stats_report,
)
from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.rollout_workers.api import RolloutRequest, RolloutSample
from sparrow.schedule import load_schedule

CONFIG = TransportConfig(vocab_size=1000)


def sample(n=12, k=4, seed=0) -> RolloutSample:
    g = torch.Generator().manual_seed(seed)
    top_lp = -torch.rand(n, k, generator=g).sort(-1).values
    top_ids = torch.randint(0, 1000, (n, k), generator=g)
    top_ids[0, -1] = -1  # padding is legal
    return RolloutSample(
        request_id="prompt-7", sample_index=3, prompt_token_ids=[5, 6, 7],
        token_ids=torch.randint(0, 1000, (n,), generator=g), logprobs=-torch.rand(n, generator=g),
        top_ids=top_ids, top_logprobs=top_lp, blocks_attended=torch.randint(1, 40, (n,), generator=g, dtype=torch.int32),
        finish_reason="length", policy_version=4, schedule_version=9, metadata={"dataset": "aime"},
    )


def test_trajectory_round_trip_is_exact():
    t = Trajectory.of(sample(), reward=0.5, worker_id="w3")
    back = trajectory_from_proto(trajectory_to_proto(t))
    assert (back.sample_id, back.group_id, back.reward, back.worker_id) == ("prompt-7#3", "prompt-7", 0.5, "w3")
    s, b = t.sample, back.sample
    for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "blocks_attended"):
        assert torch.equal(getattr(s, name), getattr(b, name)), name
        assert getattr(s, name).dtype == getattr(b, name).dtype, name
    assert (b.request_id, b.sample_index, b.prompt_token_ids, b.finish_reason) == ("prompt-7", 3, [5, 6, 7], "length")
    assert (b.policy_version, b.schedule_version, dict(b.metadata)) == (4, 9, {"dataset": "aime"})


def test_failed_sample_and_missing_reward_round_trip():
    failed = RolloutSample.failed(RolloutRequest("r1", (1, 2)), 0, "prompt too long", policy_version=1, schedule_version=0)
    msg = trajectory_to_proto(Trajectory.of(failed))
    validate_sample(msg, CONFIG)
    back = trajectory_from_proto(msg)
    assert back.reward is None and back.sample.finish_reason == "error" and back.sample.error == "prompt too long"
    assert back.sample.top_ids.shape == (0, 0)


def test_histogram_round_trip_matches_to_dict():
    h = AlphaHistogram.empty(20, 2000)
    g = torch.Generator().manual_seed(1)
    h.add(torch.rand(5000, generator=g) ** 0.1, torch.randint(0, 20, (5000,), generator=g))
    msg = histogram_to_proto(h)
    d = h.to_dict()
    assert [c // 2000 for c in msg.cells] == [c[0] for c in d["cells"]]
    assert [c % 2000 for c in msg.cells] == [c[1] for c in d["cells"]]
    assert list(msg.counts) == d["values"]
    back = histogram_from_proto(msg)
    assert torch.equal(back.counts, h.counts) and torch.equal(back.sums, h.sums)
    assert torch.allclose(back.percentile(5), h.percentile(5), equal_nan=True)


def test_schedule_round_trip_keeps_dense_bins():
    s = load_schedule("qwen3-4b-0.86")
    s = s.with_topk([None] + list(s.topk_blocks[1:]), version=12)
    back = schedule_from_proto(schedule_to_proto(s))
    assert back == s and back.topk_blocks[0] is None


def test_schedule_with_wrong_bin_count_is_invalid():
    msg = schedule_to_proto(load_schedule("qwen3-1.7b-0.86"))
    del msg.topk_blocks[-1]
    with pytest.raises(InvalidMessage, match="topk_blocks has 19 values") as exc:
        schedule_from_proto(msg)
    assert exc.value.field == "schedule"


def test_schedule_name_and_notes_are_bounded():
    msg = schedule_to_proto(load_schedule("qwen3-1.7b-0.86"))
    msg.name = "n" * 100_000
    with pytest.raises(InvalidMessage, match="schedule.name: has 100000 characters; at most 256 are allowed"):
        schedule_from_proto(msg)
    msg = schedule_to_proto(load_schedule("qwen3-1.7b-0.86"))
    msg.notes.append("x" * 65_537)
    with pytest.raises(InvalidMessage) as exc:
        schedule_from_proto(msg)
    assert exc.value.field == f"schedule.notes[{len(msg.notes) - 1}]"


def corrupt(fn):
    msg = trajectory_to_proto(Trajectory.of(sample()))
    fn(msg)
    return msg


CORRUPTIONS = {
    "sample_id": lambda m: setattr(m, "sample_id", ""),
    "group_id": lambda m: setattr(m, "group_id", ""),
    "sample_index": lambda m: setattr(m, "sample_index", -1),
    "policy_version": lambda m: setattr(m, "policy_version", -2),
    "schedule_version": lambda m: setattr(m, "schedule_version", -1),
    "finish_reason": lambda m: setattr(m, "finish_reason", pb.FINISH_REASON_UNSPECIFIED),
    "reward": lambda m: setattr(m, "reward", math.nan),
    "prompt_token_ids": lambda m: m.prompt_token_ids.append(1000),
    "token_ids": lambda m: m.token_ids.__setitem__(2, -5),
    "logprobs": lambda m: m.logprobs.__setitem__(1, math.inf),
    "blocks_attended": lambda m: m.blocks_attended.pop(),
    "top_k": lambda m: setattr(m, "top_k", 65),
    "top_ids": lambda m: m.top_ids.__setitem__(5, 1000),
    "top_logprobs": lambda m: m.top_logprobs.__setitem__(3, math.nan),
    "error": lambda m: setattr(m, "finish_reason", pb.FINISH_REASON_ERROR),
    "worker_id": lambda m: setattr(m, "worker_id", "w" * 257),
    "metadata": lambda m: m.metadata.__setitem__("", "x"),
    "metadata[dataset]": lambda m: m.metadata.__setitem__("dataset", "x" * 65_537),
}


@pytest.mark.parametrize("field", sorted(CORRUPTIONS))
def test_each_invalid_field_is_named(field):
    with pytest.raises(InvalidMessage) as exc:
        validate_sample(corrupt(CORRUPTIONS[field]), CONFIG)
    assert exc.value.field == field


def test_logprob_shape_and_positive_logprob_messages_say_what_to_fix():
    with pytest.raises(InvalidMessage, match=r"top_ids: has 47 values; expected num_tokens\*top_k = 12\*4 = 48"):
        validate_sample(corrupt(lambda m: m.top_ids.pop()), CONFIG)
    with pytest.raises(InvalidMessage, match=r"logprobs: \[0\]=0.5 must be a finite log-probability <= 0"):
        validate_sample(corrupt(lambda m: m.logprobs.__setitem__(0, 0.5)), CONFIG)


def stats(alpha_upper=True) -> StatsRecord:
    g = torch.Generator().manual_seed(2)
    lower = AlphaHistogram.empty(4, 100).add(torch.rand(300, generator=g), torch.randint(0, 4, (300,), generator=g))
    upper = AlphaHistogram(lower.counts.roll(1, -1), lower.sums) if alpha_upper else None
    return StatsRecord("r-1", "trainer-0", 3, 3, 2, lower, upper, {"loss": 0.25, "tis_capped_fraction": 0.01})


def test_stats_round_trip_and_validation():
    msg = stats_to_proto(stats())
    validate_stats_report(msg)
    back = stats_from_proto(msg)
    assert torch.equal(back.alpha.counts, stats().alpha.counts) and torch.equal(back.alpha_upper.counts, stats().alpha_upper.counts)
    assert back.metrics == {"loss": 0.25, "tis_capped_fraction": 0.01}
    assert stats_from_proto(stats_to_proto(stats(alpha_upper=False))).alpha_upper is None


@pytest.mark.parametrize(
    "field, fn",
    [
        ("alpha", lambda m: m.ClearField("alpha")),
        ("alpha.sums", lambda m: m.alpha.sums.__setitem__(0, 1e9)),
        ("alpha.cells", lambda m: m.alpha.cells.__setitem__(1, m.alpha.cells[0])),
        ("alpha.counts", lambda m: m.alpha.counts.__setitem__(0, 0)),
        ("alpha.resolution", lambda m: setattr(m.alpha, "resolution", 0)),
        ("alpha_upper", lambda m: m.alpha_upper.counts.__setitem__(0, m.alpha_upper.counts[0] + 1)),
        ("metrics[loss]", lambda m: m.metrics.__setitem__("loss", math.inf)),
        ("step", lambda m: setattr(m, "step", -1)),
    ],
)
def test_invalid_stats_report_names_the_field(field, fn):
    msg = stats_to_proto(stats())
    fn(msg)
    with pytest.raises(InvalidMessage) as exc:
        validate_stats_report(msg)
    assert exc.value.field == field


def test_transport_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="retry.max_backoff_s=0.01 is below retry.initial_backoff_s=0.5"):
        RetryConfig(initial_backoff_s=0.5, max_backoff_s=0.01)
    with pytest.raises(ValidationError, match="queue_capacity"):
        TransportConfig(queue_capacity=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TransportConfig(window=3)
    assert TransportConfig(port=0).grpc_options()[0] == ("grpc.max_send_message_length", 64 * 1024 * 1024)
