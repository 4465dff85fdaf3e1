"""The trainer's batch format: finished trajectories with the rollout's logprobs, independent of gRPC.

A `Trajectory` is one sample: prompt and response token ids, the rollout policy's log q of each sampled
token at the rollout temperature, optionally its top-k (ids, logprobs) per token, the reward and the
GRPO group. Tensors live on the CPU; the trainer collates them into padded micro-batches.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .advantages import grpo_advantages


@dataclass
class Trajectory:
    prompt_ids: torch.Tensor
    """`[P]` prompt token ids (P ≥ 1)."""
    response_ids: torch.Tensor
    """`[R]` generated token ids (R ≥ 1)."""
    rollout_logprobs: torch.Tensor
    """`[R]` log q(response_ids[t]) under the rollout policy at the rollout temperature."""
    reward: float = 0.0
    group_id: str = ""
    advantage: float | None = None
    """Set by `TrajectoryBatch.with_grpo_advantages` (or by the caller); the loss needs it."""
    top_ids: torch.Tensor | None = None
    """`[R, K]` the rollout's K most likely tokens per position (-1 = padding); needed for α."""
    top_logprobs: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None
    """`[R]` bool, tokens that enter the loss (e.g. False for tool output); None = all."""
    policy_version: int = 0
    schedule_version: int = -1
    """Version of the sparsity schedule the rollout used (-1 = dense); α is reported per version."""
    sample_id: str = ""

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def response_len(self) -> int:
        return int(self.response_ids.numel())

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.response_len

    def response_mask(self) -> torch.Tensor:
        return torch.ones(self.response_len, dtype=torch.bool) if self.loss_mask is None else self.loss_mask.bool()

    def validate(self, where: str, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the trajectory, the field and the problem."""
        if self.prompt_ids.dim() != 1 or self.prompt_len < 1:
            raise ValueError(f"{where}: prompt_ids must be a non-empty 1-D tensor, got shape {tuple(self.prompt_ids.shape)}")
        if self.response_ids.dim() != 1 or self.response_len < 1:
            raise ValueError(f"{where}: response_ids must be a non-empty 1-D tensor, got shape {tuple(self.response_ids.shape)}")
        for name in ("prompt_ids", "response_ids"):
            ids = getattr(self, name)
            if ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{where}: {name} has dtype {ids.dtype}; token ids must be int64 (or int32)")
            if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
                raise ValueError(
                    f"{where}: {name} holds ids in [{int(ids.min())}, {int(ids.max())}], outside the vocabulary [0, {vocab_size})"
                )
        R = self.response_len
        if tuple(self.rollout_logprobs.shape) != (R,):
            raise ValueError(f"{where}: rollout_logprobs has shape {tuple(self.rollout_logprobs.shape)}; expected ({R},)")
        if not torch.isfinite(self.rollout_logprobs).all() or bool((self.rollout_logprobs > 1e-4).any()):
            raise ValueError(f"{where}: rollout_logprobs must be finite and <= 0 (log-probabilities)")
        if (self.top_ids is None) != (self.top_logprobs is None):
            raise ValueError(f"{where}: give both top_ids and top_logprobs, or neither")
        if self.top_ids is not None:
            if self.top_ids.dim() != 2 or self.top_ids.shape[0] != R or self.top_logprobs.shape != self.top_ids.shape:
                raise ValueError(
                    f"{where}: top_ids {tuple(self.top_ids.shape)} and top_logprobs {tuple(self.top_logprobs.shape)} "
                    f"must both be [{R}, K]"
                )
        if self.loss_mask is not None and tuple(self.loss_mask.shape) != (R,):
            raise ValueError(f"{where}: loss_mask has shape {tuple(self.loss_mask.shape)}; expected ({R},)")
        if self.advantage is not None and not torch.isfinite(torch.tensor(float(self.advantage))):
            raise ValueError(f"{where}: advantage={self.advantage} is not finite")


@dataclass
class TrajectoryBatch:
    trajectories: list[Trajectory] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):
        return iter(self.trajectories)

    def __getitem__(self, i: int) -> Trajectory:
        return self.trajectories[i]

    @property
    def num_response_tokens(self) -> int:
        return sum(int(t.response_mask().sum()) for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(t.total_len for t in self.trajectories)

    def validate(self, vocab_size: int | None = None, need_advantages: bool = False) -> None:
        if not self.trajectories:
            raise ValueError("empty TrajectoryBatch: give at least one trajectory")
        for i, t in enumerate(self.trajectories):
            where = f"trajectory {i} ({t.sample_id or t.group_id or 'no id'})"
            t.validate(where, vocab_size)
            if need_advantages and t.advantage is None:
                raise ValueError(
                    f"{where}: advantage is None; call TrajectoryBatch.with_grpo_advantages() or set it"
                )

    def with_grpo_advantages(self, std_norm: bool = True, eps: float = 1e-6) -> "TrajectoryBatch":
        """A copy whose advantages are the group-normalised rewards (see `grpo_advantages`)."""
        rewards = torch.tensor([float(t.reward) for t in self.trajectories], dtype=torch.float64)
        adv = grpo_advantages(rewards, [t.group_id for t in self.trajectories], std_norm=std_norm, eps=eps)
        return TrajectoryBatch([replace(t, advantage=float(a)) for t, a in zip(self.trajectories, adv.tolist())])

    def shard(self, num_shards: int) -> list[tuple[list[int], "TrajectoryBatch"]]:
        """Split across ranks balancing total tokens (longest first, each to the lightest shard).

        Returns (original indices, shard) pairs; a shard may be empty when there are fewer
        trajectories than ranks.
        """
        if num_shards < 1:
            raise ValueError(f"num_shards={num_shards}: must be >= 1")
        order = sorted(range(len(self)), key=lambda i: -self.trajectories[i].total_len)
        loads, members = [0] * num_shards, [[] for _ in range(num_shards)]
        for i in order:
            s = min(range(num_shards), key=lambda j: (loads[j], len(members[j])))
            loads[s] += self.trajectories[i].total_len
            members[s].append(i)
        return [(sorted(m), TrajectoryBatch([self.trajectories[i] for i in sorted(m)])) for m in members]

    @classmethod
    def from_rollout_samples(
        cls,
        samples: Sequence,
        rewards: Sequence[float],
        group_ids: Sequence[str] | None = None,
    ) -> "TrajectoryBatch":
        """From `sparrow.rollout_workers.api.RolloutSample`s; the group defaults to the request id.

        Failed samples (finish_reason "error") are refused: the caller decides what to do with them.
        """
        if len(rewards) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(rewards)} rewards; give one reward per sample")
        if group_ids is not None and len(group_ids) != len(samples):
            raise ValueError(f"{len(samples)} samples but {len(group_ids)} group_ids")
        out = []
        for i, (s, r) in enumerate(zip(samples, rewards)):
            if s.finish_reason == "error":
                raise ValueError(f"sample {i} ({s.request_id}#{s.sample_index}) failed ({s.error}); drop it before training")
            has_top = s.top_ids.dim() == 2 and s.top_ids.shape[-1] > 0
            out.append(
                Trajectory(
                    prompt_ids=torch.as_tensor(list(s.prompt_token_ids), dtype=torch.long),
                    response_ids=s.token_ids.long(),
                    rollout_logprobs=s.logprobs.float(),
                    reward=float(r),
                    group_id=group_ids[i] if group_ids is not None else s.request_id,
                    top_ids=s.top_ids.long() if has_top else None,
                    top_logprobs=s.top_logprobs.float() if has_top else None,
                    policy_version=s.policy_version,
                    schedule_version=s.schedule_version,
                    sample_id=f"{s.request_id}#{s.sample_index}",
                )
            )
        return cls(out)
