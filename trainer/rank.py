"""`TrainerRank`: one DeepSpeed rank of the dense-policy trainer (a plain class; wrap it in `ray.remote`).

Life cycle: `TrainerRank(config, rank, world_size)` → `setup(master_addr, master_port)` on every rank
→ `train_step` / `recompute` / `publish_weights` / checkpoints, called on all ranks with their shard of
the batch (`TrainerGroup` does the fan-out). Every call that touches the model is collective: all
ranks must make it, in the same order.
"""

import socket
import time
from pathlib import Path

import torch

from sparrow.acceptance import acceptance_exact, token_context_lengths
from sparrow.finite import all_finite
from sparrow.schedule import SPARROW_EDGES, SparsitySchedule, load_schedule
from sparrow.weight_sync import CollectiveGroup, CollectiveSender, Manifest, ObjectStoreSender, plan_buckets

from . import sparse_attention
from .alpha import AlphaReport, add_trajectory_alpha
from .batch import Trajectory, TrajectoryBatch
from .checkpoint import convert_to_universal, load_universal, model_states
from .collectives import all_gather_objects, all_reduce_dict, all_reduce_grads, all_reduce_scalar
from .config import TrainerConfig
from .engine import (
    deepspeed_config,
    init_distributed,
    load_causal_lm,
    make_optimizer,
    resolve_device,
    resolve_dtype,
    set_rank_environment,
)
from .export import WeightExporter
from .forward import PolicyModule, PolicyRunner
from .hf_export import DEFAULT_MAX_SHARD_SIZE, write_hf_dir
from .lora import adapter_state, attach_lora, is_lora_param
from .losses import k3_kl, policy_loss, ppo_clip_loss, rollout_correction
from .microbatch import MicroBatch, collate, plan_micro_batches
from .publish import PublishReport, send_buckets
from .results import RecomputeResult, StepResult

DENSE_BINS = SparsitySchedule(name="dense-bins", topk_blocks=(None,) * (len(SPARROW_EDGES) + 1))
"""Length bins for α when no schedule is set: Sparrow's 2000-token bins."""

LORA_OPTIMIZER_FILE = "sparse_lora_optimizer.pt"


LOSS_SUM_KEYS = (
    "tokens", "clipped", "dual_clipped", "tis_capped", "band_masked", "abs_log_ratio", "ppo_kl", "pg_loss",
    "entropy", "tokens_total",
)
"""Per-step sums every rank reports: the same keys everywhere, so the all-reduce lines up even on a
rank whose shard was empty."""


def _split(t: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(t.split(lengths))


def _index_parts(n: int, parts: int) -> list[list[int]]:
    """Consecutive near-equal index ranges (PPO mini-batches; some may be empty on a small shard)."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


KNOWN_SCHEDULES = 16
"""Schedule versions a rank remembers, so exact α can replay a trajectory under the one it was decoded with."""


class TrainerRank:
    def __init__(self, config: TrainerConfig | dict, rank: int = 0, world_size: int = 1):
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig.model_validate(config)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.engine = None
        self.step_count = 0
        self.weight_group: CollectiveGroup | None = None
        self.known_schedules: dict[int, SparsitySchedule] = {}

    # ------------------------------------------------------------------ set-up

    def address(self) -> tuple[str, int]:
        """This host's address and a free port (for rank 0's rendezvous or a weight group)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str = "127.0.0.1", master_port: int = 29500) -> dict:
        cfg = self.config
        self.device = resolve_device(cfg, self.rank)
        self.dtype = resolve_dtype(cfg, self.device)
        if self.device.type == "cuda":
            local_rank, local_size = self.device.index, torch.cuda.device_count()
        else:
            local_rank, local_size = self.rank, self.world_size
        set_rank_environment(self.rank, self.world_size, master_addr, master_port, local_rank, local_size)
        init_distributed("nccl" if self.device.type == "cuda" else "gloo")
        torch.manual_seed(cfg.seed)
        self.set_schedule(load_schedule(cfg.schedule) if cfg.schedule else None)

        import deepspeed

        ds_config = deepspeed_config(cfg, self.dtype)
        if cfg.zero_stage == 3:
            from transformers.integrations import HfDeepSpeedConfig

            self._hf_ds_config = HfDeepSpeedConfig(ds_config)  # must stay alive: from_pretrained partitions under it
        distill = cfg.distill_sparse.enabled
        attn = sparse_attention.register() if distill or cfg.exact_alpha else "sdpa"
        model = load_causal_lm(cfg.model, self.dtype, attn)
        self.vocab_size = model.config.vocab_size
        self.num_layers = model.config.num_hidden_layers
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if distill:
            cfg.distill_sparse.layout_for(None).check_layers(self.num_layers, "distill_sparse.dense_layers")
            model = attach_lora(model, cfg.distill_sparse)
        module = PolicyModule(model, cfg.temperature, cfg.recompute_topk, cfg.logprob_chunk_tokens)
        named = list(module.named_parameters())
        base = [p for n, p in named if not is_lora_param(n)]
        self.lora_params = [p for n, p in named if is_lora_param(n)]
        for p in base:  # peft freezes the base model; the dense update trains it
            p.requires_grad_(True)
        for p in self.lora_params:  # trained only inside distill_step
            p.requires_grad_(False)
        optimizer, scheduler = make_optimizer(base, cfg.optimizer)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        if distill:
            for p in self.lora_params:  # DeepSpeed cast the module to bf16 on GPU; the adapter keeps fp32 weights
                p.data = p.data.float()  # (peft casts activations to the adapter's dtype and back)
            self.lora_optimizer, self.lora_scheduler = make_optimizer(self.lora_params, cfg.optimizer, cfg.distill_sparse.lr_scale)
            # The adapter trains outside DeepSpeed (its own optimizer, replicated): its forward must not
            # register the engine's ZeRO backward hooks, so it calls the module directly.
            self.lora_forward = PolicyRunner(self.engine.module, self.engine.module, self.device)
        self.forward = PolicyRunner(self.engine, self.engine.module, self.device)
        self.ref_forward = None
        if cfg.loss.kl_coef > 0:
            ref = load_causal_lm(cfg.model, self.dtype, "sdpa")
            ref.requires_grad_(False)
            ref_config = {k: v for k, v in ds_config.items() if k != "gradient_clipping"}
            ref_engine = deepspeed.initialize(model=PolicyModule(ref, cfg.temperature, 1, cfg.logprob_chunk_tokens), config=ref_config)[0]
            ref_engine.eval()
            self.ref_forward = PolicyRunner(ref_engine, ref_engine.module, self.device)
        self.exporter = WeightExporter(self.engine.module, cfg.zero_stage == 3)
        return {"rank": self.rank, "device": str(self.device), "dtype": str(self.dtype), "parameters": sum(p.numel() for p in base)}

    def set_schedule(self, schedule: SparsitySchedule | dict | str | None) -> None:
        """The schedule in force: α length bins and DistillSparse budgets (None = dense)."""
        if isinstance(schedule, dict):
            schedule = SparsitySchedule.from_dict(schedule)
        elif isinstance(schedule, str):
            schedule = load_schedule(schedule)
        self.schedule = schedule
        if schedule is not None:
            self.known_schedules[schedule.version] = schedule
            while len(self.known_schedules) > KNOWN_SCHEDULES:
                del self.known_schedules[min(self.known_schedules)]

    @property
    def bins(self) -> SparsitySchedule:
        return self.schedule or DENSE_BINS

    def _require_setup(self) -> None:
        if self.engine is None:
            raise RuntimeError("TrainerRank.setup() has not run on this rank")

    # ------------------------------------------------------------------ helpers

    def _plans(self, trajectories: list[Trajectory]) -> tuple[list[list[int]], int]:
        """This rank's micro-batches and the most any rank has (all must run that many passes)."""
        plans = plan_micro_batches([t.total_len for t in trajectories], self.config.micro_batch_tokens)
        return plans, int(all_reduce_scalar(len(plans), "max", self.device))

    def _loss_tokens(self, trajectories: list[Trajectory]) -> float:
        return all_reduce_scalar(sum(int(t.response_mask().sum()) for t in trajectories), "sum", self.device)

    def _per_token(self, mb: MicroBatch, trajectories: list[Trajectory], attr: str) -> torch.Tensor:
        rows = [trajectories[i] for i in mb.indices]
        if attr == "advantage":
            values = [torch.full((t.response_len,), float(t.advantage)) for t in rows]
        elif attr == "mask":
            values = [t.response_mask() for t in rows]
        else:
            values = [getattr(t, attr) for t in rows]
        return torch.cat(values).to(self.device)

    def _alpha(self, report: AlphaReport, mb: MicroBatch, trajectories, top_ids, top_lp, out=None) -> None:
        for i, ids, lp in zip(mb.indices, _split(top_ids, mb.response_lens), _split(top_lp, mb.response_lens)):
            bounds = add_trajectory_alpha(report, trajectories[i], ids, lp, self.bins)
            if out is not None:
                out["alpha_lower"][i], out["alpha_upper"][i] = bounds if bounds is not None else (None, None)

    def _global_alpha(self, report: AlphaReport) -> AlphaReport:
        merged = AlphaReport(report.num_length_bins)
        for part in all_gather_objects(report):
            merged = merged.merge(part)
        return merged

    # ------------------------------------------------------------------ dense recompute

    @torch.no_grad()
    def recompute(self, batch: TrajectoryBatch) -> RecomputeResult:
        """Dense log-prob, entropy and top-k of every response token, and α against the rollout's top-k."""
        self._require_setup()
        start = time.perf_counter()
        trajectories = list(batch)
        for i, t in enumerate(trajectories):
            t.validate(f"trajectory {i}", self.vocab_size)
        self.engine.module.eval()
        n = len(trajectories)
        out = {k: [None] * n for k in ("logprobs", "entropy", "top_ids", "top_logprobs", "alpha_lower", "alpha_upper")}
        report = AlphaReport(self.bins.num_bins)
        plans, passes = self._plans(trajectories)
        for j in range(passes):
            if j >= len(plans):
                with self.forward.adapter(False):
                    self.forward.dummy_loss()
                continue
            mb = collate(trajectories, plans[j], pad_id=0)
            with self.forward.adapter(False):
                stats = self.forward.stats(mb)
            for name in ("logprobs", "entropy", "top_ids", "top_logprobs"):
                for i, v in zip(mb.indices, _split(getattr(stats, name).cpu(), mb.response_lens)):
                    out[name][i] = v
            self._alpha(report, mb, trajectories, stats.top_ids, stats.top_logprobs, out)
        tokens = all_reduce_scalar(sum(t.total_len for t in trajectories), "sum", self.device)
        seconds = time.perf_counter() - start
        return RecomputeResult(
            **out,
            alpha=self._global_alpha(report),
            metrics={"recompute/tokens": tokens, "recompute/seconds": seconds, "recompute/tokens_per_s": tokens / seconds},
        )

    # ------------------------------------------------------------------ policy update

    def train_step(self, batch: TrajectoryBatch, return_gradients: bool = False) -> StepResult:
        """One GRPO update of the dense policy on this rank's shard (advantages already set).

        On-policy (1 mini-batch, 1 epoch) π_old is the same forward, detached; otherwise a dense
        recompute gives π_old first. With DistillSparse on, the LoRA distillation follows the update,
        with π_old's log-probs as its KL target. α is measured against π_old either way.
        """
        self._require_setup()
        cfg = self.config.loss
        start = time.perf_counter()
        if len(batch):
            batch.validate(self.vocab_size, need_advantages=True)
        trajectories = list(batch)
        exact, exact_seconds = None, 0.0
        if self.config.exact_alpha and self.schedule is not None:
            exact = self.measure_sparse_alpha(batch)
            exact_seconds = time.perf_counter() - start
        if cfg.on_policy:
            old, report = [None] * len(trajectories), AlphaReport(self.bins.num_bins)
        else:
            pre = self.recompute(batch)
            old, report = pre.logprobs, pre.alpha
        sums = dict.fromkeys(LOSS_SUM_KEYS + (("ref_kl",) if self.ref_forward else ()), 0.0)
        maxes = {"abs_log_ratio": 0.0}
        gradients, norm = None, None
        skipped_before = self.engine.skipped_steps  # DeepSpeed drops an update whose gradients are not finite
        parts = _index_parts(len(trajectories), cfg.mini_batches)
        for epoch in range(cfg.epochs):
            for k, part in enumerate(parts):
                dense = self._update(
                    [trajectories[i] for i in part], [old[i] for i in part], sums, maxes, report if cfg.on_policy else None
                )
                if cfg.on_policy:
                    old = dense
                if return_gradients and epoch == cfg.epochs - 1 and k == len(parts) - 1:
                    gradients = self._full_gradients()
                self.engine.step()
                norm = self.engine.get_global_grad_norm()
        self.step_count += 1
        metrics = self._step_metrics(sums, maxes, norm, start)
        metrics["train/skipped_updates"] = float(self.engine.skipped_steps - skipped_before)
        if self.config.distill_sparse.enabled:
            metrics.update(self.distill_step(batch, old))
        alpha = self._global_alpha(report) if cfg.on_policy else report
        metrics["train/alpha_nonfinite_tokens"] = float(alpha.nonfinite)
        if exact is not None:
            metrics["train/alpha_exact_seconds"] = exact_seconds
            metrics["train/alpha_exact_unmeasured_tokens"] = float(exact.unmeasured)
        return StepResult(metrics=metrics, alpha=alpha, gradients=gradients, alpha_exact=exact)

    def _update(self, members: list[Trajectory], old: list, sums: dict, maxes: dict, report: AlphaReport | None) -> list:
        """Forward/backward over one mini-batch's micro-batches, up to the accumulation boundary.

        `old[i]` None means on-policy (π_old = this forward, detached). Adds this rank's loss sums
        and maxima into `sums`/`maxes` and returns the π_old log-probs per trajectory.
        """
        self.engine.module.train()
        normalizer = self._loss_tokens(members)
        plans, passes = self._plans(members)
        dense_old: list[torch.Tensor | None] = [None] * len(members)
        for j in range(passes):
            self.engine.set_gradient_accumulation_boundary(j == passes - 1)
            if j >= len(plans) or normalizer == 0:
                if self.ref_forward is not None:
                    with torch.no_grad():
                        self.ref_forward.dummy_loss()
                with self.forward.adapter(False):
                    self.engine.backward(self.forward.dummy_loss())
                continue
            mb = collate(members, plans[j], pad_id=0)
            ref = None
            if self.ref_forward is not None:
                with torch.no_grad():
                    ref = self.ref_forward.stats(mb).logprobs
            with self.forward.adapter(False):
                stats = self.forward.stats(mb)
                logp = stats.logprobs
                if old[mb.indices[0]] is None:
                    old_lp = logp.detach()
                else:
                    old_lp = torch.cat([old[i] for i in mb.indices]).to(self.device)
                mask = self._per_token(mb, members, "mask")
                out = policy_loss(
                    logp, old_lp, self._per_token(mb, members, "rollout_logprobs"),
                    self._per_token(mb, members, "advantage"), mask, self.config.loss, normalizer, ref,
                )
                # DeepSpeed averages gradients over ranks; the loss is already a share of the global token mean.
                self.engine.backward(out.loss * self.world_size)
            for key, v in out.sums.items():
                sums[key] += float(v)
            for key, v in out.maxes.items():
                maxes[key] = max(maxes[key], float(v))
            sums["entropy"] += float((stats.entropy * mask).sum())
            sums["tokens_total"] += float(sum(members[i].total_len for i in mb.indices))
            for i, lp in zip(mb.indices, _split(old_lp.cpu(), mb.response_lens)):
                dense_old[i] = lp
            if report is not None:
                self._alpha(report, mb, members, stats.top_ids, stats.top_logprobs)
        return dense_old

    def _full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        grads = {}
        for name, p in self.exporter.params.items():
            g = safe_get_full_grad(p)
            if g is not None:
                grads[name] = g.detach().float().cpu().clone()
        return grads

    def _step_metrics(self, sums: dict, maxes: dict, grad_norm, start: float) -> dict[str, float]:
        total = all_reduce_dict(sums, "sum", self.device)
        peak = all_reduce_dict(maxes, "max", self.device)
        n = max(total["tokens"], 1.0)
        seconds = time.perf_counter() - start
        metrics = {
            "train/loss_tokens": total["tokens"],
            "train/tokens": total["tokens_total"],
            "train/seconds": seconds,
            "train/tokens_per_s": total["tokens_total"] / seconds,
            "train/pg_loss": total["pg_loss"] / n,
            "train/clip_fraction": total["clipped"] / n,
            "train/dual_clip_fraction": total["dual_clipped"] / n,
            "train/tis_capped_fraction": total["tis_capped"] / n,
            "train/band_masked_fraction": total["band_masked"] / n,
            "train/abs_log_ratio_mean": total["abs_log_ratio"] / n,
            "train/abs_log_ratio_max": peak["abs_log_ratio"],
            "train/ppo_kl": total["ppo_kl"] / n,
            "train/entropy": total["entropy"] / n,
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/lr": float(self.scheduler.get_last_lr()[0]),
            "train/step": float(self.step_count),
        }
        if "ref_kl" in total:
            metrics["train/ref_kl"] = total["ref_kl"] / n
        return metrics

    # ------------------------------------------------------------------ DistillSparse

    def _sparse_forward(self, mb: MicroBatch, schedules: list[SparsitySchedule] | None = None) -> sparse_attention.SparseForward:
        """The sparse forward of a micro-batch under the schedule in force, or one schedule per row."""
        budgets = sparse_attention.query_budgets(mb.prompt_lens, mb.input_ids.shape[1], schedules or self.schedule)
        lengths = [p + r for p, r in zip(mb.prompt_lens, mb.response_lens)]
        return sparse_attention.SparseForward.of(self.config.distill_sparse.layout_for(self.schedule), budgets, lengths,
                                                 self.device, self.config.kv_cache_dtype)

    def distill_step(self, batch: TrajectoryBatch, dense_logprobs: list[torch.Tensor]) -> dict[str, float]:
        """One LoRA update through the sparse forward (adapter on, base frozen).

        loss = [PPO on the sparse log-probs, on-policy] + λ·k3(sparse+LoRA ‖ dense) at the sampled
        tokens, token mean over all ranks; `dense_logprobs` (per trajectory) is the KL target.
        """
        self._require_setup()
        cfg = self.config.distill_sparse
        if not cfg.enabled:
            raise RuntimeError("distill_step needs distill_sparse.enabled=true in the TrainerConfig")
        if self.schedule is None:
            raise ValueError("distill_step needs a sparsity schedule (TrainerConfig.schedule or set_schedule); none is set")
        start = time.perf_counter()
        trajectories = list(batch)
        if len(dense_logprobs) != len(trajectories):
            raise ValueError(f"{len(dense_logprobs)} dense log-prob tensors for {len(trajectories)} trajectories")
        base = [p for p in self.exporter.params.values()]
        for p in base:
            p.requires_grad_(False)
        for p in self.lora_params:
            p.requires_grad_(True)
        self.engine.module.train()
        sums = {"tokens": 0.0, "kl": 0.0, "pg": 0.0, "abs_log_ratio": 0.0}
        try:
            normalizer = self._loss_tokens(trajectories)
            for plan in plan_micro_batches([t.total_len for t in trajectories], self.config.micro_batch_tokens):
                mb = collate(trajectories, plan, pad_id=0)
                with self.lora_forward.adapter(True):
                    logq = self.lora_forward.stats(mb, self._sparse_forward(mb)).logprobs
                mask = self._per_token(mb, trajectories, "mask").float()
                dense = torch.cat([dense_logprobs[i] for i in mb.indices]).to(self.device)
                kl = k3_kl(logq, dense)
                loss = cfg.kl_coef * (kl * mask).sum()
                if cfg.policy_loss:
                    adv = self._per_token(mb, trajectories, "advantage")
                    lc = self.config.loss
                    pg, _, _ = ppo_clip_loss(logq, logq.detach(), adv, lc.clip_eps_low, lc.clip_eps_high, lc.dual_clip)
                    weight, _, _ = rollout_correction(logq, self._per_token(mb, trajectories, "rollout_logprobs"), cfg.tis_cap, None)
                    pg = pg * weight * mask
                    loss = loss + pg.sum()
                    sums["pg"] += float(pg.detach().sum())
                (loss / normalizer).backward()
                sums["tokens"] += float(mask.sum())
                sums["kl"] += float((kl.detach() * mask).sum())
                sums["abs_log_ratio"] += float(((logq.detach() - dense).abs() * mask).sum())
            all_reduce_grads(self.lora_params)
            clip = self.config.optimizer.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(self.lora_params, clip if clip is not None else float("inf"))
            self.lora_optimizer.step()
            self.lora_scheduler.step()
        finally:
            self.lora_optimizer.zero_grad(set_to_none=True)
            for p in self.lora_params:
                p.requires_grad_(False)
            for p in base:
                p.requires_grad_(True)
        total = all_reduce_dict(sums, "sum", self.device)
        n = max(total["tokens"], 1.0)
        return {
            "distill/kl": total["kl"] / n,
            "distill/pg_loss": total["pg"] / n,
            "distill/abs_log_ratio_mean": total["abs_log_ratio"] / n,
            "distill/grad_norm": float(norm),
            "distill/lr": float(self.lora_scheduler.get_last_lr()[0]),
            "distill/seconds": time.perf_counter() - start,
        }

    @torch.no_grad()
    def measure_sparse_alpha(self, batch: TrajectoryBatch) -> AlphaReport:
        """Exact α between the dense policy and the trainer's sparse (+LoRA) forward, per length bin.

        Full-vocabulary distributions on both sides, so lower = upper. Each trajectory runs under the schedule it
        was decoded with (`schedule_version`; the one in force when it has none) and is keyed by that version; one
        whose version this rank no longer knows is counted in `unmeasured`. Costs one dense and one sparse forward
        per micro-batch.
        """
        self._require_setup()
        if self.schedule is None:
            raise ValueError("measure_sparse_alpha needs a sparsity schedule; none is set")
        known = [(t, self._rollout_schedule(t)) for t in batch]
        trajectories = [t for t, s in known if s is not None]
        schedules = [s for _, s in known if s is not None]
        self.engine.module.eval()
        report = AlphaReport(self.bins.num_bins, unmeasured=sum(t.response_len for t, s in known if s is None))
        chunk = self.config.logprob_chunk_tokens
        for plan in plan_micro_batches([t.total_len for t in trajectories], self.config.micro_batch_tokens):
            mb = collate(trajectories, plan, pad_id=0)
            with self.forward.adapter(False):
                dense_h = self.forward.hidden(mb)
            with self.forward.adapter(True):
                sparse_h = self.forward.hidden(mb, self._sparse_forward(mb, [schedules[i] for i in mb.indices]))
            alpha = torch.cat([
                acceptance_exact(
                    self.forward.module.full_logprobs(dense_h[s : s + chunk]), self.forward.module.full_logprobs(sparse_h[s : s + chunk])
                )
                for s in range(0, dense_h.shape[0], chunk)
            ]).cpu()
            for i, a in zip(mb.indices, _split(alpha, mb.response_lens)):
                t = trajectories[i]
                keep = t.response_mask()
                bins = self.bins.bins_for_lengths(token_context_lengths(t.prompt_len, t.response_len))
                report.add(schedules[i].version, a[keep], a[keep], bins[keep])
        return self._global_alpha(report)

    def _rollout_schedule(self, trajectory: Trajectory) -> SparsitySchedule | None:
        """The schedule `trajectory` was decoded with: by its version, the one in force if it has none."""
        if trajectory.schedule_version < 0:
            return self.schedule
        return self.known_schedules.get(trajectory.schedule_version)

    # ------------------------------------------------------------------ weight publishing

    def init_weight_group(self, host: str, port: int, world_size: int, backend: str | None = None) -> None:
        """Rank 0 joins a broadcast group as its rank 0 (rollout workers are ranks 1..world_size-1).

        Blocks until every member has joined: start the workers' `CollectiveGroup(...)` concurrently.
        """
        if self.rank != 0:
            return
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.weight_group is not None:  # re-formed (a worker joined, left or was replaced): leave the old one
            self.weight_group.close()
            self.weight_group = None
        self.weight_group = CollectiveGroup(
            host, port, 0, world_size, backend=backend, device=self.device, timeout_s=self.config.publish.timeout_s
        )

    def weights_finite(self) -> bool:
        """True when no rank holds a NaN/Inf weight (each checks its own ZeRO-3 partition); collective."""
        local = all(all_finite(p.ds_tensor if hasattr(p, "ds_tensor") else p.data)
                    for p in self.exporter.params.values())
        return all_reduce_scalar(float(not local), "max", self.device) == 0.0

    def publish_weights(self, version: int, channel: str = "collective") -> PublishReport | None:
        """Send the full policy (LoRA merged when DistillSparse is on) as `version`; call on all ranks.

        channel "collective": broadcast over the weight group (workers call `receive` concurrently);
        "object_store": buckets go to Ray's object store and rank 0's report carries the handle.
        Returns the report on rank 0 (None elsewhere); its `seconds` is the publication time.
        """
        self._require_setup()
        if channel not in ("collective", "object_store"):
            raise ValueError(f"channel={channel!r}: use 'collective' or 'object_store'")
        if not self.weights_finite():
            refused = f"version {version} holds NaN/Inf weights; not sent (the rollout pool keeps its version)"
            return PublishReport(version, 0, 0, 0, 0.0, refused=refused) if self.rank == 0 else None
        sender = None
        if self.rank == 0:
            if channel == "collective":
                if self.weight_group is None:
                    raise RuntimeError("publish_weights(channel='collective') before init_weight_group()")
                sender = CollectiveSender(self.weight_group)
            else:
                sender = ObjectStoreSender()
        bucket_bytes = int(self.config.publish.bucket_mb * 2**20)
        manifest = Manifest(version, plan_buckets(self.exporter.specs(), bucket_bytes))
        merge = self.config.distill_sparse.enabled
        report = send_buckets(manifest, lambda b: self.exporter.tensors([e.name for e in b.entries], merge), sender)
        return report if self.rank == 0 else None

    # ------------------------------------------------------------------ checkpoints and export

    def save_checkpoint(self, directory: str, tag: str | None = None) -> str:
        """DeepSpeed checkpoint (model, optimizer, LR schedule, ZeRO partitions) plus the LoRA optimizer."""
        self._require_setup()
        tag = tag or f"step{self.step_count}"
        self.engine.save_checkpoint(directory, tag=tag, client_state={"step_count": self.step_count})
        if self.config.distill_sparse.enabled and self.rank == 0:
            torch.save(
                {"optimizer": self.lora_optimizer.state_dict(), "scheduler": self.lora_scheduler.state_dict()},
                Path(directory) / tag / LORA_OPTIMIZER_FILE,
            )
        return tag

    def load_checkpoint(self, directory: str, tag: str | None = None) -> dict:
        """Resume from `save_checkpoint` (tag None = the latest one DeepSpeed recorded), saved by this many
        ranks or another (then through DeepSpeed's universal checkpoint, `checkpoint.py`); collective."""
        self._require_setup()
        latest = Path(directory) / "latest"
        if tag is None and not latest.is_file():
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory!r} (no 'latest' file); give a tag")
        tag = tag or latest.read_text().strip()
        path = Path(directory) / tag
        if not path.is_dir():
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory!r}")
        saved = model_states(path)
        saved_ranks = int(saved["dp_world_size"])
        resized = saved_ranks != self.world_size
        if resized:
            self._convert_once(path, saved_ranks)
            _, client = load_universal(self.engine, path)
        else:
            _, client = self.engine.load_checkpoint(directory, tag=tag)
        self.step_count = int(client.get("step_count", 0))
        if self.config.distill_sparse.enabled:
            if resized:  # the universal load restores what DeepSpeed optimises; the adapter is outside it
                params = dict(self.engine.module.named_parameters())
                for name, t in saved["module"].items():
                    if is_lora_param(name):
                        params[name].data.copy_(t)
            state = torch.load(path / LORA_OPTIMIZER_FILE)
            self.lora_optimizer.load_state_dict(state["optimizer"])
            self.lora_scheduler.load_state_dict(state["scheduler"])
        return {"tag": tag, "step_count": self.step_count}

    def _convert_once(self, path: Path, saved_ranks: int) -> None:
        """Rank 0 converts; every rank waits for it and raises its error (a collective, so none hangs)."""
        error = None
        if self.rank == 0:
            try:
                convert_to_universal(path, saved_ranks, self.world_size)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
                error = e
        message = all_gather_objects(None if error is None else str(error))[0]
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(message)

    def export_hf(self, directory: str, replace: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> dict:
        """The dense policy as an HF directory (`hf_export.write_hf_dir`: sharded safetensors, config,
        generation config, tokenizer; with DistillSparse the adapter, unmerged, under `sparse_lora/`).

        Collective under ZeRO-3 (every rank gathers, bucket by bucket as `publish_weights` does);
        rank 0 holds the full policy in CPU memory and writes. Returns what was written on rank 0.
        """
        self._require_setup()
        state = {}
        buckets = plan_buckets(self.exporter.specs(), int(self.config.publish.bucket_mb * 2**20))
        for bucket in buckets:
            with self.exporter.tensors([e.name for e in bucket.entries], merge_lora=False) as tensors:
                if self.rank == 0:
                    state.update({n: t.detach().cpu().clone() for n, t in tensors.items()})
        if self.rank != 0:
            return {}
        start = time.perf_counter()
        adapter = None
        if self.config.distill_sparse.enabled:
            adapter = {n: t.detach().cpu().clone() for n, t in adapter_state(self.engine.module.named_parameters()).items()}
        written = write_hf_dir(state, self.config.model, directory, adapter, self.config.distill_sparse, replace, max_shard_size)
        return {**written, "seconds": time.perf_counter() - start}
