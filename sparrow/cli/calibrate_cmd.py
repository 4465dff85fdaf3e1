"""`sparrow calibrate --model DIR|smollm2 --prompts SOURCE ...`: tail α per (length bin, budget) from
sparse rollouts and exact recomputes, and the cheapest schedule meeting τ (docs/calibration.md)."""

import argparse
import shlex
import sys
from pathlib import Path

from sparrow.layout import KV_CACHE_DTYPES, LANDMARK_MODES


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 4,8,16") from None


def configure(p) -> None:
    p.add_argument("--model", default="smollm2", help="HF model directory, or smollm2 (fetched if missing; default)")
    p.add_argument("--prompts", default="arithmetic",
                   help="a built-in task (arithmetic, lookup, needle; docs/tasks.md), FILE.jsonl or FILE.parquet")
    p.add_argument("--task", action="append", default=[], metavar="KNOB=VALUE",
                   help="a knob of the built-in task (its data.<task> key, YAML value), e.g. --task context_lines=[180,600] "
                        "(repeatable)")
    p.add_argument("--prompt-key", default="prompt", help="prompt column of a JSONL/Parquet file (text or chat messages)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt text without the chat template")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts (default 8)")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4; Sparrow: 8)")
    p.add_argument("--max-tokens", type=int, default=256, help="generated tokens per sample at most (default 256)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS, to fill the long length bins")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--budgets", type=_ints, default=None,
                   help="total blocks attended (sink + top-k + recent), e.g. 4,8,16; default: 4,8,16,24,32,48,...,1024 "
                        "below the longest context")
    p.add_argument("--no-dense-baseline", action="store_true", help="skip the dense rollout (the measurement's α floor)")
    bins = p.add_mutually_exclusive_group()
    bins.add_argument("--edges", type=_ints, default=None, help="length-bin edges in tokens (default: Sparrow's 2000-token bins)")
    bins.add_argument("--bin-width", type=int, default=None, help="equal bins of this many tokens, e.g. 128 for short contexts")
    p.add_argument("--target", type=float, default=0.86, help="τ: the tail α each bin must keep (default 0.86)")
    p.add_argument("--percentile", type=float, default=5.0, help="percentile of α taken as the tail (default 5)")
    p.add_argument("--statistic", default="exact", choices=["exact", "lower", "upper"],
                   help="α the schedule is chosen on: exact (default), or the top-K lower/upper bound the controller "
                        "acts on (match controller.statistic)")
    p.add_argument("--min-tokens", type=int, default=200, help="flag (bin, budget) cells with fewer tokens (default 200)")
    p.add_argument("--logprobs", type=int, default=20, help="K of the rollout top-K lists for the top-K α interval (default 20)")
    p.add_argument("--hardware", default="h200", help="cost-model GPU profile for the bins' cost shares (default h200)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the engine's K/V pages; fp8_e4m3 measures FP8 KV's α cost (default auto = the model's dtype)")
    p.add_argument("--landmark", default="mean", choices=LANDMARK_MODES,
                   help="the engine's block summary; mean_int8 measures int8 landmarks' α cost (default mean)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("calibration"), help="output directory (default ./calibration)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=run)


def run(args) -> int:
    from pydantic import ValidationError
    from tqdm import tqdm

    from sparrow.cli.main import CliError
    from sparrow.coordinator.calibration import CalibrationConfig
    from sparrow.coordinator.calibration.runner import run_calibration
    from sparrow.coordinator.config import ConfigError, set_override

    task: dict = {}
    try:
        for knob in args.task:
            set_override(task, knob)
    except ConfigError as exc:
        raise CliError(str(exc).replace("--set", "--task")) from None
    try:
        config = CalibrationConfig(
            model=str(args.model), prompts=args.prompts, task=task, prompt_key=args.prompt_key, chat_template=not args.no_chat_template,
            num_prompts=args.num_prompts, samples=args.samples, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
            temperature=args.temperature, budgets=args.budgets, dense_baseline=not args.no_dense_baseline,
            edges=args.edges, bin_width=args.bin_width, target=args.target, percentile=args.percentile,
            statistic=args.statistic, min_tokens=args.min_tokens, logprobs=args.logprobs, hardware=args.hardware, device=args.device,
            dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, landmark=args.landmark, threads=args.threads, seed=args.seed, out=args.out,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = err["msg"].removeprefix("Value error, ")
        where = "--" + "-".join(str(x) for x in err["loc"]).replace("_", "-") if err["loc"] else \
            "--task" if msg.startswith("task knob") else "arguments"
        raise CliError(f"{where}: {msg}") from None
    command = "sparrow calibrate " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if sys.argv[1:2] == ["calibrate"] \
        else "sparrow calibrate"
    run_calibration(config, command=command, progress=not args.no_progress,
                    log=print if args.no_progress else tqdm.write)
    return 0
