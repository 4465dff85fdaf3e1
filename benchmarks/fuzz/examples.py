"""Valid messages built directly as protobuf (no torch): the samples of load tests, of the fuzzer's valid
traffic and of its protocol cases."""

import random

from sparrow.protos import sparrow_v1_pb2 as pb


def valid_sample(i: int, prefix: str = "s", tokens: int = 64, top_k: int = 4, vocab: int = 1000) -> pb.Sample:
    """A sample that passes validation with `vocab_size=vocab`, id `<prefix>-<i>`."""
    rng = random.Random(f"{prefix}-{i}")
    return pb.Sample(
        sample_id=f"{prefix}-{i}", prompt_id=f"{prefix}-p{i // 4}", group_id=f"{prefix}-p{i // 4}", sample_index=i % 4,
        prompt_token_ids=[rng.randrange(vocab) for _ in range(8)],
        token_ids=[rng.randrange(vocab) for _ in range(tokens)],
        logprobs=[-rng.random() for _ in range(tokens)],
        top_k=top_k,
        top_ids=[rng.randrange(vocab) for _ in range(tokens * top_k)],
        top_logprobs=[-rng.random() for _ in range(tokens * top_k)],
        blocks_attended=[1 + t // 16 for t in range(tokens)],
        policy_version=1, schedule_version=0, reward=float(i % 2), finish_reason=pb.FINISH_REASON_STOP, worker_id=prefix,
    )

