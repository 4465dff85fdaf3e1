"""Sparsity schedules: Sparrow's exact bin and budget semantics, round-trips, validation errors."""

import json
import math

import pytest
import torch

from sparrow.cli.main import main
from sparrow.schedule import DENSE_BUDGET, ScheduleError, SparsitySchedule, load_schedule, published_schedules

RAW = json.loads(open(__import__("pathlib").Path(__file__).parents[1] / "sparrow/data/published_schedules.json").read())


def sparrow_budget(values, length):
    """Sparrow's planner, transcribed: bin = min(ceil(L/16)//125, 19); blocks = value + 3; dense if they fit."""
    blocks = math.ceil(length / 16)
    budget = values[min(blocks // 125, 19)] + 3
    return None if blocks <= budget else budget


def test_every_published_table_loads_by_name():
    tables = published_schedules()
    assert sorted(tables) == sorted(RAW["schedules"])
    assert len(tables) == 20
    assert tables["qwen3-8b-0.86"].topk_blocks[17] == 385


@pytest.mark.parametrize("name", sorted(RAW["schedules"]))
def test_published_semantics_match_sparrow_exactly(name):
    schedule = load_schedule(name)
    values = RAW["schedules"][name]
    lengths = list(range(1, 4100)) + [1984, 1985, 3984, 3985, 37984, 37985, 39999, 40000, 65536]
    for length in lengths:
        assert schedule.blocks_attended(length) == sparrow_budget(values, length), length
        assert schedule.bin_of(length) == min(math.ceil(length / 16) // 125, 19)
    vector = schedule.budgets_for_lengths(torch.tensor(lengths))
    for length, budget in zip(lengths, vector.tolist()):
        assert budget == values[min(math.ceil(length / 16) // 125, 19)] + 3


def test_bin_ranges_cover_lengths_without_gaps():
    s = load_schedule("qwen3-1.7b-0.86")
    assert s.bin_range(0) == (1, 1984)
    assert s.bin_range(1) == (1985, 3984)
    assert s.bin_range(19) == (37985, None)
    for i in range(19):
        assert s.bin_range(i + 1)[0] == s.bin_range(i)[1] + 1
        lo, hi = s.bin_range(i)
        assert s.bin_of(lo) == s.bin_of(hi) == i


def test_dense_bins_and_custom_edges():
    s = SparsitySchedule(name="custom", topk_blocks=(None, 5, 13), edges=(256, 1024), sink=1, recent=1)
    assert s.blocks_attended(100) is None  # bin 0 is dense
    assert s.bin_of(240) == 0 and s.bin_of(241) == 1 and s.bin_of(256) == 1
    assert s.blocks_attended(256) == 7  # 16 context blocks > 5 + 1 + 1
    assert s.blocks_attended(100_000) == 15
    assert s.budgets_for_lengths(torch.tensor([100, 256, 2000])).tolist() == [DENSE_BUDGET, 7, 15]


def test_round_trip_json_yaml_and_inline(tmp_path):
    """A file, or the mapping a job hands its engines (`to_dict`), version included."""
    s = load_schedule("qwen3-4b-0.86").with_topk([None] + [40] * 19, name="mine", version=5)
    for suffix in (".json", ".yaml"):
        path = tmp_path / f"s{suffix}"
        s.save(path)
        assert load_schedule(path) == s
    assert load_schedule(s.to_dict()) == s
    with pytest.raises(ScheduleError, match=r"rollout.schedule: unknown key\(s\) \['budget'\]"):
        load_schedule({**s.to_dict(), "budget": 3}, origin="rollout.schedule")


@pytest.mark.parametrize(
    "data, message",
    [
        ({"topk_blocks": [1] * 19}, "topk_blocks has 19 values but 19 edges define 20 bins"),
        ({"topk_blocks": [1, -2], "edges": [100]}, r"topk_blocks\[1\]=-2 must be an integer >= 0"),
        ({"topk_blocks": [1, 2], "edges": [0]}, r"edges\[0\]=0 must be a positive integer"),
        ({"topk_blocks": [1, 2, 3], "edges": [200, 100]}, r"edges\[1\]=100 must be greater than edges\[0\]=200"),
        ({"topk_blocks": [1] * 20, "recent": 0}, "recent=0 must be >= 1"),
        ({"topk_blocks": [1] * 20, "block_size": 0}, "block_size=0 must be >= 1"),
        ({"topk_blocks": [1] * 20, "budget": 3}, r"unknown key\(s\) \['budget'\]"),
        ({"name": "x"}, "missing key 'topk_blocks'"),
        ({"topk_blocks": [1.5] * 20}, r"topk_blocks\[0\]=1.5"),
    ],
)
def test_bad_schedule_files_name_the_field(tmp_path, data, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=message):
        load_schedule(path)


def test_unknown_name_and_unparsable_file(tmp_path):
    with pytest.raises(ScheduleError, match="sparrow schedule list"):
        load_schedule("qwen3-4b-0.99")
    path = tmp_path / "broken.yaml"
    path.write_text("topk_blocks: [1, 2\n")
    with pytest.raises(ScheduleError, match="not valid JSON/YAML"):
        load_schedule(path)


@pytest.mark.parametrize("name", sorted(RAW["schedules"]))
def test_cli_show_and_budget_answer_for_every_published_schedule(name, capsys):
    assert main(["schedule", "show", name]) == 0
    out = capsys.readouterr().out
    assert "1-1984" in out and ">= 37985" in out
    assert main(["schedule", "budget", name, "--length", "30000", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["blocks"] == RAW["schedules"][name][15] + 3 and info["tokens"] == 16 * info["blocks"]
    assert main(["schedule", "budget", name, "--length", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dense"] is True


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["schedule", "show", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sparrow schedule list" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"topk_blocks": [1, 2]}))
    assert main(["schedule", "budget", str(bad), "--length", "5"]) == 2
    assert "one value per bin" in capsys.readouterr().err
    assert main(["schedule", "list", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 20


def test_a_fixed_budget_counts_sink_and_recent_in_its_blocks():
    schedule = SparsitySchedule.fixed_budget(16)
    assert schedule.name == "budget-16" and schedule.num_bins == 1
    assert schedule.blocks_attended(100_000) == 16
    assert SparsitySchedule.fixed_budget(3).blocks_attended(5000) == 3  # sink + recent only
    with pytest.raises(ScheduleError, match="--budget-blocks=2: must be >= 3, the sink \\+ recent blocks"):
        SparsitySchedule.fixed_budget(2, "--budget-blocks")
