"""The tiny `sparrow train` job of the end-to-end tests, in one place: the tiny model on 0/1 additions, a
three-bin schedule whose budgets bite from 80 tokens on, one rollout worker and one trainer rank. Each test
changes what it is about with dotted keys (as `--set` names them) and gets a YAML file, loaded by the same
path as a user's job file."""

import copy
from pathlib import Path

import yaml

TINY_JOB = {
    "data": {"arithmetic": {"min_value": 0, "max_value": 1, "operations": ["+"]}},
    "rollout": {
        "pool": {"size": 1, "cpus": 0.5},
        "native": {"max_num_seqs": 16, "max_model_len": 256, "num_kv_blocks": 512},
        "sampling": {"max_tokens": 12, "n": 2, "temperature": 1.0},
        "schedule": {"name": "tiny", "edges": [80, 96], "topk_blocks": [2, 2, 3]},
    },
    "trainer": {"pool": {"size": 1, "cpus": 0.5}, "optimizer": {"lr": 1.0e-3}, "micro_batch_tokens": 512,
                "recompute_topk": 8},
    "controller": {"ladder": [1, 2, 3, 4, 6, 8], "min_samples": 20, "window_steps": 1},
    "metrics": {"enabled": False},
    "run": {"steps": 3, "prompts_per_step": 3, "mode": "sync"},
}


def tiny_job(path: Path, model, out_dir, settings: dict | None = None) -> Path:
    """Write TINY_JOB for `model`, with runs under `out_dir` (None: no run.out_dir) and `settings` applied
    ({"rollout.pool.size": 2, "run.mode": "async", ...}; a mapping value replaces the whole section)."""
    job = {"model": str(model)} | copy.deepcopy(TINY_JOB)
    if out_dir is not None:
        job["run"]["out_dir"] = str(out_dir)
    for key, value in (settings or {}).items():
        *parents, leaf = key.split(".")
        section = job
        for name in parents:
            section = section.setdefault(name, {})
        section[leaf] = value
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def expected_ids(job, steps: range) -> list[str]:
    """The sample ids a job dispatches for `steps`: every sample of every prompt of those steps, first attempts."""
    n = job.config.rollout.sampling.n
    return [f"{r.prompt_id}#{i}" for k in steps for r in job.data.batch(k, job.config.run.prompts_per_step) for i in range(n)]
