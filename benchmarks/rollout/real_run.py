"""A real generation driven step by step, with every decode step's wall time: what `bench rollout` and
`bench rollout-paper` measure end to end (continuous batching, prefill, sampling, stop rules, host work)."""

import time

import torch

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams

STEP_WINDOW = 512
"""Decode steps per window of the recorded step-time profile (a 32K run keeps 64 windows, not 32K floats)."""
AGREE_EVERY = 64
"""Engine steps between the tensor-parallel ranks' checks of the time cap (all stop at the same step)."""


def protocol_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[tuple[int, ...]]:
    """The benchmark protocol's prompts: `count` of `length` uniformly random token ids, the same for every seed's
    run whichever engine serves them."""
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab_size, (length,), generator=gen).tolist()) for _ in range(count)]


def protocol_requests(prompts, samples: int, gen_len: int, seed: int = 0) -> list[RolloutRequest]:
    """The benchmark protocol: every sample decodes exactly `gen_len` tokens (EOS ignored) at T = 1 with
    top-20 logprobs; request i samples with seed `seed + i`, so separate processes draw the same tokens."""
    return [RolloutRequest(f"p{i}", p, _protocol_sampling(gen_len, seed + i, samples)) for i, p in enumerate(prompts)]


def _protocol_sampling(max_tokens: int, seed: int, n: int = 1) -> SamplingParams:
    """The protocol's sampling, for whole runs and segments alike: T = 1, EOS ignored, top-20 logprobs."""
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True, logprobs=20)


def segment_requests(prompts, samples: int, gen_len: int, start_step: int, vocab_size: int,
                     seed: int = 0) -> list[RolloutRequest]:
    """The protocol's requests from decode step `start_step` on (`bench rollout --start-step`): every sample's prompt
    carries `start_step` random tokens of its own where its generated tokens would be, and decodes the rest. With
    random weights and EOS ignored no token value changes the work, so these steps time as the whole run's do from
    there: a run longer than one job is measured in segments. Step 0 is the protocol itself."""
    if start_step == 0:
        return protocol_requests(prompts, samples, gen_len, seed)
    gen = torch.Generator().manual_seed(seed + start_step)
    requests = []
    for i, prompt in enumerate(prompts):
        for j in range(samples):
            own = torch.randint(0, vocab_size, (start_step,), generator=gen).tolist()
            requests.append(RolloutRequest(f"p{i}s{j}", tuple(prompt) + tuple(own),
                                           _protocol_sampling(gen_len - start_step, seed + i * samples + j)))
    return requests


SEGMENT_FIXED_TOKENS = {"dense": 4096, "sparse": 16384}
"""A decode step's cost that does not grow with the context, in tokens of context: Qwen3-8B's FP8 protocol on an H200
(batch 40) stepped 4.96 ms + 1.41 µs per token dense and 5.25 ms + 0.38 µs per token sparse (about 3.5K and 13.8K)."""
SEGMENT_PREFILL_TOKENS = {"dense": 1800, "sparse": 6000}
"""A segment from decode step N first prefills N tokens more per sample, which costs about N decode steps of this many
tokens of context each. On an H200 (2026-11-28 segments, prefill time over the step profile's per-token slope) it was
1,500-2,000 for dense steps of Qwen3-4B (bf16 batch 24, FP8 batch 40) and Qwen3-8B (FP8 batch 40) alike, 5,400-6,700
for their cheaper sparse steps."""


def segment_bounds(first: int, stop: int, parts: int, prompt_len: int, mode: str) -> list[tuple[int, int]]:
    """`[start, end)` decode-step ranges that split `[first, stop)` into `parts` segments of about equal time, each
    boundary a multiple of STEP_WINDOW. A segment's time is its prefill (SEGMENT_PREFILL_TOKENS) plus its steps, a
    step at context c costing about `fixed + c` (SEGMENT_FIXED_TOKENS; `both` runs dense too, which dominates), so
    later segments get fewer steps. The common time is the least that lets `parts` segments, each filled up to it
    in turn, reach `stop`."""
    windows = -(-(stop - first) // STEP_WINDOW)
    if not 1 <= parts <= windows:
        raise ValueError(f"--segments={parts}: decode steps {first}-{stop - 1} make {windows} step-profile window(s) "
                         f"of {STEP_WINDOW}, and a segment needs one; use 1..{windows}")
    kind = "sparse" if mode == "sparse" else "dense"
    offset, prefill = SEGMENT_FIXED_TOKENS[kind] + prompt_len, SEGMENT_PREFILL_TOKENS[kind]

    def end_within(start: float, budget: float) -> float:  # the step where steps [start, t) have cost `budget`
        budget -= prefill * start
        if budget <= 0:
            return start
        return -offset + (offset * offset + 2 * (budget + start * start / 2 + offset * start)) ** 0.5

    def reach(budget: float) -> list[float]:  # segment starts when each takes `budget`; the last entry: where it ends
        starts = [float(first)]
        for _ in range(parts):
            starts.append(end_within(starts[-1], budget))
        return starts

    lo, hi = 0.0, prefill * stop + (stop - first) * (offset + stop)
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if reach(mid)[-1] < stop else (lo, mid)
    starts = [first]
    for k, t in enumerate(reach(hi)[1:parts], start=1):
        bound = first + round((t - first) / STEP_WINDOW) * STEP_WINDOW
        starts.append(min(max(bound, starts[-1] + STEP_WINDOW), first + (windows - parts + k) * STEP_WINDOW))
    return list(zip(starts, starts[1:] + [stop]))


def window_steps(window: dict) -> int:
    """Decode steps in one window of a step profile."""
    return window["last_context"] - window["first_context"] + 1


def profile_seconds(windows: list[dict]) -> float:
    """Seconds the decode steps of these step-profile windows took."""
    return sum(w["mean_ms"] * window_steps(w) for w in windows) / 1e3


def sparse_step(schedule, context: int) -> bool:
    """Whether a decode step at `context` tokens takes the sparse path under `schedule` (a `SparsitySchedule`; None =
    dense): bins whose budget covers the whole context run dense."""
    return schedule is not None and schedule.blocks_attended(context) is not None


def replay_windows(profile: list[dict], schedule, points: int) -> list[dict]:
    """`points` windows of a step profile, evenly spread, to time against the graph-replayed step: only windows whose
    steps all take one path under `schedule` (`sparse_step`), since the replay runs one path. A sparse run's first
    window straddles the context where its schedule turns sparse: its median is half dense steps."""
    uniform = [w for w in profile
               if sparse_step(schedule, w["first_context"]) == sparse_step(schedule, w["last_context"])]
    return [uniform[round(i * (len(uniform) - 1) / max(points - 1, 1))] for i in range(min(points, len(uniform)))]


def join_segments(parts: list[tuple[int, dict, str]], batch: int) -> dict:
    """One mode's results of runs that began at different decode steps, `(start_step, result, name)`, joined into the
    run they stand for: each segment's whole windows up to where the next one begins, then the next one's. Times come
    from the step profiles, as `common_steps_speedup`'s do; the median step is the median of the windows' medians;
    blocks per token is not reported (samples finish in the last segment only)."""
    parts = sorted(parts, key=lambda part: part[0])
    profile, segments = [], []
    for k, (start, result, name) in enumerate(parts):
        windows = result["step_profile"]
        if profile and (not windows or windows[0]["first_context"] != profile[-1]["last_context"] + 1):
            prev_start, _, prev_name = parts[k - 1]
            made = prev_start + segments[-1]["steps"]
            raise ValueError(
                f"{name}: its segment starts at decode step {start} but {prev_name} (from step {prev_start}) made "
                f"steps up to {made - 1} only; run the later segment again with --start-step at a multiple of "
                f"{STEP_WINDOW} no greater than {made}, or give the earlier one --end-step {start} (no --time-cap)")
        if k + 1 < len(parts) and parts[k + 1][1]["step_profile"]:
            next_first = parts[k + 1][1]["step_profile"][0]["first_context"]
            windows = [w for w in windows if w["first_context"] < next_first]
        profile += windows
        segments.append({"start_step": start, "file": name, "truncated": result["truncated"],
                         "steps": sum(window_steps(w) for w in windows)})
    steps = sum(seg["steps"] for seg in segments)
    seconds = profile_seconds(profile)
    first, last = parts[0][1], parts[-1][1]
    generated = first["tokens_generated"] - first["decode_tokens"] + steps * batch
    medians = sorted(w["median_ms"] for w in profile) or [0.0]
    return {"prefill_seconds": first["prefill_seconds"], "decode_seconds": seconds, "decode_tokens": steps * batch,
            "decode_steps": steps, "tokens_generated": generated, "wall_s": sum(p[1]["wall_s"] for p in parts),
            "truncated": last["truncated"], "median_step_ms": medians[len(medians) // 2],
            "last_step_ms": last["last_step_ms"], "decode_tok_s": steps * batch / max(seconds, 1e-9),
            "total_tok_s": generated / max(first["prefill_seconds"] + seconds, 1e-9),
            "errors": sum(p[1]["errors"] for p in parts), "mean_blocks": None, "step_profile": profile,
            "segments": segments,
            **({"decode_reads": sum(p[1]["decode_reads"] for p in parts)}
               if all("decode_reads" in p[1] for p in parts) else {}),
            **({"replayed": [r for p in parts for r in p[1].get("replayed", [])]}
               if any("replayed" in p[1] for p in parts) else {})}


def step_profile(contexts: list[int], step_s: list[float], window: int | None = None) -> list[dict]:
    """Decode-step wall times in windows of `window` (default STEP_WINDOW) consecutive steps: first/last context,
    median, mean."""
    window = window or STEP_WINDOW
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
    whole = 0
    for d, s in zip(dense, sparse):
        if not (d["first_context"] == s["first_context"] and window_steps(d) == window_steps(s) == STEP_WINDOW):
            break
        whole += 1
    seconds = {name: profile_seconds(profile[:whole]) for name, profile in (("dense", dense), ("sparse", sparse))}
    return {"steps": whole * STEP_WINDOW, "dense_s": seconds["dense"], "sparse_s": seconds["sparse"],
            "speedup": seconds["dense"] / seconds["sparse"] if whole else None}


def real_rollout(engine, requests: list[RolloutRequest], time_cap_s: float | None = None, progress=None,
                 agree=None) -> dict:
    """Generate `requests` step by step; stopped (and marked truncated) once `time_cap_s` has passed.
    Tensor-parallel ranks must stop at the same step: with `agree(passed) -> any rank's passed`, the cap is
    checked every AGREE_EVERY engine steps, by all ranks together.

    Every engine step is timed from the end of the one before it, so the times add up to the run's wall clock,
    this loop's own work included. Timing only the `engine.step()` call would not: with overlapped decode the GPU
    runs step t + 1 while the host is outside that call, so the call's time is the step's minus whatever the host
    did outside it. A decode step is one whose engine counter `decode_steps` moved; its context is the longest
    sequence's length when it ran (all equal under the protocol). A step that only reads the step in flight (the
    overlapped loop's last, or one after which the next could not be chained) is added to the next decode step, or
    the last one; `decode_reads` counts them. `progress(done_steps, seconds)` is called every window, with the
    seconds since the requests were added (so a run cut short from outside still shows its pace). Samples that
    finish are counted (errors) and their blocks attended per token averaged."""
    before = engine.stats()
    start = time.perf_counter()
    for r in requests:
        if engine.add_request(r):
            raise RuntimeError(f"request {r.request_id} was refused by the engine")
    truncated = False
    step_s, contexts = [], []
    errors, blocks, tokens = 0, 0.0, 0
    prefill_s, carried, reads = 0.0, 0.0, 0
    counts = before
    context = max(len(r.prompt_token_ids) for r in requests)
    engine_steps = 0
    last = time.perf_counter()
    while engine.has_unfinished():
        engine_steps += 1
        finished = engine.step()
        for sample in finished:
            errors += sample.error is not None
            blocks += float(sample.blocks_attended.float().sum())
            tokens += sample.blocks_attended.numel()
        now_counts = engine.stats()
        now = time.perf_counter()
        elapsed, last = now - last, now
        if now_counts["prefill_steps"] > counts["prefill_steps"]:
            prefill_s += elapsed
        elif now_counts["decode_steps"] > counts["decode_steps"]:
            context += 1
            step_s.append(elapsed + carried)
            contexts.append(context)
            carried = 0.0
            if progress is not None and len(step_s) % STEP_WINDOW == 0:
                progress(len(step_s), now - start)
        else:
            carried += elapsed
            reads += 1
        counts = now_counts
        if time_cap_s is not None and (agree is None or engine_steps % AGREE_EVERY == 0):
            passed = now - start > time_cap_s
            if passed if agree is None else agree(passed):
                engine.drop_unfinished()
                truncated = True
                break
    if step_s:
        step_s[-1] += carried
    wall = time.perf_counter() - start
    after = engine.stats()
    d = {k: after[k] - before[k] for k in ("decode_tokens", "decode_steps", "tokens_generated")}
    decode_s = sum(step_s)
    ordered = sorted(step_s) or [0.0]
    return {**d, "prefill_seconds": prefill_s, "decode_seconds": decode_s, "wall_s": wall, "truncated": truncated,
            "decode_reads": reads, "median_step_ms": 1e3 * ordered[len(ordered) // 2],
            "last_step_ms": 1e3 * (step_s[-1] if step_s else 0.0),  # the step that finishes the samples
            "decode_tok_s": d["decode_tokens"] / max(decode_s, 1e-9),
            "total_tok_s": d["tokens_generated"] / max(prefill_s + decode_s, 1e-9),
            "errors": errors, "mean_blocks": blocks / tokens if tokens else None,  # None: no sample finished
            "step_profile": step_profile(contexts, step_s)}
