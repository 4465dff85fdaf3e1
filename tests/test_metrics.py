"""Metrics scraped over real HTTP: names, labels and values match what was recorded; docs, the
Grafana dashboard and the Prometheus rules only use names that exist."""

import json
import math
import re
import socket
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from sparrow.acceptance import AlphaHistogram
from sparrow.coordinator.controller import ControllerConfig, PowerLawResponse, Simulator, SparsityController
from sparrow.coordinator.metrics import MetricsConfig, SparrowMetrics, start_metrics_server
from sparrow.coordinator.transport import JobCredentials, Trajectory, TrajectoryClient, TrajectoryServer, TransportConfig
from sparrow.cost import CostModel, resolve_hardware, resolve_model
from sparrow.rollout_workers.api import RolloutSample
from sparrow.schedule import load_schedule

ROOT = Path(__file__).resolve().parents[1]


def scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


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


def test_scrape_finds_every_family_with_the_recorded_values():
    metrics = SparrowMetrics(MetricsConfig(port=0), worker="w0", pool="rollout")
    schedule = load_schedule("qwen3-1.7b-0.86")
    ctl = SparsityController(ControllerConfig(), schedule)
    hist, _ = Simulator(PowerLawResponse(), 4000, seed=0).measure(schedule)
    step = ctl.step_with(hist, schedule.version)
    metrics.observe_alpha(hist)
    metrics.observe_alpha(hist)
    metrics.record_control_step(step, target=0.86)
    metrics.record_samples([trajectory(i, n) for i, n in enumerate((100, 3000, 70000))])
    metrics.record_staleness(5, [5, 4, 3])
    metrics.tokens_per_second.labels(worker="w0", pool="rollout").set(5662)
    metrics.speedup_measured.labels(pool="rollout").set(2.21)
    cost_model = CostModel(resolve_model("qwen3-1.7b"), resolve_hardware("h200"))
    predicted = metrics.set_predicted_speedup(cost_model, step.schedule)
    metrics.tis_capped_fraction.labels(pool="trainer").set(0.02)
    metrics.weight_publication.labels(pool="trainer").observe(1.5)
    metrics.policy_version.labels(worker="w0", pool="rollout").set(3)

    credentials = JobCredentials.create(TransportConfig())
    with TrajectoryServer(TransportConfig(port=0, queue_capacity=10), credentials) as transport:
        metrics.watch_transport("trajectory", transport.stats)
        with TrajectoryClient(transport.address, transport.config, credentials) as client:
            client.send([trajectory(7, 5), trajectory(7, 5)])
        server = start_metrics_server(metrics)
        try:
            families = scrape(server.url)
        finally:
            server.close()

    alpha = families["sparrow_alpha"]
    assert alpha.type == "histogram"
    counts = hist.counts[3]
    # le=0.86 covers the cells below 0.86·2000 = 1720; two identical steps were observed.
    assert sample_value(alpha, "sparrow_alpha_bucket", bin="3", le="0.86") == 2 * counts[:1720].sum().item()
    assert sample_value(alpha, "sparrow_alpha_count", bin="3") == 2 * 4000
    assert sample_value(alpha, "sparrow_alpha_sum", bin="3") == pytest.approx(2 * hist.sums[3].item())
    tail = families["sparrow_alpha_tail"]
    assert sample_value(tail, "sparrow_alpha_tail", bin="3", quantile="0.05") == pytest.approx(float(hist.percentile(5)[3]))
    assert sample_value(families["sparrow_alpha_target"], "sparrow_alpha_target") == 0.86
    blocks = families["sparrow_schedule_budget_blocks"]
    assert sample_value(blocks, "sparrow_schedule_budget_blocks", bin="0") == step.schedule.blocks_for_bin(0)
    assert sample_value(families["sparrow_schedule_version"], "sparrow_schedule_version") == step.schedule.version
    decisions = families["sparrow_controller_decisions"]
    assert sum(s.value for s in decisions.samples if s.name.endswith("_total")) == 20
    assert sample_value(families["sparrow_rollout_tokens"], "sparrow_rollout_tokens_total", worker="w0") == 73100
    assert sample_value(families["sparrow_rollout_samples"], "sparrow_rollout_samples_total", finish_reason="length") == 1
    lengths = families["sparrow_response_length_tokens"]
    assert sample_value(lengths, "sparrow_response_length_tokens_bucket", le="65536.0") == 2
    assert sample_value(lengths, "sparrow_response_length_tokens_count") == 3
    assert sample_value(families["sparrow_reward"], "sparrow_reward_sum", pool="rollout") == 1.0
    assert sample_value(families["sparrow_staleness_steps"], "sparrow_staleness_steps_bucket", le="1.0") == 2
    assert sample_value(families["sparrow_queue_depth"], "sparrow_queue_depth", queue="trajectory") == 1
    messages = families["sparrow_transport_messages"]
    assert sample_value(messages, "sparrow_transport_messages_total", queue="trajectory", status="duplicate") == 1
    assert sample_value(families["sparrow_speedup_measured"], "sparrow_speedup_measured", pool="rollout") == 2.21
    speedup = sample_value(families["sparrow_speedup_predicted"], "sparrow_speedup_predicted", pool="rollout")
    assert speedup == pytest.approx(predicted) and speedup > 1.5
    assert math.isfinite(sample_value(families["sparrow_weight_publication_seconds"], "sparrow_weight_publication_seconds_sum"))


def test_dense_bins_export_nan_budget_and_dense_flag():
    metrics = SparrowMetrics()
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
        server = start_metrics_server(SparrowMetrics(), MetricsConfig(port=port, port_search=20))
        try:
            assert server.port != port and port < server.port < port + 20
        finally:
            server.close()
        with pytest.raises(OSError, match=rf"ports {port}\.\.{port} on 127.0.0.1 are all in use"):
            start_metrics_server(SparrowMetrics(), MetricsConfig(port=port, port_search=1))


def test_config_errors():
    with pytest.raises(ValidationError, match="alpha_buckets"):
        MetricsConfig(alpha_buckets=[0.9, 0.8])
    with pytest.raises(ValidationError, match="alpha_quantiles"):
        MetricsConfig(alpha_quantiles=[0.0])
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        MetricsConfig(prot=1)


def exported_names() -> set[str]:
    metrics = SparrowMetrics()
    metrics.observe_alpha(AlphaHistogram.empty(2, 100).add(torch.tensor([0.5]), torch.tensor([0])))
    metrics.watch_transport("q", lambda: dict.fromkeys(
        ["queue_depth", "queue_capacity", "accepted", "duplicate", "invalid_argument", "unavailable", "waits"], 0.0
    ))
    return {f.name for f in metrics.registry.collect()}


def base_name(name: str, names: set[str]) -> str | None:
    for suffix in ("", "_bucket", "_sum", "_count", "_total"):
        if name.endswith(suffix) and name[: len(name) - len(suffix)] in names:
            return name[: len(name) - len(suffix)]
    return None


def test_docs_list_every_metric_and_dashboards_use_only_real_names():
    names = exported_names()
    assert len(names) == 24
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(sparrow_[a-z_]+)`", doc))
    missing = {n for n in names if n not in documented and f"{n}_total" not in documented}
    assert not missing, f"docs/metrics.md does not document {sorted(missing)}"
    dashboard = (ROOT / "deploy" / "grafana" / "sparrow.json").read_text()
    json.loads(dashboard)
    rules = (ROOT / "deploy" / "prometheus-rules.yml").read_text()
    yaml.safe_load(rules)
    for source, text in (("dashboard", dashboard), ("rules", rules), ("docs", doc)):
        used = set(re.findall(r"\bsparrow_[a-z_]+", text))
        unknown = {u for u in used if base_name(u, names) is None}
        assert not unknown, f"{source} uses metric names that are not exported: {sorted(unknown)}"
