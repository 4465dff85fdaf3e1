"""The built-in long-context tasks (lookup, needle): seeded items whose answers an independent solver
agrees with, knobs that do what they say, a held-out eval split, exact rewards, long prompts through the
native engine, and the GPU job configs that use them."""

import random
import re
from pathlib import Path

import pytest
import torch

from sparrow.coordinator.config import ConfigError, DataConfig, RewardConfig, load_config
from sparrow.coordinator.data import EVAL_SHARE, PromptSource, in_eval_split, render_prompt, stable_seed
from sparrow.coordinator.rewards import RewardFunction
from sparrow.coordinator.tasks import ArithmeticConfig, ArithmeticTask, LookupConfig
from sparrow.coordinator.tasks.context import ADJECTIVES, NOUNS, PLACES, SUBJECTS, TIMES, VERBS

ROOT = Path(__file__).resolve().parents[1]
DEFINITION = re.compile(r"^([a-z]+) = ([a-z]+|-?\d+)(?: \+ (\d))?$")
NEEDLE = re.compile(r"^The magic number of the ([a-z]+) ([a-z]+) is (\d+)\.$")
FILLER = re.compile(rf"^({'|'.join(SUBJECTS)}) ({'|'.join(VERBS)}) ({'|'.join(PLACES)}) ({'|'.join(re.escape(t) for t in TIMES)})$")


def context_lines(record) -> list[str]:
    """The context of a prompt rendered with the default template: between the two question lines."""
    text = record.messages[-1]["content"]
    first, _, rest = text.partition("\n\n")
    context, _, last = rest.rpartition("\n\n")
    assert first == last and first.startswith("Question: ")  # the question before and after the context
    return context.split("\n")


def solve_lookup(record) -> tuple[int, list[int], dict]:
    """Answer, line indices of the asked chain and all definitions, by parsing the prompt alone."""
    lines = context_lines(record)
    definitions = {}
    for i, line in enumerate(lines):
        if m := DEFINITION.match(line):
            assert m.group(1) not in definitions  # every variable is defined once
            definitions[m.group(1)] = (i, m.group(2), int(m.group(3) or 0))
        else:
            assert FILLER.match(line), line
    name = re.fullmatch(r"Question: What is the value of ([a-z]+)\?", record.messages[-1]["content"].split("\n")[0]).group(1)
    offset, chain = 0, []
    while True:
        line, ref, add = definitions[name]
        chain.append(line)
        offset += add
        if not ref.isalpha():
            return int(ref) + offset, chain, definitions
        name = ref


def solve_needle(record) -> tuple[int, int, list[tuple[str, str]]]:
    """Answer, line index of the asked needle and the keys of all needles."""
    lines = context_lines(record)
    needles = {}
    for i, line in enumerate(lines):
        if m := NEEDLE.match(line):
            needles[(m.group(1), m.group(2))] = (i, int(m.group(3)))
        else:
            assert FILLER.match(line), line
    key = re.fullmatch(r"Question: What is the magic number of the ([a-z]+) ([a-z]+)\?",
                       record.messages[-1]["content"].split("\n")[0]).groups()
    line, value = needles[key]
    return value, line, [key] + [k for k in needles if k != key]


def records(source: str, knobs: dict, count: int = 40, seed: int = 0, split: str = "train"):
    return PromptSource(DataConfig(source=source, **{source: knobs}), seed, split=split).batch(0, count)


@pytest.mark.parametrize("source", ["arithmetic", "lookup", "needle"])
def test_items_are_a_pure_function_of_seed_split_and_index(source):
    cfg = DataConfig(source=source)
    batch = PromptSource(cfg, seed=3).batch(2, 4)
    assert [r.index for r in batch] == [8, 9, 10, 11] and [r.prompt_id for r in batch] == ["s2-p0", "s2-p1", "s2-p2", "s2-p3"]
    assert batch == PromptSource(cfg, seed=3).batch(2, 4)
    assert [r.messages for r in batch] != [r.messages for r in PromptSource(cfg, seed=4).batch(2, 4)]
    evaluation = PromptSource(cfg, seed=3, split="eval").batch(2, 4)
    assert [r.prompt_id for r in evaluation] == ["e2-p0", "e2-p1", "e2-p2", "e2-p3"]
    assert evaluation == PromptSource(cfg, seed=3, split="eval").batch(2, 4)


@pytest.mark.parametrize("knobs", [
    {},
    {"hops": 1, "distractors": 30, "context_lines": 60},
    {"hops": 4, "distractors": 9, "context_lines": [50, 120], "max_offset": 9, "min_value": -5, "max_value": 5},
    {"hops": 3, "distractors": 0, "context_lines": 7},  # the shortest context that fits 3 spread hops
])
def test_lookup_answers_equal_an_independent_solve(knobs):
    cfg = LookupConfig(**knobs)
    for record in records("lookup", knobs):
        answer, chain, definitions = solve_lookup(record)
        assert str(answer) == record.answer
        assert len(chain) == cfg.hops and len(definitions) == cfg.hops + cfg.distractors
        assert cfg.context_lines[0] <= len(context_lines(record)) <= cfg.context_lines[1]
        roots = [int(ref) for _, ref, _ in definitions.values() if not ref.isalpha()]
        assert len(roots) == cfg.chains == len(set(roots)) and all(cfg.min_value <= v <= cfg.max_value for v in roots)
        if cfg.max_offset == 0:
            assert all(add == 0 for _, _, add in definitions.values())


@pytest.mark.parametrize("knobs", [{}, {"needles": 30, "similar_keys": 12, "context_lines": 40}, {"needles": 1, "similar_keys": 0}])
def test_needle_answers_equal_an_independent_solve(knobs):
    cfg = DataConfig(source="needle", needle=knobs).needle
    for record in records("needle", knobs):
        answer, _, keys = solve_needle(record)
        assert str(answer) == record.answer and len(keys) == len(set(keys)) == cfg.needles
        asked = keys[0]
        sharing = [k for k in keys[1:] if k[0] == asked[0] or k[1] == asked[1]]
        assert len(sharing) == cfg.similar_keys  # the similar keys share exactly one word; the others none
        assert all(a in ADJECTIVES and n in NOUNS for a, n in keys)


def test_depth_spreads_the_answer_bearing_lines():
    lines = 200
    for record in records("lookup", {"hops": 3, "distractors": 12, "context_lines": lines}, count=100):
        _, chain, _ = solve_lookup(record)
        chain = sorted(chain)
        thirds = [int(3 * i / lines) for i in chain]
        assert thirds == [0, 1, 2]  # one per third of the context
        assert min(b - a for a, b in zip(chain, chain[1:])) >= lines / 6 - 1  # at least half a third apart
    for record in records("needle", {"depth": [0.9, 1.0], "context_lines": 101}, count=100):
        _, line, _ = solve_needle(record)
        assert 92 <= line <= 98  # the middle half of [0.9, 1.0] of 101 lines
    for record in records("needle", {"depth": [0.5, 0.5], "context_lines": 101}, count=10):
        assert solve_needle(record)[1] == 50


def test_answer_bearing_lines_sit_in_far_apart_blocks_outside_sink_and_recent(smollm2):
    """With SmolLM2's tokenizer: the default lookup's two hops lie in different 16-token KV blocks, many
    blocks apart, neither in the sink block nor in the 2 recent blocks; and the tokens per line docs/tasks.md gives."""
    from transformers import AutoTokenizer

    from sparrow.coordinator.tasks.context import filler_sentence

    tok = AutoTokenizer.from_pretrained(smollm2)
    per_line = {}
    for source in ("lookup", "needle"):
        batch = records(source, {}, count=10)
        prompts = [render_prompt(tok, r.messages, chat_template=True) for r in batch]
        per_line[source] = sum(map(len, prompts)) / sum(len(context_lines(r)) for r in batch)  # whole prompt per line
        if source == "lookup":
            for record, prompt in zip(batch, prompts):
                text = tok.decode(prompt)
                encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
                assert encoded["input_ids"] == prompt
                content = record.messages[-1]["content"]
                start = text.index(content) + content.index("\n\n") + 2
                lines = context_lines(record)
                blocks = []
                for i in solve_lookup(record)[1]:  # the block holding the last token of each hop's line
                    last = start + sum(len(line) + 1 for line in lines[:i]) + len(lines[i]) - 1
                    token = next(t for t, (_, b) in enumerate(encoded["offset_mapping"]) if b > last)
                    blocks.append(token // 16)
                total = -(-len(prompt) // 16)
                assert all(1 <= b < total - 2 for b in blocks) and abs(blocks[0] - blocks[1]) >= 20
    assert 11.4 <= per_line["lookup"] <= 12.0 and 11.7 <= per_line["needle"] <= 12.3  # docs/tasks.md: 11.7 and 12.0
    rng = random.Random(0)
    filler = sum(len(tok(filler_sentence(rng) + "\n")["input_ids"]) for _ in range(200)) / 200
    assert 11.4 <= filler <= 12.0  # docs/tasks.md: 11.7


def test_eval_split_never_yields_a_training_item():
    embedded = load_config().data
    train = {(r.messages[-1]["content"], r.answer) for k in range(100) for r in PromptSource(embedded, 0).batch(k, 20)}
    evaluation = {(r.messages[-1]["content"], r.answer) for k in range(10)
                  for r in PromptSource(embedded, 0, split="eval").batch(k, 20)}
    assert len(evaluation) > 50 and len(train) > 400  # arithmetic repeats problems (800 exist) ...
    assert not train & evaluation  # ... but none of the held-out ones
    for source in ("lookup", "needle"):  # membership is a property of the content, so any seeds are disjoint
        assert not any(in_eval_split(list(r.messages), r.answer) for r in records(source, {}, seed=1))
        assert all(in_eval_split(list(r.messages), r.answer) for r in records(source, {}, seed=2, split="eval"))
    # arithmetic keeps its pre-split problem at every index whose problem is not held out (1 in EVAL_SHARE is)
    task = ArithmeticTask(ArithmeticConfig(**embedded.arithmetic.model_dump()))
    before = [task.item(random.Random(stable_seed(0, i))) for i in range(400)]
    after = [(list(r.messages), r.answer) for r in PromptSource(embedded, 0).batch(0, 400)]
    kept = [b == a for b, a in zip(before, after)]
    assert all(k != in_eval_split(*b) for k, b in zip(kept, before))
    assert 1 - 2 / EVAL_SHARE < sum(kept) / len(kept) < 1


def test_eval_split_errors(tmp_path):
    with pytest.raises(ValueError, match="split='test': use 'train' or 'eval'"):
        PromptSource(DataConfig(), 0, split="test")
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "x", "answer": "1"}\n')
    with pytest.raises(ValueError, match="data.source='jsonl' has no held-out rows"):
        PromptSource(DataConfig(source="jsonl", path=str(path)), 0, split="eval")
    one = DataConfig(arithmetic={"min_value": 3, "max_value": 3, "operations": ["+"]})  # one problem: 3 + 3
    held = in_eval_split([{"role": "user", "content": one.arithmetic.template.replace("{expression}", "3 + 3")}], "6")
    with pytest.raises(ValueError, match=f"data.arithmetic: 1000 draws for index 0 found no {'train' if held else 'eval'} item"):
        PromptSource(one, 0, split="train" if held else "eval").batch(0, 1)


@pytest.mark.parametrize("source", ["lookup", "needle"])
def test_integer_rewards_are_exact(source):
    reward = RewardFunction(RewardConfig(), source)
    assert reward.kind == "arithmetic"
    record = records(source, {}, count=1)[0]
    question = record.messages[-1]["content"].split("\n")[0].removeprefix("Question: ")
    right, wrong = record.answer, str(int(record.answer) + 1)
    subject = question.removeprefix("What is ").removesuffix("?")
    assert reward(f"The {subject.removeprefix('the ')} is {right}.", record.answer, "stop") == 1.0
    assert reward(f"{right} is {subject}.", record.answer, "stop") == 1.0  # names carry no digits
    assert reward(f"The answer is \\boxed{{{right}}}", record.answer, "stop") == 1.0
    assert reward(f"The {subject.removeprefix('the ')} is {wrong}.", record.answer, "stop") == 0.0
    assert reward(f"It is {right}, no, {wrong}.", record.answer, "stop") == 0.0  # the last integer counts
    assert reward("I could not find it.", record.answer, "stop") == 0.0
    assert reward(right, record.answer, "length") == 1.0 and RewardFunction(RewardConfig(truncated=-1), source)(
        right, record.answer, "length") == -1.0


@pytest.mark.parametrize("overrides, expected", [
    (["data.lookup.context_lines=10", "data.lookup.distractors=20"],
     "data.lookup: context_lines=10 is too short for hops=2 + distractors=20 definitions (22 lines); raise context_lines"),
    (["data.lookup.context_lines=[300, 100]"], "data.lookup: context_lines=[300, 100]: need 1 <= min <= max"),
    (["data.lookup.depth=[0.8, 0.2]"], "data.lookup: depth=[0.8, 0.2]: need 0 <= low <= high <= 1"),
    (["data.lookup.hops=3", "data.lookup.depth=[0.5, 0.51]"],
     "data.lookup: depth=[0.5, 0.51] over context_lines=200 is too narrow to put 3 answer-bearing lines on distinct lines"),
    (["data.lookup.distractors=300"], "hops=2 + distractors=300 = 302 variables; at most 233 names exist; lower distractors"),
    (["data.lookup.max_value=12"],
     "min_value=10..max_value=12 holds 3 values, fewer than the 4 distinct values of the 4 chains' root values"),
    (["data.lookup.template='Question: {question}'"], "has no {context} placeholder"),
    (["data.lookup.hops=0"], "data.lookup.hops: Input should be greater than or equal to 1 (got 0)"),
    (["data.needle.similar_keys=4"],
     "data.needle: similar_keys=4 needs needles >= 5 (the asked needle plus the similar ones; got needles=4)"),
    (["data.needle.needles=100", "data.needle.context_lines=50"], "data.needle: context_lines=50 is too short for needles=100"),
    (["data.needle.needles=100", "data.needle.max_value=50"], "holds 41 values, fewer than the 100 distinct values of needles=100"),
    (["data.needle.colour=red"], "data.needle.colour: unknown key"),
    (["data.source=lookup", "data.path=x.jsonl"], "data: path='x.jsonl' is set but source='lookup' generates its prompts"),
])
def test_knob_errors_name_the_key_the_value_and_the_fix(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)


def test_a_long_generated_prompt_runs_through_the_native_engine_sparsely(tiny_qwen3):
    from transformers import AutoTokenizer

    from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
    from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
    from sparrow.schedule import SparsitySchedule

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    record = records("lookup", {"hops": 3, "distractors": 30, "context_lines": 150}, count=1)[0]
    ids = render_prompt(tok, record.messages, chat_template=True)
    assert 2000 <= len(ids) <= 4000
    engine = NativeEngine(NativeEngineConfig(model=str(tiny_qwen3), max_model_len=4096, max_num_seqs=2, num_kv_blocks=600))
    engine.set_schedule(SparsitySchedule(name="8", topk_blocks=(8,), edges=()))
    sample = engine.generate([RolloutRequest("r", tuple(ids), SamplingParams(max_tokens=4, temperature=1.0, seed=1,
                                                                            ignore_eos=True))])[0]
    assert sample.finish_reason == "length" and sample.token_ids.numel() == 4
    assert sample.blocks_attended[0] == -(-len(ids) // 16)  # the first token comes from the dense prefill
    assert (sample.blocks_attended[1:] == 8 + 1 + 2).all()  # then top-8 + sink + 2 recent of ~190 blocks
    assert torch.isfinite(sample.logprobs).all()


@pytest.mark.parametrize("name, shared", [("smollm2-longctx-h200.yaml", True), ("smollm2-longctx-2gpu.yaml", False)])
def test_the_long_context_gpu_configs_validate(name, shared):
    from sparrow.cli.main import main

    path = ROOT / "deploy/configs" / name
    assert main(["train", "--print-config", "--config", str(path)]) == 0
    cfg = load_config(path)
    assert cfg.model is None and cfg.data.source in ("lookup", "needle")
    native = cfg.rollout.native
    assert (native.device, native.dtype, native.attention_backend, native.cuda_graphs) == ("cuda", "bfloat16", "triton", True)
    assert native.max_model_len == 8192 and cfg.trainer.dtype == "bfloat16" and cfg.controller.target == 0.86
    assert (cfg.rollout.pool.gpus, cfg.trainer.pool.gpus) == ((0.5, 0.5) if shared else (1, 1))
    assert (cfg.run.weights_channel, cfg.run.mode) == (("object_store", "async") if shared else ("collective", "sync"))
    template = cfg.schedule_template()
    task = getattr(cfg.data, cfg.data.source)
    edges = template.edges  # bins of at most 2000 tokens across the 2-7K range
    assert 2000 < edges[0] <= 3100 and edges[-1] >= 6000 and max(b - a for a, b in zip(edges, edges[1:])) <= 2000
    assert 180 <= task.context_lines[0] and task.context_lines[1] <= 600  # ~2K to ~7K tokens at ~11.5 per line
    assert 600 * 12.5 + cfg.rollout.sampling.max_tokens + 40 <= native.max_model_len
