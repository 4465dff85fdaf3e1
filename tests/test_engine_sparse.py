"""Sparse decode in the engine = the reference causal block-sparse attention, teacher-forced; and on a
real model with a small budget, the dense/sparse acceptance α is < 1 on some tokens, ≈ 1 on most."""

import sysconfig
from pathlib import Path

import pytest
import torch

from sparrow.acceptance import acceptance_exact
from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import (
    SparseRows,
    block_sparse_causal_attention,
    block_sparse_causal_sdpa,
    block_sparse_causal_sdpa_batch,
    first_sparse_query,
    sparse_causal_mask,
    sparse_rows_mask,
)
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, teacher_forced_logprobs
from sparrow.rollout_workers.native.attention import TeacherForced
from sparrow.schedule import DENSE_BUDGET, SparsitySchedule

SMALL = SparsitySchedule(name="small", topk_blocks=(2, 4), edges=(160,))  # 5 blocks, then 7 beyond 160 tokens


def sparse_samples(model_dir, schedule, landmark="mean", n=2):
    engine = NativeEngine.from_pretrained(model_dir, num_kv_blocks=256, landmark=landmark)
    engine.set_schedule(schedule)
    requests = [RolloutRequest(f"r{i}", tuple(range(3 + i, 110 + 7 * i)),
                               SamplingParams(max_tokens=60, temperature=1.0, seed=i, n=n, ignore_eos=True))
                for i in range(2)]
    return engine, engine.generate(requests)


@pytest.mark.parametrize("landmark", ["mean", "minmax", "mean_int8"])
@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_llama"])
def test_sparse_decode_equals_teacher_forced_reference(family, landmark, request):
    engine, samples = sparse_samples(request.getfixturevalue(family), SMALL, landmark)
    sparse_seen = False
    for s in samples:
        tokens = list(s.prompt_token_ids) + s.token_ids.tolist()
        prompt_len = len(s.prompt_token_ids)
        forced = teacher_forced_logprobs(engine.runner.model, tokens, prompt_len, SMALL, engine.layout)
        assert (forced.logprobs - s.logprobs).abs().max().item() < 1e-4
        assert torch.equal(forced.blocks_attended.int(), s.blocks_attended)
        # The same from the sample's own block counts, without the schedule (what a trainer has).
        replay = teacher_forced_logprobs(engine.runner.model, tokens, prompt_len, attention=engine.layout,
                                         blocks_attended=s.blocks_attended)
        assert (replay.logprobs - s.logprobs).abs().max().item() < 1e-4
        dense = teacher_forced_logprobs(engine.runner.model, tokens, prompt_len, None, engine.layout)
        sparse_seen |= (dense.logprobs - s.logprobs).abs().max().item() > 1e-2
        lengths = prompt_len + torch.arange(len(tokens) - prompt_len)  # context of the producing query
        expected = torch.minimum((lengths + 15) // 16, SMALL.budgets_for_lengths(lengths))
        expected[0] = (prompt_len + 15) // 16  # the first token comes from the dense prefill
        assert torch.equal(s.blocks_attended.long(), expected)
    assert sparse_seen, "the budget never bit: the test would pass for a dense engine"


def test_sparse_rows_mask_equals_reference_rows():
    torch.manual_seed(0)
    config = SparseAttentionConfig(sink=1, recent=2)
    q, k = torch.randn(200, 4, 16), torch.randn(200, 2, 16)
    budgets = torch.randint(3, 9, (200,))
    budgets[:40] = DENSE_BUDGET
    full = sparse_causal_mask(q, k, budgets, config)
    start, end = 120, 170
    rows = sparse_rows_mask(q[start:end], k[:end], torch.arange(start, end), budgets[start:end], config)
    assert torch.equal(rows, full[:, start:end, :end])


def test_teacher_forced_attention_equals_reference_function():
    torch.manual_seed(1)
    config = SparseAttentionConfig(sink=1, recent=2, dense_layers=(0,))
    q, k, v = torch.randn(150, 4, 16), torch.randn(150, 2, 16), torch.randn(150, 2, 16)
    budgets = torch.randint(3, 7, (150,))
    ours = TeacherForced(config, budgets)(1, q, k, v)
    assert (ours - block_sparse_causal_attention(q, k, v, budgets, config)).abs().max().item() < 1e-5


def license_prompt(tokenizer, num_tokens: int) -> list[int]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    return tokenizer(text)["input_ids"][:num_tokens]


@pytest.mark.slow
def test_small_budget_on_smollm2_gives_alpha_below_one_on_some_tokens(smollm2):
    """The phenomenon Sparrow rests on, measured: α between the transformers fp32 dense forward and the
    engine's sparse policy (8 blocks of a ~1.2K-token context) drops below 1 on some tokens, stays high
    on typical ones, and rises toward 1 as the budget grows. Numbers are printed (docs/native_engine.md)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    small = SparsitySchedule(name="8-blocks", topk_blocks=(5,), edges=())
    large = SparsitySchedule(name="32-blocks", topk_blocks=(29,), edges=())
    engine = NativeEngine.from_pretrained(smollm2, num_kv_blocks=200)
    engine.set_schedule(small)
    prompt = license_prompt(tokenizer, 1200)
    sample = engine.generate([RolloutRequest("license", tuple(prompt),
                                             SamplingParams(max_tokens=48, temperature=1.0, seed=3, ignore_eos=True))])[0]
    assert sample.finish_reason == "length" and torch.isfinite(sample.logprobs).all()
    assert (sample.blocks_attended[1:] == 8).all()
    tokens = prompt + sample.token_ids.tolist()
    q_small = engine.teacher_forced_logprobs(tokens, len(prompt), small, full=True)
    assert (q_small.logprobs - sample.logprobs).abs().max().item() < 1e-3
    q_large = engine.teacher_forced_logprobs(tokens, len(prompt), large, full=True)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    with torch.no_grad():
        p = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    # Token 0 comes from the dense prefill, so it is exact under both.
    alpha = {name: acceptance_exact(p, q.full_logprobs)[1:] for name, q in (("8", q_small), ("32", q_large))}
    for name, a in alpha.items():
        print(f"\nSmolLM2-135M, {name} blocks of {len(tokens) // 16} (context {len(prompt)}-{len(tokens)}): "
              f"alpha min {a.min():.3f} p5 {a.quantile(0.05):.3f} median {a.median():.3f} mean {a.mean():.3f} "
              f"share>=0.95 {(a >= 0.95).float().mean():.2f}")
    a8, a32 = alpha["8"], alpha["32"]
    assert a8.min() < 0.9 and a8.median() > 0.6
    assert a32.mean() > a8.mean()


def test_byte_floor_speedup_counts_the_bytes_each_mode_must_move():
    """The rollout benchmark's bound: 1 when the budget covers every context; at one context, weights + dense
    layers' K/V + attended K/V + landmarks and scores of the candidates, per the step's byte count."""
    from sparrow.bench.rollout import byte_floor_speedup
    from sparrow.rollout_workers.native.shapes import spec_for_shape

    config, spec = SparseAttentionConfig(), spec_for_shape("qwen3-1.7b")
    wide = SparsitySchedule(name="wide", topk_blocks=(4096,), edges=())
    assert byte_floor_speedup(spec, wide, config, 8, 257, 32768) == pytest.approx(1.0)
    budget = SparsitySchedule(name="b64", topk_blocks=(64 - config.reserved_blocks,), edges=())
    batch, heads, kv_tok = 8, 8, 8 * 128 * 2 * 2  # Qwen3-1.7B: 8 KV heads of 128, K and V in bf16, per token
    weights = 1_720_574_976 * 2  # tied embeddings: every parameter is read
    context, n = 32769, 2049
    dense = weights + 28 * batch * context * kv_tok
    per_candidate = heads * (128 * 2 + 8)  # a mean landmark per KV head, and its fp32 score written and read
    sparse = (weights + 2 * batch * context * kv_tok + 26 * batch * (63 * 16 + 1) * kv_tok
              + 26 * batch * (n - 3) * per_candidate)
    assert byte_floor_speedup(spec, budget, config, batch, context, context) == pytest.approx(dense / sparse)
    fp8_tok = 8 * (128 + 4) * 2  # FP8 pages: a byte an element and a float32 scale per vector, K and V
    dense = weights + 28 * batch * context * fp8_tok
    sparse = (weights + 2 * batch * context * fp8_tok + 26 * batch * (63 * 16 + 1) * fp8_tok
              + 26 * batch * (n - 3) * per_candidate)
    assert byte_floor_speedup(spec, budget, config, batch, context, context, "fp8_e4m3") == pytest.approx(dense / sparse)
    dense = weights + 28 * batch * context * kv_tok
    sparse = (weights + 2 * batch * context * kv_tok + 26 * batch * (63 * 16 + 1) * kv_tok
              + 26 * batch * (n - 3) * heads * (144 + 8))  # int8 rows: 128 values, the scale, padding to 16 bytes
    int8 = SparseAttentionConfig(landmark="mean_int8")
    assert byte_floor_speedup(spec, budget, int8, batch, context, context) == pytest.approx(dense / sparse)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_the_sdpa_form_equals_the_reference_with_its_gradients(heads):
    """What the trainer's sparse forward and the teacher-forced engine run, against the definition: same output and
    same gradients for q, k, v (float32), GQA included, with a scale other than 1/sqrt(D)."""
    num_q, num_kv = heads
    gen = torch.Generator().manual_seed(0)
    seq, dim = 150, 16
    config = SparseAttentionConfig(block_size=16, sink=1, recent=2)
    inputs = [torch.randn(seq, h, dim, generator=gen, requires_grad=True) for h in (num_q, num_kv, num_kv)]
    weights = torch.randn(seq, num_q, dim, generator=gen)
    # a 40-token prompt; no prompt (sparse from the first query whose blocks exceed 5); every query dense
    for budgets in (torch.where(torch.arange(seq) < 40, DENSE_BUDGET, 5), torch.full((seq,), 5),
                    torch.full((seq,), DENSE_BUDGET)):
        grads = []
        for attention in (block_sparse_causal_attention, block_sparse_causal_sdpa):
            out = attention(*inputs, budgets, config, 0.2)
            grads.append((out, *torch.autograd.grad((out * weights).sum(), inputs)))
        for ref, got in zip(*grads):
            assert (ref - got).abs().max().item() < 1e-5


def test_first_sparse_query_is_where_a_budget_first_falls_below_its_blocks():
    """The dense prefix the SDPA form runs causally: a prompt's end, the first query whose context outgrows its
    budget (never before `reserved_blocks` of context), or the whole row when every budget covers its context."""
    config = SparseAttentionConfig(block_size=16, sink=1, recent=2)
    assert first_sparse_query(torch.where(torch.arange(150) < 40, DENSE_BUDGET, 5), config) == 80  # 5 blocks cover 80
    assert first_sparse_query(torch.where(torch.arange(150) < 100, DENSE_BUDGET, 5), config) == 100
    assert first_sparse_query(torch.full((150,), 1), config) == 3 * 16  # reserved 3 blocks: queries 0..47 dense
    assert first_sparse_query(torch.full((150,), DENSE_BUDGET), config) == 150
    budgets = torch.where(torch.arange(150) < 40, DENSE_BUDGET, 5)
    q, k, v = (torch.randn(150, h, 16, generator=torch.Generator().manual_seed(h)) for h in (4, 2, 2))
    rows = SparseRows.of(budgets[None], [150], config)
    given = block_sparse_causal_sdpa(q, k, v, budgets, config, rows=rows)
    assert torch.equal(given, block_sparse_causal_sdpa(q, k, v, budgets, config))


def test_the_batched_sdpa_form_equals_the_reference_row_by_row_with_its_gradients():
    """One call for a right-padded batch (what each trainer layer runs): rows of different lengths and prompts, one
    with no sparse query at all, equal the reference on each row alone, outputs and q/k/v gradients, and the
    padding gets no gradient from the real positions."""
    gen = torch.Generator().manual_seed(3)
    seq, dim, config = 150, 16, SparseAttentionConfig(block_size=16, sink=1, recent=2)
    lengths, prompts = [150, 97, 120], [40, 60, 120]
    budgets = torch.stack([torch.where(torch.arange(seq) < p, DENSE_BUDGET, 5) for p in prompts])
    q, k, v = (torch.randn(3, h, seq, dim, generator=gen, requires_grad=True) for h in (6, 2, 2))
    weights = torch.randn(3, seq, 6, dim, generator=gen)
    valid = (torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None])[..., None, None]
    firsts = [first_sparse_query(budgets[b, :n], config) for b, n in enumerate(lengths)]
    assert firsts == [80, 80, 120]  # the third row is all prompt: nothing of it runs masked
    rows = SparseRows.of(budgets, lengths, config)
    out = block_sparse_causal_sdpa_batch(q, k, v, budgets, rows, config, 0.2)
    grads = torch.autograd.grad((out * weights * valid).sum(), (q, k, v))
    for b, n in enumerate(lengths):
        row = [t[b, :, :n].detach().transpose(0, 1).requires_grad_() for t in (q, k, v)]
        ref = block_sparse_causal_attention(*row, budgets[b, :n], config, 0.2)
        ref_grads = torch.autograd.grad((ref * weights[b, :n]).sum(), row)
        assert (out[b, :n] - ref).abs().max().item() < 1e-5
        for got, want in zip(grads, ref_grads):
            assert (got[b, :, :n].transpose(0, 1) - want).abs().max().item() < 1e-5
            assert got[b, :, n:].abs().max().item() == 0.0 if n < seq else True
