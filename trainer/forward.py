"""One micro-batch through the policy: final hidden states at the predicting positions, then the
chunked vocabulary statistics. Dense or sparse, with the LoRA adapter on or off.

`PolicyModule` is what DeepSpeed wraps: the whole computation (decoder, gather of the response
positions, chunked LM head) runs inside `engine.forward`, whose output hooks DeepSpeed's ZeRO
backward relies on; calling submodules from outside the engine gives wrong ZeRO-3 gradients.
"""

from contextlib import nullcontext

import torch

from .logprobs import TokenStats, token_stats
from .microbatch import MicroBatch
from .sparse_attention import SparseForward

WRAPPER_PREFIX = "policy."
"""Parameter names inside the engine start with this (then peft's prefix, when an adapter is on)."""


class PolicyModule(torch.nn.Module):
    def __init__(self, policy: torch.nn.Module, temperature: float, topk: int, chunk_tokens: int):
        super().__init__()
        self.policy = policy
        self.temperature, self.topk, self.chunk_tokens = temperature, topk, chunk_tokens

    @property
    def is_peft(self) -> bool:
        return hasattr(self.policy, "disable_adapter")

    @property
    def hf_model(self) -> torch.nn.Module:
        """The transformers model (inside peft's wrapper when an adapter is attached)."""
        return self.policy.get_base_model() if self.is_peft else self.policy

    def forward(self, input_ids, attention_mask, rows, cols, targets, sparse: SparseForward | None = None, hidden_only: bool = False):
        extra = {} if sparse is None else {"sparrow_sparse": sparse}
        out = self.hf_model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        hidden = out.last_hidden_state[rows, cols]
        if hidden_only:
            return hidden
        s = token_stats(hidden, targets, self.hf_model.get_output_embeddings(), self.temperature, self.topk, self.chunk_tokens)
        return s.logprobs, s.entropy, s.top_ids, s.top_logprobs

    def full_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, V]` tempered float32 log-distribution (for exact α; short batches)."""
        return torch.log_softmax(self.hf_model.get_output_embeddings()(hidden).float() / self.temperature, dim=-1)


class PolicyRunner:
    """Feeds micro-batches to a DeepSpeed engine (or any callable) holding a `PolicyModule`."""

    def __init__(self, engine, module: PolicyModule, device: torch.device):
        self.engine, self.module, self.device = engine, module, device

    def adapter(self, enabled: bool):
        """Context with the LoRA adapter on (`enabled`) or off; a no-op without an adapter."""
        if not self.module.is_peft or enabled:
            return nullcontext()
        return self.module.policy.disable_adapter()

    def _inputs(self, mb: MicroBatch) -> tuple:
        rows, cols = mb.predicting_positions()
        d = self.device
        return mb.input_ids.to(d), mb.attention_mask.to(d), rows.to(d), cols.to(d), mb.targets().to(d)

    def stats(self, mb: MicroBatch, sparse: SparseForward | None = None) -> TokenStats:
        return TokenStats(*self.engine(*self._inputs(mb), sparse=sparse))

    def hidden(self, mb: MicroBatch, sparse: SparseForward | None = None) -> torch.Tensor:
        """`[N, H]` final hidden states predicting the response tokens, rows in order."""
        return self.engine(*self._inputs(mb), sparse=sparse, hidden_only=True)

    def dummy_loss(self) -> torch.Tensor:
        """A zero loss through every parameter: keeps ranks with fewer micro-batches in lockstep
        (ZeRO-2/3 reduce gradients and ZeRO-3 gathers parameters inside forward/backward)."""
        one = torch.zeros(1, dtype=torch.long, device=self.device)
        logprobs = self.engine(one[None], torch.ones_like(one)[None], one, one, one)[0]
        return logprobs.sum() * 0.0
