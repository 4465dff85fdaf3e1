"""`TrainerRank`: one DeepSpeed rank of the dense-policy trainer (a plain class; wrap it in `ray.remote`).

Life cycle: `TrainerRank(config, rank, world_size)` → `setup(master_addr, master_port)` on every rank
→ `train_step` / `recompute` / `publish_weights` / checkpoints, called on all ranks with their shard of
the batch (`TrainerGroup` does the fan-out). Every call that touches the model is collective: all
ranks must make it, in the same order. The class holds the rank's state and composes the pieces, each in
its own module: `policy` (set-up), `recompute`, `update`, `distill`, `exact_alpha`, `publish`, `offload`,
`checkpoint`, `hf_export`.
"""

import socket
import time

import torch

from sparrow.schedule import SparsitySchedule
from sparrow.weight_sync import current_gpu
from sparrow.weight_sync.send import PublishReport

from . import checkpoint, offload
from .alpha import AlphaReport
from .batch import TrajectoryBatch
from .config import TrainerConfig
from .distill import distill_step
from .exact_alpha import measure_sparse_alpha
from .hf_export import DEFAULT_MAX_SHARD_SIZE, export_live
from .policy import Policy, build_policy, join_process_group
from .publish import WeightPublisher
from .recompute import recompute
from .results import RecomputeResult, StepResult
from .schedules import KnownSchedules
from .update import update_policy


class TrainerRank:
    def __init__(self, config: TrainerConfig | dict, rank: int = 0, world_size: int = 1):
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig.model_validate(config)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: must be in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size
        self.step_count = 0
        self.schedules = KnownSchedules()
        self.policy: Policy | None = None
        self.publisher: WeightPublisher | None = None

    # ------------------------------------------------------------------ set-up and state

    def address(self) -> tuple[str, int]:
        """This host's address and a free port (for rank 0's rendezvous or a weight group)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str = "127.0.0.1", master_port: int = 29500) -> dict:
        device = join_process_group(self.config, self.rank, self.world_size, master_addr, master_port)
        self.set_schedule(self.config.schedule or None)
        policy = self.policy = build_policy(self.config, device)
        merge_lora = self.config.distill_sparse.enabled
        self.publisher = WeightPublisher(self.rank, policy.exporter, self.config.publish, merge_lora, device)
        parameters = sum(p.numel() for p in policy.base_params)
        gpu = current_gpu() if device.type == "cuda" else None
        return {"rank": self.rank, "device": str(device), "gpu": gpu, "dtype": str(policy.dtype), "parameters": parameters}

    def set_schedule(self, schedule: SparsitySchedule | dict | str | None) -> None:
        """The schedule in force: α length bins and DistillSparse budgets (None = dense)."""
        self.schedules.set(schedule)

    @property
    def bins(self) -> SparsitySchedule:
        return self.schedules.bins

    @property
    def engine(self):
        """The DeepSpeed engine (None before `setup`)."""
        return self.policy.engine if self.policy else None

    @property
    def device(self) -> torch.device:
        return self._policy().device

    @property
    def vocab_size(self) -> int:
        return self._policy().vocab_size

    @property
    def weight_group(self):
        """The weight broadcast group rank 0 is in (`init_weight_group`), or None."""
        return self.publisher.group if self.publisher else None

    def _policy(self) -> Policy:
        if self.policy is None:
            raise RuntimeError("TrainerRank.setup() has not run on this rank")
        return self.policy

    def _publisher(self) -> WeightPublisher:
        self._policy()  # raises before set-up
        return self.publisher

    # ------------------------------------------------------------------ steps

    def recompute(self, batch: TrajectoryBatch) -> RecomputeResult:
        """Dense log-prob, entropy and top-k of every response token, and α against the rollout's top-k."""
        return recompute(self._policy(), self.config, self.bins, batch)

    def train_step(self, batch: TrajectoryBatch, return_gradients: bool = False) -> StepResult:
        """One GRPO update on this rank's shard (advantages set): exact α first when on, then the update (α against
        π_old), then DistillSparse when on, with π_old's log-probs as its KL target."""
        policy = self._policy()
        start = time.perf_counter()
        if len(batch):
            batch.validate(policy.vocab_size, need_advantages=True)
        exact, exact_seconds = None, 0.0
        if self.config.exact_alpha and self.schedules.in_force is not None:
            exact = self.measure_sparse_alpha(batch)
            exact_seconds = time.perf_counter() - start
        update = update_policy(policy, self.config, self.bins, batch, world_size=self.world_size,
                               step=self.step_count + 1, start=start, return_gradients=return_gradients)
        self.step_count += 1
        metrics = update.metrics
        if self.config.distill_sparse.enabled:
            metrics.update(self.distill_step(batch, update.old_logprobs))
        metrics["train/alpha_nonfinite_tokens"] = float(update.alpha.nonfinite)
        if exact is not None:
            metrics["train/alpha_exact_seconds"] = exact_seconds
            metrics["train/alpha_exact_unmeasured_tokens"] = float(exact.unmeasured)
        return StepResult(metrics=metrics, alpha=update.alpha, gradients=update.gradients, alpha_exact=exact)

    def distill_step(self, batch: TrajectoryBatch, dense_logprobs: list[torch.Tensor]) -> dict[str, float]:
        """One LoRA update through the sparse forward (adapter on, base frozen) under the schedule in force."""
        return distill_step(self._policy(), self.config, self.schedules.in_force, batch, dense_logprobs)

    def measure_sparse_alpha(self, batch: TrajectoryBatch) -> AlphaReport:
        """Exact α between the dense policy and the trainer's sparse (+LoRA) forward, per length bin, each
        trajectory under the schedule it was decoded with."""
        return measure_sparse_alpha(self._policy(), self.config, self.schedules, batch)

    # ------------------------------------------------------------------ weight publishing

    def init_weight_group(self, host: str, port: int, world_size: int, backend: str | None = None) -> None:
        """Rank 0 joins a broadcast group as its rank 0 (rollout workers are ranks 1..world_size-1); blocks until
        every member has joined: start the workers' `CollectiveGroup(...)` concurrently."""
        self._publisher().join_group(host, port, world_size, backend)

    def weights_finite(self) -> bool:
        """True when no rank holds a NaN/Inf weight (each checks its own ZeRO-3 partition); collective."""
        return self._publisher().weights_finite()

    def publish_weights(self, version: int, channel: str = "collective") -> PublishReport | None:
        """Send the full policy (LoRA merged when DistillSparse is on) as `version`; call on all ranks. "collective":
        over the weight group (workers `receive` concurrently); "object_store": rank 0's report carries the handle;
        "shared": every rank packs its own shared buffers and its report carries their handle (for the worker on
        its GPU). Rank 0 gets the report (every rank on "shared"; None elsewhere); its `seconds` is the time to
        publish, the finiteness check included."""
        return self._publisher().publish(version, channel)

    def close_publication(self) -> None:
        """Release this rank's shared weight buffers (the "shared" channel's)."""
        if self.publisher is not None:
            self.publisher.close()

    # ------------------------------------------------------------------ time-sharing a GPU (colocated placement)

    def offload_states(self) -> dict[str, float]:
        """Optimizer states, master weights, gradients and weights to host memory while an engine uses the GPU."""
        return offload.offload_states(self._policy())

    def reload_states(self) -> dict[str, float]:
        """Back on the GPU for the next update."""
        return offload.reload_states(self._policy())

    # ------------------------------------------------------------------ checkpoints and export

    def save_checkpoint(self, directory: str, tag: str | None = None) -> str:
        """DeepSpeed checkpoint (model, optimizer, LR schedule, ZeRO partitions) plus the LoRA optimizer."""
        tag = tag or f"step{self.step_count}"
        checkpoint.save(self._policy(), directory, tag, self.step_count, self.rank)
        return tag

    def load_checkpoint(self, directory: str, tag: str | None = None) -> dict:
        """Resume from `save_checkpoint` (tag None = the latest one DeepSpeed recorded), saved by this many
        ranks or another (then through DeepSpeed's universal checkpoint, `checkpoint.py`); collective."""
        tag, self.step_count = checkpoint.load(self._policy(), directory, tag, self.rank, self.world_size)
        return {"tag": tag, "step_count": self.step_count}

    def export_hf(self, directory: str, replace: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> dict:
        """The dense policy as an HF directory (`hf_export.export_live`: sharded safetensors, config, generation
        config, tokenizer; with DistillSparse the adapter, unmerged, under `sparse_lora/`). Collective under
        ZeRO-3; returns what was written on rank 0."""
        return export_live(self._policy(), self.config, self.rank, directory, replace, max_shard_size)
