"""A real generation driven step by step, with every decode step's wall time: what `bench rollout` and
`bench rollout-paper` measure end to end (continuous batching, prefill, sampling, stop rules, host work)."""

import time

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams

STEP_WINDOW = 512
"""Decode steps per window of the recorded step-time profile (a 32K run keeps 64 windows, not 32K floats)."""
AGREE_EVERY = 64
"""Engine steps between the tensor-parallel ranks' checks of the time cap (all stop at the same step)."""


def protocol_requests(prompts, samples: int, gen_len: int, seed: int = 0) -> list[RolloutRequest]:
    """The benchmark protocol: every sample decodes exactly `gen_len` tokens (EOS ignored) at T = 1 with
    top-20 logprobs; request i samples with seed `seed + i`, so separate processes draw the same tokens."""
    return [RolloutRequest(f"p{i}", p, SamplingParams(max_tokens=gen_len, temperature=1.0, seed=seed + i, n=samples,
                                                      ignore_eos=True, logprobs=20))
            for i, p in enumerate(prompts)]


def step_profile(contexts: list[int], step_s: list[float], window: int = STEP_WINDOW) -> list[dict]:
    """Decode-step wall times in windows of `window` consecutive steps: first/last context, median, mean."""
    out = []
    for start in range(0, len(step_s), window):
        chunk = step_s[start:start + window]
        ordered = sorted(chunk)
        out.append({"first_context": contexts[start], "last_context": contexts[start + len(chunk) - 1],
                    "median_ms": 1e3 * ordered[len(ordered) // 2], "mean_ms": 1e3 * sum(chunk) / len(chunk)})
    return out


def common_steps_speedup(dense: list[dict], sparse: list[dict]) -> dict:
    """sparse / dense over the decode steps both runs made, from their step profiles' whole windows. A run stopped
    at its time cap lacks its longest-context (slowest) steps, so whole-run tok/s would flatter it."""
    def window_steps(w):
        return w["last_context"] - w["first_context"] + 1

    whole = 0
    for d, s in zip(dense, sparse):
        if not (d["first_context"] == s["first_context"] and window_steps(d) == window_steps(s) == STEP_WINDOW):
            break
        whole += 1
    seconds = {name: sum(w["mean_ms"] * window_steps(w) for w in profile[:whole]) / 1e3
               for name, profile in (("dense", dense), ("sparse", sparse))}
    return {"steps": whole * STEP_WINDOW, "dense_s": seconds["dense"], "sparse_s": seconds["sparse"],
            "speedup": seconds["dense"] / seconds["sparse"] if whole else None}


def real_rollout(engine, requests: list[RolloutRequest], time_cap_s: float | None = None, progress=None,
                 agree=None) -> dict:
    """Generate `requests` step by step; stopped (and marked truncated) once `time_cap_s` has passed.
    Tensor-parallel ranks must stop at the same step: with `agree(passed) -> any rank's passed`, the cap is
    checked every AGREE_EVERY engine steps, by all ranks together.
    A decode step is one whose engine counter `decode_steps` moved; its context is the longest sequence's
    length when it ran (all equal under the protocol). `progress(done_steps, seconds)` is called every window,
    with the seconds since the requests were added (so a run cut short from outside still shows its pace).
    Samples that finish are counted (errors) and their blocks attended per token averaged."""
    before = engine.stats()
    start = time.perf_counter()
    for r in requests:
        if engine.add_request(r):
            raise RuntimeError(f"request {r.request_id} was refused by the engine")
    truncated = False
    step_s, contexts = [], []
    errors, blocks, tokens = 0, 0.0, 0
    decode_steps = before["decode_steps"]
    context = max(len(r.prompt_token_ids) for r in requests)
    engine_steps = 0
    while engine.has_unfinished():
        engine_steps += 1
        t0 = time.perf_counter()
        finished = engine.step()
        elapsed = time.perf_counter() - t0
        for sample in finished:
            errors += sample.error is not None
            blocks += float(sample.blocks_attended.float().sum())
            tokens += sample.blocks_attended.numel()
        now = engine.stats()["decode_steps"]
        if now > decode_steps:
            decode_steps = now
            context += 1
            step_s.append(elapsed)
            contexts.append(context)
            if progress is not None and len(step_s) % STEP_WINDOW == 0:
                progress(len(step_s), time.perf_counter() - start)
        if time_cap_s is not None and (agree is None or engine_steps % AGREE_EVERY == 0):
            passed = time.perf_counter() - start > time_cap_s
            if passed if agree is None else agree(passed):
                engine.drop_unfinished()
                truncated = True
                break
    wall = time.perf_counter() - start
    after = engine.stats()
    d = {k: after[k] - before[k] for k in ("prefill_seconds", "decode_seconds", "decode_tokens", "decode_steps",
                                           "tokens_generated")}
    ordered = sorted(step_s) or [0.0]
    return {**d, "wall_s": wall, "truncated": truncated, "median_step_ms": 1e3 * ordered[len(ordered) // 2],
            "last_step_ms": 1e3 * (step_s[-1] if step_s else 0.0),  # the step that finishes the samples
            "decode_tok_s": d["decode_tokens"] / max(d["decode_seconds"], 1e-9),
            "total_tok_s": d["tokens_generated"] / max(d["prefill_seconds"] + d["decode_seconds"], 1e-9),
            "errors": errors, "mean_blocks": blocks / tokens if tokens else None,  # None: no sample finished
            "step_profile": step_profile(contexts, step_s)}
