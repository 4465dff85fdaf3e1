"""The CLI imports a subcommand's heavy modules only when that subcommand runs, and every subcommand
still parses. (How fast it starts is measured by benchmarks/cli_startup.py, not here.)"""

import subprocess
import sys
from importlib.metadata import version

import pytest

from sparrow.cli.main import SUBCOMMANDS, main

HEAVY = ("torch", "ray", "deepspeed", "transformers", "grpc")

LOADED_AFTER = """
import contextlib, io, json, sys
from sparrow.cli.main import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in {heavy} if m in sys.modules)))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["schedule", "list"], ["schedule", "show", "qwen3-4b-0.86"],
                                  ["train", "--help"], ["generate", "--help"], ["calibrate", "--help"],
                                  ["pool", "--help"], ["pool", "resize", "--help"], ["pool", "status", "--help"]], ids=" ".join)
def test_light_commands_import_no_heavy_module(argv):
    code = LOADED_AFTER.format(heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"sparrow {' '.join(argv)} imported {out.stdout.strip()}"


def test_version_is_the_installed_distribution(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"sparrow {version('sparrow-rl')}\n"


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name, (_, help_text) in SUBCOMMANDS.items():
        assert name in out and help_text.split()[0] in out


@pytest.mark.parametrize("argv", [[name] for name in SUBCOMMANDS]
                         + [["schedule", a] for a in ("list", "show", "budget")]
                         + [["bench", a] for a in ("rollout", "kernels", "decode-step", "rollout-paper", "trainer", "tail-model")]
                         + [["pool", a] for a in ("resize", "status")],
                         ids=" ".join)
def test_every_subcommand_help_works(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: sparrow {' '.join(argv)}")


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-command"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["sparrow", "bench", "decode-step", "--batch", "24"],
                                  ["-m", "decode-step", "--batch", "24"], ["-m", "--batch", "24"]], ids=" ".join)
def test_bench_records_the_sparrow_command_that_repeats_it(argv, monkeypatch):
    """A result file names `sparrow bench ACTION ...` whether the run came from the CLI or `python -m sparrow.bench.rollout`."""
    from sparrow.bench.rollout.common import bench_command

    monkeypatch.setattr(sys, "argv", argv)
    assert bench_command("decode-step") == "sparrow bench decode-step --batch 24"
