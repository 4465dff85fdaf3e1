"""Schedule-aware decode cost of a rollout, summed exactly over its decode steps.

A rollout of `gen_len` tokens runs one decode step per token, at total lengths
L = prompt_len + 1 … prompt_len + gen_len (L counts the token being decoded, as the schedule does).
All `batch × samples` sequences advance in lockstep. Per step, in physical units:

  weights    2·P FLOPs per sequence; P·weight_bytes bytes once per step (shared by the batch)
  dense layer     (first `dense_layers`, and every layer while the context fits the budget)
             K/V of all L tokens: L · 2·H_kv·d · kv_bytes bytes, 4·H_q·d·L FLOPs (QK and PV)
  sparse layer    (budget b blocks from the schedule at L, ceil(L/bs) > b)
             K/V of the b attended blocks, the last one partial: L − (ceil(L/bs) − b)·bs tokens
             + scoring pass over the c = ceil(L/bs) − sink − recent candidate blocks, per KV head:
               one landmark (d, or 2d for min/max, of kv_bytes each; mean_int8: d + 4 bytes) read and
               scored (2·width FLOPs), and its
               score written and read back (`score_bytes`)

eFLOPs = FLOPs + I·bytes (I = FLOP/s ÷ bytes/s); predicted seconds = max(FLOPs / FLOP/s,
bytes / bytes/s) per step (roofline: decode kernels overlap compute and memory; the eFLOPs sum
divided by peak FLOP/s is the no-overlap upper bound). Ignored: prefill, KV and landmark writes of
the new token, activations, norms, sampling, launch overheads, prefix sharing between samples, and
the fact that real rollouts finish at different lengths.
"""

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from sparrow.layout import LandmarkMode, SparseAttentionConfig
from sparrow.schedule import SparsitySchedule

from .hardware import Hardware
from .shapes import ModelShape


class RolloutSpec(BaseModel):
    """Geometry of the rollout being costed, and the byte widths of what decode reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_len: int = Field(256, ge=0, description="prompt tokens before the first decode step")
    gen_len: int = Field(32000, ge=1, description="generated tokens = decode steps")
    samples: int = Field(8, ge=1, description="N: samples per prompt")
    batch: int = Field(1, ge=1, description="prompts decoded together (batch × samples sequences)")
    dense_layers: int = Field(2, ge=0, description="leading layers that always attend densely (Sparrow: 2)")
    landmark: LandmarkMode = Field("mean", description="block summary: mean key (Sparrow), Quest min/max, or the mean "
                                   "key in int8 with a float32 scale (mean_int8)")
    kv_bytes: int = Field(2, ge=1, description="bytes per K/V/landmark element (bf16: 2)")
    weight_bytes: int = Field(2, ge=1, description="bytes per weight (bf16: 2)")
    score_bytes: int = Field(8, ge=0, description="per (block, KV head): fp32 score written by scoring, read by top-k")

    @property
    def sequences(self) -> int:
        return self.batch * self.samples

    def lengths(self) -> np.ndarray:
        """Total length L at every decode step of the rollout."""
        return self.prompt_len + np.arange(1, self.gen_len + 1, dtype=np.int64)


def schedule_bins(schedule: SparsitySchedule, lengths: np.ndarray) -> np.ndarray:
    """Bin index per length, the vectorised `SparsitySchedule.bin_of`."""
    bs = schedule.block_size
    aligned = (np.asarray(lengths, dtype=np.int64) + bs - 1) // bs * bs
    return np.searchsorted(np.asarray(schedule.edges, dtype=np.int64), aligned, side="right")


@dataclass(frozen=True)
class StepCosts:
    """Per-decode-step cost arrays for the whole batch (all layers, all sequences)."""

    lengths: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    scoring_bytes: np.ndarray
    attended_tokens: np.ndarray
    """K/V tokens read per sequence in each sparse-capable layer (= L where dense)."""
    hardware: Hardware

    @property
    def eflops(self) -> np.ndarray:
        return self.flops + self.hardware.intensity * self.bytes

    @property
    def seconds(self) -> np.ndarray:
        return np.maximum(self.flops / self.hardware.flops, self.bytes / self.hardware.bandwidth)


@dataclass(frozen=True)
class RolloutCost:
    """Totals of a rollout's decode steps (the per-step arrays are in `steps`)."""

    steps: StepCosts

    @property
    def flops(self) -> float:
        return float(self.steps.flops.sum())

    @property
    def bytes(self) -> float:
        return float(self.steps.bytes.sum())

    @property
    def eflops(self) -> float:
        return float(self.steps.eflops.sum())

    @property
    def seconds(self) -> float:
        return float(self.steps.seconds.sum())

    def by_bin(self, schedule: SparsitySchedule, metric: str = "seconds") -> np.ndarray:
        """Sum of a per-step metric ('seconds', 'eflops', 'flops', 'bytes', 'steps') per bin of `schedule`."""
        bins = schedule_bins(schedule, self.steps.lengths)
        weights = np.ones(len(bins)) if metric == "steps" else getattr(self.steps, metric)
        return np.bincount(bins, weights=weights, minlength=schedule.num_bins)


@dataclass(frozen=True)
class Comparison:
    dense: RolloutCost
    sparse: RolloutCost

    @property
    def speedup_eflops(self) -> float:
        return self.dense.eflops / self.sparse.eflops

    @property
    def speedup_seconds(self) -> float:
        return self.dense.seconds / self.sparse.seconds


@dataclass(frozen=True)
class CostModel:
    """Decode cost of `shape` on `hardware` for rollouts shaped like `spec`."""

    shape: ModelShape
    hardware: Hardware
    spec: RolloutSpec = RolloutSpec()

    def __post_init__(self):
        if self.spec.dense_layers > self.shape.layers:
            raise ValueError(
                f"dense_layers={self.spec.dense_layers}: {self.shape.name} has only {self.shape.layers} layers"
            )

    def step_costs(self, schedule: SparsitySchedule | None, lengths: np.ndarray | None = None) -> StepCosts:
        """Cost of one decode step at each total length (default: the rollout's steps); dense when schedule is None."""
        s, spec = self.shape, self.spec
        L = spec.lengths() if lengths is None else np.asarray(lengths, dtype=np.int64)
        kv_token = 2 * s.kv_heads * s.head_dim * spec.kv_bytes
        attn_flops_token = 4 * s.q_heads * s.head_dim
        dense_bytes, dense_flops = L * float(kv_token), L * float(attn_flops_token)
        if schedule is None:
            tokens = L.astype(np.float64)
            scoring_bytes = scoring_flops = np.zeros(len(L))
        else:
            bs = schedule.block_size
            table = np.array([schedule.blocks_for_bin(i) or 0 for i in range(schedule.num_bins)], dtype=np.int64)
            dense_bin = np.array([schedule.blocks_for_bin(i) is None for i in range(schedule.num_bins)])
            bins = schedule_bins(schedule, L)
            blocks = (L + bs - 1) // bs
            budget = table[bins]
            sparse = ~dense_bin[bins] & (blocks > budget)
            tokens = np.where(sparse, L - (blocks - budget) * bs, L).astype(np.float64)
            candidates = np.where(sparse, blocks - schedule.sink - schedule.recent, 0).astype(np.float64)
            width = s.head_dim * (2 if spec.landmark == "minmax" else 1)
            lm_bytes = SparseAttentionConfig(landmark=spec.landmark).landmark_bytes(s.head_dim, spec.kv_bytes)
            scoring_bytes = candidates * s.kv_heads * (lm_bytes + spec.score_bytes)
            scoring_flops = candidates * s.kv_heads * 2 * width
        n_sparse = s.layers - spec.dense_layers
        per_seq_bytes = spec.dense_layers * dense_bytes + n_sparse * (tokens * kv_token + scoring_bytes)
        per_seq_flops = spec.dense_layers * dense_flops + n_sparse * (tokens * attn_flops_token + scoring_flops)
        seqs = spec.sequences
        return StepCosts(
            lengths=L,
            flops=2.0 * s.decode_params * seqs + seqs * per_seq_flops,
            bytes=float(s.decode_params * spec.weight_bytes) + seqs * per_seq_bytes,
            scoring_bytes=seqs * n_sparse * scoring_bytes,
            attended_tokens=tokens,
            hardware=self.hardware,
        )

    def rollout_cost(self, schedule: SparsitySchedule | None) -> RolloutCost:
        return RolloutCost(self.step_costs(schedule))

    def compare(self, schedule: SparsitySchedule) -> Comparison:
        return Comparison(dense=self.rollout_cost(None), sparse=self.rollout_cost(schedule))
