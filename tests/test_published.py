"""A sweep's report beside the published study of its preset (experiments/report/published.py):
runs matched by name, final losses compared by hand, and no verdict or t interval with fewer seeds
than the published verdicts used."""

import numpy as np
import pytest
from test_report import _curve_run, _write_study

from experiments.report import build as report
from experiments.report import metrics

WINDOW = 30
SPEEDS = (("pipedream", 1.0, 4.0), ("nesterov", 1.3, 6.0), ("pipedream-lr", 1.0, 3.5),
          ("rotation", 1 / 1.2, 2.0 / 1.2), ("muon", 1 / 1.1, 2.5 / 1.1))


def _study(seeds):
  """Rotation slows down more with every seed (by 1 + seed / 10); PipeDream-LR is the best baseline."""
  runs = []
  for seed in seeds:
    for m, s1, sp in SPEEDS:
      j = 1 + 0.1 * seed if m == "rotation" else 1.0
      runs += [_curve_run(m, 1, s1, seed), _curve_run(m, 8, sp * j, seed)]
  return runs


@pytest.fixture
def published(tmp_path):  # four seeds; one run of seed 1 not published
  runs = [r for r in _study((0, 1, 2, 3)) if r["name"] != "muon_P8_lr0.003_s1"]
  return _write_study(tmp_path / "published", runs)


def test_fewer_seeds_than_the_published_verdicts_draw_no_verdict_and_no_interval(tmp_path, published):
  mine = _study((0, 1))
  moved = next(r for r in mine if r["name"] == "rotation_P8_lr0.003_s1")
  moved["losses"] = (np.asarray(moved["losses"]) + 0.02).tolist()  # trained elsewhere: a little off
  source = _write_study(tmp_path / "mine", mine)
  summary = report.build(source, published=published)
  assert summary["claims"] == [] and summary["published"]["seeds_needed"] == 4
  runs = summary["published"]["runs"]
  assert runs["matched"] == 19 and runs["total"] == 20
  assert runs["largest"]["name"] == "rotation_P8_lr0.003_s1"
  assert runs["largest"]["difference"] == pytest.approx(0.02, abs=1e-4)  # the stored precision
  assert runs["median"] == pytest.approx(0.0, abs=1e-4)
  text = (source / "report.md").read_text()
  assert "## The claims on your 2 seeds (no verdict: the published verdicts used 4)" in text
  assert "CI" not in text and "The paper's claims, checked" not in text
  # each claim: the two seeds' values, and the published four seeds' range, computed by hand here
  (row,) = [c for c in summary["published"]["claims"] if c["claim"].startswith("rotation's lead")]
  gains = [3.5 / (2.0 * (1 + 0.1 * s)) for s in (0, 1, 2, 3)]  # PipeDream-LR's slowdown over rotation's
  assert row["values"] == pytest.approx(gains[:2], rel=0.03)
  assert row["published_range"] == pytest.approx([min(gains), max(gains)], rel=0.03)
  assert row["published_verdict"] in ("reproduced", "refuted", "inconclusive")


def test_as_many_seeds_as_the_published_study_draw_verdicts_and_compare_each_seed(tmp_path, published):
  mine = _study((0, 1, 2, 3))
  slow = next(r for r in mine if r["name"] == "rotation_P8_lr0.003_s3")
  slow["losses"] = _curve_run("rotation", 8, 4.0, 3)["losses"]  # a seed far outside the published range
  source = _write_study(tmp_path / "mine", mine)
  summary = report.build(source, published=published)
  assert summary["claims"] and all(c["verdict"] in ("reproduced", "refuted", "inconclusive")
                                   for c in summary["claims"])
  (row,) = [c for c in summary["published"]["claims"] if c["claim"].startswith("rotation's lead")]
  assert not row["inside"]
  expected = metrics.final_smoothed(np.asarray(slow["losses"]), WINDOW) - metrics.final_smoothed(
      np.asarray(_curve_run("rotation", 8, 2.0 / 1.2 * 1.3, 3)["losses"]), WINDOW)
  assert summary["published"]["runs"]["largest"]["difference"] == pytest.approx(expected, abs=1e-4)
  assert "## The claims against the published seeds" in (source / "report.md").read_text()
