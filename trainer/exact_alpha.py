"""Exact α between the dense policy and the trainer's sparse (+LoRA) forward: full-vocabulary distributions on both
sides, so lower = upper (docs/trainer.md, "Exact α")."""

import torch

from sparrow.acceptance import acceptance_exact, token_context_lengths

from .alpha import AlphaReport, merged_over_ranks
from .batch import TrajectoryBatch
from .config import TrainerConfig
from .microbatch import collate, plan_micro_batches
from .policy import Policy
from .schedules import KnownSchedules
from .sparse_attention import micro_batch_forward


@torch.no_grad()
def measure_sparse_alpha(policy: Policy, config: TrainerConfig, schedules: KnownSchedules,
                         batch: TrajectoryBatch) -> AlphaReport:
    """Per length bin, all ranks merged (collective). Each trajectory runs under the schedule it was decoded with
    and is keyed by that version; one whose version this rank no longer knows is counted in `unmeasured`. Costs
    one dense and one sparse forward per micro-batch."""
    if schedules.in_force is None:
        raise ValueError("measure_sparse_alpha needs a sparsity schedule; none is set")
    known = [(t, schedules.of(t)) for t in batch]
    trajectories = [t for t, s in known if s is not None]
    decoded_with = [s for _, s in known if s is not None]
    bins = schedules.bins
    policy.engine.module.eval()
    report = AlphaReport(bins.num_bins, unmeasured=sum(t.response_len for t, s in known if s is None))
    forward, chunk = policy.forward, config.logprob_chunk_tokens
    layout = config.distill_sparse.layout_for(schedules.in_force)
    for plan in plan_micro_batches([t.total_len for t in trajectories], config.micro_batch_tokens):
        mb = collate(trajectories, plan, pad_id=0)
        with forward.adapter(False):
            dense_h = forward.hidden(mb)
        with forward.adapter(True):
            rows = [decoded_with[i] for i in mb.indices]
            sparse = micro_batch_forward(mb, layout, rows, policy.device, config.kv_cache_dtype)
            sparse_h = forward.hidden(mb, sparse)
        full = forward.module.full_logprobs
        alpha = torch.cat([
            acceptance_exact(full(dense_h[s : s + chunk]), full(sparse_h[s : s + chunk]))
            for s in range(0, dense_h.shape[0], chunk)
        ]).cpu()
        for i, a in zip(mb.indices, mb.per_row(alpha)):
            t = trajectories[i]
            keep = t.response_mask()
            token_bins = bins.bins_for_lengths(token_context_lengths(t.prompt_len, t.response_len))
            report.add(decoded_with[i].version, a[keep], a[keep], token_bins[keep])
    return merged_over_ranks(report)
