"""The prepared accelerator command (experiments/bench/accelerator.py), on CPU with the smoke preset."""

import pytest

from experiments.bench import accelerator as bench_accelerator


def test_the_preset_part_trains_every_run_and_prints_its_ratios(capsys):
  rows = bench_accelerator.main(["--preset", "smoke", "--steps", "20", "--stages", "1", "4",
                                 "--skip", "optimizer", "pipeline", "--matmul-sizes", "128"])
  assert sorted(rows) == [("pipedream", 1), ("pipedream", 4), ("rotation", 1), ("rotation", 4)]
  for row in rows.values():
    assert row["steps_per_second"] > 0 and row["first_chunk_seconds"] > 0 and row["flops_per_step"] > 0
  out = capsys.readouterr().out
  t = {k: 1.0 / v["steps_per_second"] for k, v in rows.items()}
  assert f"P=4: rotation / pipedream step time = {t[('rotation', 4)] / t[('pipedream', 4)]:.2f}x" in out
  assert f"rotation: P=4 / P=1 step time = {t[('rotation', 4)] / t[('rotation', 1)]:.2f}x" in out
  assert "bench_optimizer done" not in out and "of plain float32 matmul" in out


def test_an_unknown_part_is_refused():
  with pytest.raises(SystemExit):
    bench_accelerator.main(["--skip", "everything"])


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "steps must be >= 1, got 0"),
    (["--stages", "1", "64"], "64 stages is more than the model's 32 blocks"),
    (["--methods", "adamw"], "unknown method 'adamw'"),
    (["--matmul-sizes", "0"], r"--matmul-sizes must be >= 1, got \[0\]"),
])
def test_bad_values_fail_before_any_part_runs(argv, message, capsys):
  with pytest.raises(ValueError, match=message):
    bench_accelerator.main(argv)
  assert "backend" not in capsys.readouterr().out  # nothing started


def test_the_paper_scale_runs_use_the_memory_options():
  from experiments.bench import accelerator as bench_accelerator
  from experiments.sweep import presets
  configs = bench_accelerator.preset_configs(presets.PRESETS["gpu-95m"], 300, (1, 8), ("rotation",))
  assert all(c.remat == "nothing_saveable" and c.loss_chunk == 2048 for c in configs)
