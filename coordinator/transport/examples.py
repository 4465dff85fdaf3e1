"""Valid messages of every kind, built directly as protobuf (no torch): the base that load tests mutate
nothing of and fuzzing mutates one field of."""

import random

from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.schedule import load_schedule

from .convert import schedule_to_proto


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


def valid_report(i: int, prefix: str = "r") -> pb.StatsReport:
    """A report that passes validation, with an `alpha_upper` equal to `alpha`."""
    rng = random.Random(f"{prefix}-{i}")
    bins, res = rng.randint(1, 6), rng.choice([10, 100, 2000])
    cells = sorted(rng.sample(range(bins * res), min(bins * res, rng.randint(1, 30))))
    counts = [rng.randint(1, 9) for _ in cells]
    per_bin = [0] * bins
    for c, n in zip(cells, counts):
        per_bin[c // res] += n
    alpha = pb.AlphaHistogram(num_length_bins=bins, resolution=res, cells=cells, counts=counts,
                              sums=[n * rng.random() for n in per_bin])
    return pb.StatsReport(report_id=f"{prefix}-{i}", trainer_id="t0", step=i, policy_version=1, schedule_version=0,
                          alpha=alpha, alpha_upper=alpha, metrics={"loss": rng.random()})


def valid_schedule(version: int) -> pb.Schedule:
    """A published schedule (20 bins) at `version`."""
    schedule = load_schedule("qwen3-1.7b-0.86")
    return schedule_to_proto(schedule.with_topk(schedule.topk_blocks, version=version))
