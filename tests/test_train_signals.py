"""`sparrow train` stopped by a signal, as a scheduler stops it: launched the way a batch script's background job is
(SIGINT ignored from the start), then SIGTERM. The step under way finishes and is checkpointed, the report is
written, the exit code is 128 + the signal, and `--resume` goes on from that step with nothing trained lost. A
second signal stops it at once."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import tiny_job

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from train_runs import step_records, train_command  # noqa: E402

from sparrow.coordinator.run_dir import RunDir  # noqa: E402

pytestmark = pytest.mark.slow


def _start(config, *sets) -> subprocess.Popen:
    command = train_command(config, list(sets))

    def as_a_background_job():  # what a non-interactive shell does to `cmd &`
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(command, preexec_fn=as_a_background_job, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_steps(proc: subprocess.Popen, run_dir: RunDir, n: int, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(step_records(run_dir.path)) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the job ended or stalled before step {n} (exit {proc.returncode}):\n{proc.communicate()[0]}")
        time.sleep(0.2)


def _job(tmp_path, model, name):
    config = tiny_job(tmp_path / "job.yaml", model, tmp_path / "runs", {"run.checkpoint_every": 0})
    return config, RunDir(tmp_path / "runs" / name)


def test_sigterm_finishes_the_step_checkpoints_it_and_resume_goes_on(tiny_qwen3, tmp_path):
    config, run_dir = _job(tmp_path, tiny_qwen3, "term")
    proc = _start(config, "run.steps=500", "run.name=term")
    _wait_for_steps(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    done = step_records(run_dir.path)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert f"stopped by SIGTERM after step {len(done)}" in out and "--resume" in out
    assert run_dir.latest_tag() == f"step{len(done)}", "the last step trained is the checkpoint"
    assert (run_dir.report / "report.md").is_file()

    resumed = subprocess.run(train_command(None, [f"run.steps={len(done) + 1}"]) + ["--resume", str(run_dir.path)],
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    steps = [r["step"] for r in step_records(run_dir.path)]
    assert steps == list(range(len(done) + 1)), steps  # 0-based: the resumed run adds exactly the next one


def test_a_second_signal_stops_at_once(tiny_qwen3, tmp_path):
    config, run_dir = _job(tmp_path, tiny_qwen3, "twice")
    proc = _start(config, "run.steps=500", "run.name=twice", "rollout.sampling.max_tokens=200",
                  "rollout.sampling.ignore_eos=true")  # ~3 s steps: the second signal lands well inside the job
    _wait_for_steps(proc, run_dir, 1)
    proc.send_signal(signal.SIGINT)
    seen = []
    while not (seen and "stopping after step" in seen[-1]):  # signals of one kind that arrive together count once
        line = proc.stdout.readline()
        assert line, "".join(seen)
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "stopped at once by SIGINT" in out and "everything started was shut down" in out


def test_a_job_run_from_another_thread_keeps_the_process_handlers():
    """Only the main thread may set signal handlers: from another thread the job runs without its own."""
    import threading

    from sparrow.cli.train_cmd import SignalStop

    class Job:
        step = 0

    before, errors = signal.getsignal(signal.SIGTERM), []

    def run():
        try:
            with SignalStop() as signals:
                signals.attach(Job())
        except Exception as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors == [] and signal.getsignal(signal.SIGTERM) is before


def test_a_stop_at_once_while_ray_get_waits_keeps_its_signal(ray_cluster):
    """A handler's exception raised while `ray.get` waits reaches the caller as Ray's own KeyboardInterrupt, so
    the signal that stopped the job is read from the handler: a scheduler's second SIGTERM exits with 143."""
    import os
    import threading

    import ray

    from sparrow.cli.train_cmd import SignalStop

    class Job:
        step = 3
        stop_reason = None

        def request_stop(self, reason):
            self.stop_reason = reason

    @ray.remote(num_cpus=0)
    def a_step():
        time.sleep(60)

    job, under_way = Job(), a_step.remote()
    try:
        with SignalStop() as signals:
            signals.attach(job)
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
            with pytest.raises(KeyboardInterrupt):
                ray.get(under_way)
    finally:
        ray.cancel(under_way, force=True)
    assert job.stop_reason == "SIGTERM" and signals.signum == signal.SIGTERM
    assert signals.at_once == signal.SIGTERM
