"""The Sample conversions round-trip exactly, and validation names the offending field."""

import math

import pytest
import torch
from pydantic import ValidationError

from sparrow.coordinator.transport import (
    InvalidMessage,
    RetryConfig,
    Trajectory,
    TransportConfig,
    trajectory_from_proto,
    trajectory_to_proto,
    validate_sample,
)
from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.rollout_workers.api import RolloutRequest, RolloutSample

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


def failed_with_top_k(k: int) -> pb.Sample:
    failed = RolloutSample.failed(RolloutRequest("r1", (1, 2)), 0, "engine crashed", policy_version=1, schedule_version=0)
    msg = trajectory_to_proto(Trajectory.of(failed))
    msg.top_k = k
    return msg


@pytest.mark.parametrize("k", [-1, -(2**31), 65, 100_000])
def test_a_failed_sample_is_held_to_the_top_k_rule_too(k):
    """The ERROR branch used to return before the top_k rule: -1 crashed the conversion, 100000 was queued."""
    with pytest.raises(InvalidMessage, match=rf"top_k: ={k} must be in \[0, max_top_k=64\]") as exc:
        validate_sample(failed_with_top_k(k), CONFIG)
    assert exc.value.field == "top_k"


@pytest.mark.parametrize("field,mutate", [
    ("top_k", lambda m: setattr(m, "top_k", -1)),
    ("top_ids", lambda m: m.top_ids.pop()),
    ("top_logprobs", lambda m: m.top_logprobs.append(-1.0)),
    ("finish_reason", lambda m: setattr(m, "finish_reason", 7)),
])
def test_conversion_of_an_unvalidated_message_names_the_field_instead_of_crashing(field, mutate):
    """trajectory_from_proto stands on its own: a message it cannot convert is an InvalidMessage, not a
    RuntimeError/KeyError that would end the stream with UNKNOWN."""
    with pytest.raises(InvalidMessage) as exc:
        trajectory_from_proto(corrupt(mutate))
    assert exc.value.field == field


def test_logprob_shape_and_positive_logprob_messages_say_what_to_fix():
    with pytest.raises(InvalidMessage, match=r"top_ids: has 47 values; expected num_tokens\*top_k = 12\*4 = 48"):
        validate_sample(corrupt(lambda m: m.top_ids.pop()), CONFIG)
    with pytest.raises(InvalidMessage, match=r"logprobs: \[0\]=0.5 must be a finite log-probability <= 0"):
        validate_sample(corrupt(lambda m: m.logprobs.__setitem__(0, 0.5)), CONFIG)


def test_transport_config_errors_name_the_field():
    with pytest.raises(ValidationError, match="retry.max_backoff_s=0.01 is below retry.initial_backoff_s=0.5"):
        RetryConfig(initial_backoff_s=0.5, max_backoff_s=0.01)
    with pytest.raises(ValidationError, match="queue_capacity"):
        TransportConfig(queue_capacity=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        TransportConfig(window=3)
    assert TransportConfig(port=0).grpc_options()[0] == ("grpc.max_send_message_length", 64 * 1024 * 1024)
