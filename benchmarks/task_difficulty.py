"""How hard the built-in long-context tasks are for a model: accuracy, greedy and sampled, per knob setting.

A setting is a built-in task with knob overrides (`lookup {hops: 2, context_lines: 90}`). Its prompts are
the task's held-out eval split, rendered with the chat template like a training job's, and generated
densely by the native engine: one greedy sample and `--samples` at `--temperature` per prompt, scored by
the job's reward function (`reward.type: auto`). Besides accuracy it reports the share of prompts whose
sampled group has both rewards (the groups that give GRPO a non-zero advantage) and the chance level of
guessing one of the context's candidate values. Prints a table last and writes JSON.

Usage (repo root; the default grid took 35 min on one thread of a busy 2-core machine, a GPU needs minutes):
    python benchmarks/task_difficulty.py [--model DIR] [--prompts 12] [--setting "needle {context_lines: 90}" ...]
        [--samples 8 (0 = greedy only)] [--device cpu|cuda] [--out FILE]
"""

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import yaml

from sparrow.coordinator.config import DataConfig, RewardConfig
from sparrow.coordinator.data import PromptSource, render_prompt, stable_seed
from sparrow.coordinator.rewards import RewardFunction
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
from sparrow.tables import format_table

GRID = [
    "lookup {hops: 1, distractors: 3, context_lines: 45}",
    "lookup {hops: 1, distractors: 3, context_lines: 90}",
    "lookup {hops: 1, distractors: 3, context_lines: 180}",
    "lookup {hops: 2, distractors: 2, context_lines: 90}",
    "lookup {hops: 3, distractors: 3, context_lines: 90}",
    "needle {needles: 4, similar_keys: 1, context_lines: 90}",
    "needle {needles: 8, similar_keys: 2, context_lines: 90}",
    "needle {needles: 4, similar_keys: 1, context_lines: 180}",
]
"""SmolLM2's tokenizer: 45 / 90 / 180 lines are ~500 / 1000 / 2000 prompt tokens. Hops 1/2/3 at ~1000, ~500/1000/2000
at one hop, the needle at ~1000 and ~2000 and with more (similar) needles. The distractor counts are the ones where
SmolLM2-135M is above chance at all (docs/tasks.md)."""


def parse_setting(text: str) -> DataConfig:
    source, _, knobs = text.strip().partition(" ")
    overrides = yaml.safe_load(knobs) if knobs.strip() else {}
    if not isinstance(overrides, dict):
        raise ValueError(f"--setting {text!r}: write the knobs as a YAML mapping, e.g. 'lookup {{hops: 2}}'")
    return DataConfig.model_validate({"source": source, source: overrides})


def chance(data: DataConfig) -> float | None:
    """Accuracy of answering one of the context's candidate values at random (None when answers are computed)."""
    if data.source == "needle":
        return 1 / data.needle.needles
    if data.source == "lookup" and data.lookup.max_offset == 0:
        return 1 / data.lookup.chains
    return None


def prompts(tokenizer, text: str, args) -> tuple[DataConfig, list, list[tuple[int, ...]]]:
    """The setting's eval records and their token ids, as a training job renders them."""
    data = parse_setting(text)
    records = PromptSource(data, args.seed, split="eval").batch(0, args.prompts)
    return data, records, [tuple(render_prompt(tokenizer, r.messages, chat_template=True)) for r in records]


def measure(engine, tokenizer, text: str, data: DataConfig, records: list, prompt_ids: list, args) -> dict:
    reward = RewardFunction(RewardConfig(), data.source)
    start = time.perf_counter()
    lengths, greedy, sampled, mixed, examples = [len(ids) for ids in prompt_ids], [], [], 0, []
    for i, (record, ids) in enumerate(zip(records, prompt_ids)):
        requests = [RolloutRequest(f"g{i}", ids, SamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=0))]
        if args.samples:
            requests.append(RolloutRequest(f"s{i}", ids, SamplingParams(
                max_tokens=args.max_tokens, temperature=args.temperature, n=args.samples, seed=stable_seed(args.seed, i),
                logprobs=0)))
        samples = engine.generate(requests)
        texts = [tokenizer.decode(s.token_ids.tolist(), skip_special_tokens=True) for s in samples]
        rewards = [reward(t, record.answer, s.finish_reason) for t, s in zip(texts, samples)]
        greedy.append(rewards[0])
        sampled.extend(rewards[1:])
        mixed += 0 < sum(rewards[1:]) < args.samples
        if i < 3:
            examples.append({"answer": record.answer, "greedy": texts[0], "sampled": texts[1:2]})
    return {
        "setting": text, "source": data.source, "knobs": getattr(data, data.source).model_dump(mode="json"),
        "prompts": len(records), "prompt_tokens_mean": sum(lengths) / len(lengths), "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths), "greedy": sum(greedy) / len(greedy),
        "sampled": sum(sampled) / len(sampled) if sampled else None,
        "mixed_groups": mixed / len(records) if sampled else None, "chance": chance(data),
        "seconds": time.perf_counter() - start,
        "examples": examples,
    }


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct, fetched if missing)")
    p.add_argument("--setting", action="append", default=None, help="task and knobs, e.g. 'lookup {hops: 2}' (repeatable; "
                   "default: the built-in grid)")
    p.add_argument("--prompts", type=int, default=12, help="eval prompts per setting")
    p.add_argument("--samples", type=int, default=8, help="sampled responses per prompt (0 = greedy only)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=24, help="generated tokens per response at most")
    p.add_argument("--seed", type=int, default=0, help="run.seed of the prompts and sampling")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--device", default="cpu", help="native engine device: cpu (fp32) or cuda (bf16, Triton kernels)")
    p.add_argument("--out", default="benchmarks/results/task_difficulty_smollm2.json")
    args = p.parse_args(argv)
    settings = args.setting or GRID
    for text in settings:  # fail before the model loads
        parse_setting(text)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from sparrow.model_zoo import default_model_dir, fetch_smollm2

    model = args.model or str(fetch_smollm2(default_model_dir()))
    tokenizer = AutoTokenizer.from_pretrained(model)
    prepared = {text: prompts(tokenizer, text, args) for text in settings}
    longest = max(len(ids) for _, _, all_ids in prepared.values() for ids in all_ids) + args.max_tokens
    # one prompt's greedy copy and sampled group at a time: two prompts' blocks plus a partial block per sample
    engine = NativeEngine(NativeEngineConfig(
        model=model, device=args.device, max_model_len=longest, max_num_seqs=1 + args.samples,
        num_kv_blocks=2 * (-(-longest // 16)) + 2 * args.samples,
    ))
    rows, start = [], time.perf_counter()
    for text in settings:
        row = measure(engine, tokenizer, text, *prepared[text], args)
        rows.append(row)
        print(f"{text}: {row['prompt_tokens_mean']:.0f} tokens, greedy {row['greedy']:.2f}, sampled {fmt(row['sampled'])}, "
              f"mixed {fmt(row['mixed_groups'])}, {row['seconds']:.0f} s", flush=True)
    result = {
        "command": shlex.join(["python", "benchmarks/task_difficulty.py"] + (sys.argv[1:] if argv is None else argv)),
        "model": model, "threads": args.threads, "samples": args.samples, "temperature": args.temperature,
        "max_tokens": args.max_tokens, "seed": args.seed, "device": args.device,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "seconds": time.perf_counter() - start, "settings": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(
        ["setting", "prompt tokens", "greedy", f"sampled (n={args.samples}, T={args.temperature})", "mixed groups", "chance", "s"],
        [[r["setting"], f"{r['prompt_tokens_mean']:.0f} ({r['prompt_tokens_min']}-{r['prompt_tokens_max']})",
          f"{r['greedy']:.2f}", fmt(r["sampled"]), fmt(r["mixed_groups"]), fmt(r["chance"]), f"{r['seconds']:.0f}"]
         for r in rows],
    ))
    print(f"wrote {args.out} ({result['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
