"""The regime study's tables and figures from synthetic runs with known slowdowns."""

import argparse
import json

import numpy as np
import pytest

from experiments.studies import regime
from experiments.sweep import presets


def _result(method, stages, steps, slowdown, seed=0):
  t = np.arange(1, steps + 1, dtype=float) / slowdown
  losses = 2.0 + 3.0 * np.exp(-t / (steps / 8)) + 0.5 / (1 + t / 40.0)
  return {"config": {"method": method, "stages": stages, "seed": seed}, "status": "finished",
          "losses": list(losses)}


def test_tables_show_the_known_slowdowns(tmp_path):
  args = argparse.Namespace(preset="cpu", top=16, methods=["pipedream", "rotation"], base=1200, seeds=[0],
                           grid=[1.0], factor_steps=1200)
  known = {"pipedream": {600: 3.0, 1200: 4.0}, "rotation": {600: 1.5, 1200: 2.0}}
  lengths = {n: [_result(m, p, n, known[m][n] if p == 16 else 1.0) for m in known for p in (1, 16)]
             for n in (600, 1200)}
  factors = {"bytes": lengths[1200]}
  record = {"learning_rates": {"chosen": {"pipedream": 3e-3, "rotation": 3e-3}, "grid": [1.0]},
            "tokenizer": {"path": "bpe.json", "sha256": "0" * 64, "tokens": 10}}
  regime.write(tmp_path, presets.PRESETS["cpu"], args, record, lengths, factors)
  text = (tmp_path / "regime.md").read_text()
  for n in (600, 1200):
    line = next(x for x in text.splitlines() if x.startswith(f"| {n} |"))
    got = [float(c) for c in line.split("|")[2:4]]
    np.testing.assert_allclose(got, [known["pipedream"][n], known["rotation"][n]], rtol=0.01)
  assert (tmp_path / "regime_slowdown_vs_length.png").stat().st_size > 0
  rows = {(r["method"], r["stages"]): r for r in json.loads(
      (tmp_path / "regime.json").read_text())["by_length"]["1200"]}
  assert abs(rows[("rotation", 16)]["fewer"] - 50.0) < 1.0  # half the iterations of PipeDream


SMALL = ["--preset", "smoke", "--top", "2", "--methods", "pipedream", "--grid", "1", "--base", "20",
         "--lengths", "20", "--factor-steps", "20"]  # the later flags of each case override these


@pytest.mark.parametrize("argv, message", [
    (["--factor-steps", "0"], "steps must be >= 1, got 0"),  # runs that would train last
    (["--lengths", "20", "25"], "steps=25 is not a multiple of chunk=10"),
    (["--context", "0"], "context must be >= 1, got 0"),
    (["--top", "1"], "--top must be >= 2, got 1"),
    (["--bpe-vocab", "200"], r"BPE vocabulary must be in \(256, 65536\], got 200"),
])
def test_every_planned_run_is_checked_before_anything_is_written(argv, message, tmp_path):
  out = tmp_path / "regime"
  with pytest.raises(ValueError, match=message):
    regime.main(SMALL + argv + ["--out", str(out)])
  assert not out.exists()
