"""The job config: one YAML, typed and validated up front; errors name the dotted key, the value and the fix."""

from pathlib import Path

import pytest
import yaml

from sparrow.cli.main import main
from sparrow.coordinator.config import EMBEDDED, ConfigError, SparrowConfig, load_config, merge, set_override

ROOT = Path(__file__).resolve().parents[1]


def _error(overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_embedded_default_is_the_shipped_yaml_and_round_trips():
    config = load_config()
    assert config.model is None and config.rollout.engine == "native" and config.controller.enabled
    shipped = load_config(ROOT / "deploy/configs/embedded.yaml")
    assert shipped == config
    assert load_config(None, []).dump() == SparrowConfig.model_validate(yaml.safe_load(config.dump())).dump()


def test_shipped_examples_validate():
    for path in sorted((ROOT / "deploy/configs").glob("*.yaml")):
        load_config(path)


def test_a_file_starts_from_component_defaults_plus_free_ports(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("transport: {queue_capacity: 8}\ncontroller: {target: 0.9}\n")
    config = load_config(path)
    assert config.transport.port == 0 and config.transport.queue_capacity == 8
    assert config.controller.target == 0.9 and config.controller.ladder[0] == 29  # Sparrow's ladder
    assert config.rollout.schedule == "dense"


def test_unknown_keys_name_the_path_and_suggest_the_near_miss():
    msg = _error(["trainer.optimzer.lr=1e-5"])
    assert "trainer.optimzer: unknown key; did you mean 'trainer.optimizer'?" in msg
    assert "allowed here:" in msg and "zero_stage" in msg
    assert "rollout.sampling.temprature: unknown key; did you mean 'rollout.sampling.temperature'?" in _error(
        ["rollout.sampling.temprature=0.5"])


@pytest.mark.parametrize("override, expected", [
    ("run.steps=0", "run.steps: Input should be greater than or equal to 1 (got 0)"),
    ("rollout.pool.strategy=FOO", "rollout.pool.strategy: Input should be 'PACK', 'SPREAD', 'STRICT_PACK' or 'STRICT_SPREAD' (got 'FOO')"),
    ("metrics.port=abc", "metrics.port: Input should be a valid integer"),
    ("trainer.optimizer.lr=-1", "trainer.optimizer.lr: Input should be greater than 0 (got -1)"),
    ("rollout.schedule=no-such-table", "rollout.schedule: schedule 'no-such-table': not a published schedule name"),
    ("rollout.sampling.n=100", "rollout.sampling.n=100 exceeds rollout.native.max_num_seqs=32"),
    ("data.source=jsonl", "data: source='jsonl' needs path"),
    ("controller.warm_start=qwen3-1.7b-0.86", "controller.warm_start='qwen3-1.7b-0.86': the initial schedule of a job is rollout.schedule"),
    ("trainer.temperature=0.3", "trainer.temperature=0.3 differs from rollout.sampling.temperature=0.7"),
    ("rollout.native.sink=2", "rollout.schedule has sink=1 but rollout.native.sink=2"),
    ("controller.ladder=[8, 4]", "controller: ladder=[8, 4] must be strictly increasing"),
])
def test_bad_values_name_the_key_the_value_and_the_fix(override, expected):
    assert expected in _error([override])


def test_cross_section_rules():
    assert "run: mode='async' with max_staleness=0 is sync mode" in _error(["run.max_staleness=0"])
    assert "max_staleness=2 needs mode='async'" in _error(["run.mode=sync", "run.max_staleness=2"])
    assert "controller.enabled=true needs rollout.sampling.logprobs > 0" in _error(["rollout.sampling.logprobs=0"])
    assert "controller.statistic='exact' needs trainer.exact_alpha=true" in _error(["controller.statistic=exact"])
    load_config(None, ["controller.statistic=exact", "trainer.exact_alpha=true", "rollout.sampling.logprobs=0"])
    assert "leave top_p=1 and top_k=0 with rollout.engine='vllm'" in _error(["rollout.engine=vllm", "rollout.sampling.top_p=0.9"])
    assert "rollout.vllm.landmark: landmark=mean_int8: the vLLM backend keeps landmarks in the model's dtype" in _error(
        ["rollout.vllm.landmark=mean_int8"])
    assert load_config(None, ["rollout.native.landmark=mean_int8"]).rollout.native.landmark == "mean_int8"
    assert "landmark" in _error(["rollout.native.landmark=int8"])
    assert "weights_channel='collective' needs mode='sync'" in _error(["run.weights_channel=collective"])
    for switch in ("trainer.exact_alpha=true", "trainer.distill_sparse.enabled=true"):
        message = _error([switch, "rollout.native.dense_layers=[0]"])
        assert "trainer.distill_sparse.dense_layers=(0, 1) differs from rollout.native.dense_layers=(0,)" in message
        assert "landmark" in _error([switch, "rollout.native.landmark=minmax"])
    assert load_config(None, ["trainer.exact_alpha=true", "rollout.native.dense_layers=[0]",
                              "trainer.distill_sparse.dense_layers=[0]"]).trainer.exact_alpha
    fp8 = load_config(None, ["rollout.native.kv_cache_dtype=fp8_e4m3", "trainer.exact_alpha=true"])
    assert fp8.trainer_config("m").kv_cache_dtype == "fp8_e4m3"
    assert load_config(None, []).trainer_config("m").kv_cache_dtype == "auto"
    assert ("trainer: kv_cache_dtype='fp8_e4m3': the trainer's sparse forward reads K/V as the rollout engines store "
            "them, so it is set once, with rollout.<engine>.kv_cache_dtype" in _error(["trainer.kv_cache_dtype=fp8_e4m3"]))
    assert "rollout.vllm.kv_cache_dtype: kv_cache_dtype='fp8_e4m3': the vLLM backend stores K/V in the model's dtype" in _error(
        ["rollout.engine=vllm", "rollout.vllm.kv_cache_dtype=fp8_e4m3"])
    several = _error(["run.steps=0", "trainer.zero_stage=5"])
    assert "run.steps" in several and "trainer.zero_stage" in several


def test_a_colocated_placement_pairs_pools_that_can_take_turns():
    colocated = load_config(None, ["run.placement=colocated", "run.mode=async"])
    assert colocated.run.synchronous and colocated.run.staleness == 0
    assert "rollout.pool.size=2 must equal trainer.pool.size=1" in _error(
        ["run.placement=colocated", "rollout.pool.size=2"])
    assert "remove max_staleness" in _error(["run.placement=colocated", "run.mode=async", "run.max_staleness=2"])
    assert "weights_channel='shared' needs placement='colocated'" in _error(["run.weights_channel=shared"])
    assert "gives its KV memory back between steps: set rollout.vllm.sleep_mode=true" in _error(
        ["run.placement=colocated", "rollout.engine=vllm", "rollout.sampling.top_p=1.0"])


@pytest.mark.parametrize("sets, together", [
    ([], True),  # CPU pools
    (["rollout.pool.gpus=1", "trainer.pool.gpus=1"], True),  # an engine's GPU is never a rank's
    (["rollout.pool.gpus=0.5", "trainer.pool.gpus=1"], True),
    (["rollout.pool.gpus=0.5", "trainer.pool.gpus=0.5"], False),  # one GPU, both pools: the engine sizes its KV
    (["run.placement=colocated"], False),  # pool from the memory free once the rank has offloaded its states
])
def test_engines_load_while_the_trainer_starts_unless_they_may_share_its_gpu(sets, together):
    assert load_config(None, sets).pools_start_together is together


def test_stock_vllm_runs_the_dense_schedule_without_a_controller():
    """vLLM's own layers attend densely: a dense job validates; a sparse schedule or a controller, which would steer
    sparsity the engine does not have, is refused up front naming both settings (it used to fail at the first
    schedule, with every pool started)."""
    stock = ["rollout.engine=vllm", "rollout.sampling.top_p=1.0", "rollout.vllm.attention=stock"]
    load_config(None, [*stock, "controller.enabled=false", "rollout.schedule=dense"])
    sparse = _error([*stock, "controller.enabled=false", "rollout.schedule=qwen3-1.7b-0.86"])
    assert "rollout.schedule='qwen3-1.7b-0.86': rollout.vllm.attention='stock'" in sparse
    assert "set rollout.schedule=dense, or rollout.vllm.attention='sparrow'" in sparse
    steered = _error([*stock, "controller.enabled=true", "rollout.schedule=dense"])
    assert "controller.enabled=true steers the rollout's sparsity, and rollout.vllm.attention='stock'" in steered


def test_a_vllm_job_takes_full_decode_graphs_and_keeps_the_engines_schedule_to_rollout_schedule():
    """A job's engines start with its schedule (the worker hands it over), so vLLM's full decode graphs capture the
    kernel the job runs; they once started dense and refused the job's schedule (found on an H100, after 144 s of
    start-up). The engine's own `schedule` stays the job's to set, once, with rollout.schedule."""
    vllm = ["rollout.engine=vllm", "rollout.sampling.top_p=1.0"]
    for graphs in ("auto", "piecewise", "full_decode"):
        assert load_config(None, [*vllm, f"rollout.vllm.cuda_graphs={graphs}"]).rollout.engine_config().cuda_graphs == graphs
    refused = _error([*vllm, "rollout.vllm.schedule=qwen3-1.7b-0.86"])
    assert "rollout.vllm.schedule='qwen3-1.7b-0.86': the job's schedule is set once, with rollout.schedule" in refused


def test_partial_rollouts_bound_staleness_past_the_runs_and_need_an_engine_that_interrupts():
    sync = load_config(None, ["run.partial_rollout.enabled=true", "run.mode=sync"])
    assert (sync.run.carry_staleness, sync.run.trained_staleness) == (1, 1)
    off = load_config(None, ["run.mode=sync"])
    assert off.run.carry_staleness is None and off.run.trained_staleness == 0
    asynchronous = load_config(None, ["run.partial_rollout.enabled=true", "run.mode=async", "run.max_staleness=2"])
    assert asynchronous.run.carry_staleness == 3
    assert "run.partial_rollout.max_staleness=2 must exceed the run's staleness (2)" in _error(
        ["run.partial_rollout.enabled=true", "run.mode=async", "run.max_staleness=2", "run.partial_rollout.max_staleness=2"])
    vllm = load_config(None, ["run.partial_rollout.enabled=true", "rollout.engine=vllm", "rollout.sampling.top_p=1.0"])
    assert vllm.rollout.engine_config().interrupts, "both built-in engines interrupt (a backend that does not: registry test)"
    assert "extra_groups" in _error(["run.partial_rollout.extra_groups=-1"])


def test_no_spare_groups_is_interrupt_and_resume_at_each_version_which_only_an_async_job_has():
    on = ["run.partial_rollout.enabled=true", "run.partial_rollout.extra_groups=0"]
    assert "does nothing in a synchronous job" in _error(on + ["run.mode=sync"])
    assert "does nothing in a synchronous job" in _error(on + ["run.mode=async", "run.placement=colocated"])
    assert "with carry='finish' does nothing" in _error(on + ["run.mode=async", "run.partial_rollout.carry=finish"])
    config = load_config(None, on + ["run.mode=async", "run.placement=disaggregated"])
    assert config.run.partial_rollout.extra_groups == 0 and config.run.carry_staleness == 2


def test_a_time_budget_may_stand_alone_in_a_sync_job_and_bounds_what_a_step_carries():
    on = ["run.partial_rollout.enabled=true", "run.prompts_per_step=4", "run.mode=sync"]
    budget = load_config(None, on + ["run.partial_rollout.extra_groups=0", "run.partial_rollout.close_after_s=20"])
    assert budget.run.budget_carry == 4, "at most one step's prompts behind its data"
    assert load_config(None, on + ["run.partial_rollout.close_after_s=20"]).run.budget_carry == 4 + 2
    assert load_config(None, on).run.budget_carry is None
    assert load_config(None, ["run.partial_rollout.close_after_s=20"]).run.budget_carry is None, "partial rollouts off"
    assert "close_after_s" in _error(on + ["run.partial_rollout.close_after_s=0"])
    assert "a time budget (close_after_s)" in _error(on + ["run.partial_rollout.extra_groups=0"])


def test_more_spare_groups_than_a_step_may_carry_are_refused_with_the_most_it_can():
    """tests/test_tail_model.py shows why: more would make the staleness bound train them at once and shrink back."""
    base = ["run.partial_rollout.enabled=true", "run.prompts_per_step=4", "run.mode=sync"]
    assert load_config(None, base + ["run.partial_rollout.extra_groups=4"]).run.partial_rollout.extra_groups == 4
    message = _error(base + ["run.partial_rollout.extra_groups=5"])
    assert "run.partial_rollout.extra_groups=5 is more than the 4 spare groups prompts_per_step=4" in message
    assert "lower extra_groups or raise run.partial_rollout.max_staleness" in message
    assert load_config(None, base + ["run.partial_rollout.extra_groups=8", "run.partial_rollout.max_staleness=2"])
    assert "more than the 4 spare groups" in _error(base + ["run.partial_rollout.extra_groups=5", "run.mode=async"])


def test_set_override_parsing():
    data = {}
    set_override(data, "a.b.c=1e-5")
    set_override(data, "a.list=[1, 2]")
    set_override(data, "a.flag=false")
    set_override(data, "a.none=")
    assert data == {"a": {"b": {"c": "1e-5"}, "list": [1, 2], "flag": False, "none": None}}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        set_override(data, "a.b")
    with pytest.raises(ConfigError, match="a.flag is False, not a section"):
        set_override(data, "a.flag.x=1")
    assert merge({"x": {"y": 1, "z": 2}}, {"x": {"y": 3}}) == {"x": {"y": 3, "z": 2}}
    assert load_config(None, ["trainer.optimizer.lr=1e-5"]).trainer.optimizer.lr == 1e-5


def test_file_errors(tmp_path):
    assert "no such file" in _error([], tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [1, 2\n")
    assert "not valid YAML" in _error([], bad)
    bad.write_text("- a\n- b\n")
    assert "the top level must be a mapping" in _error([], bad)


def test_cli_print_config_and_errors(capsys, tmp_path):
    assert main(["train", "--print-config", "--set", "run.steps=3"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["run"]["steps"] == 3 and printed["rollout"]["schedule"]["name"] == EMBEDDED["rollout"]["schedule"]["name"]
    assert main(["train", "--set", "rollout.pool.size=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparrow train: error: invalid config") and "rollout.pool.size: Input should be greater than or equal to 1" in err
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "not a run directory (no config.yaml)" in capsys.readouterr().err


def test_worker_payload_inlines_a_schedule_file_so_other_nodes_need_not_have_it(tmp_path):
    from sparrow.schedule import load_schedule

    schedule_file = tmp_path / "schedule.json"
    load_schedule("qwen3-4b-0.86").save(schedule_file)
    config = load_config(None, [f"rollout.schedule={schedule_file}", "controller.enabled=false"])
    payload, edges = config.worker_payload(), config.schedule_template().edges
    schedule_file.unlink()  # as on a rollout node that does not have the file
    worker_view = SparrowConfig.model_validate(payload)
    assert worker_view.initial_schedule().topk_blocks == load_schedule("qwen3-4b-0.86").topk_blocks
    assert worker_view.schedule_template().edges == edges


def test_the_docs_list_every_key_with_its_default():
    """docs/coordinator.md's "Every key" tables are generated from the config models (config_docs)."""
    from sparrow.coordinator.config_docs import DOC, rewritten

    text = DOC.read_text()
    assert rewritten(text) == text, "run: python -m sparrow.coordinator.config_docs"
