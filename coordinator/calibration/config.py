"""`CalibrationConfig`: what `sparrow calibrate` measures, on which prompts, and what it optimises for."""

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sparrow.coordinator.tasks import TASKS
from sparrow.cost import HARDWARE
from sparrow.layout import KVCacheDType, LandmarkMode


class CalibrationConfig(BaseModel):
    """One calibration run: sparse rollouts at each budget, exact α against the dense policy, the
    tail per (length bin, budget), and the cheapest schedule whose tail meets `target`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("smollm2", description="HF model directory, or 'smollm2' (SmolLM2-135M-Instruct, fetched if missing)")
    prompts: str = Field(
        "arithmetic", description="a built-in task (arithmetic, lookup, needle: docs/tasks.md), a .jsonl or a .parquet file"
    )
    task: dict[str, Any] = Field(
        default_factory=dict, description="knobs of the built-in task, as its data.<task> section, e.g. "
        "{context_lines: [180, 600]} for needle (long contexts without a prompt file)"
    )
    prompt_key: str = Field("prompt", description="column of a JSONL/Parquet file with the prompt text or chat messages")
    chat_template: bool = Field(True, description="wrap prompts in the tokenizer's chat template")
    num_prompts: int = Field(8, ge=1, description="prompts (a file with fewer rows uses all of them)")
    samples: int = Field(4, ge=1, description="samples per prompt (Sparrow: 8)")
    max_tokens: int = Field(256, ge=1, description="generated tokens per sample at most")
    ignore_eos: bool = Field(False, description="generate max_tokens even past EOS (fills long length bins)")
    temperature: float = Field(1.0, ge=0.0, description="sampling temperature; α compares the distributions at it (0 = greedy, α at 1)")
    budgets: list[int] | None = Field(
        None, description="total blocks attended (sink + top-k + recent) to profile; None = a ladder up to the longest context"
    )
    dense_baseline: bool = Field(True, description="also roll out densely: the α floor of the measurement itself")
    edges: list[int] | None = Field(None, description="length-bin edges in tokens; None = Sparrow's 2000-token bins")
    bin_width: int | None = Field(None, ge=16, description="equal bins of this many tokens up to the longest context")
    target: float = Field(0.86, gt=0.0, lt=1.0, description="τ: the tail α every bin must keep")
    percentile: float = Field(5.0, gt=0.0, le=50.0, description="which percentile of α is the tail (Sparrow: 5)")
    statistic: Literal["exact", "lower", "upper"] = Field(
        "exact", description="α the schedule is chosen on: exact, or the top-K lower / upper bound (match controller.statistic)"
    )
    min_tokens: int = Field(200, ge=1, description="a (bin, budget) cell with fewer tokens is flagged as unreliable")
    logprobs: int = Field(20, ge=1, le=64, description="K of the rollout's top-K lists, for the top-K α interval")
    hardware: str = Field("h200", description="GPU profile of the cost model (sparrow cost --hardware)")
    sink: int = Field(1, ge=0, description="first blocks always attended")
    recent: int = Field(2, ge=1, description="last blocks always attended")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto = float32 on CPU, bfloat16 on CUDA")
    kv_cache_dtype: KVCacheDType = Field(
        "auto", description="the engine's K/V pages: fp8_e4m3 measures what FP8 KV costs in α (against the dense "
        "policy with unrounded K/V, at every budget and in the dense baseline)",
    )
    landmark: LandmarkMode = Field(
        "mean", description="the engine's block summary: mean_int8 measures what int8 landmarks cost in α (selection "
        "from the rounded mean keys)",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None = torch's default)")
    seed: int = Field(0, description="prompt choice and sampling seeds; every budget reuses the same seeds")
    out: Path = Field(Path("calibration"), description="output directory")

    def data_config(self):
        """The training job's data section for these prompts (calibration reuses the job's prompt sources)."""
        from sparrow.coordinator.config import DataConfig

        if self.prompts in TASKS:
            try:
                return DataConfig.model_validate({"source": self.prompts, "chat_template": self.chat_template,
                                                  self.prompts: self.task})
            except ValidationError as exc:
                err = exc.errors()[0]
                key = ".".join(str(x) for x in err["loc"][1:])
                raise ValueError(f"task knob {key or self.prompts}: {err['msg'].removeprefix('Value error, ')} "
                                 f"(got {err.get('input')!r}; the knobs of {self.prompts} are in docs/tasks.md)") from None
        source = "jsonl" if self.prompts.endswith(".jsonl") else "parquet"
        # Calibration never scores a response, so the prompt column doubles as the (unused) answer column.
        return DataConfig(source=source, path=self.prompts, prompt_key=self.prompt_key, answer_key=self.prompt_key,
                          chat_template=self.chat_template)

    @field_validator("hardware")
    @classmethod
    def _hardware(cls, value: str) -> str:
        if value.lower() not in HARDWARE:
            raise ValueError(f"hardware={value!r}: choose one of {', '.join(HARDWARE)}")
        return value.lower()

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, value: str) -> str:
        if value not in TASKS and Path(value).suffix not in (".jsonl", ".parquet"):
            raise ValueError(f"prompts={value!r}: use a built-in task ({', '.join(TASKS)}), a .jsonl file or a .parquet file")
        return value

    @field_validator("edges")
    @classmethod
    def _edges(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(b <= a for a, b in zip(value, value[1:])) or value[0] <= 0):
            raise ValueError(f"edges={value}: give increasing positive token lengths, e.g. 128,256,384")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        if self.edges is not None and self.bin_width is not None:
            raise ValueError("give either edges or bin_width, not both")
        if self.task and self.prompts not in TASKS:
            raise ValueError(f"task knobs {sorted(self.task)} apply to a built-in task; prompts={self.prompts!r} is a file")
        if self.task:
            self.data_config()  # a bad knob fails here, named
        if self.budgets is not None:
            if not self.budgets:
                raise ValueError("budgets is empty; give total block counts, e.g. 4,8,16")
            reserved = self.sink + self.recent
            low = [b for b in self.budgets if b < reserved]
            if low:
                raise ValueError(
                    f"budgets {low}: a budget counts the sink ({self.sink}) and recent ({self.recent}) blocks, so it must be "
                    f">= {reserved}"
                )
            if len(set(self.budgets)) != len(self.budgets):
                raise ValueError(f"budgets={self.budgets}: each budget once")
            self.budgets = sorted(self.budgets)
        return self
