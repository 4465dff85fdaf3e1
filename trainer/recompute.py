"""Dense recompute: the policy's log-prob, entropy and top-k of every response token of a rank's shard, and α of
the rollout against it (docs/trainer.md, "Dense recompute and α")."""

import time

import torch

from sparrow.schedule import SparsitySchedule

from .alpha import AlphaReport, add_micro_batch_alpha, merged_over_ranks
from .batch import TrajectoryBatch
from .collectives import all_reduce_scalar
from .config import TrainerConfig
from .lockstep import lockstep_plans
from .microbatch import collate
from .policy import Policy
from .results import RecomputeResult

PER_TOKEN = ("logprobs", "entropy", "top_ids", "top_logprobs")


@torch.no_grad()
def recompute(policy: Policy, config: TrainerConfig, bins: SparsitySchedule, batch: TrajectoryBatch) -> RecomputeResult:
    """Collective; α is binned by `bins` and merged over ranks, the per-token tensors are this rank's."""
    start = time.perf_counter()
    trajectories = list(batch)
    for i, t in enumerate(trajectories):
        t.validate(f"trajectory {i}", policy.vocab_size)
    policy.engine.module.eval()
    n = len(trajectories)
    out = {k: [None] * n for k in PER_TOKEN + ("alpha_lower", "alpha_upper")}
    report = AlphaReport(bins.num_bins)
    plans, passes = lockstep_plans(trajectories, config.micro_batch_tokens, policy.device)
    forward = policy.forward
    for j in range(passes):
        if j >= len(plans):
            with forward.adapter(False):
                forward.dummy_loss()
            continue
        mb = collate(trajectories, plans[j], pad_id=0)
        with forward.adapter(False):
            stats = forward.stats(mb)
        for name in PER_TOKEN:
            for i, v in zip(mb.indices, mb.per_row(getattr(stats, name).cpu())):
                out[name][i] = v
        add_micro_batch_alpha(report, mb, trajectories, stats.top_ids, stats.top_logprobs, bins, out)
    tokens = all_reduce_scalar(sum(t.total_len for t in trajectories), "sum", policy.device)
    seconds = time.perf_counter() - start
    return RecomputeResult(
        **out,
        alpha=merged_over_ranks(report),
        metrics={"recompute/tokens": tokens, "recompute/seconds": seconds, "recompute/tokens_per_s": tokens / seconds},
    )
