"""Prompt sources (arithmetic task, JSONL, Parquet) and the verifiable rewards."""

import json
import random

import pytest

from sparrow.coordinator.config import DataConfig, RewardConfig
from sparrow.coordinator.data import PromptSource, render_prompt, stable_seed
from sparrow.coordinator.tasks import ArithmeticConfig, ArithmeticTask, evaluate
from sparrow.coordinator.rewards import RewardFunction, arithmetic_answer, last_boxed, math_verify_correct


def test_arithmetic_problems_are_seeded_and_exact():
    cfg = ArithmeticConfig(min_value=-9, max_value=30, terms=4, operations=["+", "-", "*"])
    task = ArithmeticTask(cfg)
    draw = lambda seed, i: task.problem(random.Random(stable_seed(seed, i)))  # noqa: E731
    problems = [draw(7, i) for i in range(200)]
    assert problems == [ArithmeticTask(cfg).problem(random.Random(stable_seed(7, i))) for i in range(200)]
    assert problems != [draw(8, i) for i in range(200)]
    for expression, answer in problems:
        assert answer == eval(expression)  # the rendered text means what the answer says (precedence, signs)
    assert evaluate([2, 3, 4], ["+", "*"]) == 14 and evaluate([2, 3, 4], ["*", "-"]) == 2
    messages, answer = task.item(random.Random(stable_seed(7, 3)))
    assert messages[0]["content"].startswith("Calculate ") and answer == str(problems[3][1])


def test_prompt_source_steps_are_a_pure_function_of_seed_and_step(tmp_path):
    source = PromptSource(DataConfig(), seed=1)
    batch = source.batch(5, 4)
    assert [r.prompt_id for r in batch] == ["s5-p0", "s5-p1", "s5-p2", "s5-p3"]
    assert [r.index for r in batch] == [20, 21, 22, 23]
    assert batch == PromptSource(DataConfig(), seed=1).batch(5, 4)


def test_jsonl_rows_epochs_and_system_prompt(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"q": f"question {i}", "a": str(i)} for i in range(5)]
    rows[2]["q"] = [{"role": "user", "content": "as messages"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    cfg = DataConfig(source="jsonl", path=str(path), prompt_key="q", answer_key="a", system_prompt="Be brief.")
    source = PromptSource(cfg, seed=0)
    epoch0 = [r.answer for k in range(5) for r in source.batch(k, 1)]
    epoch1 = [r.answer for k in range(5, 10) for r in source.batch(k, 1)]
    assert sorted(epoch0) == sorted(epoch1) == [str(i) for i in range(5)]  # every row once per epoch
    assert epoch0 != epoch1  # reshuffled
    record = next(r for k in range(5) for r in source.batch(k, 1) if r.answer == "2")
    assert record.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "as messages"})
    assert [r.answer for k in range(5) for r in PromptSource(cfg.model_copy(update={"shuffle": False}), 0).batch(k, 1)] == \
        ["0", "1", "2", "3", "4"]


def test_parquet_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"prompt": ["What is $1+1$?", "Solve $x^2=4$, x>0."], "answer": ["2", "2"]}), path)
    batch = PromptSource(DataConfig(source="parquet", path=str(path), shuffle=False), seed=0).batch(0, 2)
    assert batch[1].messages[0]["content"] == "Solve $x^2=4$, x>0." and batch[1].answer == "2"


def test_dataset_errors_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path='.*missing.jsonl': no such file"):
        PromptSource(DataConfig(source="jsonl", path=str(tmp_path / "missing.jsonl")), 0)
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "x", "answer": "1"}\n')
    with pytest.raises(ValueError, match="no column 'prompt' \\(columns: question, answer\\); set data.prompt_key"):
        PromptSource(DataConfig(source="jsonl", path=str(path)), 0)
    path.write_text('{"prompt": "x", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match="d.jsonl:2: not valid JSON"):
        PromptSource(DataConfig(source="jsonl", path=str(path)), 0)
    path.write_text('{"prompt": "x", "answer": null}\n')
    with pytest.raises(ValueError, match="row 0: 'answer' is empty"):
        PromptSource(DataConfig(source="jsonl", path=str(path)), 0)
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        PromptSource(DataConfig(source="parquet", path=str(bad)), 0)


def test_prompts_render_with_the_chat_template(tiny_qwen3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    messages = ({"role": "user", "content": "Calculate 2 + 3."},)
    chat = tok.decode(render_prompt(tok, messages, chat_template=True))
    assert chat.startswith("<|im_start|>user\nCalculate 2 + 3.<|im_end|>") and chat.endswith("<|im_start|>assistant\n")
    assert tok.decode(render_prompt(tok, messages, chat_template=False)) == "Calculate 2 + 3."


@pytest.mark.parametrize("response, expected", [
    ("7 + 6 = 13", 13),
    ("The result is -8.", -8),
    ("so 1,234 in total", 1234),
    ("first 5, then \\boxed{12} and later 99", 12),
    ("\\boxed{\\text{12}} is it", 12),
    ("\\boxed{1} then \\boxed{2}", 2),
    ("no number here", None),
])
def test_arithmetic_answer_extraction(response, expected):
    assert arithmetic_answer(response) == expected


def test_rewards():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}" and last_boxed("\\boxed{open") is None
    arithmetic = RewardFunction(RewardConfig(), "arithmetic")
    assert arithmetic.kind == "arithmetic"
    assert arithmetic("3 + 4 = 7", "7", "stop") == 1.0 and arithmetic("3 + 4 = 8", "7", "stop") == 0.0
    truncated = RewardFunction(RewardConfig(truncated=-0.5, correct=2.0), "arithmetic")
    assert truncated("7", "7", "length") == -0.5 and truncated("7", "7", "stop") == 2.0
    math = RewardFunction(RewardConfig(), "jsonl")
    assert math.kind == "math_verify"
    assert math("We get $\\boxed{\\frac{1}{2}}$.", "0.5", "stop") == 1.0
    assert math("The answer is \\boxed{3}", "\\boxed{2}", "stop") == 0.0
    assert math_verify_correct("x = \\boxed{2\\sqrt{2}}", "\\sqrt{8}")
    assert not math_verify_correct("I don't know", "2")
