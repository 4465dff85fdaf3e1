"""Process-wide state of the sparse layers inside one vLLM worker.

The engine front end cannot reach the attention layers directly (they live in vLLM's engine-core
process), so what they share lives here: the attention settings and the first schedule arrive with
the model through `additional_config["sparrow"]`; later schedules arrive between engine steps
through the `sparrow_set_schedule` worker RPC. Every sparse layer reads the same schedule, so a
replacement takes effect at the next step for all of them at once.
"""

from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from sparrow.kernels import AttentionBackend, SparseAttentionConfig, make_backend
from sparrow.kernels.reference import choice_margin, chosen_candidates, score_paged_blocks
from sparrow.schedule import DENSE_BUDGET, SparsitySchedule

OPTIONS_KEY = "sparrow"
"""Key of Sparrow's section in vLLM's `additional_config`."""

BACKENDS = ("auto", "reference", "triton")


@dataclass(frozen=True)
class WorkerOptions:
    """What the engine front end tells each worker (JSON-serialisable through `to_dict`)."""

    attention: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)
    attention_backend: str = "auto"
    schedule: dict | None = None
    trace_steps: int = 0
    full_decode_graphs: bool = False
    """Decode-only steps replay one CUDA graph of the whole model, sparse layers included (cuda_graphs: full_decode)."""

    def to_dict(self) -> dict:
        return {
            "attention": {**asdict(self.attention), "dense_layers": list(self.attention.dense_layers)},
            "attention_backend": self.attention_backend,
            "schedule": self.schedule,
            "trace_steps": self.trace_steps,
            "full_decode_graphs": self.full_decode_graphs,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "WorkerOptions":
        return cls(
            attention=SparseAttentionConfig(**data["attention"]),
            attention_backend=data["attention_backend"],
            schedule=data["schedule"],
            trace_steps=data["trace_steps"],
            full_decode_graphs=data.get("full_decode_graphs", False),
        )


def make_attention_backend(kind: str, device: torch.device) -> AttentionBackend:
    """This backend's rule: `auto` = the reference on CPU, the Triton kernels on CUDA (which they need)."""
    if kind not in BACKENDS:
        raise ValueError(f"attention_backend={kind!r}: use one of {BACKENDS}")
    if kind == "auto":
        kind = "triton" if device.type == "cuda" else "reference"
    if kind == "triton" and device.type != "cuda":
        raise ValueError(f"attention_backend='triton' needs a CUDA device, the KV cache is on {device}")
    return make_backend(kind, device)


class SparseRuntime:
    """Schedule, kernels and counters shared by the sparse layers of one worker."""

    def __init__(self, options: WorkerOptions):
        self.attention = options.attention
        self.backend_kind = options.attention_backend
        self.full_decode_graphs = options.full_decode_graphs
        self.graph_budgets = options.full_decode_graphs and options.schedule is not None
        """Decode graphs captured with budgets: every later schedule, dense (None) too, is read through budgets
        (dense = DENSE_BUDGET, every block). An engine started dense (None) captured the dense kernel and stays dense:
        it takes dense schedules (a job's bins) only."""
        self.schedule: SparsitySchedule | None = None
        self._budget_lookup: tuple[tuple, torch.Tensor] | None = None
        """(block-table width, device) -> the schedule's budget by block count there; dropped with the schedule."""
        self.set_schedule(options.schedule)
        self._backend: AttentionBackend | None = None
        self.trace: deque | None = deque(maxlen=options.trace_steps) if options.trace_steps else None
        self.first_sparse_layer: int | None = None
        """The layer whose decode steps are counted (all sparse layers attend to the same counts)."""
        self.landmark_bytes = 0
        self.decode_steps = 0
        self.decode_rows = 0
        self.prompt_rows = 0
        self.prompt_tokens = 0
        """Rows and query tokens attended densely as prompt (a prefix-cache hit leaves one token to compute)."""
        self._block_sums: torch.Tensor | None = None

    @property
    def schedule_version(self) -> int:
        return -1 if self.schedule is None else self.schedule.version

    def set_schedule(self, payload: dict | None) -> None:
        schedule = None if payload is None else SparsitySchedule.from_dict(payload, origin="sparrow_set_schedule")
        if schedule is not None and not schedule.is_dense and self.full_decode_graphs and not self.graph_budgets:
            raise ValueError(f"schedule {schedule.name!r}: this engine started dense with cuda_graphs='full_decode', "
                             "so its decode graphs hold the dense kernel; start it with a schedule (a dense one may "
                             "follow), or use cuda_graphs='piecewise'")
        self.attention.check_compatible(schedule)
        self.schedule = schedule
        self._budget_lookup = None

    def backend(self, device: torch.device) -> AttentionBackend:
        if self._backend is None:
            self._backend = make_attention_backend(self.backend_kind, device)
        return self._backend

    def budgets(self, seq_lens: torch.Tensor, max_blocks: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Blocks each decode row may attend to (total context length → schedule); None = dense. A lookup by block
        count in a table on the rows' device, made once per schedule and width: building the budgets from Python
        lists each step copied them host to device, which waits for the GPU's queue (`max_blocks`: the block
        table's width, the most blocks a row can hold). Written into `out` when given: a decode graph reads the
        budgets from the address it captured."""
        if (self.schedule is None or self.schedule.is_dense) and not self.graph_budgets:
            return None
        key = (max_blocks, seq_lens.device)
        if self._budget_lookup is None or self._budget_lookup[0] != key:
            table = (torch.full((max_blocks + 1,), DENSE_BUDGET, dtype=torch.long) if self.schedule is None
                     else self.schedule.budget_by_blocks(max_blocks))
            self._budget_lookup = (key, table.to(seq_lens.device))
        blocks = (seq_lens.long() + self.attention.block_size - 1) // self.attention.block_size
        return torch.index_select(self._budget_lookup[1], 0, blocks.clamp(max=max_blocks), out=out)

    def count_decode_step(self, rows: int) -> None:
        """One engine step's decode rows, counted on the host when the step's metadata is built (a replayed decode
        graph runs no Python in the layers)."""
        self.decode_steps += 1
        self.decode_rows += rows

    def prepare_counters(self, device: torch.device) -> None:
        """The device counters the first sparse layer adds to in place, made with the model (before any graph is
        captured: a captured add then counts every replay). Not with the attention builders: vLLM makes those with the
        KV cache, in the memory pool its sleep mode discards, and the counts read 0 after a sleep (H100, 12-07); the
        model's pool is backed up by a level-1 sleep."""
        if self._block_sums is None:
            self._block_sums = torch.zeros(2, dtype=torch.long, device=device)

    def reset_counters(self) -> None:
        """Zero every count once the engine has started: vLLM's profile, warm-up and capture runs decode dummy
        batches through the sparse layers (an engine started under a sparse schedule counted 119 blocks before its
        first request, H100 12-07). Zeroed in place: captured graphs add to the counter's address."""
        self.decode_steps = self.decode_rows = self.prompt_rows = self.prompt_tokens = 0
        if self._block_sums is not None:
            self._block_sums.zero_()

    def record_step(self, seq_lens: torch.Tensor, blocks: torch.Tensor) -> None:
        """Count one decode step of one sparse layer (the first): blocks attended vs in context (padding rows of a
        graph, of length 0, add nothing)."""
        self.prepare_counters(seq_lens.device)
        context = (seq_lens.long() + self.attention.block_size - 1) // self.attention.block_size
        self._block_sums.add_(torch.stack([blocks.long().sum(), context.sum()]))
        if self.tracing():
            self.trace.append({
                "schedule_version": self.schedule_version,
                "seq_lens": seq_lens.tolist(),
                "blocks_attended": blocks.tolist(),
                "chosen": {},
                "margin": {},
                "scores": {},
            })

    def trace_choice(self, layer: int, q, landmarks, block_table, seq_lens, budgets) -> None:
        """Trace mode: which candidate blocks this sparse layer chose per row and KV head (logical ids), how near
        the choice came to another (`choice_margin`, the smallest over heads; None where nothing was chosen) and the
        score of every block in use per head, from the reference rule on the layer's own inputs. Two runs that part
        can then be told apart: a near-tie flipped by rounding upstream, or attention that really differs. Added to
        the step the first sparse layer opened."""
        if not self.tracing() or not self.trace or budgets is None:
            return
        cfg = self.attention
        num_blocks = (seq_lens.long() + cfg.block_size - 1) // cfg.block_size
        scores = score_paged_blocks(q, landmarks, block_table, num_blocks, cfg.landmark)
        chosen = chosen_candidates(scores, num_blocks, budgets, cfg.sink, cfg.recent)
        margin = choice_margin(scores, num_blocks, budgets, cfg.sink, cfg.recent).amin(-1)
        step = self.trace[-1]
        step["chosen"][layer] = [[torch.nonzero(head).flatten().tolist() for head in row] for row in chosen.cpu()]
        step["margin"][layer] = [None if m == float("inf") else m for m in margin.tolist()]
        step["scores"][layer] = [[head[:n].tolist() for head in row]
                                 for row, n in zip(scores.float().cpu(), num_blocks.tolist())]

    def tracing(self) -> bool:
        """Trace mode, outside a CUDA-graph capture (the trace reads tensors back to the host)."""
        return self.trace is not None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def record_prompt(self, query_spans: list[tuple[int, int]]) -> None:
        """Count one step's prompt rows of one sparse layer (the first)."""
        self.prompt_rows += len(query_spans)
        self.prompt_tokens += sum(end - start for start, end in query_spans)

    def stats(self) -> dict:
        attended, context = (0, 0) if self._block_sums is None else self._block_sums.tolist()
        return {
            "schedule_version": self.schedule_version,
            "attention_backend": None if self._backend is None else self._backend.name,
            "landmark_bytes": self.landmark_bytes,
            "decode_steps": self.decode_steps,
            "decode_rows": self.decode_rows,
            "prompt_rows": self.prompt_rows,
            "prompt_tokens": self.prompt_tokens,
            "blocks_attended": attended,
            "blocks_in_context": context,
        }


_RUNTIME: SparseRuntime | None = None


def configure(options: dict) -> SparseRuntime:
    """Called by the Sparrow model classes when vLLM builds the model in a worker."""
    global _RUNTIME
    _RUNTIME = SparseRuntime(WorkerOptions.from_dict(options))
    return _RUNTIME


def current() -> SparseRuntime:
    if _RUNTIME is None:
        raise RuntimeError(
            "Sparrow's sparse attention is not configured in this process: the model must be one of the "
            "Sparrow architectures (SparrowQwen3ForCausalLM, SparrowLlamaForCausalLM) built with "
            f"additional_config['{OPTIONS_KEY}'] (VllmEngine does both)"
        )
    return _RUNTIME
