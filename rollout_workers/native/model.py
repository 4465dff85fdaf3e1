"""Llama / Qwen2 / Qwen3 decoder over a flat batch of tokens, with attention left to the caller.

Parameter names equal the HF checkpoint names (`model.layers.0.self_attn.q_proj.weight`, ...), so
checkpoints and trainer state dicts load without a name map. The model only projects, normalises,
rotates and runs the MLP; each layer hands `q, k, v` to an `attention(layer, q, k, v)` callable, which
is where the paged cache, the sparse decode and the teacher-forced sparse attention live.

On CUDA the model is *fused* (`DecoderModel(fuse=...)`): q/k/v and gate/up each read one weight tensor
(the per-projection parameters are views into it, so loading weights fills it), and q/k RMSNorm + RoPE
and the SiLU gate are single Triton kernels, and each residual add runs inside the RMSNorm after it
(`sparrow.kernels.triton.fused`). A decode layer then launches ~12 kernels instead of ~28, which is what
a small-batch decode step costs.

With a `TensorParallel` (tensor_parallel.py) the model is one rank's shard: `spec` counts this rank's heads,
KV heads and MLP slice, and o_proj / down_proj outputs are summed over the ranks by an all-reduce.
"""

import zlib
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from sparrow.seeds import stable_seed

from .model_spec import ModelSpec
from .rope import RotaryEmbedding, apply_rotary
from .tensor_parallel import TensorParallel


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`q: [N, H, D]`, `k, v: [N, H_kv, D]` (post-RoPE) → `[N, H, D]`."""


def fused_ops(required: bool = True):
    """`sparrow.kernels.triton.fused`, or None when Triton is missing and `required` is False."""
    try:
        from sparrow.kernels.triton import fused
    except ImportError as exc:
        if required:
            raise ValueError(f"the fused model needs the Triton kernels ({exc}); build it with fuse=False") from None
        return None
    return fused


def share_storage(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) tensor for linears that read the same input, their outputs concatenated; each
    linear's parameters become views into it, so weights loaded into them land in the shared tensor."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    bias = None if linears[0].bias is None else torch.cat([lin.bias.detach() for lin in linears])
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalises in float32 like HF's RMSNorm; one fused kernel on CUDA instead of seven launches.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.tensor_parallel = tensor_parallel
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        """Fused q/k/v weight and bias (set by `DecoderModel.fuse`)."""

    def forward(self, x, rotary: tuple[torch.Tensor, torch.Tensor], attention: Attention, layer: int) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        if self.qkv is None:
            q = self.q_proj(x).view(n, self.num_heads, d)
            k = self.k_proj(x).view(n, self.num_kv_heads, d)
            v = self.v_proj(x).view(n, self.num_kv_heads, d)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rotary(q, k, *rotary)
        else:
            qkv = F.linear(x, *self.qkv)
            q_end, k_end = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
            q = qkv[:, :q_end].view(n, self.num_heads, d)
            k = qkv[:, q_end:k_end].view(n, self.num_kv_heads, d)
            v = qkv[:, k_end:].view(n, self.num_kv_heads, d)
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            q, k = fused_ops().qk_norm_rope(q, k, norms[0], norms[1], *rotary, norms[2])
        out = self.o_proj(attention(layer, q, k, v).reshape(n, self.num_heads * self.head_dim))
        return out if self.tensor_parallel is None else self.tensor_parallel.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.tensor_parallel = tensor_parallel
        h, i, b = spec.hidden_size, spec.intermediate_size, spec.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None
        """Fused gate/up weight and bias (set by `DecoderModel.fuse`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        else:
            out = self.down_proj(fused_ops().silu_mul(F.linear(x, *self.gate_up)))
        return out if self.tensor_parallel is None else self.tensor_parallel.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = SelfAttention(spec, tensor_parallel)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, tensor_parallel)

    def forward(self, x, rotary, attention, layer):
        x = x + self.self_attn(self.input_layernorm(x), rotary, attention, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, spec: ModelSpec, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, tensor_parallel) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DecoderModel(nn.Module):
    """`forward(input_ids [N], positions [N], attention)` → final hidden states `[N, hidden]`;
    `logits(hidden)` → float32 logits. A tied model has no `lm_head` parameter of its own.
    With `tensor_parallel`, it is this rank's shard and `spec` is the shard's (`TensorParallel.shard_spec`)."""

    def __init__(self, spec: ModelSpec, max_positions: int, device: torch.device | str = "cpu", dtype=torch.float32,
                 fuse: bool | None = None, tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.tensor_parallel = tensor_parallel
        self.spec = spec if tensor_parallel is None else tensor_parallel.shard_spec(spec)
        with torch.device("meta"):
            self.model = Body(self.spec, tensor_parallel)
            self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Cast while still on meta: casting after allocation would hold float32 weights for a moment (32.8 GB for
        # the 8B shape), which does not fit beside a full KV cache.
        self.to(dtype)
        self.to_empty(device=device)
        self.rope = RotaryEmbedding(spec.rope, spec.head_dim, max_positions, device=device)
        self.requires_grad_(False)
        self.fused = False
        if fuse or (fuse is None and torch.device(device).type == "cuda" and fused_ops(required=False) is not None):
            self.fuse()

    def fuse(self) -> None:
        """Share one weight tensor between q/k/v and between gate/up and use the fused Triton kernels.
        Call once, before loading weights or anywhere after; do not move the model afterwards."""
        fused_ops()
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv = share_storage([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.gate_up = share_storage([mlp.gate_proj, mlp.up_proj])
        self.fused = True

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        rotary = self.rope(positions, x.dtype)
        if self.fused:
            return self._fused_layers(x, rotary, attention)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rotary, attention, i)
        return self.model.norm(x)

    def _fused_layers(self, x, rotary, attention) -> torch.Tensor:
        """The layers with each residual add fused into the RMSNorm that follows it (the next sublayer's,
        or the final norm): two kernels per layer instead of four."""
        add_norm = fused_ops().add_rms_norm
        norms = [n for layer in self.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(self.model.norm)
        x, h = add_norm(x, None, norms[0].weight, norms[0].eps)
        for i, layer in enumerate(self.model.layers):
            post, after = norms[2 * i + 1], norms[2 * i + 2]
            x, h = add_norm(x, layer.self_attn(h, rotary, attention, i), post.weight, post.eps)
            x, h = add_norm(x, layer.mlp(h), after.weight, after.eps)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def init_random(self, seed: int = 0, std: float = 0.02) -> "DecoderModel":
        """Random weights (norms at 1) for shape-only benchmarks. Each parameter draws from its own generator,
        seeded by `seed` and its name, so the replicated parameters of tensor-parallel shards are equal."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                gen = torch.Generator(device=self.device).manual_seed(stable_seed(seed, zlib.crc32(name.encode())))
                p.normal_(0.0, std, generator=gen)
        return self
