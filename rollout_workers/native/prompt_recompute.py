"""Teacher-forced recomputes of many samples of one prompt, with the prompt's K/V computed once.

Calibration recomputes every sample twice (dense and sparse) over the full vocabulary. At 1-3K
token prompts and a few hundred generated tokens, a whole-sequence recompute
(`native.teacher_forced_logprobs`) spends most of its time re-encoding the prompt, which is the same
for every sample and every budget: all prompt positions attend densely in both passes (the engine
prefills densely, and the query at `prompt_len - 1`, which draws token 0, is a prompt position).
So the K/V of the first `prompt_len - 1` positions are computed once per prompt, and each recompute
runs only the G queries at positions `prompt_len - 1 … prompt_len + G - 2` over that prefix and
their own K/V, under the same rule (`sparse_rows_mask`, the rows of the reference
`sparse_causal_mask`). Same numbers as the whole-sequence recompute, ~5-8x faster at 2K prompts.

An engine with FP8 KV pages reads every K/V rounded through e4m3 (`round_trip`), prompt included, so
its rollout distribution differs from the dense policy even where no pass was sparse: the replay
(`blocks_attended` given) then encodes its own prefix with rounded K/V and rounds the suffix's too;
the dense pass stays unrounded (the trainer's policy). The replay is an FP8 computation of the same
tokens, not the engine's bit for bit: a value whose two computations differ in the last float bit can
round to neighbouring e4m3 steps (on SmolLM2, 30 layers: most tokens' log q differ by > 1e-3).
"""

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import causal_rows_mask, round_trip, sdpa, sparse_rows_mask
from sparrow.rollout_workers.api import TeacherForcedOutput

from .attention import blocks_attended as count_blocks
from .model import DecoderModel
from .teacher_forced import query_budgets


class _RecordPrefix:
    """Dense causal attention over the prefix that keeps each layer's post-RoPE K/V (`rounded`: as FP8 pages
    store them)."""

    def __init__(self, rounded: bool = False):
        self.rounded = rounded
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def __call__(self, layer: int, q, k, v):
        if self.rounded:
            k, v = round_trip(k), round_trip(v)
        self.keys.append(k)
        self.values.append(v)
        return sdpa(q, k, v, causal=True)


class _OverPrefix:
    """The suffix queries over the cached prefix K/V plus their own: causal in dense layers (or
    when every row is dense), the reference block-sparse rows elsewhere."""

    def __init__(self, prefix: _RecordPrefix | None, config: SparseAttentionConfig, positions: torch.Tensor,
                 budgets: torch.Tensor | None, rounded: bool = False):
        self.prefix, self.config, self.positions, self.budgets = prefix, config, positions, budgets
        self.rounded = rounded

    def __call__(self, layer: int, q, k, v):
        if self.rounded:
            k, v = round_trip(k), round_trip(v)
        if self.prefix is not None:
            k = torch.cat([self.prefix.keys[layer], k])
            v = torch.cat([self.prefix.values[layer], v])
        if self.budgets is None or self.config.is_dense_layer(layer):
            mask = causal_rows_mask(self.positions, k.shape[0])[None]
        else:
            mask = sparse_rows_mask(q, k, self.positions, self.budgets, self.config)
        return sdpa(q, k, v, mask)


class PromptRecompute:
    """The native engine's `PromptScorer` (`NativeEngine.prompt_scorer`). Recomputes of samples sharing one
    prompt: `logprobs(generated, blocks_attended)` equals
    `teacher_forced_logprobs(model, prompt + generated, len(prompt), attention=..., full=True,
    blocks_attended=...)` (dense when `blocks_attended` is None)."""

    @torch.inference_mode()
    def __init__(self, model: DecoderModel, prompt_token_ids, attention: SparseAttentionConfig, temperature: float = 1.0,
                 quantized_kv: bool = False):
        self.model, self.attention, self.temperature = model, attention, temperature
        self.quantized_kv = quantized_kv
        """The rollouts read FP8 K/V: replays round K/V, and a replay differs from the dense pass even at full budget."""
        self.prompt = torch.as_tensor(list(prompt_token_ids), dtype=torch.long, device=model.device)
        if self.prompt.numel() == 0:
            raise ValueError("the prompt is empty; a recompute needs at least one prompt token")
        self.prefix_len = self.prompt.numel() - 1
        self.prefix = self.rollout_prefix = None
        if self.prefix_len:
            self.prefix = self._encode(rounded=False)
            self.rollout_prefix = self._encode(rounded=True) if quantized_kv else self.prefix

    def _encode(self, rounded: bool) -> _RecordPrefix:
        prefix = _RecordPrefix(rounded)
        self.model(self.prompt[: self.prefix_len], torch.arange(self.prefix_len, device=self.model.device), prefix)
        return prefix

    @torch.inference_mode()
    def logprobs(self, generated: torch.Tensor, blocks_attended: torch.Tensor | None = None) -> TeacherForcedOutput:
        generated = torch.as_tensor(generated, dtype=torch.long, device=self.model.device).flatten()
        if generated.numel() == 0:
            raise ValueError("no generated tokens to recompute")
        prompt_len = self.prompt.numel()
        total = prompt_len + generated.numel()
        budgets = query_budgets(total, prompt_len, blocks_attended=blocks_attended)
        if all(self.attention.is_dense_layer(i) for i in range(self.model.spec.num_layers)):
            budgets = None
        positions = torch.arange(self.prefix_len, total - 1, device=self.model.device)
        row_budgets = None if budgets is None else budgets[self.prefix_len : total - 1].to(self.model.device)
        inputs = torch.cat([self.prompt[-1:], generated[:-1]])
        replay = blocks_attended is not None
        over = _OverPrefix(self.rollout_prefix if replay else self.prefix, self.attention, positions, row_budgets,
                           rounded=replay and self.quantized_kv)
        hidden = self.model(inputs, positions, over)
        logprobs = torch.log_softmax(self.model.logits(hidden) / (self.temperature or 1.0), dim=-1)
        return TeacherForcedOutput(
            logprobs=logprobs.gather(-1, generated[:, None])[:, 0],
            blocks_attended=count_blocks(positions + 1, row_budgets, self.attention),
            full_logprobs=logprobs,
        )
