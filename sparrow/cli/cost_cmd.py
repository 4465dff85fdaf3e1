"""`sparrow cost`: predicted dense vs sparse decode cost of a rollout and the speedup of a schedule."""

import json

from pydantic import ValidationError

from sparrow.cost import (
    CostModel, RolloutSpec, appf_cost, resolve_hardware, resolve_model, sec33_dense, sec33_sparse,
)
from sparrow.cost.hardware import HARDWARE
from sparrow.layout import LANDMARK_MODES
from sparrow.schedule import load_schedule
from sparrow.tables import format_table


def configure(p) -> None:
    p.add_argument("--model", required=True, help="qwen3-0.6b|1.7b|4b|8b|14b, or an HF config.json / model directory")
    p.add_argument("--schedule", required=True, metavar="NAME_OR_FILE", help="published schedule name or schedule file")
    p.add_argument("--hardware", default="h200", help=f"one of {', '.join(HARDWARE)} (default h200)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--gen-len", type=int, default=32000, help="generated tokens per sample (default 32000)")
    p.add_argument("--samples", type=int, default=8, help="N: samples per prompt (default 8)")
    p.add_argument("--batch", type=int, default=1, help="prompts decoded together (default 1)")
    p.add_argument("--dense-layers", type=int, default=2, help="leading layers kept dense (default 2)")
    p.add_argument("--landmark", choices=LANDMARK_MODES, default="mean", help="block summary (default mean)")
    p.add_argument("--scoring-as-printed", action="store_true",
                   help="Sec. 3.3 prompt scoring terms as printed (not divided by the block size)")
    p.add_argument("--per-bin", action="store_true", help="also print the schedule-aware cost per length bin")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run)


def _spec(args) -> RolloutSpec:
    try:
        return RolloutSpec(prompt_len=args.prompt_len, gen_len=args.gen_len, samples=args.samples, batch=args.batch,
                           dense_layers=args.dense_layers, landmark=args.landmark)
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-")
        raise ValueError(f"{flag}={err['input']}: {err['msg'].lower()}") from None


def _paper_budget(schedule, spec: RolloutSpec) -> int | None:
    """The largest budget (tokens) the rollout meets: the paper's forms take one fixed budget."""
    bins = {schedule.bin_of(int(L)) for L in (spec.prompt_len + 1, spec.prompt_len + spec.gen_len)}
    bins = range(min(bins), max(bins) + 1)
    blocks = [schedule.blocks_for_bin(b) for b in bins]
    return None if None in blocks else max(blocks) * schedule.block_size


def _cost_dict(c) -> dict:
    return {"compute": c.compute, "memory": c.memory, "eflops": c.eflops}


def _rollout_dict(r) -> dict:
    return {"flops": r.flops, "bytes": r.bytes, "eflops": r.eflops, "seconds": r.seconds}


def build_report(args) -> dict:
    shape, hw, schedule = resolve_model(args.model), resolve_hardware(args.hardware), load_schedule(args.schedule)
    spec = _spec(args)
    model = CostModel(shape, hw, spec)
    budget = _paper_budget(schedule, spec)
    sym = dict(P=shape.decode_params, N=spec.samples, L_in=spec.prompt_len, L_out=spec.gen_len, D=shape.kv_dim * spec.kv_bytes,
               r=shape.gqa_ratio, I=hw.intensity)
    s33_dense = sec33_dense(**sym)
    s33_sparse = sec33_sparse(**sym, budget=budget or spec.prompt_len + spec.gen_len, page_size=schedule.block_size,
                              prefix_over_ps=not args.scoring_as_printed)
    f_dense, f_sparse = appf_cost(**sym, B=spec.batch), appf_cost(**sym, B=spec.batch, K=budget)
    cmp = model.compare(schedule)
    bins = []
    d_bin, s_bin = cmp.dense.by_bin(schedule), cmp.sparse.by_bin(schedule)
    steps = cmp.sparse.by_bin(schedule, "steps")
    for b in range(schedule.num_bins):
        if steps[b] == 0:
            continue
        lo, hi = schedule.bin_range(b)
        blocks = schedule.blocks_for_bin(b)
        bins.append({"bin": b, "min_length": lo, "max_length": hi, "steps": int(steps[b]),
                     "budget_tokens": None if blocks is None else blocks * schedule.block_size,
                     "dense_seconds": float(d_bin[b]), "sparse_seconds": float(s_bin[b]),
                     "speedup": float(d_bin[b] / s_bin[b]), "sparse_share": float(s_bin[b] / cmp.sparse.seconds)})
    return {
        "model": {"name": shape.name, "params": shape.params, "decode_params": shape.decode_params,
                  "layers": shape.layers, "kv_dim": shape.kv_dim, "gqa_ratio": shape.gqa_ratio},
        "hardware": {"name": hw.name, "flops": hw.flops, "bandwidth": hw.bandwidth, "intensity": hw.intensity,
                     "source": hw.source},
        "schedule": schedule.name,
        "rollout": spec.model_dump(),
        "paper_budget_tokens": budget,
        "sec33": {"dense": _cost_dict(s33_dense), "sparse": _cost_dict(s33_sparse),
                  "speedup": s33_dense.eflops / s33_sparse.eflops, "prompt_scoring_over_ps": not args.scoring_as_printed},
        "appf": {"dense": _cost_dict(f_dense), "sparse": _cost_dict(f_sparse), "speedup": f_dense.eflops / f_sparse.eflops},
        "schedule_aware": {"dense": _rollout_dict(cmp.dense), "sparse": _rollout_dict(cmp.sparse),
                           "speedup_eflops": cmp.speedup_eflops, "speedup_seconds": cmp.speedup_seconds},
        "bins": bins,
    }


def _e(x: float) -> str:
    return f"{x:.3e}"


def run(args) -> int:
    rep = build_report(args)
    if args.json:
        print(json.dumps(rep))
        return 0
    m, h, ro, sa = rep["model"], rep["hardware"], rep["rollout"], rep["schedule_aware"]
    budget = "dense" if rep["paper_budget_tokens"] is None else f"{rep['paper_budget_tokens']} tok"
    print(f"{m['name']} (P={m['decode_params'] / 1e9:.2f}B weights per token, D={m['kv_dim']} K elements per token, r={m['gqa_ratio']}) "
          f"on {h['name']}: {h['flops'] / 1e12:.1f} TFLOP/s, {h['bandwidth'] / 1e12:.2f} TB/s, I={h['intensity']:.1f} FLOP/B")
    print(f"schedule {rep['schedule']}; prompt {ro['prompt_len']} + {ro['gen_len']} generated tokens, "
          f"{ro['batch']} prompt(s) x {ro['samples']} samples, first {ro['dense_layers']} of {m['layers']} layers dense")
    s33_label = "Sec. 3.3 paper form, 1 prompt" + (" (prompt scoring as printed)" if not rep["sec33"]["prompt_scoring_over_ps"] else "")
    rows = [
        [s33_label, f"fixed {budget}", "eFLOPs", _e(rep["sec33"]["dense"]["eflops"]), _e(rep["sec33"]["sparse"]["eflops"]),
         f"{rep['sec33']['speedup']:.2f}x"],
        [f"App. F paper form, batch {ro['batch']}", f"dense until {budget}", "eFLOPs", _e(rep["appf"]["dense"]["eflops"]),
         _e(rep["appf"]["sparse"]["eflops"]), f"{rep['appf']['speedup']:.2f}x"],
        ["schedule-aware per-step sum", "schedule", "eFLOPs", _e(sa["dense"]["eflops"]), _e(sa["sparse"]["eflops"]),
         f"{sa['speedup_eflops']:.2f}x"],
        ["", "", "seconds (roofline)", f"{sa['dense']['seconds']:.2f}", f"{sa['sparse']['seconds']:.2f}",
         f"{sa['speedup_seconds']:.2f}x"],
        ["", "", "TB read", f"{sa['dense']['bytes'] / 1e12:.2f}", f"{sa['sparse']['bytes'] / 1e12:.2f}",
         f"{sa['dense']['bytes'] / sa['sparse']['bytes']:.2f}x"],
        ["", "", "PFLOP", f"{sa['dense']['flops'] / 1e15:.2f}", f"{sa['sparse']['flops'] / 1e15:.2f}",
         f"{sa['dense']['flops'] / sa['sparse']['flops']:.2f}x"],
    ]
    print(format_table(["form", "budget", "metric", "dense", "sparse", "speedup"], rows))
    if args.per_bin:
        print()
        rows = [[b["bin"], f"{b['min_length']}-{b['max_length'] or ''}", b["steps"],
                 "dense" if b["budget_tokens"] is None else b["budget_tokens"], f"{b['dense_seconds']:.3f}",
                 f"{b['sparse_seconds']:.3f}", f"{b['speedup']:.2f}x", f"{100 * b['sparse_share']:.1f}%"]
                for b in rep["bins"]]
        print(format_table(["bin", "total length", "steps", "budget tok", "dense s", "sparse s", "speedup", "share"], rows))
    print("paper forms use one fixed budget (the largest the rollout reaches) and no dense layers; "
          "see docs/cost_model.md")
    return 0
