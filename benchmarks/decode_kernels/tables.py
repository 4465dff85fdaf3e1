"""The tables `sparrow bench kernels` prints from its report (dense and sparse rows, beside the peers)."""

from sparrow.tables import format_table


def render_tables(report: dict) -> str:
    """The dense table, then the sparse one, under a line saying how to read them."""
    dense = [r for r in report["results"] if r["kind"] == "dense"]
    sparse = [r for r in report["results"] if r["kind"] == "sparse"]
    pages = "FP8 (e4m3 + scales)" if report.get("kv_cache_dtype", "auto") != "auto" else "bfloat16"
    lines = [f"{report['device']}, {pages} K/V pages, copy bandwidth {report['copy_GBps']:.0f} GB/s; times are medians of CUDA-graph "
             f"replays after a read-only L2 flush (us; a one-element kernel times {report['launch_floor_us']:.1f} us); "
             f"% = achieved bandwidth on the bytes that must move / copy bandwidth; 'zero-flush' = the same "
             f"graph after do_bench's zeroing flush", ""]
    lines.append(format_table(
        ["B", "L", "G", "splits", "dense us", "dense %", "zero-flush us", "sdpa us", "sdpa %", "sdpa backend",
         "rel err vs sdpa", "flashinfer us", "flashinfer %", "ours / flashinfer"],
        [[r["batch"], r["context"], r["group"], r["splits"], f"{r['us']:.1f}", f"{r['pct_copy']:.0f}",
          f"{r['zero_flush_us']:.1f}",
          format_or_dash(r["sdpa_us"], ".1f"), format_or_dash(r["sdpa_pct_copy"], ".0f"), r["sdpa_backend"],
          format_or_dash(r["rel_err_vs_sdpa"], ".1e"),
          format_or_dash(r.get("flashinfer_us"), ".1f"), format_or_dash(r.get("flashinfer_pct_copy"), ".0f"),
          format_or_dash(_ratio(r["us"], r.get("flashinfer_us")), ".2f")]
         for r in dense]))
    lines.append("")
    lines.append(format_table(
        ["B", "L", "G", "lm", "budget", "score us", "score %", "select us", "attn us", "attn %", "merge us",
         "layer us", "layer %", "vs dense", "flashinfer attn us", "attn+merge / flashinfer"],
        [[r["batch"], r["context"], r["group"], r["landmark"], r["budget_tokens"], f"{r['score_us']:.1f}",
          f"{r['score_pct_copy']:.0f}", f"{r['select_us']:.1f}", f"{r['attn_us']:.1f}", f"{r['attn_pct_copy']:.0f}",
          f"{r['merge_us']:.1f}", f"{r['layer_us']:.1f}", f"{r['layer_pct_copy']:.0f}", f"{r['speedup_vs_dense']:.2f}x",
          format_or_dash(r.get("flashinfer_us"), ".1f"),
          format_or_dash(_ratio(r["attn_us"] + r["merge_us"], r.get("flashinfer_us")), ".2f")]
         for r in sparse]))
    return "\n".join(lines)


def format_or_dash(value, spec: str) -> str:
    """`value` formatted, or `-` where it was not measured (a peer missing, a backend unsupported)."""
    return "-" if value is None else format(value, spec)


def _ratio(ours: float, peer: float | None) -> float | None:
    """Our time over the peer's (< 1: ours is faster)."""
    return None if peer is None else ours / peer
