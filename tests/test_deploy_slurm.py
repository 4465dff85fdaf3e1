"""deploy/slurm/sparrow.sbatch --dry-run under a fake Slurm allocation: which Ray node starts where with
which pool label and GPU count, and the `sparrow train` command it hands the cluster to."""

import os
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "deploy" / "slurm" / "sparrow.sbatch"
CONFIG = "deploy/configs/qwen3-4b-vllm-multinode.yaml"

# `scontrol show hostnames LIST` for lists like gpu[01-04] or a,b[1-2]: the one Slurm command the
# script reads from the allocation.
FAKE_SCONTROL = r"""#!/usr/bin/env python3
import re, sys
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
for prefix, ranges in re.findall(r"([^,\[]+)(?:\[([^\]]*)\])?", sys.argv[3]):
    for r in ranges.split(",") if ranges else [None]:
        if r is None:
            print(prefix)
            continue
        lo, _, hi = r.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{prefix}{i:0{len(lo)}d}")
"""


@pytest.fixture
def slurm_env(tmp_path):
    (tmp_path / "scontrol").write_text(FAKE_SCONTROL)
    (tmp_path / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPARROW_", "RAY_"))}
    env.update(PATH=f"{tmp_path}:{env['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu[01-04]",
               SLURM_JOB_NUM_NODES="4", SLURM_GPUS_PER_TASK="8", SLURM_CPUS_PER_TASK="64")
    return env


def dry_run(env, *args):
    return subprocess.run(["bash", str(SBATCH), "--dry-run", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def commands(out: str) -> list[list[str]]:
    """The printed commands as argv lists (comment lines dropped, a trailing `&` kept as a word)."""
    return [shlex.split(line) for line in _logical_lines(out) if not line.startswith("#")]


def _logical_lines(out: str) -> list[str]:
    lines, buf = [], ""
    for line in out.splitlines():  # `python -c '...'` spans lines inside its quotes
        buf = f"{buf}\n{line}" if buf else line
        try:
            shlex.split(buf)
        except ValueError:
            continue
        lines.append(buf)
        buf = ""
    return lines


def ray_starts(cmds):
    """node -> the `ray start` arguments of its srun step."""
    starts = {}
    for c in cmds:
        if c[0] == "srun":
            assert c[:5] == ["srun", "--nodes=1", "--ntasks=1", "-w", c[4]] and c[5:7] == ["ray", "start"], c
            assert c[-2:] == ["--block", "&"], "each Ray node must be a backgrounded, blocking job step"
            starts[c[4]] = c[7:-2]
    return starts


def test_head_on_first_node_workers_on_the_rest_with_pool_labels(slurm_env):
    out = dry_run(slurm_env, "--config", CONFIG)
    assert out.returncode == 0, out.stderr
    starts = ray_starts(commands(out.stdout))
    assert list(starts) == ["gpu01", "gpu02", "gpu03", "gpu04"]
    assert "--head" in starts["gpu01"] and "--port=6379" in starts["gpu01"]
    for node in ("gpu02", "gpu03", "gpu04"):
        assert "--head" not in starts[node] and "--address=gpu01:6379" in starts[node]
    labels = {node: next(a for a in args if a.startswith("--resources=")) for node, args in starts.items()}
    assert labels == {"gpu01": '--resources={"trainer_node": 1}', "gpu02": '--resources={"trainer_node": 1}',
                      "gpu03": '--resources={"rollout_node": 1}', "gpu04": '--resources={"rollout_node": 1}'}
    for args in starts.values():
        assert "--num-gpus=8" in args and "--num-cpus=64" in args


def test_train_command_joins_the_cluster_with_matching_labels(slurm_env):
    out = dry_run(slurm_env, "--config", CONFIG, "--", "--set", "run.steps=10")
    assert out.returncode == 0, out.stderr
    cmds = commands(out.stdout)
    train = cmds[-1]
    assert train[:4] == ["sparrow", "train", "--config", CONFIG]
    assert train[-2:] == ["--set", "run.steps=10"]
    sets = dict(train[i + 1].split("=", 1) for i, a in enumerate(train) if a == "--set")
    assert sets["run.ray.address"] == "gpu01:6379"
    assert sets["trainer.pool.node_label"] == "trainer_node" and sets["rollout.pool.node_label"] == "rollout_node"
    # The wait step runs before the job and is valid Python.
    wait = cmds[-2]
    assert wait[:2] == ["python", "-c"] and "ray.nodes()" in wait[2] and ") < 4)" in wait[2]
    compile(wait[2], "wait_for_nodes", "exec")


def test_the_printed_train_command_is_accepted_by_sparrow_train(slurm_env, capsys):
    out = dry_run(slurm_env, "--config", CONFIG)
    train = commands(out.stdout)[-1]
    assert main(train[1:] + ["--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "address: gpu01:6379" in printed and "node_label: trainer_node" in printed


def test_resume_continues_a_run_instead_of_a_config(slurm_env):
    out = dry_run(slurm_env, "--resume", "/shared/runs/train-1")
    assert out.returncode == 0, out.stderr
    train = commands(out.stdout)[-1]
    assert train[:4] == ["sparrow", "train", "--resume", "/shared/runs/train-1"] and "--config" not in train


def test_options_and_environment_choose_the_split_and_gpus(slurm_env):
    env = dict(slurm_env, SLURM_JOB_NODELIST="a01,b[1-2]", SPARROW_TRAINER_NODES="1")
    out = dry_run(env, "--config", CONFIG, "--gpus-per-node", "4", "--port", "7000")
    assert out.returncode == 0, out.stderr
    starts = ray_starts(commands(out.stdout))
    assert list(starts) == ["a01", "b1", "b2"]
    assert [a for a in starts["a01"] if "trainer_node" in a] and [a for a in starts["b2"] if "rollout_node" in a]
    assert "--address=a01:7000" in starts["b1"] and all("--num-gpus=4" in s for s in starts.values())
    assert "trainer a01; rollout b1 b2" in out.stdout


def head_start(env, *args) -> str:
    """The head node's `ray start` line exactly as the dry run prints it."""
    out = dry_run(env, "--config", CONFIG, *args)
    assert out.returncode == 0, out.stderr
    return next(line for line in out.stdout.splitlines() if line.startswith("srun") and " --head " in line)


HEAD_START = ("srun --nodes=1 --ntasks=1 -w gpu01 ray start --head --node-ip-address=gpu01 --port={port} "
              "--disable-usage-stats --num-gpus={gpus} --num-cpus=64 '--resources={{\"trainer_node\": 1}}' --block &")


@pytest.mark.parametrize("env, args, gpus", [
    ({"SLURM_GPUS_PER_TASK": "8"}, [], 8),
    ({"SLURM_GPUS_PER_TASK": "h200:8"}, [], 8),  # sites with typed GRES
    ({"SLURM_GPUS_PER_TASK": None, "SLURM_GPUS_PER_NODE": "h200:4"}, [], 4),
    ({"SLURM_GPUS_PER_TASK": None, "SLURM_GPUS_PER_NODE": "4"}, [], 4),
    ({"SLURM_GPUS_PER_NODE": "h200:4", "SLURM_GPUS_PER_TASK": "h200:8"}, [], 4),  # per node is what Ray declares
    ({"SLURM_GPUS_PER_TASK": None, "SLURM_GPUS_ON_NODE": "2"}, [], 2),
    ({"SLURM_GPUS_PER_TASK": None}, [], 8),
    ({"SLURM_GPUS_PER_TASK": "h200:8"}, ["--gpus-per-node=h200:4"], 4),
    ({}, ["--gpus-per-node", "gpu:h200:2"], 2),
    ({}, ["--gpus-per-node", "gpu:3"], 3),
    ({"SLURM_GPUS_PER_TASK": "h200:4,a100:2"}, [], 6),
], ids=["untyped", "typed", "per-node-typed", "per-node", "per-node-first", "on-node", "default", "option-typed",
        "gres-typed", "gres", "two-types"])
def test_typed_and_untyped_gpu_requests_become_a_ray_gpu_count(slurm_env, env, args, gpus):
    env = {k: v for k, v in {**slurm_env, **env}.items() if v is not None}
    assert head_start(env, *args) == HEAD_START.format(port=6379, gpus=gpus)


@pytest.mark.parametrize("args, env", [(["--port", "7000"], {}), (["--port=7000"], {}), ([], {"SPARROW_RAY_PORT": "7000"})])
def test_port_from_the_option_or_the_environment(slurm_env, args, env):
    assert head_start({**slurm_env, **env}, *args) == HEAD_START.format(port=7000, gpus=8)


@pytest.mark.parametrize("args, env, message", [
    (["--config", CONFIG, "--port", "abc"], {}, "--port/SPARROW_RAY_PORT 'abc': must be a whole number from 1 to 65535"),
    (["--config", CONFIG, "--port", "0"], {}, "--port/SPARROW_RAY_PORT '0': must be a whole number from 1 to 65535"),
    (["--config", CONFIG, "--port", "65536"], {}, "'65536': must be a whole number from 1 to 65535"),
    (["--config", CONFIG, "--port", "010"], {}, "'010': must be a whole number from 1 to 65535"),
    (["--config", CONFIG], {"SPARROW_RAY_PORT": "6379x"}, "--port/SPARROW_RAY_PORT '6379x'"),
    (["--config", CONFIG, "--timeout", "0"], {}, "--timeout/SPARROW_RAY_TIMEOUT '0': must be a whole number of at least 1"),
    (["--config", CONFIG, "--trainer-nodes", "two"], {}, "--trainer-nodes/SPARROW_TRAINER_NODES 'two': must be a whole number"),
    (["--config", CONFIG], {"SLURM_GPUS_PER_TASK": "h200:x"},
     "SLURM_GPUS_PER_TASK 'h200:x' is not a GPU count: give N, TYPE:N or gpu:TYPE:N (e.g. 8, h200:8, gpu:h200:8)"),
    (["--config", CONFIG, "--gpus-per-node", "gpu:a:b:4"], {}, "--gpus-per-node 'gpu:a:b:4' is not a GPU count"),

    ([], {}, "--config JOB.yaml or --resume RUN_DIR is required"),
    (["--config", CONFIG], {"SLURM_JOB_NODELIST": "gpu01"}, "needs at least 2 nodes"),
    (["--config", CONFIG, "--trainer-nodes", "4"], {}, "must leave at least one node to each pool"),
    (["--config", CONFIG, "--bogus"], {}, "unknown option '--bogus'"),
    (["--config", CONFIG, "--resume", "runs/x"], {}, "give --config or --resume, not both"),
])
def test_bad_input_fails_naming_the_fix(slurm_env, args, env, message):
    out = dry_run({**slurm_env, **env}, *args)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""


@pytest.mark.slow
def test_real_run_starts_ray_runs_the_job_and_stops_ray(tmp_path):
    """The script for real, on this machine: a stand-in `srun` runs each step here, so the "nodes"
    localhost and 127.0.0.1 are two Ray nodes on one host; the job is `sparrow train --print-config`."""
    bindir = Path(sys.executable).parent
    if shutil.which("ray", path=f"{bindir}:{os.environ['PATH']}") is None:
        pytest.skip("the `ray` command is not installed")
    (tmp_path / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'localhost\\n127.0.0.1\\n'\n")
    (tmp_path / "srun").write_text('#!/usr/bin/env bash\n'
                                   '# stand-in: drop srun\'s options (and -w NODE), run the step here\n'
                                   'while [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done\nexec "$@"\n')
    for tool in ("scontrol", "srun"):
        (tmp_path / tool).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPARROW_", "RAY_"))}
    env.update(PATH=f"{tmp_path}:{bindir}:{env['PATH']}", SLURM_JOB_NODELIST="localhost,127.0.0.1", SLURM_CPUS_PER_TASK="1")
    out = subprocess.run(["bash", str(SBATCH), "--config", "deploy/configs/embedded.yaml", "--gpus-per-node", "0",
                          "--port", str(port), "--timeout", "240", "--", "--print-config"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Ray cluster up: 2 nodes" in out.stdout
    assert f"address: 127.0.0.1:{port}" in out.stdout  # the job was handed the cluster
    assert "stopping Ray on 2 nodes" in out.stdout
    assert not [args for args in _processes() if Path(args[0]).name in ("gcs_server", "raylet")
                and any(a.endswith((f"={port}", f":{port}")) for a in args)], "Ray processes of the job outlived it"


def _processes() -> list[list[str]]:
    """argv of every process this user can see."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if args[0]:
            found.append(args)
    return found
