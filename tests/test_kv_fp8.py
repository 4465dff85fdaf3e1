"""FP8 (e4m3) KV pages with one scale per stored vector: the rounding bound, the backends reading them as the
round-tripped values, the memory they save, the engine's rollouts replayed exactly, and the refusals."""

import pytest
import torch
from test_engine_backend import random_paged_batch

from sparrow.kernels import ReferenceBackend, SparseAttentionConfig, TorchBackend
from sparrow.kernels.reference import FP8_KV_DTYPE, KVScales, landmarks_from_keys, quantize, round_trip
from sparrow.kernels.reference.kv_quant import FP8_MAX, INV_FP8_MAX
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
from sparrow.rollout_workers.native.kv_cache import bytes_per_block
from sparrow.rollout_workers.native.model_spec import ModelSpec
from sparrow.schedule import SparsitySchedule


def test_rounding_is_within_e4m3s_step_of_each_element():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen) * torch.logspace(-3, 3, 512)[:, None]
    x[0] = 0.0
    q, scale = quantize(x)
    assert q.dtype == FP8_KV_DTYPE and scale.shape == (512,) and scale[0] == 0
    back = round_trip(x)
    assert torch.equal(back[0], x[0])
    scaled_error = ((back - x).abs() / torch.where(scale > 0, scale, 1)[:, None])
    scaled = (x.abs() / torch.where(scale > 0, scale, 1)[:, None])
    # 3 mantissa bits: half a step is 2^-4 of the value for normals, 2^-10 (half the subnormal step) below 2^-6.
    assert bool((scaled_error <= torch.maximum(scaled * 2**-4, torch.full_like(scaled, 2**-10)) + 1e-6).all())
    assert float(scaled.amax(dim=1)[1:].min()) == pytest.approx(448.0)


def test_scale_is_the_same_float32_product_on_every_device():
    """amax * float32(1/448), not amax / 448: torch on CUDA divides by a Python scalar through its reciprocal and
    the CPU divides, so a quotient would differ in the last bit between the devices (and from the Triton kernel),
    and a one-ulp scale moves elements on e4m3 rounding boundaries by a whole step (seen on an H100)."""
    assert torch.tensor(INV_FP8_MAX, dtype=torch.float32).item() == INV_FP8_MAX  # exact in float32
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(1))
    _, scale = quantize(x)
    product = x.abs().amax(dim=1) * torch.tensor(INV_FP8_MAX, dtype=torch.float32)
    assert torch.equal(scale, product)
    quotient = x.abs().amax(dim=1) / FP8_MAX
    assert not torch.equal(product, quotient)  # the two definitions do differ on some vectors


@pytest.mark.parametrize("landmark", ["mean", "minmax"])
@pytest.mark.parametrize("budget_kind", ["dense", "sparse"])
def test_fp8_pages_read_as_the_round_tripped_values_by_both_cpu_backends(landmark, budget_kind):
    """Writing FP8 pages then decoding equals decoding a float32 cache holding round_trip(k), round_trip(v); the
    landmarks are those of the stored (rounded) keys."""
    config = SparseAttentionConfig(landmark=landmark)
    lengths = [37, 160, 201]
    q, k0, v0, slots, k, v, tables = random_paged_batch(3, lengths)
    seq_lens = torch.tensor(lengths)
    budgets = None if budget_kind == "dense" else torch.tensor([3, 4, 5])
    width = config.landmark_width(k0.shape[-1])

    exact_lm = torch.zeros(k0.shape[0], k0.shape[1], width)
    k_exact, v_exact = k0.clone(), v0.clone()
    ReferenceBackend().write_kv(k_exact, v_exact, exact_lm, slots, round_trip(k), round_trip(v), config)
    want, want_counts = ReferenceBackend().decode(q, k_exact, v_exact, exact_lm, tables, seq_lens, budgets, config, 0.25)

    for backend in (ReferenceBackend(), TorchBackend()):
        k_cache = torch.zeros(k0.shape, dtype=FP8_KV_DTYPE)
        v_cache = torch.zeros(k0.shape, dtype=FP8_KV_DTYPE)
        scales = KVScales(torch.zeros(k0.shape[:-1]), torch.zeros(k0.shape[:-1]))
        landmarks = torch.zeros(k0.shape[0], k0.shape[1], width)
        backend.write_kv(k_cache, v_cache, landmarks, slots[:120], k[:120], v[:120], config, scales)
        backend.write_kv(k_cache, v_cache, landmarks, slots[120:], k[120:], v[120:], config, scales)
        assert (landmarks - exact_lm).abs().max() < 1e-5, backend.name
        out, counts = backend.decode(q, k_cache, v_cache, landmarks, tables, seq_lens, budgets, config, 0.25, scales)
        assert torch.equal(counts, want_counts), backend.name
        assert (out - want).abs().max() < 1e-5, backend.name


def test_landmarks_of_a_full_block_are_the_mean_of_its_rounded_keys():
    config = SparseAttentionConfig()
    keys = torch.randn(32, 2, 16) * 3
    k_cache = torch.zeros(4, 2, 16, 16, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    scales = KVScales(torch.zeros(4, 2, 16), torch.zeros(4, 2, 16))
    landmarks = torch.zeros(4, 2, 16)
    TorchBackend().write_kv(k_cache, v_cache, landmarks, torch.tensor([32 + i for i in range(32)]), keys, keys, config, scales)
    assert torch.allclose(landmarks[2:4], landmarks_from_keys(round_trip(keys), 16), atol=1e-6)


def test_fp8_pages_take_0_53_of_bfloat16s_bytes():
    """Qwen3-1.7B's shape (28 layers, 8 KV heads, head_dim 128), layers 0-1 dense: what sizes the KV pool."""
    spec = ModelSpec(family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                     num_heads=16, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
                     tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True)
    attention = SparseAttentionConfig()
    bf16 = bytes_per_block(spec, attention, torch.bfloat16)
    fp8 = bytes_per_block(spec, attention, torch.bfloat16, "fp8_e4m3")
    pages = 2 * 28 * 8 * 16 * 128
    landmarks = 26 * 8 * 128 * 2
    assert bf16 == pages * 2 + landmarks
    assert fp8 == pages + 2 * 28 * 8 * 16 * 4 + landmarks
    assert round(fp8 / bf16, 3) == 0.529


@pytest.mark.parametrize("landmark", ["mean", "mean_int8"])
def test_an_fp8_engine_rolls_out_what_its_replay_recomputes(tiny_qwen3, landmark):
    """The engine (chunked prefill, sparse decode) reads K/V as stored; the calibration replay rounds them the same
    way, so on the 4-layer model it reproduces the sampled tokens' log-probabilities (on deep models last-bit
    differences flip some roundings: calibration.md); the dense recompute (unrounded) does not. Int8 landmarks over
    FP8 pages too."""
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=128, kv_cache_dtype="fp8_e4m3", prefill_chunk_size=64,
                                          landmark=landmark)
    engine.set_schedule(SparsitySchedule(name="s", topk_blocks=(4,), edges=()))
    request = RolloutRequest("r", tuple(range(5, 105)), SamplingParams(max_tokens=40, ignore_eos=True, n=2, seed=1))
    samples = engine.generate([request])
    scorer = engine.prompt_scorer(request.prompt_token_ids, 1.0)
    assert scorer.quantized_kv and engine.stats()["kv_cache_dtype"] == "fp8_e4m3"
    for sample in samples:
        replay = scorer.logprobs(sample.token_ids, sample.blocks_attended)
        dense = scorer.logprobs(sample.token_ids)
        assert torch.equal(replay.blocks_attended.cpu(), sample.blocks_attended)
        assert (replay.logprobs - sample.logprobs.float()).abs().max() < 1e-4
        assert (dense.logprobs - sample.logprobs.float()).abs().max() > 1e-3
    plain = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=128, prefill_chunk_size=64)
    assert not plain.prompt_scorer(request.prompt_token_ids, 1.0).quantized_kv


def test_an_unknown_kv_cache_dtype_is_named(tiny_qwen3):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        NativeEngineConfig(model=str(tiny_qwen3), kv_cache_dtype="fp8")
