"""`SparrowConfig`: the one typed configuration of a `sparrow train` job.

It composes the components' own config models (native / vLLM engine, trainer, controller, transport,
metrics) with the coordinator's sections (data, reward, rollout pool, trainer pool, run). Everything is
validated before anything starts: unknown keys and bad values fail with the dotted key path, the value
and the fix (`ConfigError`). Its defaults *are* the embedded default job (docs/coordinator.md).

    config = load_config("job.yaml", overrides=["run.steps=20", "trainer.optimizer.lr=1e-6"])
"""

import copy
import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sparrow.coordinator.controller import ControllerConfig
from sparrow.coordinator.metrics import MetricsConfig
from sparrow.coordinator.tasks import TASKS, ArithmeticConfig, LookupConfig, NeedleConfig
from sparrow.coordinator.transport import TransportConfig
from sparrow.rollout_workers import registry
from sparrow.rollout_workers.api import SamplingParams
from sparrow.rollout_workers.engine_settings import EngineSettings
from sparrow.schedule import SPARROW_EDGES, ScheduleError, SparsitySchedule, load_schedule
from sparrow.trainer import TrainerConfig, TrainerSettings

from .user_reward import load_user_function

BASE: dict = {"transport": {"port": 0}}
"""Under every config: a job's servers take free ports and tell the workers (TransportConfig's own default is 50051)."""

EMBEDDED: dict = {
    "data": {
        "source": "arithmetic",
        "arithmetic": {
            "min_value": 1, "max_value": 20, "terms": 2, "operations": ["+", "-"],
            "template": (
                "This is an exercise from a worksheet for practising mental arithmetic with whole numbers. Each "
                "exercise is one short expression with two numbers between 1 and 20, joined by a plus or a minus "
                "sign. Work it out carefully; negative results are allowed.\n\n"
                "Calculate {expression}. End your reply with the result as a number."
            ),
        },
    },
    "rollout": {
        "engine": "native",
        "pool": {"size": 1, "cpus": 1},
        "native": {"max_num_seqs": 32, "max_model_len": 512},
        "sampling": {"temperature": 0.7, "max_tokens": 96, "n": 4, "logprobs": 20},
        "speedup_probe_every": 2,
        "schedule": {
            "name": "smollm2-arith",
            "edges": [136, 168, 200],
            "topk_blocks": [3, 4, 5, 6],
            "notes": ["embedded default: bins L<=128, 129-160, 161-192, >=193 tokens; prompts are ~100 tokens "
                      "(7 blocks), so decode is sparse from the first generated token"],
        },
    },
    "trainer": {
        "pool": {"size": 1, "cpus": 1},
        "optimizer": {"lr": 1.0e-5, "weight_decay": 0.0},
        "gradient_checkpointing": False,
        "micro_batch_tokens": 4096,
    },
    "controller": {
        "ladder": [1, 2, 3, 4, 5, 6, 7, 8, 10, 12], "min_samples": 100, "window_steps": 2,
        "lower_patience": 2, "cooldown_steps": 2, "dense_retry_steps": 4,
    },
    "run": {"steps": 8, "prompts_per_step": 6, "mode": "async", "checkpoint_every": 0},
}
"""The embedded default job (no --config): SmolLM2-135M on the arithmetic task, sized for a 2-core CPU.
A config file starts from the components' defaults instead; deploy/configs/embedded.yaml is this job as a file."""


class ConfigError(ValueError):
    """A configuration problem: each line names the dotted key, the value and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PoolConfig(_Section):
    """One Ray pool: `size` actors, each in its own placement-group bundle."""

    size: int = Field(1, ge=1, description="actors in the pool (rollout workers / trainer ranks)")
    cpus: float = Field(1.0, ge=0, description="CPUs reserved per actor")
    gpus: float = Field(0.0, ge=0, description="GPUs per actor (rollout: per engine; trainer: 1 per rank)")
    threads: int | None = Field(None, ge=1, description="torch threads per actor; None = max(1, int(cpus))")
    node_label: str | None = Field(
        None, description="custom resource the pool's nodes declare (e.g. ray start --resources '{\"rollout_node\": 1}')"
    )
    label_amount: float = Field(0.001, gt=0, le=1, description="amount of node_label each bundle takes")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("PACK", description="placement strategy")
    ready_timeout_s: float = Field(300.0, gt=0, description="seconds to wait for the pool's placement group")

    def bundle(self) -> dict[str, float]:
        out = {"CPU": self.cpus}
        if self.gpus:
            out["GPU"] = self.gpus
        if self.node_label:
            out[self.node_label] = self.label_amount
        return out

    @property
    def torch_threads(self) -> int:
        return self.threads or max(1, int(self.cpus))


class SamplingConfig(_Section):
    temperature: float = Field(1.0, gt=0, description="rollout temperature (the trainer's log-probs use the same)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (logprobs stay those of the full distribution)")
    top_k: int = Field(0, ge=0, description="0 = off")
    max_tokens: int = Field(1024, ge=1, description="generated tokens per sample at most")
    n: int = Field(8, ge=1, description="samples per prompt (the GRPO group)")
    logprobs: int = Field(20, ge=0, le=64, description="top-K logprobs per token (needed for α; 0 = off)")
    ignore_eos: bool = Field(
        False, description="generate max_tokens every time, past the stop tokens: for benchmarks of fixed length "
        "(sparrow bench rl-step), never for training a policy",
    )


class RolloutConfig(_Section):
    """The rollout pool. Every backend registered in `sparrow.rollout_workers.registry` has a section named after it
    (`rollout.native`, `rollout.vllm`, ...), validated by the backend's own config class; `engine` picks the one the
    pool runs. A section given for another backend is validated too (a typo there is an error, not ignored)."""

    model_config = ConfigDict(extra="allow")

    engine: str = Field(registry.DEFAULT, description=f"rollout backend, a name in sparrow.rollout_workers.registry "
                        f"({', '.join(registry.names())})")
    pool: PoolConfig = Field(default_factory=PoolConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    schedule: str | dict[str, Any] = Field(
        "dense",
        description="initial schedule: 'dense', a published name, a schedule file, or an inline mapping",
    )
    speedup_probe_every: int = Field(
        0, ge=0, description="every N steps worker 0 also decodes its prompts densely (not trained on) to measure "
        "the speedup; 0 = off",
    )
    dense_bin_edges: list[int] | None = Field(
        None, description="bin edges (tokens) when schedule is 'dense'; None = Sparrow's 2000-token bins"
    )

    @classmethod
    def section_class(cls, key: str) -> type[BaseModel] | None:
        """The config class of the backend section `key` (None if no backend of that name is registered)."""
        return registry.config_class(key) if key in registry.names() else None

    @field_validator("engine")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in registry.names():
            raise ValueError(f"engine={value!r} is not a registered rollout backend; use one of "
                             f"{', '.join(registry.names())} (a backend registers with sparrow.rollout_workers.registry.register)")
        return value

    @model_validator(mode="after")
    def _backend_sections(self):
        """Each backend section as its own config class (the chosen engine's is always there, with its defaults)."""
        sections = self.__pydantic_extra__
        errors = []
        for key in sorted(set(sections) | {self.engine}):
            section_class = self.section_class(key)
            value = sections.get(key, {})
            if section_class is None:
                errors.append({"type": "extra_forbidden", "loc": (key,), "input": value})
                continue
            try:
                sections[key] = section_class.model_validate(value.model_dump() if isinstance(value, BaseModel) else value)
            except ValidationError as exc:
                errors += [{"type": e["type"], "loc": (key, *e["loc"]), "input": e["input"], "ctx": e.get("ctx", {})}
                           for e in exc.errors()]
        if errors:
            raise ValidationError.from_exception_data(type(self).__name__, errors)
        return self

    def sections(self) -> dict[str, EngineSettings]:
        """The backend sections of this config, by backend name."""
        return dict(self.__pydantic_extra__)

    def engine_config(self) -> EngineSettings:
        """The section of the backend the pool runs."""
        return self.__pydantic_extra__[self.engine]


class TrainerSection(TrainerSettings):
    """`TrainerSettings` (model optional: the top-level model by default) plus the pool it runs on."""

    model: str | None = Field(None, description="HF model directory; None = the top-level model")
    pool: PoolConfig = Field(default_factory=PoolConfig)

    @model_validator(mode="before")
    @classmethod
    def _pages_are_the_engines(cls, data):
        if isinstance(data, dict) and "kv_cache_dtype" in data:
            raise ValueError(f"kv_cache_dtype={data['kv_cache_dtype']!r}: the trainer's sparse forward reads K/V as the "
                             "rollout engines store them, so it is set once, with rollout.<engine>.kv_cache_dtype; remove it here")
        return data

    def trainer_config(self, model: str, kv_cache_dtype: str) -> TrainerConfig:
        """The trainer's own config; `temperature` was set to the rollout's when the job config was validated, and
        `kv_cache_dtype` is the rollout engine's."""
        data = self.model_dump(exclude={"pool"})
        data.update(model=self.model or model, kv_cache_dtype=kv_cache_dtype)
        return TrainerConfig.model_validate(data)


class ControllerSection(ControllerConfig):
    """`ControllerConfig` plus the switch; the initial schedule is `rollout.schedule` (or `calibration`)."""

    enabled: bool = Field(True, description="adjust the schedule between steps from the measured α tail")


class EvalConfig(_Section):
    """A held-out set, scored before the first step, every `every` steps and after the last (docs/coordinator.md)."""

    every: int = Field(0, ge=0, description="evaluate the policy every N steps (and before the first and after the "
                       "last); 0 = off")
    prompts: int = Field(32, ge=1, description="held-out prompts (the same ones every time)")
    samples: int = Field(1, ge=1, description="samples per prompt")
    decoding: Literal["greedy", "sampled"] = Field("greedy", description="greedy, or at the rollout temperature")
    modes: list[Literal["dense", "sparse"]] = Field(
        default_factory=lambda: ["dense", "sparse"], min_length=1,
        description="decode densely and/or under the schedule in force (sparse = what rollouts see)",
    )
    path: str | None = Field(
        None, description="eval prompts for a dataset source (same format and keys as data.path); the built-in "
        "tasks use their held-out split",
    )

    @model_validator(mode="after")
    def _modes(self):
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes={self.modes} lists a mode twice; list each of dense, sparse at most once")
        return self


class DataConfig(_Section):
    source: Literal["arithmetic", "lookup", "needle", "jsonl", "parquet", "hf"] = Field(
        "arithmetic", description="where prompts come from: a built-in task (docs/tasks.md) or a dataset"
    )
    path: str | None = Field(None, description="JSONL/Parquet file, or a dataset saved with datasets' save_to_disk")
    split: str = Field("train", description="split of an hf dataset")
    prompt_key: str = Field("prompt", description="column with the prompt text (or a list of chat messages)")
    answer_key: str = Field("answer", description="column with the reference answer")
    system_prompt: str | None = Field(None, description="system message prepended to every prompt")
    chat_template: bool = Field(True, description="apply the tokenizer's chat template")
    shuffle: bool = Field(True, description="reshuffle the dataset every epoch (seeded by run.seed)")
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    lookup: LookupConfig = Field(default_factory=LookupConfig)
    needle: NeedleConfig = Field(default_factory=NeedleConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation (off unless every > 0)")

    @model_validator(mode="after")
    def _path(self):
        if self.eval.every and self.source not in TASKS and not self.eval.path:
            raise ValueError(
                f"eval.every={self.eval.every} with source={self.source!r} needs eval.path (a file of held-out prompts "
                "with the same keys); only the built-in tasks have a held-out split of their own"
            )
        if self.eval.path and self.source in TASKS:
            raise ValueError(f"eval.path={self.eval.path!r}: source={self.source!r} holds out its own eval split; remove eval.path")
        if self.source in ("jsonl", "parquet", "hf") and not self.path:
            raise ValueError(f"source={self.source!r} needs path (the dataset file or directory)")
        if self.source in TASKS and self.path:
            raise ValueError(f"path={self.path!r} is set but source={self.source!r} generates its prompts; remove path or set source")
        return self


class RewardConfig(_Section):
    type: Literal["auto", "arithmetic", "math_verify"] = Field(
        "auto", description="auto = arithmetic (exact integer) for the built-in tasks, math_verify otherwise"
    )
    correct: float = Field(1.0, description="reward of a correct answer")
    incorrect: float = Field(0.0, description="reward of a wrong or missing answer")
    truncated: float | None = Field(None, description="reward of a sample cut at max_tokens; None = judge it like any other")
    function: str | None = Field(
        None, description='user reward "package.module:function", called as fn(text, answer, metadata) -> float '
        "(def or async def); replaces type/correct/incorrect",
    )
    timeout_s: float = Field(30.0, gt=0, description="reward.function: seconds a call may take before it scores on_error")
    on_error: float = Field(
        0.0, description="reward.function: reward of a call that raises, times out or returns a non-number / non-finite value"
    )

    @field_validator("function")
    @classmethod
    def _importable(cls, value):
        if value is not None:
            load_user_function(value)
        return value

    @model_validator(mode="after")
    def _function_settings(self):
        changed = {k for k, f in type(self).model_fields.items() if getattr(self, k) != f.default}  # a dump sets them all
        builtin = sorted({"type", "correct", "incorrect"} & changed)
        if self.function is not None and builtin:
            raise ValueError(
                f"function={self.function!r} computes the reward itself, so {'/'.join(builtin)} would be ignored; "
                "remove them (truncated and on_error still apply)"
            )
        hook = sorted({"timeout_s", "on_error"} & changed)
        if self.function is None and hook:
            raise ValueError(f"{'/'.join(hook)} apply to a reward function only; set function or remove them")
        return self

    def resolved(self, source: str) -> str:
        """The built-in check in use (`function` when reward.function is set)."""
        if self.function is not None:
            return "function"
        if self.type != "auto":
            return self.type
        return "arithmetic" if source in TASKS else "math_verify"


class RayConfig(_Section):
    address: str | None = Field(None, description="None = start a local Ray; 'auto' or host:port = join a cluster")
    num_cpus: int | None = Field(None, ge=1, description="local Ray only: logical CPUs (None = the machine's cores, or what the pools reserve if more)")
    num_gpus: int | None = Field(None, ge=0, description="local Ray only: GPUs to declare")
    resources: dict[str, float] = Field(default_factory=dict, description="local Ray only: custom resources (node labels)")
    namespace: str = Field("sparrow", description="Ray namespace of the job's actors")
    log_to_driver: bool = Field(False, description="print actor logs here (they are always in Ray's session logs)")


class WandbConfig(_Section):
    """The W&B run of a job whose `run.loggers` has 'wandb' (coordinator/loggers/wandb_logger.py)."""

    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: written under RUN_DIR/wandb/ only (upload later with `wandb sync`); online: "
        "streamed to the W&B server (needs an API key and the network)",
    )
    project: str = Field("sparrow", min_length=1, description="W&B project")
    entity: str | None = Field(None, description="W&B user or team; None = the API key's default entity")
    name: str | None = Field(None, description="W&B run name; None = the run directory's name")
    group: str | None = Field(None, description="W&B group (e.g. one per sweep)")
    tags: list[str] = Field(default_factory=list, description="W&B tags")
    init_timeout_s: float = Field(90.0, gt=0, description="online: seconds to wait for the W&B server at start")


class RecoveryConfig(_Section):
    """How the job notices and survives lost rollout workers and trainer ranks (docs/reliability.md)."""

    lease_timeout_s: float = Field(
        120.0, gt=0, description="a leased GRPO group not renewed for this long goes back to the queue (a worker "
        "renews while its engine makes progress)",
    )
    speculate_after_s: float | None = Field(
        None, gt=0, description="when nothing is left to lease, an idle rollout worker generates again a group another "
        "worker has held this many seconds (the oldest first, once a group); the first to finish is trained, the other "
        "aborted. Keeps a slow worker from holding a step back, at the cost of the duplicated work; None = off",
    )
    hung_worker_timeout_s: float = Field(
        30.0, gt=0, description="a worker whose leases expired and that does not answer within this is replaced",
    )
    join_timeout_s: float = Field(
        900.0, gt=0, description="a new rollout worker (a replacement or an added one) that does not serve within this "
        "many seconds of its start is replaced in turn (a start-up that hangs)",
    )
    max_worker_restarts: int = Field(3, ge=0, description="replacements per rollout worker slot before the job stops")
    max_trainer_restarts: int = Field(
        2, ge=0, description="trainer pool rebuilds (from the last checkpoint) before the job stops",
    )


class PartialRolloutConfig(_Section):
    """Partial rollouts against the long tail: a step trains the first `prompts_per_step` groups to finish; the
    groups still generating carry over to the next step instead of holding this one (docs/coordinator.md, The
    long tail)."""

    enabled: bool = Field(False, description="keep extra_groups more groups in flight than a step trains; a step "
                          "closes once prompts_per_step of them are done")
    extra_groups: int = Field(2, ge=0, description="groups in flight beyond prompts_per_step (over-provisioning): "
                              "the slowest of them carry over, so the step no longer waits for them; at most "
                              "prompts_per_step x (max_staleness - the run's staleness), which the staleness bound "
                              "lets the steps carry. 0 (async, carry resume): no spares, but a weight change "
                              "interrupts the groups generating and resumes them under the new version instead of "
                              "waiting for them; 0 with close_after_s: the time budget alone makes the spares")
    carry: Literal["resume", "finish"] = Field(
        "resume", description="a carried group still generating at the next weight change: resume = interrupted "
        "there and resumed under the new weights (its tokens keep the log-probabilities of the policy that sampled "
        "them; needs an engine that interrupts); finish = the weight change waits until it is done, under the "
        "policy that started it",
    )
    max_staleness: int | None = Field(
        None, ge=1, description="most policy versions a carried sample's oldest token may lag the policy that trains "
        "it; a group that would lag more holds its step open until it is done (default: the run's staleness + 1)",
    )
    close_after_s: float | None = Field(
        None, gt=0, description="a time budget: once the trainer has waited this many seconds for a step, the step "
        "closes with the groups done (at least one) and the rest carry over, provided it leaves at most "
        "prompts_per_step + extra_groups groups to the next step (so the job is never more than that behind its "
        "data); the groups in flight then grow to what the tail needs. None: a step waits for prompts_per_step groups",
    )


def budget_carry_limit(prompts_per_step: int, extra_groups: int) -> int:
    """Most groups a step closed by its time budget may leave to the next: one step's groups and its spares, so
    the job is never more than a step behind its data. The tail model and `bench rl-step`'s engine sizing use it
    without a `RunConfig`."""
    return prompts_per_step + extra_groups


class RunConfig(_Section):
    steps: int = Field(100, ge=1, description="GRPO steps (policy updates) in total")
    prompts_per_step: int = Field(32, ge=1, description="prompts per step; each gives rollout.sampling.n samples")
    mode: Literal["sync", "async"] = Field("sync", description="async: rollouts of later steps overlap training")
    max_staleness: int | None = Field(
        None, ge=0, description="async: most policy versions a sample may lag the trainer (default 1); sync: 0"
    )
    seed: int = Field(0, description="seeds data order, arithmetic problems and sampling")
    out_dir: str = Field("runs", description="run directories are created under this folder")
    name: str | None = Field(None, description="run directory name; None = train-<date>-<time>")
    checkpoint_every: int = Field(
        10, ge=0, description="checkpoint every N steps and at the end (0 = only at the end); a lost trainer "
        "restarts from the last one",
    )
    keep_checkpoints: int = Field(1, ge=1, description="checkpoints kept on disk (older ones are deleted)")
    export_hf_every: int = Field(
        0, ge=0, description="write the policy as a Hugging Face model to RUN_DIR/hf/stepN every N steps and at the "
        "last step; 0 = off",
    )
    placement: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: rollout engines and trainer ranks on GPUs (bundles) of their own; "
        "colocated: rollout worker i and trainer rank i share bundle i (its GPU) and take turns on it — the engine "
        "gives its KV cache back while the trainer updates, the trainer moves its optimizer states, gradients and "
        "weights to host memory while the engine generates; rollouts never overlap training, so a colocated job runs "
        "synchronously whatever mode says (docs/coordinator.md, Placement)",
    )
    weights_channel: Literal["auto", "object_store", "collective", "shared"] = Field(
        "auto", description="auto = shared for a colocated placement (each rank's weights handed over in place: CUDA "
        "IPC on a GPU, shared memory on a CPU) and for a sync GPU job whose rollout workers sit on trainer ranks' GPUs "
        "(0.5 + 0.5 of one), collective (NCCL) for sync GPU jobs whose workers have GPUs of their own, Ray's object "
        "store otherwise; chosen once the pools are placed, and an explicit collective over a shared GPU is refused then"
    )
    cost_hardware: str = Field("h200", description="hardware profile of the predicted speedup (sparrow.cost)")
    collect_timeout_s: float = Field(600.0, gt=0, description="seconds the trainer waits for a step's samples")
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"], description="where every step's record goes: jsonl = RUN_DIR/metrics.jsonl "
        "(required), tensorboard = RUN_DIR/tensorboard/, wandb = W&B (run.wandb); the last two need the tracking extra",
    )
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    partial_rollout: PartialRolloutConfig = Field(default_factory=PartialRolloutConfig)

    def exports_hf_at(self, step: int) -> bool:
        """Whether the job writes RUN_DIR/hf/step<step> once `step` steps are done."""
        every = self.export_hf_every
        return bool(every) and (step % every == 0 or step == self.steps)

    @property
    def synchronous(self) -> bool:
        """Rollouts of step k start only once policy k exists: sync mode, and any colocated job (its engines sleep
        while the trainer updates, so there is nothing to overlap)."""
        return self.mode == "sync" or self.placement == "colocated"

    @property
    def staleness(self) -> int:
        if self.synchronous:
            return 0
        return self.max_staleness if self.max_staleness is not None else 1

    @property
    def carry_staleness(self) -> int | None:
        """The bound on a carried sample's staleness (None: partial rollouts off)."""
        partial = self.partial_rollout
        if not partial.enabled:
            return None
        return partial.max_staleness if partial.max_staleness is not None else self.staleness + 1

    @property
    def budget_carry(self) -> int | None:
        """Most groups a step closed by the time budget may hand to the next (None: no time budget)."""
        partial = self.partial_rollout
        if not partial.enabled or partial.close_after_s is None:
            return None
        return budget_carry_limit(self.prompts_per_step, partial.extra_groups)

    @property
    def trained_staleness(self) -> int:
        """Most policy versions a trained sample's oldest token may lag (the trainer refuses older ones)."""
        return self.carry_staleness if self.carry_staleness is not None else self.staleness

    @model_validator(mode="after")
    def _partial_rollout(self):
        bound = self.carry_staleness
        if bound is None:
            return self
        if bound <= self.staleness:
            raise ValueError(f"run.partial_rollout.max_staleness={bound} must exceed the run's staleness "
                             f"({self.staleness}): a carried group trains at least one step later; raise it or leave "
                             "it unset")
        if not self.partial_rollout.extra_groups:
            if self.synchronous and self.partial_rollout.close_after_s is None:
                raise ValueError("run.partial_rollout.extra_groups=0 does nothing in a synchronous job (no group is "
                                 "generating when the weights change): give spare groups (>= 1), a time budget "
                                 "(close_after_s), or run.mode=async on the disaggregated placement to interrupt and "
                                 "resume groups at each new version")
            if self.partial_rollout.carry == "finish":
                raise ValueError("run.partial_rollout.extra_groups=0 with carry='finish' does nothing (no spare groups, "
                                 "none interrupted): give spare groups (>= 1) or use carry='resume'")
        most = self.prompts_per_step * (bound - self.staleness)
        if self.partial_rollout.extra_groups > most:
            raise ValueError(
                f"run.partial_rollout.extra_groups={self.partial_rollout.extra_groups} is more than the "
                f"{most} spare groups prompts_per_step={self.prompts_per_step} can keep in flight: a carried group "
                f"may wait {bound - self.staleness} step(s) before the staleness bound trains it, so a step would "
                f"train more than its {self.prompts_per_step} groups and the spares would shrink back to {most}; "
                "lower extra_groups or raise run.partial_rollout.max_staleness")
        return self

    @model_validator(mode="after")
    def _staleness(self):
        if self.mode == "sync" and self.max_staleness:
            raise ValueError(f"max_staleness={self.max_staleness} needs mode='async' (sync mode trains on fresh samples only)")
        if self.mode == "async" and self.max_staleness == 0:
            raise ValueError("mode='async' with max_staleness=0 is sync mode; set mode='sync' or max_staleness >= 1")
        return self

    @model_validator(mode="after")
    def _placement(self):
        if self.placement == "colocated" and self.max_staleness:
            raise ValueError(f"max_staleness={self.max_staleness} with placement='colocated': the engine and the trainer "
                             "take turns on one GPU, so rollouts never overlap training and every sample is fresh; "
                             "remove max_staleness (a colocated job runs synchronously) or use placement='disaggregated'")
        if self.weights_channel == "shared" and self.placement != "colocated":
            raise ValueError("weights_channel='shared' needs placement='colocated' (each trainer rank hands its weights "
                             "to the rollout worker on its own GPU); use 'auto'")
        return self

    @model_validator(mode="after")
    def _loggers(self):
        twice = sorted({name for name in self.loggers if self.loggers.count(name) > 1})
        if twice:
            raise ValueError(f"loggers={self.loggers} lists {', '.join(map(repr, twice))} more than once; list each logger once")
        if "jsonl" not in self.loggers:
            raise ValueError(f"loggers={self.loggers} leaves out 'jsonl': the report (RUN_DIR/report/) is made from "
                             "RUN_DIR/metrics.jsonl; add 'jsonl'")
        if "wandb" not in self.loggers and self.wandb != WandbConfig():
            raise ValueError(
                f"wandb is set ({self.wandb.model_dump(exclude_defaults=True)}) but loggers={self.loggers} has no 'wandb'; "
                "add 'wandb' to loggers or remove the wandb section"
            )
        return self


class SparrowConfig(_Section):
    """The whole job. Its defaults are the components' own; `load_config()` without a file gives EMBEDDED."""

    model: str | None = Field(None, description="HF model directory; None = SmolLM2-135M-Instruct, fetched if missing")
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerSection = Field(default_factory=TrainerSection)
    controller: ControllerSection = Field(default_factory=ControllerSection)
    transport: TransportConfig = Field(default_factory=lambda: TransportConfig(port=0))
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _consistent(self):
        s = self.rollout.sampling
        if "temperature" in self.trainer.model_fields_set and self.trainer.temperature != s.temperature:
            raise ValueError(
                f"trainer.temperature={self.trainer.temperature} differs from rollout.sampling.temperature={s.temperature}; "
                "the trainer scores log-probs at the rollout temperature, so set only rollout.sampling.temperature"
            )
        self.trainer.temperature = s.temperature
        for name, section in self.rollout.sections().items():
            if section.schedule is not None:
                raise ValueError(f"rollout.{name}.schedule={section.schedule!r}: the job's schedule is set once, with "
                                 "rollout.schedule")
        if self.trainer.schedule is not None:
            raise ValueError(f"trainer.schedule={self.trainer.schedule!r}: the job's schedule is set once, with rollout.schedule")
        if self.controller.warm_start != "dense":
            raise ValueError(
                f"controller.warm_start={self.controller.warm_start!r}: the initial schedule of a job is rollout.schedule "
                "(or controller.calibration); remove controller.warm_start"
            )
        if s.logprobs > self.transport.max_top_k:
            raise ValueError(f"rollout.sampling.logprobs={s.logprobs} exceeds transport.max_top_k={self.transport.max_top_k}")
        exact = self.controller.statistic == "exact"
        if self.controller.enabled and exact and not self.trainer.exact_alpha:
            raise ValueError(
                "controller.statistic='exact' needs trainer.exact_alpha=true (the trainer then measures α itself each "
                "step); set it, or steer on 'lower', 'midpoint' or 'upper'"
            )
        if self.controller.enabled and not exact and s.logprobs == 0:
            raise ValueError(
                "controller.enabled=true needs rollout.sampling.logprobs > 0 (α is measured from the rollout's top-k); "
                "set logprobs (e.g. 20), controller.statistic=exact with trainer.exact_alpha=true, or controller.enabled=false"
            )
        if self.run.weights_channel == "collective" and not self.run.synchronous:
            raise ValueError(
                "run.weights_channel='collective' needs mode='sync': a broadcast waits for every rollout worker, "
                "which in async mode are busy generating; use 'object_store' or 'auto'"
            )
        self._colocated_pools_pair_up()
        self._partial_rollout_engine_interrupts()
        self._controller_has_sparsity_to_steer()
        self.rollout.engine_config().check_job(
            SamplingParams(**s.model_dump()), self.schedule_template(), "rollout", self.rollout.engine
        )
        self._trainer_sparse_layers_match_rollout()
        return self

    def _colocated_pools_pair_up(self) -> None:
        """A colocated job pairs rollout worker i with trainer rank i on one bundle: equal sizes, an engine that can
        give its memory back, and no elastic rollout pool."""
        if self.run.placement != "colocated":
            return
        rollout, trainer = self.rollout.pool, self.trainer.pool
        if rollout.size != trainer.size:
            raise ValueError(f"run.placement='colocated' pairs each rollout worker with a trainer rank on one GPU: "
                             f"rollout.pool.size={rollout.size} must equal trainer.pool.size={trainer.size}")
        if (rollout.node_label, rollout.strategy) != (trainer.node_label, trainer.strategy):
            raise ValueError("run.placement='colocated' places both pools on the same bundles: set rollout.pool and "
                             "trainer.pool node_label and strategy alike (the trainer pool's are used)")
        engine = self.rollout.engine_config()
        if not engine.releases_memory:
            raise ValueError("run.placement='colocated' needs an engine that gives its KV memory back between steps: "
                             + engine.how_to_release_memory("rollout", self.rollout.engine))

    def _controller_has_sparsity_to_steer(self) -> None:
        dense = self.rollout.engine_config().dense_only("rollout", self.rollout.engine)
        if self.controller.enabled and dense:
            raise ValueError(f"controller.enabled=true steers the rollout's sparsity, and {dense}: set "
                             "controller.enabled=false for a dense run, or let the engine run sparse layers")

    def _partial_rollout_engine_interrupts(self) -> None:
        partial = self.run.partial_rollout
        if partial.enabled and partial.carry == "resume" and not self.rollout.engine_config().interrupts:
            raise ValueError(f"run.partial_rollout.carry='resume' needs an engine that interrupts a sample and keeps "
                             f"its tokens; rollout.engine={self.rollout.engine!r} does not: set "
                             "run.partial_rollout.carry='finish' or rollout.engine='native'")

    def _trainer_sparse_layers_match_rollout(self) -> None:
        """The trainer's sparse forward (DistillSparse, exact α) must select blocks as the rollout engines do."""
        if not (self.trainer.distill_sparse.enabled or self.trainer.exact_alpha):
            return
        engine, name = self.rollout.engine_config(), self.rollout.engine
        trainer = self.trainer.distill_sparse
        for key in ("dense_layers", "landmark"):
            if getattr(trainer, key) != getattr(engine, key):
                raise ValueError(
                    f"trainer.distill_sparse.{key}={getattr(trainer, key)!r} differs from rollout.{name}.{key}="
                    f"{getattr(engine, key)!r}: the trainer's sparse forward (DistillSparse, trainer.exact_alpha) must "
                    "select blocks as the rollout engines do; set both to the same value"
                )

    # ------------------------------------------------------------------ derived values

    @property
    def pools_start_together(self) -> bool:
        """Whether the engines may load while the trainer ranks start. Not when an engine and a rank can share a
        GPU (colocated bundles, or fractional GPUs in both pools): an engine sizes its KV pool from the memory free
        when it starts, which the rank is then still taking."""
        fractional = [p.gpus % 1 > 0 for p in (self.rollout.pool, self.trainer.pool)]
        return self.run.placement != "colocated" and not all(fractional)

    def trainer_config(self, model: str) -> TrainerConfig:
        """The trainer ranks' config: the trainer section, with the rollout engine's K/V pages."""
        return self.trainer.trainer_config(model, self.rollout.engine_config().kv_cache_dtype)

    def initial_schedule(self) -> SparsitySchedule | None:
        """`rollout.schedule` as a schedule (None = dense); its bins are the job's α length bins."""
        value = self.rollout.schedule
        try:
            return None if value == "dense" else load_schedule(value, origin="rollout.schedule")
        except ScheduleError as exc:
            raise ValueError(f"rollout.schedule: {exc}") from None

    def worker_payload(self) -> dict:
        """The config as sent to actors on other nodes, with `rollout.schedule` inlined: a schedule file
        then needs to exist on the driver's node only (workers validate the config again)."""
        payload = self.model_dump(mode="json")
        schedule = self.initial_schedule()
        if schedule is not None:
            payload["rollout"]["schedule"] = schedule.to_dict()
        return payload

    def schedule_template(self) -> SparsitySchedule:
        """Bins, block size, sink and recent of the job (from the initial schedule, or dense bins)."""
        schedule = self.initial_schedule()
        if schedule is not None:
            return schedule
        edges = tuple(self.rollout.dense_bin_edges or SPARROW_EDGES)
        try:
            return SparsitySchedule(name="dense", topk_blocks=(None,) * (len(edges) + 1), edges=edges)
        except ScheduleError as exc:
            raise ValueError(f"rollout.dense_bin_edges: {exc}") from None

    def dump(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# ---------------------------------------------------------------------- loading and errors


TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "tuple"}
"""Union-member tags pydantic puts in error locations; never config keys."""


def _model_at(model: type[BaseModel] | None, loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class reached by following `loc` from `model` (None if it leaves models)."""
    for key in loc:
        if model is None or not isinstance(key, str):
            return None
        if key not in model.model_fields:
            model = _section_class(model, key)
            continue
        annotation = model.model_fields[key].annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return model


def _section_class(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    """The class of a section a model takes by name beyond its fields (`RolloutConfig`'s backend sections)."""
    return model.section_class(key) if hasattr(model, "section_class") else None


def _allowed_keys(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return sorted(model.model_fields) + (registry.names() if model is RolloutConfig else [])


def _dotted(loc: tuple) -> str:
    out = ""
    for key in loc:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def format_validation_error(exc: ValidationError, root: type[BaseModel] = SparrowConfig) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(k for k in err["loc"] if not (isinstance(k, str) and ("[" in k or k in TYPE_TAGS)))
        key = _dotted(loc)
        if err["type"] == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            allowed = _allowed_keys(parent)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f"did you mean {_dotted(loc[:-1] + (close[0],))!r}? " if close else ""
            lines.append(f"{key}: unknown key; {hint}allowed here: {', '.join(allowed)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if isinstance(value, (dict, BaseModel)) else f" (got {value!r})"
        lines.append(f"{key}: {msg}{shown}" if key else msg)
    return "\n".join(lines)


def set_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` (value parsed as a YAML scalar or flow collection) to nested dicts."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set run.steps=10")
    key, _, text = assignment.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r}: empty key segment in {key!r}")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value {text!r} is not valid YAML ({str(exc).splitlines()[0]})") from None
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: i + 1])} is {child!r}, not a section with keys")
        node = child
    node[parts[-1]] = value


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of sections (data, rollout, trainer, ...)")
    return data


def read_trainer_config(path: str | Path) -> TrainerConfig:
    """The trainer's config in a saved job config (a run's config.yaml). Only the trainer section is
    validated: the whole config would import reward.function, which e.g. `sparrow export` does not need."""
    from sparrow.model_zoo import default_model_dir

    data = read_config_file(path)
    try:
        section = TrainerSection.model_validate(data.get("trainer") or {})
    except ValidationError as exc:
        raise ConfigError(f"invalid trainer section in {path}:\n{format_validation_error(exc, TrainerSection)}") from None
    model = data.get("model") or str(default_model_dir())
    return section.trainer_config(model, kv_cache_dtype="auto")  # export reads dense weights only, never K/V pages


def build_config(data: dict, origin: str = "config") -> SparrowConfig:
    try:
        return SparrowConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid {origin}:\n{format_validation_error(exc)}") from None


def merge(base: dict, top: dict) -> dict:
    """`top` over `base`, recursively for mappings (lists and scalars in `top` replace)."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> SparrowConfig:
    """The file's config (the embedded default when None) with `--set` overrides applied, validated."""
    data = merge(copy.deepcopy(BASE), read_config_file(path) if path else copy.deepcopy(EMBEDDED))
    for assignment in overrides:
        set_override(data, assignment)
    origin = f"config {path}" if path else "config (embedded default)"
    return build_config(data, origin + (" with --set overrides" if overrides else ""))
