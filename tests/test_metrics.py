"""Metrics scraped over real HTTP: names, labels and values match what was recorded; docs, the
Grafana dashboard and the Prometheus rules only use names that exist."""

import json
import math
import re
import socket
import urllib.request
from pathlib import Path
from dataclasses import replace

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from records import make_record

from sparrow.coordinator.controller import ControllerConfig, PowerLawResponse, Simulator, SparsityController
from sparrow.coordinator.metrics import ROLE_FAMILIES, ROLES, MetricsConfig, SparrowMetrics, start_metrics_server
from sparrow.coordinator.step_record import BatchSummary, EvalRecord, EvalResult, FaultEvent
from sparrow.coordinator.transport import Trajectory
from sparrow.cost import CostModel, resolve_hardware, resolve_model
from sparrow.rollout_workers.api import RolloutSample
from sparrow.schedule import load_schedule

ROOT = Path(__file__).resolve().parents[1]


def scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    # prometheus-client's text format adds a `<family>_created` gauge per counter and histogram: not families of ours.
    return {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def sample_value(family, name: str, **labels) -> float:
    for s in family.samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{name} {labels} not in {family.name}")


def trajectory(i: int, n: int) -> Trajectory:
    s = RolloutSample(
        request_id=f"p{i}", sample_index=0, prompt_token_ids=[1], token_ids=torch.zeros(n, dtype=torch.long),
        logprobs=torch.zeros(n), top_ids=torch.zeros(n, 0, dtype=torch.long), top_logprobs=torch.zeros(n, 0),
        blocks_attended=torch.ones(n, dtype=torch.int32), finish_reason="stop" if i else "length",
        policy_version=3, schedule_version=0,
    )
    return Trajectory.of(s, reward=float(i % 2))


def serve_and_scrape(metrics: SparrowMetrics) -> dict:
    server = start_metrics_server(metrics, MetricsConfig(port=0))
    try:
        return scrape(server.url)
    finally:
        server.close()


def series(families: dict) -> set[str]:
    """Names of the families that have at least one sample."""
    return {name for name, f in families.items() if f.samples}


BLANK_SUMMARY = BatchSummary(samples=0, failed=0, errors=[], rewards=[], response_lengths=[], prompt_lengths=[],
                             truncated=0, staleness=[], kv_read_fraction=1.0, schedule_versions=[])


def test_coordinator_exports_alpha_control_and_the_step_record():
    metrics = SparrowMetrics.for_coordinator(MetricsConfig(port=0))
    schedule = load_schedule("qwen3-1.7b-0.86")
    ctl = SparsityController(ControllerConfig(), schedule)
    hist, _ = Simulator(PowerLawResponse(), 4000, seed=0).measure(schedule)
    step = ctl.step_with(hist, schedule.version)
    metrics.observe_alpha(hist)
    metrics.observe_alpha(hist)
    metrics.record_control_step(step, target=0.86)
    cost_model = CostModel(resolve_model("qwen3-1.7b"), resolve_hardware("h200"))
    predicted = metrics.set_predicted_speedup(cost_model, step.schedule)
    first, second = make_record(4), make_record(5)
    metrics.record_step(replace(
        first, predicted_speedup=predicted, publish=replace(first.publish, seconds=1.5),
        alpha_exact=replace(first.alpha, p5=[0.91, 0.9, 0.88, None], p5_upper=None),
        rollout=replace(first.rollout, kv_read_fraction=0.25, speedup_measured=2.21, utilisation={"rollout-0": 0.75}),
        faults=[FaultEvent("rollout_worker_lost", "rollout-0", "killed", 42.0, 4),
                FaultEvent("trainer_lost", "trainer", "rank 1 killed", None, 4)],  # not recovered yet: not counted
    ), replace(BLANK_SUMMARY, staleness=[0, 1, 2]), target=0.86)
    metrics.record_step(replace(
        second, predicted_speedup=predicted, publish=replace(second.publish, seconds=2.5), faults=[],
        rollout=replace(second.rollout, kv_read_fraction=0.5, speedup_measured=None, utilisation={}),
    ), BLANK_SUMMARY)
    metrics.record_eval(EvalRecord(6, 32, "greedy", 3, [EvalResult("dense", 0.5, 0.5, 41.0, 32, 1312, 2.0),
                                                        EvalResult("sparse", 0.4375, 0.4375, 40.5, 32, 1296, 1.5)]))
    families = serve_and_scrape(metrics)

    alpha = families["sparrow_alpha"]
    assert alpha.type == "histogram"
    counts = hist.counts[3]
    # le=0.86 covers the cells below 0.86·2000 = 1720; two identical steps were observed.
    assert sample_value(alpha, "sparrow_alpha_bucket", bin="3", le="0.86") == 2 * counts[:1720].sum().item()
    assert sample_value(alpha, "sparrow_alpha_count", bin="3") == 2 * 4000
    assert sample_value(alpha, "sparrow_alpha_sum", bin="3") == pytest.approx(2 * hist.sums[3].item())
    exact = families["sparrow_alpha_tail_exact"]
    assert [sample_value(exact, "sparrow_alpha_tail_exact", bin=str(b), quantile="0.05") for b in range(3)] == [0.91, 0.9, 0.88]
    assert not [s for s in exact.samples if s.labels["bin"] == "3"], "a bin without tokens is not set"
    tail = families["sparrow_alpha_tail"]
    assert sample_value(tail, "sparrow_alpha_tail", bin="3", quantile="0.05") == pytest.approx(float(hist.percentile(5)[3]))
    assert sample_value(families["sparrow_alpha_target"], "sparrow_alpha_target") == 0.86
    blocks = families["sparrow_schedule_budget_blocks"]
    assert sample_value(blocks, "sparrow_schedule_budget_blocks", bin="0") == step.schedule.blocks_for_bin(0)
    version = families["sparrow_schedule_version"]
    assert sample_value(version, "sparrow_schedule_version", worker="coordinator") == step.schedule.version
    decisions = families["sparrow_controller_decisions"]
    assert sum(s.value for s in decisions.samples if s.name.endswith("_total")) == 20
    assert sample_value(families["sparrow_speedup_measured"], "sparrow_speedup_measured", pool="rollout") == 2.21, \
        "a step without a probe keeps the last measurement"
    speedup = sample_value(families["sparrow_speedup_predicted"], "sparrow_speedup_predicted", pool="rollout")
    assert speedup == pytest.approx(predicted) and speedup > 1.5
    assert sample_value(families["sparrow_train_step"], "sparrow_train_step") == 6
    assert sample_value(families["sparrow_eval_accuracy"], "sparrow_eval_accuracy", mode="sparse") == 0.4375
    assert sample_value(families["sparrow_eval_reward"], "sparrow_eval_reward", mode="dense") == 0.5
    assert sample_value(families["sparrow_eval_policy_version"], "sparrow_eval_policy_version") == 6
    assert sample_value(families["sparrow_rollout_kv_read_fraction"], "sparrow_rollout_kv_read_fraction") == 0.5
    assert sample_value(families["sparrow_rollout_utilisation"], "sparrow_rollout_utilisation", worker="rollout-0") == 0.75
    assert sample_value(families["sparrow_rollout_tail_share"], "sparrow_rollout_tail_share") == 0.21
    assert sample_value(families["sparrow_rollout_busy_batch_fraction"],
                        "sparrow_rollout_busy_batch_fraction") == pytest.approx(0.57), "the last step's"
    publication = families["sparrow_weight_publication_seconds"]
    assert sample_value(publication, "sparrow_weight_publication_seconds_count", pool="trainer") == 2
    assert sample_value(families["sparrow_staleness_steps"], "sparrow_staleness_steps_bucket", le="1.0") == 2
    assert sample_value(families["sparrow_recoveries"], "sparrow_recoveries_total", kind="rollout_worker_lost") == 1
    assert sample_value(families["sparrow_recovery_seconds"], "sparrow_recovery_seconds_sum", kind="rollout_worker_lost") == 42
    assert not [x for x in families["sparrow_recoveries"].samples if x.labels["kind"] == "trainer_lost"]
    assert set(families) == ROLE_FAMILIES["coordinator"]
    assert series(families) == ROLE_FAMILIES["coordinator"], "every family of the role was set"
    # The coordinator serves no queue: statistics reach it over Ray, samples go to trainer rank 0.
    assert not {"sparrow_queue_depth", "sparrow_transport_messages"} & set(families)
    with pytest.raises(AttributeError, match="a coordinator process serves no queue .only trainer processes do"):
        metrics.watch_transport("trajectory", dict)


def test_rollout_worker_exports_its_samples_and_versions_only():
    metrics = SparrowMetrics.for_rollout(MetricsConfig(port=0), 0)
    fresh = serve_and_scrape(metrics)
    assert set(fresh) == ROLE_FAMILIES["rollout"] and not series(fresh), "nothing before the worker sets it"
    metrics.record_samples([trajectory(i, n) for i, n in enumerate((100, 3000, 70000))])
    metrics.record_reward_error("timeout")
    metrics.tokens_per_second.labels(worker="rollout-0", pool="rollout").set(5662)
    metrics.policy_version.labels(worker="rollout-0", pool="rollout").set(3)
    schedule = load_schedule("qwen3-1.7b-0.86")
    metrics.set_schedule(schedule.with_topk([None] + list(schedule.topk_blocks[1:])))  # applied at a step's start
    families = serve_and_scrape(metrics)

    assert set(families) == ROLE_FAMILIES["rollout"] and series(families) == ROLE_FAMILIES["rollout"]
    assert sample_value(families["sparrow_rollout_tokens"], "sparrow_rollout_tokens_total", worker="rollout-0") == 73100
    assert sample_value(families["sparrow_rollout_samples"], "sparrow_rollout_samples_total", finish_reason="length") == 1
    lengths = families["sparrow_response_length_tokens"]
    assert sample_value(lengths, "sparrow_response_length_tokens_bucket", le="65536.0") == 2
    assert sample_value(lengths, "sparrow_response_length_tokens_count") == 3
    assert sample_value(families["sparrow_reward"], "sparrow_reward_sum", pool="rollout") == 1.0
    assert sample_value(families["sparrow_reward_errors"], "sparrow_reward_errors_total", reason="timeout") == 1
    assert sample_value(families["sparrow_schedule_version"], "sparrow_schedule_version", worker="rollout-0") == 1
    # No τ (it was NaN on every worker), no budgets, no speedup: those are the coordinator's.
    assert not {"sparrow_alpha_target", "sparrow_schedule_budget_blocks", "sparrow_speedup_measured"} & set(families)
    with pytest.raises(AttributeError, match="only coordinator processes do"):
        metrics.speedup_measured.labels(pool="rollout").set(2.0)
    with pytest.raises(AttributeError, match="only coordinator processes do"):
        metrics.set_schedule(schedule, target=0.86)


def test_trainer_rank_exports_its_step_memory_and_rank0_queue():
    metrics = SparrowMetrics.for_trainer(MetricsConfig(port=0), 1, device=torch.device("cpu"))
    step = {"train/tokens_per_s": 812.0, "train/seconds": 2.5, "train/pg_loss": -0.125, "train/grad_norm": 0.75,
            "train/tis_capped_fraction": 0.02, "train/entropy": 3.0}
    metrics.record_train_step(step, skipped_updates=0)
    metrics.record_train_step(step, skipped_updates=2)
    metrics.watch_transport("trajectory", lambda: {"queue_depth": 0.0, "queue_capacity": 10.0, "accepted": 5.0,
                                                   "duplicate": 0.0, "invalid_argument": 0.0, "unavailable": 0.0,
                                                   "waits": 0.0})
    families = serve_and_scrape(metrics)

    assert set(families) == ROLE_FAMILIES["trainer"]
    rank = {"worker": "trainer-1", "pool": "trainer"}
    for family, value in (("sparrow_train_tokens_per_second", 812.0), ("sparrow_train_step_seconds", 2.5),
                          ("sparrow_train_loss", -0.125), ("sparrow_train_grad_norm", 0.75),
                          ("sparrow_tis_capped_fraction", 0.02)):
        assert sample_value(families[family], family, **rank) == value, family
    skipped = families["sparrow_train_skipped_updates"]
    assert skipped.type == "counter" and sample_value(skipped, "sparrow_train_skipped_updates_total", **rank) == 2
    host = families["sparrow_host_memory_bytes"]
    assert 10e6 < sample_value(host, "sparrow_host_memory_bytes", kind="rss", **rank) <= \
        sample_value(host, "sparrow_host_memory_bytes", kind="peak_rss", **rank)
    assert not families["sparrow_gpu_memory_bytes"].samples, "a CPU rank has no GPU memory series"
    assert sample_value(families["sparrow_queue_capacity"], "sparrow_queue_capacity", queue="trajectory") == 10
    assert series(families) == ROLE_FAMILIES["trainer"] - {"sparrow_gpu_memory_bytes"}
    # Ranks other than 0 serve no trajectory queue: the families are there, without series.
    other = serve_and_scrape(SparrowMetrics.for_trainer(MetricsConfig(port=0), 2))
    assert not other["sparrow_queue_depth"].samples and not other["sparrow_train_loss"].samples


def test_roles_and_ports():
    with pytest.raises(ValueError, match="one of coordinator, rollout, trainer"):
        SparrowMetrics(role="observer")
    with pytest.raises(TypeError):
        SparrowMetrics()  # the role is explicit
    config = MetricsConfig(port=9400)
    assert config.for_role("coordinator").port == 9400
    assert (config.for_role("rollout").port, config.for_role("trainer").port) == (9401, 9401)
    assert config.for_role("trainer").port_search == 256
    assert MetricsConfig(port=0).for_role("rollout").port == 0
    shared = {"sparrow_schedule_version"}  # the coordinator's decided version and each worker's own
    for a in ROLES:
        for b in ROLES:
            if a < b:
                assert ROLE_FAMILIES[a] & ROLE_FAMILIES[b] <= shared, (a, b)


def test_dense_bins_export_nan_budget_and_dense_flag():
    metrics = SparrowMetrics.for_coordinator()
    schedule = load_schedule("qwen3-1.7b-0.86")
    metrics.set_schedule(schedule.with_topk([None] + list(schedule.topk_blocks[1:])))
    server = start_metrics_server(metrics, MetricsConfig(port=0))
    try:
        families = scrape(server.url)
    finally:
        server.close()
    assert math.isnan(sample_value(families["sparrow_schedule_budget_blocks"], "sparrow_schedule_budget_blocks", bin="0"))
    assert sample_value(families["sparrow_schedule_dense"], "sparrow_schedule_dense", bin="0") == 1
    assert sample_value(families["sparrow_schedule_dense"], "sparrow_schedule_dense", bin="1") == 0


def test_port_in_use_moves_to_the_next_and_gives_up_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_metrics_server(SparrowMetrics.for_coordinator(), MetricsConfig(port=port, port_search=20))
        try:
            assert server.port != port and port < server.port < port + 20
        finally:
            server.close()
        with pytest.raises(OSError, match=rf"ports {port}\.\.{port} on 127.0.0.1 are all in use"):
            start_metrics_server(SparrowMetrics.for_coordinator(), MetricsConfig(port=port, port_search=1))


def test_config_errors():
    with pytest.raises(ValidationError, match="alpha_buckets"):
        MetricsConfig(alpha_buckets=[0.9, 0.8])
    with pytest.raises(ValidationError, match="alpha_quantiles"):
        MetricsConfig(alpha_quantiles=[0.0])
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        MetricsConfig(prot=1)


def exported_names() -> set[str]:
    return set().union(*ROLE_FAMILIES.values())


def base_name(name: str, names: set[str]) -> str | None:
    for suffix in ("", "_bucket", "_sum", "_count", "_total"):
        if name.endswith(suffix) and name[: len(name) - len(suffix)] in names:
            return name[: len(name) - len(suffix)]
    return None


def documented_families(doc: str) -> dict[str, set[str]]:
    """docs/metrics.md's reference: one `### ... (role="X")` table per role; counters named with _total."""
    reference = doc.split("\n## Metric reference", 1)[1].split("\n## ", 1)[0]
    out = {}
    for section in reference.split("\n### ")[1:]:
        role = re.search(r'role="(\w+)"', section.splitlines()[0]).group(1)
        out[role] = set(re.findall(r"^\| `(sparrow_[a-z_]+)`", section, re.M))
    return out


def test_docs_list_every_family_per_role_and_dashboards_use_only_real_names():
    names = exported_names()
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = documented_families(doc)
    assert set(documented) == set(ROLES)
    for role, families in documented.items():
        assert {base_name(n, names) for n in families} == ROLE_FAMILIES[role], f"docs/metrics.md, role {role}"
    dashboard = (ROOT / "deploy" / "grafana" / "sparrow.json").read_text()
    json.loads(dashboard)
    rules = (ROOT / "deploy" / "prometheus-rules.yml").read_text()
    yaml.safe_load(rules)
    coordinator_md = (ROOT / "docs" / "coordinator.md").read_text()
    for source, text in (("dashboard", dashboard), ("rules", rules), ("docs", doc), ("coordinator.md", coordinator_md)):
        used = set(re.findall(r"\bsparrow_[a-z_]+", text))
        unknown = {u for u in used if base_name(u, names) is None}
        assert not unknown, f"{source} uses metric names that are not exported: {sorted(unknown)}"


def test_dashboard_plots_every_family_with_a_legend_per_query():
    board = json.loads((ROOT / "deploy" / "grafana" / "sparrow.json").read_text())
    names = exported_names()
    targets = [t for p in board["panels"] for t in p.get("targets", [])]
    plotted = {base_name(u, names) for t in targets for u in re.findall(r"\bsparrow_[a-z_]+", t["expr"])}
    assert plotted == names, f"exported but not plotted: {sorted(names - plotted)}"
    for panel in board["panels"]:
        for t in panel.get("targets", []):
            assert t["legendFormat"].strip(), (panel["title"], t["expr"])
            assert 'run="$run"' in t["expr"] or panel["type"] == "row", (panel["title"], t["expr"])
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_busy_rate_reports_each_busy_second_and_each_shorter_burst_that_ends_idle():
    from sparrow.coordinator.metrics import BusyRate

    rate = BusyRate(window_s=1.0)
    assert rate.update(tokens=300, busy_seconds=0.4, idle=False) is None, "a window stays open under 1 busy second"
    assert rate.update(tokens=900, busy_seconds=1.2, idle=False) == pytest.approx(750.0)
    assert rate.update(tokens=1000, busy_seconds=1.45, idle=True) == pytest.approx(400.0), "going idle closes it"
    assert rate.update(tokens=1000, busy_seconds=1.45, idle=True) is None, "no busy time since: nothing to report"
    # A whole job shorter than one busy second (3 steps of a tiny model) still reports a rate.
    short = BusyRate()
    rates = [short.update(tokens=240 * step, busy_seconds=0.3 * step, idle=True) for step in (1, 2, 3)]
    assert rates == pytest.approx([800.0] * 3)


def test_utilisation_of_a_replaced_worker_counts_its_restarted_busy_counter():
    from sparrow.coordinator.metrics import busy_fractions

    before = {"rollout-0": 30.0, "rollout-1": 12.0}
    # rollout-0 was replaced during the 40 s window: its new actor has been busy 6 s (its count restarted at 0)
    now = {"rollout-0": 6.0, "rollout-1": 32.0, "rollout-2": 50.0}
    assert busy_fractions(before, now, 40.0) == pytest.approx({"rollout-0": 0.15, "rollout-1": 0.5, "rollout-2": 1.0})
    assert busy_fractions(now, now, 0.0) == {"rollout-0": 0.0, "rollout-1": 0.0, "rollout-2": 0.0}


def test_batch_shape_of_a_rollout_with_a_long_tail():
    from sparrow.coordinator.metrics import BatchOccupancy, batch_shape

    worker = BatchOccupancy()
    worker.add(8, 10.0)  # the whole group decoding together
    worker.add(3, 4.0)
    worker.add(1, 6.0)  # the longest samples alone: below half the peak of 8
    worker.add(0, 50.0)  # idle time is utilisation's business, not the batch's
    shape = batch_shape({}, {"rollout-0": worker.seconds}, max_num_seqs=16)
    assert shape.peak == 8
    assert shape.busy_batch_fraction == pytest.approx((8 * 10 + 3 * 4 + 1 * 6) / (16 * 20))
    assert shape.tail_share == pytest.approx((4 + 6) / 20)
    with pytest.raises(ValueError, match="running=-1"):
        worker.add(-1, 1.0)


def test_batch_shape_takes_the_step_from_cumulative_counts_and_a_replacements_restart():
    from sparrow.coordinator.metrics import batch_shape

    before = {"rollout-0": [0.0, 5.0, 0.0, 0.0, 10.0], "rollout-1": [0.0, 0.0, 0.0, 0.0, 7.0]}
    # rollout-0 went on (4 s more at batch 4), rollout-1 was replaced: its counts restarted (2 s at batch 2)
    now = {"rollout-0": [0.0, 5.0, 0.0, 0.0, 14.0], "rollout-1": [0.0, 0.0, 2.0]}
    shape = batch_shape(before, now, max_num_seqs=4)
    assert shape.peak == 4
    assert shape.busy_batch_fraction == pytest.approx((4 * 4 + 2 * 2) / (4 * 6))
    assert shape.tail_share == pytest.approx(0.0), "2 is not below half of 4"
    idle = batch_shape(now, now, 4)
    assert (idle.busy_batch_fraction, idle.tail_share, idle.peak) == (None, None, 0), "no work since: nothing to say"
