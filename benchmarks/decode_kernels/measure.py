"""Kernel benchmark behind `sparrow bench kernels`: decode attention bandwidth against the copy ceiling.

For each (batch, context, group size, budget) it times, as CUDA-graph replays with a cold, clean L2
(median over CUDA events, see `cuda_timing.median_us`): the dense Triton decode, torch SDPA (flash) on a contiguous cache, and the
sparse layer — score, select, split-K attention and merge, each alone and together. It reports the
bytes each must move and the achieved fraction of the device-to-device copy bandwidth measured in the
same run (bytes read + written), with V = bytes of one stored key or value vector (D · 2 B in bfloat16 pages,
D + 4 B in FP8 pages with their scales, `--kv-cache-dtype fp8_e4m3`):

    dense   = Σ_b L_b · H_kv · 2 (K and V) · V
    sparse  = selected K/V tokens · H_kv · 2 · V + candidate landmarks · H_kv · W · 2 B + scores (fp32, written + read)

The peers (SDPA, FlashInfer) read bfloat16 pages only: FP8 runs time ours alone.

Run: `sparrow bench kernels` or `python -m sparrow.bench.decode_kernels` (CUDA only).
"""

import datetime
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from sparrow.bench.cuda_timing import DEVICE, copy_bandwidth, graph_replay, median_us
from sparrow.bench.result_files import default_out_path
from sparrow.kernels.triton.attention import AttentionTiling, attention_partials, attention_tiling, merge_splits
from sparrow.kernels.triton.backend import TritonBackend, choose_splits, split_waves
from sparrow.kernels.triton.scoring import score_blocks
from sparrow.kernels.triton.selection import select_blocks
from sparrow.layout import BLOCK_SIZE, KVCacheDType, SparseAttentionConfig

from . import flashinfer_baseline as flashinfer
from .cases import Case, Pool, dense_bytes, make_case, sparse_bytes
from .tables import format_or_dash, render_tables


@dataclass
class BenchSpec:
    batches: list[int] = field(default_factory=lambda: [8, 64])
    contexts: list[int] = field(default_factory=lambda: [8192, 16384, 32768])
    budgets: list[int] = field(default_factory=lambda: [1024, 2048, 4096])  # tokens, sinks and recent included
    groups: list[int] = field(default_factory=lambda: [2, 4])
    minmax_contexts: list[int] = field(default_factory=lambda: [32768])  # also time Quest min/max landmarks here
    num_kv_heads: int = 8
    head_dim: int = 128
    kv_cache_dtype: KVCacheDType = "auto"
    sweep: bool = True
    rep_ms: int = 60


def sdpa_dense_us(pool: Pool, case: Case, num_kv_heads: int, head_dim: int, rep_ms: int,
                  check: torch.Tensor | None) -> tuple[float, str, float | None]:
    """torch SDPA on a contiguous [B, H_kv, L, D] cache at uniform length L = context (flash if available)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = math.ceil(case.context / BLOCK_SIZE)
    k = pool.k[case.tables[:, :n].long()].permute(0, 2, 1, 3, 4).reshape(case.batch, num_kv_heads, n * BLOCK_SIZE, head_dim)
    v = pool.v[case.tables[:, :n].long()].permute(0, 2, 1, 3, 4).reshape(case.batch, num_kv_heads, n * BLOCK_SIZE, head_dim)
    k, v = k[:, :, : case.context].contiguous(), v[:, :, : case.context].contiguous()
    q = case.q[:, :, None, :]
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                out = fn()
                us = median_us(fn, rep_ms)
        except RuntimeError:  # backend unsupported for these shapes (or out of memory): try the next
            continue
        err = None if check is None else ((check.float() - out[:, :, 0].float()).norm() / out.float().norm()).item()
        return us, backend.name.lower(), err
    return None, "none", None


def time_attention(pool: Pool, case: Case, tiling: AttentionTiling, splits: int, rep_ms: int,
                   budget_blocks: int | None = None, config: SparseAttentionConfig | None = None) -> float:
    """Microseconds of the split-K attention kernel alone (dense, or sparse after a real selection)."""
    rows = case.batch * pool.k.shape[1]
    g, d = case.group, pool.k.shape[3]
    o_part = torch.empty(rows * splits * g * d, device=DEVICE)
    lse = torch.empty(rows * splits * g, device=DEVICE)
    out = torch.empty_like(case.q)
    kwargs = {}
    if budget_blocks is not None:
        budgets = torch.full((case.batch,), budget_blocks, device=DEVICE, dtype=torch.int32)
        scores = torch.empty(rows, case.tables.shape[1], device=DEVICE)
        selected = torch.empty(rows, case.tables.shape[1], device=DEVICE, dtype=torch.int32)
        counts = torch.empty(case.batch, dtype=torch.long, device=DEVICE)
        score_blocks(case.q, pool.mean, case.tables, case.seq_lens, budgets, scores, block_size=BLOCK_SIZE, sink=config.sink,
                     recent=config.recent, mode="mean")
        select_blocks(scores, case.tables, case.seq_lens, budgets, selected, counts, num_kv_heads=pool.k.shape[1],
                      block_size=BLOCK_SIZE, sink=config.sink, recent=config.recent)
        kwargs = dict(budgets=budgets, selected=selected, sink=config.sink, recent=config.recent)
    fn = lambda: attention_partials(case.q, pool.k, pool.v, case.tables, case.seq_lens, out, o_part, lse,  # noqa: E731
                                    scale=d**-0.5, splits=splits, tiling=tiling, kv_scales=pool.scales, **kwargs)
    return median_us(graph_replay(fn), rep_ms)


def sweep_attention(pool: Pool, spec: BenchSpec, num_sms: int, log) -> tuple[AttentionTiling, int, list[dict]]:
    """Pick the attention tiling and the split-K target (waves of programs per SM) on two probe shapes."""
    config = SparseAttentionConfig()
    probes = [(8, 32768, 4, None), (64, 32768, 4, 128), (8, 32768, 4, 128)]
    tilings = [attention_tiling(spec.head_dim, pool.scales is not None), AttentionTiling(4, 4, 2),
               AttentionTiling(4, 4, 3), AttentionTiling(2, 4, 5), AttentionTiling(8, 4, 3), AttentionTiling(4, 8, 3)]
    if pool.scales is not None:
        tilings += [AttentionTiling(8, 4, 2), AttentionTiling(16, 4, 2), AttentionTiling(8, 8, 2), AttentionTiling(16, 8, 2)]
    waves = [2, 4, 8]
    rows, totals = [], {}
    for i, (batch, context, group, budget) in enumerate(probes):
        case = make_case(pool, batch, context, group, spec.num_kv_heads, spec.head_dim, seed=1000 + i)
        nbytes = (dense_bytes(case, spec.num_kv_heads, pool.vector_bytes) if budget is None
                  else sparse_bytes(case, budget, config, spec.num_kv_heads, spec.head_dim, pool.vector_bytes)["kv"])
        for tiling in dict.fromkeys(tilings):
            for w in waves:
                splits = choose_splits(batch * spec.num_kv_heads, num_sms, pool.scales is not None, waves=w)
                try:
                    us = time_attention(pool, case, tiling, splits, spec.rep_ms, budget, config)
                except Exception as exc:  # a tiling that does not compile or fit is skipped, and said so
                    log(f"  tiling {tuple(tiling)} failed: {type(exc).__name__}: {str(exc)[:120]}")
                    break
                key = (tuple(tiling), w)
                totals[key] = totals.get(key, 0.0) + us / nbytes
                rows.append({"batch": batch, "context": context, "group": group, "budget_blocks": budget,
                             "tiling": list(tiling), "waves": w, "splits": splits, "us": us,
                             "GBps": nbytes / us / 1e3})
    complete = {k: v for k, v in totals.items() if sum(1 for r in rows if (tuple(r["tiling"]), r["waves"]) == k) == len(probes)}
    (best_tiling, best_waves) = min(complete, key=complete.get)
    return AttentionTiling(*best_tiling), best_waves, rows


def time_flashinfer(table: flashinfer.PageTable, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    num_kv_heads: int, reference: torch.Tensor, rep_ms: int) -> dict:
    """FlashInfer's paged decode over `table` (graph-replayed like ours) and its relative error against our output;
    a failure (FlashInfer's JIT build, an unsupported shape) is recorded in the row, not raised."""
    head_dim = q.shape[-1]
    try:
        decode = flashinfer.FlashInferDecode(table, q.shape[1], num_kv_heads, head_dim, k_cache.shape[2], q.dtype,
                                             head_dim**-0.5)
        out = torch.empty_like(q)
        us = median_us(graph_replay(lambda: decode.run(q, k_cache, v_cache, out)), rep_ms)
    except Exception as exc:  # recorded: the rest of the benchmark still runs
        return {"flashinfer_us": None, "flashinfer_error": f"{type(exc).__name__}: {exc}"[:500]}
    ref = reference.reshape(out.shape).float()
    return {"flashinfer_us": us, "flashinfer_rel_err": ((out.float() - ref).norm() / ref.norm()).item()}


def run(spec: BenchSpec, out_path: Path | None, command: str, log=print) -> dict:
    if not torch.cuda.is_available():
        raise ValueError("sparrow bench kernels needs a CUDA GPU (the Triton kernels are CUDA kernels)")
    import triton

    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    h, d = spec.num_kv_heads, spec.head_dim
    copy_gbps = copy_bandwidth()
    tiny = torch.zeros(1, device=DEVICE)
    launch_us = median_us(graph_replay(lambda: tiny.add_(1)), spec.rep_ms)
    log(f"{props.name}: {num_sms} SMs, device-to-device copy {copy_gbps:.0f} GB/s (read + write); "
        f"a one-element kernel in a graph times {launch_us:.1f} us (the per-measurement floor)")
    fp8 = spec.kv_cache_dtype != "auto"
    flashinfer_missing = ("the FP8 pages' per-vector scales: FlashInfer's FP8 decode takes one scale per tensor" if fp8
                          else flashinfer.available())
    log(f"peer kernel: FlashInfer {flashinfer.version()} paged decode (HND, pages of {BLOCK_SIZE})" if flashinfer_missing
        is None else f"peer kernel: FlashInfer not timed: {flashinfer_missing}")
    max_tokens = max(spec.batches) * max(spec.contexts)
    pool = Pool(math.ceil(max_tokens / BLOCK_SIZE) + max(spec.batches), h, d, spec.kv_cache_dtype)
    log(f"K/V pages: {'FP8 (e4m3, a float32 scale per vector)' if fp8 else 'bfloat16'}, {pool.vector_bytes} B per vector")

    tiling, waves, sweep_rows = attention_tiling(d, fp8), split_waves(fp8), []
    if spec.sweep:
        tiling, waves, sweep_rows = sweep_attention(pool, spec, num_sms, log)
        log(f"attention tiling {tuple(tiling)} (blocks/iter, warps, stages), split-K target {waves} waves")

    results = []
    mean_cfg, minmax_cfg = SparseAttentionConfig(), SparseAttentionConfig(landmark="minmax")
    cases = [(b, c, g) for b in spec.batches for c in spec.contexts for g in spec.groups]
    for i, (batch, context, group) in enumerate(cases):
        case = make_case(pool, batch, context, group, h, d, seed=i)
        splits = choose_splits(batch * h, num_sms, fp8, waves=waves)
        backend = TritonBackend(splits=splits, tiling=tiling)
        backend.prepare(batch, case.tables.shape[1], h * group, h, d, DEVICE)
        scale = d**-0.5

        dense_fn = lambda: backend.decode(case.q, pool.k, pool.v, None, case.tables, case.seq_lens, None,  # noqa: E731
                                          mean_cfg, scale, pool.scales)
        dense_graph = graph_replay(dense_fn)
        dense_us = median_us(dense_graph, spec.rep_ms)
        dense_zero_flush_us = median_us(dense_graph, spec.rep_ms, flush="zero")
        nbytes = dense_bytes(case, h, pool.vector_bytes)
        sdpa_us, sdpa_name, sdpa_err = None, "-", None
        if not fp8:
            uniform = torch.full_like(case.seq_lens, context)
            check = backend.decode(case.q, pool.k, pool.v, None, case.tables, uniform, None, mean_cfg, scale)[0]
            sdpa_us, sdpa_name, sdpa_err = sdpa_dense_us(pool, case, h, d, spec.rep_ms, check)
        peer = {"flashinfer_us": None}
        if flashinfer_missing is None:
            peer = time_flashinfer(flashinfer.dense_page_table(case.tables, case.seq_lens, BLOCK_SIZE), case.q,
                                   pool.k, pool.v, h, dense_fn()[0], spec.rep_ms)
        base = {"batch": batch, "context": context, "group": group, "splits": splits}
        results.append({**base, "kind": "dense", "us": dense_us, "zero_flush_us": dense_zero_flush_us, "bytes": nbytes,
                        "pct_copy": 100 * nbytes / dense_us / 1e3 / copy_gbps,
                        "sdpa_us": sdpa_us, "sdpa_backend": sdpa_name,
                        "sdpa_pct_copy": None if sdpa_us is None else
                        100 * (case.batch * context * h * d * 4) / sdpa_us / 1e3 / copy_gbps,
                        "rel_err_vs_sdpa": sdpa_err, **peer,
                        "flashinfer_pct_copy": None if peer["flashinfer_us"] is None else
                        100 * nbytes / peer["flashinfer_us"] / 1e3 / copy_gbps})
        log(f"[{i + 1}/{len(cases)}] B={batch} L={context} G={group}: dense {dense_us:.1f} us "
            f"({results[-1]['pct_copy']:.0f}% of copy), sdpa[{sdpa_name}] {format_or_dash(sdpa_us, '.1f')} us, "
            f"rel err vs sdpa {format_or_dash(sdpa_err, '.1e')}, flashinfer {format_or_dash(peer['flashinfer_us'], '.1f')} us"
            + (f" ({peer['flashinfer_error']})" if "flashinfer_error" in peer else ""))

        modes = [("mean", mean_cfg, pool.mean)] + ([("minmax", minmax_cfg, pool.minmax)]
                                                   if context in spec.minmax_contexts else [])
        for mode, cfg, landmarks in modes:
            for budget_tokens in spec.budgets:
                row = time_sparse(backend, pool, case, landmarks, cfg, budget_tokens // BLOCK_SIZE, splits, tiling, spec.rep_ms,
                                  peer=flashinfer_missing is None)
                row.update(base, kind="sparse", landmark=mode, budget_tokens=budget_tokens,
                           speedup_vs_dense=dense_us / row["layer_us"])
                total = row["bytes"]["total"]
                row["layer_pct_copy"] = 100 * total / row["layer_us"] / 1e3 / copy_gbps
                row["attn_pct_copy"] = 100 * row["bytes"]["kv"] / row["attn_us"] / 1e3 / copy_gbps
                row["score_pct_copy"] = 100 * (row["bytes"]["landmarks"] + row["bytes"]["scores"] // 2) / row["score_us"] / 1e3 / copy_gbps
                results.append(row)
        torch.cuda.empty_cache()

    report = {
        "device": props.name, "num_sms": num_sms, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command, "torch": torch.__version__, "triton": triton.__version__,
        "flashinfer": flashinfer.version() if flashinfer_missing is None else None,
        "flashinfer_missing": flashinfer_missing,
        "kv_cache_dtype": spec.kv_cache_dtype, "vector_bytes": pool.vector_bytes,
        "copy_GBps": copy_gbps, "launch_floor_us": launch_us, "tiling": list(tiling), "split_waves": waves, "spec": asdict(spec),
        "sweep": sweep_rows, "results": results,
    }
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1))
        log(f"wrote {out_path}")
    log(render_tables(report))
    return report


def time_sparse(backend: TritonBackend, pool: Pool, case: Case, landmarks: torch.Tensor, cfg: SparseAttentionConfig,
                budget_blocks: int, splits: int, tiling: AttentionTiling, rep_ms: int, peer: bool = False) -> dict:
    """Per-kernel and whole-layer graph-replay times of one sparse decode layer; with `peer`, FlashInfer's paged
    decode over the same selected blocks (one request per sequence and KV head) beside our attention kernel."""
    h, d = pool.k.shape[1], pool.k.shape[3]
    ws = backend.workspace
    budgets = torch.full((case.batch,), budget_blocks, dtype=torch.int32, device=DEVICE)
    counts = torch.empty(case.batch, dtype=torch.long, device=DEVICE)
    out = torch.empty_like(case.q)
    score = lambda: score_blocks(case.q, landmarks, case.tables, case.seq_lens, budgets, ws.scores, block_size=BLOCK_SIZE,  # noqa: E731
                                 sink=cfg.sink, recent=cfg.recent, mode=cfg.landmark)
    select = lambda: select_blocks(ws.scores, case.tables, case.seq_lens, budgets, ws.selected, counts,  # noqa: E731
                                   num_kv_heads=h, block_size=BLOCK_SIZE, sink=cfg.sink, recent=cfg.recent)
    attend = lambda: attention_partials(case.q, pool.k, pool.v, case.tables, case.seq_lens, out, ws.o_part,  # noqa: E731
                                        ws.lse_part, scale=d**-0.5, splits=splits, budgets=budgets,
                                        selected=ws.selected, sink=cfg.sink, recent=cfg.recent, tiling=tiling,
                                        kv_scales=pool.scales)
    merge = lambda: merge_splits(ws.o_part, ws.lse_part, out, num_kv_heads=h, splits=splits)  # noqa: E731
    layer = lambda: backend.decode(case.q, pool.k, pool.v, landmarks, case.tables, case.seq_lens, budgets, cfg,  # noqa: E731
                                   d**-0.5, pool.scales)
    times = {"score_us": median_us(graph_replay(score), rep_ms), "select_us": median_us(graph_replay(select), rep_ms),
             "attn_us": median_us(graph_replay(attend), rep_ms),
             "merge_us": median_us(graph_replay(merge), rep_ms) if splits > 1 else 0.0,
             "layer_us": median_us(graph_replay(layer), rep_ms)}
    if peer:
        select()
        table = flashinfer.sparse_page_table(case.tables, case.seq_lens, ws.selected, counts, h, BLOCK_SIZE)
        group_q = case.q.view(case.batch * h, case.group, d)
        times.update(time_flashinfer(table, group_q, flashinfer.per_head_pages(pool.k), flashinfer.per_head_pages(pool.v),
                                     1, layer()[0], rep_ms))
    return {**times, "budget_blocks": budget_blocks,
            "bytes": sparse_bytes(case, budget_blocks, cfg, h, d, pool.vector_bytes)}


def run_from_args(args, command: str) -> dict:
    """Run with the options of `sparrow bench kernels` (None = the BenchSpec default)."""
    defaults = BenchSpec()
    pick = lambda name: getattr(defaults, name) if getattr(args, name, None) is None else getattr(args, name)  # noqa: E731
    spec = BenchSpec(batches=pick("batches"), contexts=pick("contexts"), budgets=pick("budgets"), groups=pick("groups"),
                     minmax_contexts=pick("minmax_contexts"), kv_cache_dtype=pick("kv_cache_dtype"),
                     sweep=not args.no_sweep, rep_ms=pick("rep_ms"))
    for budget in spec.budgets:
        if budget <= 0 or budget % BLOCK_SIZE:
            raise ValueError(f"--budgets {budget}: use positive multiples of the block size {BLOCK_SIZE}")
    out = args.out
    if out is None and torch.cuda.is_available():
        out = default_out_path(torch.cuda.get_device_properties(0).name, "kernels")
    return run(spec, out, command)
