"""Session 17 diagnostic: why FP8 sparse attention runs at 45 % of its floor where dense runs at 56 % (4B, batch 48).
Times the split-K attention kernel alone (graph replay, cold L2) at B=48, H_kv=8, G=4, D=128: dense at 32K and at
6,144 tokens (the budget's block count), sparse 384 blocks of 32K, the committed kernel (HEAD) against the working
tree's, and a sweep of tilings x splits for the sparse rows."""
import json, sys
import torch
from sparrow.layout import SparseAttentionConfig
from sparrow.kernels.triton import bench as kb
from sparrow.kernels.triton import attention as new
from sparrow.kernels.triton import _attention_old as old
from sparrow.kernels.triton.attention import AttentionTiling, attention_tiling
from sparrow.kernels.triton.backend import choose_splits

out = sys.argv[1]
B, H, G, D, CTX, BUDGET = 48, 8, 4, 128, 32768, 384
cfg = SparseAttentionConfig()
rows = []
for dtype in ("fp8_e4m3", "auto"):
    fp8 = dtype != "auto"
    pool = kb.Pool(B * (CTX // 16) + B, H, D, dtype)
    base = attention_tiling(D, fp8)
    splits0 = choose_splits(B * H, 132, fp8)
    full = kb.make_case(pool, B, CTX, G, H, D, seed=1)
    short = kb.make_case(pool, B, BUDGET * 16, G, H, D, seed=2)
    def t(case, tiling, splits, budget, mod):
        saved = kb.attention_partials
        kb.attention_partials = mod.attention_partials
        try:
            return kb.time_attention(pool, case, tiling, splits, 60, budget, cfg if budget else None)
        finally:
            kb.attention_partials = saved
    def rec(what, case, tiling, splits, budget, mod):
        try:
            us = t(case, tiling, splits, budget, mod)
        except Exception as exc:
            print(f"{dtype} {what} {tuple(tiling)} s{splits}: failed {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            return
        tokens = sum(case.lengths) if budget is None else B * BUDGET * 16
        rows.append(dict(dtype=dtype, what=what, tiling=list(tiling), splits=splits, us=us, ns_per_token=1e3 * us / tokens / H))
        print(f"{dtype:8s} {what:14s} {str(tuple(tiling)):12s} s{splits:<2d} {us:9.1f} us  {1e3 * us / tokens / H:.3f} ns/token-head", flush=True)
    for mod, tag in ((old, "HEAD"), (new, "tree")):
        rec(f"dense32K-{tag}", full, base, splits0, None, mod)
        rec(f"dense6K-{tag}", short, base, splits0, None, mod)
        rec(f"sparse-{tag}", full, base, splits0, BUDGET, mod)
    tilings = [base, AttentionTiling(4, 4, 3), AttentionTiling(8, 8, 3), AttentionTiling(16, 4, 3), AttentionTiling(8, 4, 4),
               AttentionTiling(16, 8, 2), AttentionTiling(4, 4, 2), AttentionTiling(8, 4, 2)]
    for tiling in dict.fromkeys(tilings):
        for splits in (1, 2, 4, 8):
            rec("sparse-sweep", full, tiling, splits, BUDGET, new)
    del pool
    torch.cuda.empty_cache()
json.dump(rows, open(out, "w"), indent=1)
