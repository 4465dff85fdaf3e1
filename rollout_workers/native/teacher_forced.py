"""Teacher-forced recompute of a rollout's logprobs with the engine's model and the *reference*
causal block-sparse attention — what a trainer's sparse forward must reproduce.

For a sequence of `prompt_len` prompt tokens followed by G generated ones, generated token t was
drawn from the pass whose query sits at position prompt_len − 1 + t. That query is a prompt position
(dense) for t = 0, and for t ≥ 1 attends with the budget of context L = prompt_len + t, given either
by a schedule or, exactly as the engine used it, by the sample's own `blocks_attended[t]` (a count
equal to the context's block count means dense).
"""

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.rollout_workers.api import TeacherForcedOutput
from sparrow.schedule import DENSE_BUDGET, SparsitySchedule

from .attention import TeacherForced, blocks_attended as count_blocks
from .model import DecoderModel


def query_budgets(
    num_tokens: int,
    prompt_len: int,
    schedule: SparsitySchedule | None = None,
    blocks_attended: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Budget (total blocks) of every query position, or None when all attention is dense."""
    if schedule is not None and blocks_attended is not None:
        raise ValueError("give either schedule or blocks_attended, not both")
    if schedule is None and blocks_attended is None:
        return None
    if schedule is not None:
        return schedule.query_budgets(prompt_len, num_tokens)
    budgets = torch.full((num_tokens,), DENSE_BUDGET, dtype=torch.long)
    generated = num_tokens - prompt_len
    if blocks_attended.shape != (generated,):
        raise ValueError(f"blocks_attended has shape {tuple(blocks_attended.shape)}; expected ({generated},), one per generated token")
    budgets[prompt_len : num_tokens - 1] = blocks_attended[1:].long().cpu()
    return budgets


@torch.inference_mode()
def teacher_forced_logprobs(
    model: DecoderModel,
    token_ids,
    prompt_len: int,
    schedule: SparsitySchedule | None = None,
    attention: SparseAttentionConfig | None = None,
    temperature: float = 1.0,
    full: bool = False,
    blocks_attended: torch.Tensor | None = None,
) -> TeacherForcedOutput:
    """Logprobs of `token_ids[prompt_len:]` under the model with Sparrow's sparse attention.

    `schedule=None` and `blocks_attended=None` give the dense policy. Logprobs are the float32
    log-softmax of logits / temperature (temperature 0 means 1, as in the engine).
    """
    tokens = torch.as_tensor(token_ids, dtype=torch.long, device=model.device).flatten()
    total = tokens.shape[0]
    if not 1 <= prompt_len < total:
        raise ValueError(f"prompt_len={prompt_len}: need 1 <= prompt_len < len(token_ids)={total}")
    attention = attention or SparseAttentionConfig.of_schedule(schedule)
    budgets = query_budgets(total, prompt_len, schedule, blocks_attended)
    if all(attention.is_dense_layer(i) for i in range(model.spec.num_layers)):
        budgets = None
    positions = torch.arange(total, device=model.device)
    forced = TeacherForced(attention, budgets, model.device)
    hidden = model(tokens, positions, forced)
    logits = model.logits(hidden[prompt_len - 1 : total - 1])
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    producing = positions[prompt_len - 1 : total - 1]
    return TeacherForcedOutput(
        logprobs=logprobs.gather(-1, tokens[prompt_len:, None])[:, 0],
        blocks_attended=count_blocks(producing + 1, None if forced.budgets is None else forced.budgets[producing], attention),
        full_logprobs=logprobs if full else None,
    )
