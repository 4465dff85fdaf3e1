"""`sparrow bench trainer` on the CPU with the tiny model: the step's parts under a fixed budget, and the profile."""

from sparrow.cli.main import main


def test_bench_trainer_times_the_parts_of_a_step_with_exact_alpha_and_distill(tiny_qwen3, capfd):
    code = main(["bench", "trainer", "--model", str(tiny_qwen3), "--ranks", "1", "--batch", "2", "--prompt-len", "96",
                 "--response-len", "32", "--steps", "1", "--no-publish", "--no-gradient-checkpointing",
                 "--distill-sparse", "--exact-alpha", "--budget-blocks", "4", "--profile", "3"])
    captured = capfd.readouterr()
    out = captured.out
    assert code == 0, out
    assert "] warm-up train_step" in captured.err and "] profiling DistillSparse pass" in captured.err  # progress
    assert "2 × (96+32) tokens, 4 blocks per query" in out
    for row in ("train_step", "exact α (dense + sparse forward)", "policy update",
                "DistillSparse pass (sparse forward + LoRA backward)", "recompute"):
        assert row in out
    for part in ("train_step", "exact α", "DistillSparse pass"):
        assert f"\n{part}: rank 0's heaviest operators\n" in out
    assert out.count("Self CPU time total") == 3


def test_bench_trainer_refuses_a_budget_below_sink_and_recent(tiny_qwen3, capsys):
    code = main(["bench", "trainer", "--model", str(tiny_qwen3), "--ranks", "1", "--batch", "2", "--no-publish",
                 "--exact-alpha", "--budget-blocks", "2"])
    assert code != 0
    assert "--budget-blocks=2: must be >= 3" in capsys.readouterr().err
