"""`sparrow train` end to end with the tiny model through real Ray, real gRPC and real DeepSpeed.

Sync job with 2 trainer ranks and weights broadcast over a gloo weight group: every dispatched sample
is trained on exactly once, also across a forced retry (the trajectory server drains mid-step, the
workers back off and resend) and forced duplicates (resends of already-trained ids are acked
DUPLICATE); the workers serve exactly the trainer's weights after each update; /metrics is served
over HTTP by the coordinator, the worker and both trainer ranks, each listed in the run's file_sd file;
then the run resumed on 1 trainer rank through DeepSpeed's universal checkpoint.
Async job (1 rank, max_staleness 1): rollouts of step k+1 run while step k trains, no sample is
more than one policy version old, and `sparrow train --resume` continues from the checkpoint.
"""

import json
import threading
import time
import urllib.request

import pytest
import torch
from jobs import expected_ids, tiny_job

ray = pytest.importorskip("ray")

from sparrow.cli.main import main  # noqa: E402
from sparrow.coordinator.config import load_config  # noqa: E402
from sparrow.coordinator.driver import TrainingJob  # noqa: E402
from sparrow.coordinator.run_dir import RunDir  # noqa: E402
from sparrow.coordinator.transport import ControlClient, Trajectory, TrajectoryClient  # noqa: E402
from sparrow.rollout_workers.api import RolloutSample  # noqa: E402
from sparrow.weight_sync import HandleSource, receive_state_dict  # noqa: E402

pytestmark = pytest.mark.slow


def _config_file(tmp_path, model, ranks: int, steps: int, mode: str):
    return tiny_job(tmp_path / "job.yaml", model, tmp_path / "runs", {
        "rollout.sampling": {"max_tokens": 20, "n": 4, "temperature": 1.0}, "rollout.speedup_probe_every": 2,
        "trainer.pool.size": ranks, "metrics": {"port": 0}, "run.steps": steps, "run.mode": mode,
    })


def _duplicate(sample_id: str) -> Trajectory:
    """A different sample under an id that was already accepted."""
    sample = RolloutSample(
        request_id=sample_id.split("#")[0], sample_index=int(sample_id.split("#")[1]), prompt_token_ids=[5, 6, 7],
        token_ids=torch.tensor([9, 9]), logprobs=torch.tensor([-1.0, -1.0]), top_ids=torch.zeros(2, 0, dtype=torch.long),
        top_logprobs=torch.zeros(2, 0), blocks_attended=torch.tensor([1, 1], dtype=torch.int32),
        finish_reason="length", policy_version=0, schedule_version=0,
    )
    return Trajectory.of(sample, reward=1.0, sample_id=sample_id)


def _initial_weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_sync_job_trains_every_sample_exactly_once_publishes_weights_and_resumes_on_another_pool_size(
        ray_cluster, tiny_qwen3, tmp_path, capsys):
    """Then, saved by its 2 trainer ranks, the run resumed on 1 (`--set trainer.pool.size=1`): the checkpoint goes through
    DeepSpeed's universal format, whose copy lives inside the checkpoint and is pruned with it. (The resume was a test
    of its own, on a 1-step job like this one's first step.)"""
    config = load_config(_config_file(tmp_path, tiny_qwen3, ranks=2, steps=2, mode="sync"),
                         ["run.weights_channel=collective", "run.checkpoint_every=1"])
    run_dir = RunDir.create(config.run.out_dir, "sync")
    run_dir.config_file.write_text(config.dump())
    initial = _initial_weights(tiny_qwen3)
    with TrainingJob(config, run_dir, progress=False, log=lambda *_: None) as job:
        assert job.channel == "collective"
        first = job.run(steps=1)[0]
        trained_first = sorted(sum(job.trained_ids(), []))
        assert trained_first == sorted(expected_ids(job, range(1)))

        # Forced duplicates: resending trained ids (with other content) is acknowledged DUPLICATE, never queued.
        with TrajectoryClient(job.trajectory_address, config.transport, job.credentials, client_id="test") as client:
            report = client.send(_duplicate(i) for i in trained_first[:5])
        assert (report.accepted, report.duplicate, report.rejected) == (0, 5, [])

        # Forced retry: the trajectory server drains during step 2's rollouts; the worker backs off and resends.
        with ControlClient(job.trajectory_address, config.transport, job.credentials) as control:
            assert control.drain(0.0)[0]
        reopen = threading.Timer(1.0, lambda: ray.get(job.trainers.rank0.resume_ingest.remote()))
        reopen.start()
        second = job.run(steps=1)[0]
        reopen.join()
        assert second.rollout.streams > job.config.run.prompts_per_step, "a group's send needed more than one stream"
        assert first.rollout.speedup_measured > 0 and second.rollout.speedup_measured is None
        max_seqs = config.rollout.engine_config().max_num_seqs
        for record in (first, second):  # the batch over time, read from the engines' samples in flight
            assert 1 <= record.rollout.peak_batch <= max_seqs, record.rollout
            assert 0 < record.rollout.busy_batch_fraction <= record.rollout.peak_batch / max_seqs
            assert 0 <= record.rollout.tail_share < 1

        per_rank = job.trained_ids()
        trained = sum(per_rank, [])
        assert all(per_rank), "both ranks trained on a shard"
        assert len(trained) == len(set(trained)), "a sample was trained on twice"
        assert sorted(trained) == sorted(expected_ids(job, range(2)))
        assert first.rollout.accepted + second.rollout.accepted == len(trained)

        # The workers serve exactly the trainer's weights, version 2, and they moved away from the initial ones.
        report = job.trainers.call_all("publish_weights", job.version, "object_store")[0]
        trainer_state, _ = receive_state_dict(HandleSource(report.handle))
        served = ray.get(job.fleet.actors[0].parameters.remote(list(trainer_state)))
        assert ray.get(job.fleet.actors[0].policy_version.remote()) == job.version == 2
        for name, tensor in trainer_state.items():
            assert torch.equal(served[name], tensor), name
        assert any(not torch.equal(trainer_state[n], initial[n]) for n in trainer_state)

        coordinator = _scrape(job.metrics_server.url)
        assert "sparrow_train_step 2.0" in coordinator
        assert 'sparrow_alpha_bucket{bin="' in coordinator
        assert 'sparrow_schedule_budget_blocks{bin="0"}' in coordinator
        assert "sparrow_queue_depth{" not in coordinator, "statistics come over Ray; the coordinator has no queue"
        assert 'sparrow_weight_publication_seconds_count{pool="trainer"} 2.0' in coordinator
        assert 'sparrow_speedup_measured{pool="rollout"}' in coordinator
        worker = _scrape(job.fleet.workers[0]["metrics_url"])
        assert 'sparrow_policy_version{pool="rollout",worker="rollout-0"} 2.0' in worker
        assert 'sparrow_schedule_version{pool="rollout",worker="rollout-0"}' in worker
        assert "sparrow_speedup_measured{" not in worker and "sparrow_alpha_target " not in worker, "the coordinator's"
        assert 'sparrow_rollout_samples_total{finish_reason="length",pool="rollout",worker="rollout-0"}' in worker
        ranks = [_scrape(url) for url in job.trainer_metrics_urls]
        assert 'sparrow_queue_depth{queue="trajectory"}' in ranks[0] and "sparrow_queue_depth{" not in ranks[1]
        assert all(f'sparrow_train_loss{{pool="trainer",worker="trainer-{r}"}}' in text for r, text in enumerate(ranks))
        listed = json.loads(run_dir.prometheus_targets_file.read_text())
        assert sorted(g["labels"]["worker"] for g in listed) == ["coordinator", "rollout-0", "trainer-0", "trainer-1"]

    rows = RunDir.read_jsonl(run_dir.metrics_file)
    assert [r["step"] for r in rows] == [0, 1]
    decisions = RunDir.read_jsonl(run_dir.decisions_file)
    assert [d["step"] for d in decisions] == [0, 1] and all(len(d["decisions"]) == 3 for d in decisions)
    assert run_dir.latest_tag() == "step2"
    assert not ray.util.list_named_actors(), "the job left actors behind"

    assert (run_dir.checkpoints / "step2").is_dir() and not (run_dir.checkpoints / "step2" / "universal").exists()
    assert not (run_dir.checkpoints / "step1").exists(), "keep_checkpoints=1 deletes older checkpoints"
    capsys.readouterr()
    resume = ["train", "--resume", str(run_dir.path), "--set", "trainer.pool.size=1", "--set", "run.steps=3"]
    assert main([*resume, "--no-progress"]) == 0
    assert "resumed from" in capsys.readouterr().out
    rows = RunDir.read_jsonl(run_dir.metrics_file)
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["policy_version"] for r in rows] == [0, 1, 2]
    assert json.loads((run_dir.checkpoints / "step3.json").read_text())["step"] == 3
    assert not (run_dir.checkpoints / "step2").exists(), "the universal copy went with its checkpoint"


def test_async_job_bounds_staleness_and_resumes(ray_cluster, tiny_qwen3, tmp_path, capsys):
    path = _config_file(tmp_path, tiny_qwen3, ranks=1, steps=3, mode="async")
    config = load_config(path, ["run.checkpoint_every=1", "run.name=async"])
    run_dir = RunDir.create(config.run.out_dir, "async")
    run_dir.config_file.write_text(config.dump())
    with TrainingJob(config, run_dir, progress=False, log=lambda *_: None) as job:
        records = job.run(steps=2)
        assert len(job.steps.inflight) == 1, "step 3's rollouts run while step 2 trains"
        trained = sum(job.trained_ids(), [])
    assert sorted(trained) == sorted(expected_ids(job, range(2)))
    assert records[0].rollout.staleness_max == 0
    assert records[1].rollout.staleness_max == 1, "step 2 was generated by policy 0 while step 1 trained"

    assert main(["train", "--resume", str(run_dir.path), "--no-progress"]) == 0
    out = capsys.readouterr()
    rows = RunDir.read_jsonl(run_dir.metrics_file)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[2]["policy_version"] == 2 and rows[2]["rollout"]["staleness_max"] == 0
    state = json.loads((run_dir.checkpoints / "step3.json").read_text())
    assert state["step"] == 3 and state["controller"]["step"] == 3
    assert not (run_dir.checkpoints / "step1").exists(), "keep_checkpoints=1 deletes older checkpoints"
    assert (run_dir.report / "report.md").is_file() and (run_dir.report / "alpha_tail.png").is_file()
    assert "report:" in out.out
    assert "1 trainer rank in" in out.out and "1 rollout worker (native) loading meanwhile" in out.out, out.out
    ledger = RunDir.read_jsonl(run_dir.ledger_file)
    assert [line["step"] for line in ledger] == [0, 1, 2], "the resumed run neither repeats nor loses a step's line"
    assert [line["policy_version"] for line in ledger] == [0, 1, 2] and all(line["schedule_versions"] for line in ledger)
    ids = [i for line in ledger for rank in line["trained_ids"] for i in rank]
    assert len(ids) == len(set(ids)) and sorted(ids) == sorted(expected_ids(job, range(3)))


def test_a_trainer_pool_that_cannot_start_stops_the_engines_already_loading(ray_cluster, tiny_qwen3, tmp_path):
    """The rollout workers load while the trainer ranks start; when the ranks cannot, the job fails naming the
    trainer pool and nothing it started keeps holding the cluster."""
    from sparrow.coordinator.pools import PlacementError

    path = _config_file(tmp_path, tiny_qwen3, ranks=1, steps=1, mode="sync")
    config = load_config(path, ["trainer.pool.cpus=64", "run.name=no-room"])
    assert config.pools_start_together
    job = TrainingJob(config, RunDir.create(config.run.out_dir, "no-room"), progress=False, log=lambda *_: None)
    with pytest.raises(PlacementError, match="trainer pool.*CPU: needs 64"):
        with job:
            pass
    assert job.fleet is None and job.trainers is None
    total = ray.cluster_resources()["CPU"]
    for _ in range(100):
        if ray.available_resources().get("CPU") == total:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == total, "a rollout worker's bundle was left placed"


def test_held_out_evaluation_before_during_and_after_training(ray_cluster, tiny_qwen3, tmp_path):
    path = _config_file(tmp_path, tiny_qwen3, ranks=1, steps=2, mode="async")
    config = load_config(path, ["data.arithmetic={min_value: 0, max_value: 50, operations: ['+']}",
                                "data.eval={every: 1, prompts: 3, samples: 2}", "run.name=eval"])
    run_dir = RunDir.create(config.run.out_dir, "eval")
    run_dir.config_file.write_text(config.dump())
    with TrainingJob(config, run_dir, progress=False, log=lambda *_: None) as job:
        records = job.run()
        coordinator = _scrape(job.metrics_server.url)
    evaluations = [e for r in records for e in r.evaluations]
    assert [e.policy_version for e in evaluations] == [0, 1, 2], "before training and after each update"
    assert [e.policy_version for e in records[0].evaluations] == [0, 1]
    for e in evaluations:
        assert e.prompts == 3 and e.decoding == "greedy" and [x.mode for x in e.results] == ["dense", "sparse"]
        assert all(x.samples == 6 and 0 <= x.accuracy <= 1 and x.tokens > 0 for x in e.results)
    assert 'sparrow_eval_policy_version 2.0' in coordinator and 'sparrow_eval_accuracy{mode="sparse"}' in coordinator
    assert RunDir.read_jsonl(run_dir.metrics_file)[1]["evaluations"][0]["policy_version"] == 2
    from sparrow.coordinator.report import write_report

    report = write_report(run_dir).read_text()
    assert "## Held-out evaluation" in report and (run_dir.report / "eval_accuracy.png").is_file()


def test_exact_alpha_lies_between_the_top_k_bounds_and_steers_the_controller(ray_cluster, tiny_qwen3, tmp_path):
    """trainer.exact_alpha in a sync job: each step records exact α of the tokens the top-k bounds cover, and each
    bin's tail lies between the bounds' tails (α is bracketed token by token, so its percentile is too); with
    controller.statistic=exact the controller judges every bin on that same exact tail."""
    import json

    from sparrow.coordinator.report import write_report

    path = tiny_job(tmp_path / "job.yaml", tiny_qwen3, tmp_path / "runs", {
        "trainer.exact_alpha": True, "run.steps": 2,
        "controller": {"enabled": True, "statistic": "exact", "min_samples": 1, "window_steps": 1, "confidence_z": 0.0,
                       "ladder": [0, 1, 2, 4]},
        "rollout.sampling": {"max_tokens": 64, "n": 2, "temperature": 1.0},
        "rollout.schedule": {"name": "tiny0", "edges": [80, 96], "topk_blocks": [0, 0, 0]},
    })
    config = load_config(path, ["run.name=exact"])
    run_dir = RunDir.create(config.run.out_dir, "exact")
    run_dir.config_file.write_text(config.dump())
    with TrainingJob(config, run_dir, progress=False, log=lambda *_: None) as job:
        records = job.run()
    for r in records:
        exact, bounds = r.alpha_exact, r.alpha
        assert exact is not None and exact.tokens == bounds.tokens and sum(exact.tokens) > 0
        assert r.train["train/alpha_exact_unmeasured_tokens"] == 0
        for lower, upper, value, n in zip(bounds.p5, bounds.p5_upper, exact.p5, exact.tokens):
            assert not n or lower - 1e-3 <= value <= upper + 1e-3
    assert any(p < 0.999 for r in records for p, n in zip(r.alpha_exact.p5, r.alpha_exact.tokens) if n), \
        "3-block budgets change α"
    assert "exact α p5" in write_report(run_dir).read_text()
    decisions = [json.loads(line) for line in run_dir.decisions_file.read_text().splitlines()]
    assert len(decisions) == len(records) == 2
    for r, step in zip(records, decisions):
        judged = {d["bin"]: d["stats"]["alpha"] for d in step["decisions"] if "alpha" in d["stats"]}
        assert judged and all(r.alpha_exact.tokens[b] for b in judged)
        for b, alpha in judged.items():
            assert alpha == pytest.approx(r.alpha_exact.p5[b], abs=1e-6)
