"""`sparrow generate --model DIR (--prompt TEXT | --prompts-file JSONL) --max-tokens N ...`: rollouts
with the native engine, dense or under a sparsity schedule, as text or one JSON line per sample."""

import json
from pathlib import Path

from sparrow.jsonl import iter_jsonl
from sparrow.layout import BLOCK_SIZE
from sparrow.tables import format_table


def configure(p) -> None:
    p.add_argument("--model", required=True, help="HF model directory (config.json + safetensors + tokenizer)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts-file", type=Path, help='JSONL, one {"prompt": TEXT} or {"messages": [...]} per line')
    p.add_argument("--max-tokens", type=int, required=True, help="tokens to generate per sample at most")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--schedule", help="sparsity schedule name or JSON/YAML file (see `sparrow schedule list`)")
    mode.add_argument("--dense", action="store_true", help="dense decode (the default)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="per-prompt seed (sample j of prompt i uses seed + i)")
    p.add_argument("--logprobs", type=int, default=None, help="top-k logprobs per token (default: engine's default_logprobs)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (they share the prompt's KV blocks)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="one JSON line per sample")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-kv-blocks", type=int, default=None, help=f"KV pool size in {BLOCK_SIZE}-token blocks")
    p.set_defaults(handler=run)


def read_prompts(args) -> list[str | list]:
    if args.prompt is not None:
        return [args.prompt]
    if not args.prompts_file.is_file():
        raise FileNotFoundError(f"--prompts-file {args.prompts_file}: no such file")
    prompts = []
    for lineno, item in iter_jsonl(args.prompts_file):
        if isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item.get("messages"), list):
            prompts.append(item["messages"])
        else:
            raise ValueError(f'{args.prompts_file}:{lineno}: expected {{"prompt": TEXT}} or {{"messages": [...]}}')
    if not prompts:
        raise ValueError(f"{args.prompts_file}: no prompts")
    return prompts


def encode(tokenizer, prompt: str | list, chat: bool) -> list[int]:
    if chat or isinstance(prompt, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


def run(args) -> int:
    from transformers import AutoTokenizer

    from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
    from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
    from sparrow.schedule import load_schedule

    prompts = read_prompts(args)
    schedule = load_schedule(args.schedule) if args.schedule else None
    config = NativeEngineConfig(model=str(args.model), device=args.device, dtype=args.dtype,
                                num_kv_blocks=args.num_kv_blocks, max_num_seqs=max(64, args.n))
    engine = NativeEngine(config)
    engine.set_schedule(schedule)
    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    logprobs = config.default_logprobs if args.logprobs is None else args.logprobs
    requests = []
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=None if args.seed is None else args.seed + i, n=args.n, logprobs=logprobs,
        )
        sampling.validate()
        requests.append(RolloutRequest(request_id=str(i), prompt_token_ids=tuple(encode(tokenizer, prompt, args.chat)),
                                       sampling=sampling, prompt_text=prompt if isinstance(prompt, str) else json.dumps(prompt)))
    samples = engine.generate(requests, progress=not args.json)
    by_id = {r.request_id: r for r in requests}
    for s in samples:
        text = tokenizer.decode(s.token_ids.tolist(), skip_special_tokens=False)
        if args.json:
            print(json.dumps({
                "request": int(s.request_id), "sample": s.sample_index, "prompt": by_id[s.request_id].prompt_text,
                "prompt_tokens": len(s.prompt_token_ids), "tokens": s.token_ids.tolist(), "text": text,
                "logprobs": s.logprobs.tolist(), "top_ids": s.top_ids.tolist(), "top_logprobs": s.top_logprobs.tolist(),
                "blocks_attended": s.blocks_attended.tolist(), "finish_reason": s.finish_reason, "error": s.error,
                "policy_version": s.policy_version, "schedule_version": s.schedule_version,
            }))
        else:
            head = f"[prompt {s.request_id} sample {s.sample_index}] {s.finish_reason}"
            print(f"{head}: {s.error}" if s.error else f"{head}, {len(s.token_ids)} tokens\n{text}\n")
    if not args.json:
        st = engine.stats()
        print(format_table(
            ["mode", "samples", "tokens", "prefill tokens", "tok/s", "decode tok/s", "preemptions"],
            [[schedule.name if schedule else "dense", len(samples), st["tokens_generated"], st["prefill_tokens"],
              f"{st['tokens_per_s']:.1f}", f"{st['decode_tokens_per_s']:.1f}", st["preemptions"]]],
        ))
    return 0 if all(s.error is None for s in samples) else 1
