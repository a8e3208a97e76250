"""The long horizon's confirmatory verdicts (experiments/studies/long_horizon.py, protocol amendment
8) on synthetic runs of known slowdowns: the runs read at their tuned rates, the three claims, the
leave-one-seed-out readings, a seed counted on the one CPU type that holds all its runs, and the CPU as
a blocking factor."""

import json
import pathlib

import numpy as np
import pytest
import scipy.stats

from experiments.report import claims, curves, metrics
from experiments.studies import long_horizon as lh
from experiments.studies import lr_grid

STEPS = 600
RATES = {"pipedream": {1: 3e-3, 16: 3e-3}, "nesterov": {1: 3e-3, 16: 2e-3},
         "rotation": {1: 3e-3, 16: 3e-3}, "muon": {1: 6e-3, 16: 3e-3}}


def _run(method, stages, lr, seed, stretch, cpu="cpu A"):
  t = np.arange(1, STEPS + 1) / stretch
  losses = list(2.0 + 3.0 * np.exp(-t / 100) + 0.5 / (1 + t / 30))
  return {"group": "main", "name": f"{method}_P{stages}_lr{lr}_s{seed}", "status": "finished",
          "config": {"method": method, "stages": stages, "lr": lr, "seed": seed, "steps": STEPS},
          "losses": losses, "val_steps": [], "val_losses": [], "host": {"cpu": cpu, "cores": 2}}


def _seed(seed, slow, cpu="cpu A", off_rate=True):
  """One seed's runs: P = 16 slows each method by ``slow[method]``; plus runs at other rates that
  must not be read (with ``off_rate``)."""
  runs = []
  for m, by_p in RATES.items():
    runs += [_run(m, 1, by_p[1], seed, 1.0, cpu), _run(m, 16, by_p[16], seed, slow[m], cpu)]
    if off_rate:
      runs.append(_run(m, 16, by_p[16] * 2, seed, slow[m] * 9, cpu))  # a worse rate: ignored
  return runs


@pytest.fixture
def study(tmp_path, monkeypatch):
  monkeypatch.setattr(lh, "STEPS", STEPS)

  def make(runs):
    (tmp_path / "src").mkdir(exist_ok=True)
    curves.write(tmp_path / "src" / curves.FILE, {"window": 15, "preset": "t", "command": "c"}, runs)
    (tmp_path / "rates.json").write_text(json.dumps({"chosen": RATES}))
    return lh.main([str(tmp_path / "src"), "--rates", str(tmp_path / "rates.json"), "--out",
                    str(tmp_path / "out")])
  return make


def test_the_three_claims_from_each_seeds_tuned_runs(study):
  runs = []
  for s in lh.SEEDS:
    j = 1 + 0.04 * (s - 8.5)
    runs += _seed(s, {"pipedream": 4.0 * j, "nesterov": 3.0 * j, "rotation": 2.0, "muon": 1.5 * j})
  summary = study(runs)
  seeds = {int(s): r for s, r in summary["seeds"].items()}
  assert sorted(seeds) == list(lh.SEEDS) and all(r["best_baseline"] == "nesterov" for r in seeds.values())
  for s, r in seeds.items():  # the gain over Nesterov: its slowdown over rotation's (3j / 2)
    j = 1 + 0.04 * (s - 8.5)
    assert r["gain"] == pytest.approx(1.5 * j, rel=0.05)
    assert r["muon_gain"] == pytest.approx(2.0, rel=0.05)
    assert r["rotation_over_muon"] == pytest.approx(r["gain"] / r["muon_gain"])
  got = {c["claim"]: c for c in summary["claims"]}
  assert got[lh.PRIMARY]["verdict"] == "reproduced" and got[lh.PRIMARY]["family"] == 1
  assert got[lh.S2]["verdict"] == "reproduced"
  assert got[lh.S1]["verdict"] == "refuted"  # rotation's gain 1.5 against Muon's 2: the trend is Muon's too
  assert got[lh.S1]["family"] == 2
  # leave one seed out, by hand, for the primary claim
  gains = np.log([seeds[s]["gain"] for s in lh.SEEDS])
  for i, row in enumerate(got[lh.PRIMARY]["leave_one_out"]):
    rest = np.delete(gains, i)
    assert row["left_out"] == lh.SEEDS[i]
    assert row["p"] == pytest.approx(scipy.stats.ttest_1samp(rest, 0.0).pvalue)
  assert got[lh.PRIMARY]["rests_on_one_seed"] == []


def test_a_seed_counts_on_the_one_cpu_type_that_holds_all_its_runs(study):
  """Amendment 9: a seed incomplete everywhere, or complete on two types, is left out; a seed complete
  on one type counts there, its runs on the other type unread (the same run names: no conflict)."""
  slow = {"pipedream": 4.0, "nesterov": 3.0, "rotation": 2.0, "muon": 1.5}
  runs = _seed(6, slow) + _seed(7, {**slow, "nesterov": 3.3}) + _seed(8, slow, off_rate=False)[:-1]
  crossed = _seed(9, slow)
  crossed[0]["host"] = {"cpu": "cpu B", "cores": 2}  # seed 9: 7 runs on A, 1 on B
  begun = [r for r in _seed(10, {**slow, "rotation": 9.0}) if r["config"]["method"] == "rotation"]
  retrained = _seed(10, slow, cpu="cpu B") + begun  # whole on B, begun on A
  twice = _seed(11, slow) + _seed(11, slow, cpu="cpu B")
  summary = study(runs + crossed + retrained + twice)
  assert sorted(summary["seeds"]) == ["10", "6", "7"]
  assert summary["seeds"]["10"]["cpu"] == "cpu B"
  assert summary["seeds"]["10"]["gain"] == pytest.approx(summary["seeds"]["6"]["gain"])  # A's rotation unread
  assert summary["left_out"]["8"] == "7 of 8 runs"
  assert summary["left_out"]["9"] == "7 of 8 runs on cpu A; 1 of 8 runs on cpu B"
  assert "complete on cpu A and cpu B" in summary["left_out"]["11"]


def test_the_cpu_is_a_blocking_factor_when_seeds_train_on_two():
  # by hand: the pooled within-CPU spread with n - B degrees of freedom
  y = np.log([1.10, 1.20, 1.15, 1.40, 1.50, 1.45])
  cpu = ["A", "A", "A", "B", "B", "B"]
  sd, df = metrics.spread(y, cpu)
  resid = np.concatenate([y[:3] - y[:3].mean(), y[3:] - y[3:].mean()])
  assert df == 4 and sd == pytest.approx(np.sqrt((resid ** 2).sum() / 4))
  t = y.mean() / (sd / np.sqrt(6))
  want = 2 * scipy.stats.t.sf(t, 4)
  assert claims.p_value(list(np.exp(y)), 1.0, log=True, blocks=cpu) == pytest.approx(want)
  iv = metrics.interval(list(np.exp(y)), log=True, blocks=cpu)
  half = scipy.stats.t.ppf(0.975, 4) * sd / np.sqrt(6)
  assert iv["ci95"] == pytest.approx([np.exp(y.mean() - half), np.exp(y.mean() + half)])
  # one block is the plain test; the CPU offset no longer counts as noise, so the interval narrows
  assert claims.p_value(list(np.exp(y)), 1.0, log=True, blocks=["A"] * 6) == pytest.approx(
      scipy.stats.ttest_1samp(y, 0.0).pvalue)
  plain = metrics.interval(list(np.exp(y)), log=True)
  assert plain["ci95"][1] - plain["ci95"][0] > iv["ci95"][1] - iv["ci95"][0]


def test_the_rates_must_be_chosen_first(tmp_path):
  with pytest.raises(ValueError, match="not chosen every rate"):
    lh.chosen_rates({"chosen": None})


def test_sources_inside_out_rebuild_it_as_they_are(tmp_path, monkeypatch):
  monkeypatch.setattr(lh, "STEPS", STEPS)
  slow = {"pipedream": 4.0, "nesterov": 3.0, "rotation": 2.0, "muon": 1.5}
  for cpu in ("A", "B"):
    (tmp_path / cpu).mkdir()
    runs = _seed(6, slow, cpu) + _seed(7, slow, cpu) if cpu == "A" else _seed(8, slow, cpu)
    curves.write(tmp_path / cpu / curves.FILE, {"window": 15, "command": cpu}, runs)
  (tmp_path / "rates.json").write_text(json.dumps({"chosen": RATES}))
  args = ["--rates", str(tmp_path / "rates.json"), "--out", str(tmp_path / "out")]
  first = lh.main([str(tmp_path / "A"), str(tmp_path / "B")] + args)
  before = {p: p.read_bytes() for p in (tmp_path / "out").rglob(curves.FILE)}
  sources = [str(tmp_path / "out" / f"confirmatory-{c}") for c in ("a", "b")]
  assert sorted(map(str, before)) == [f"{s}/{curves.FILE}" for s in sources]
  assert first["command"].startswith("python -m experiments.studies.long_horizon " + " ".join(sources))
  summary = lh.main(sources + args)
  assert sorted(summary["seeds"]) == ["6", "7", "8"] and summary == first
  assert {p: p.read_bytes() for p in (tmp_path / "out").rglob(curves.FILE)} == before


def test_a_queue_publishes_every_run_per_cpu_before_any_seed_is_complete(tmp_path, monkeypatch):
  """The queue's call: the published folder (empty at first) beside its own finished runs. Every run
  is written into OUT's folder of its CPU type, read or not; with no seed complete the report lists
  what each seed holds and claims nothing."""
  monkeypatch.setattr(lh, "STEPS", STEPS)
  slow = {"pipedream": 4.0, "nesterov": 3.0, "rotation": 2.0, "muon": 1.5}
  (tmp_path / "rates.json").write_text(json.dumps({"chosen": RATES}))
  args = ["--rates", str(tmp_path / "rates.json"), "--out", str(tmp_path / "out")]
  first, rest = _seed(6, slow)[:5], _seed(6, slow)[5:]
  for i, part in enumerate((first, rest)):
    (tmp_path / f"pub{i}").mkdir()
    curves.write(tmp_path / f"pub{i}" / curves.FILE, {"window": 15, "command": "c"}, part)
  summary = lh.main([str(tmp_path / "pub0")] + args)
  assert summary["claims"] == [] and summary["left_out"] == {"6": "4 of 8 runs"}  # one of 5 is off-rate
  assert "seeds counted: none yet; left out: 6: 4 of 8 runs" in (tmp_path / "out" / "report.md").read_text()
  folder = tmp_path / "out" / "confirmatory-cpu-a"
  assert [r["name"] for r in curves.read(folder)["runs"]] == [r["name"] for r in first]
  stored = {r["name"]: r.get("stored_every") for r in curves.read(folder)["runs"]}
  assert stored == {r["name"]: (lr_grid.BLOCK if r["name"] == "pipedream_P16_lr0.006_s6" else None)
                    for r in first}  # the run at a rate never read: block means
  # the next publish (the queue's own copies given again): seed 6 complete
  summary = lh.main([str(folder), str(tmp_path / "pub0"), str(tmp_path / "pub1")] + args)
  assert list(summary["seeds"]) == ["6"] and len(curves.read(folder)["runs"]) == len(first + rest)
  assert summary["command"].startswith(f"python -m experiments.studies.long_horizon {folder} --rates")
  assert summary["claims"] == []  # one seed of six: numbers, no verdict
  assert "**Interim: 1 of 6 seeds counted, no verdict.**" in (tmp_path / "out" / "report.md").read_text()


def test_no_verdict_until_all_six_seeds_are_counted(study):
  """Amendment 8: the verdict is the one on all six seeds. Five seeds that would reproduce every
  claim give their numbers and no verdict; the sixth draws all three."""
  slow = {"pipedream": 4.0, "nesterov": 3.0, "rotation": 2.0, "muon": 2.5}
  runs = [r for s in lh.SEEDS for r in _seed(s, {**slow, "rotation": 2.0 - 0.02 * s})]
  five = study([r for r in runs if r["config"]["seed"] != 11])
  assert five["claims"] == [] and sorted(five["seeds"]) == ["10", "6", "7", "8", "9"]
  assert five["left_out"] == {}
  six = study(runs)
  assert [c["verdict"] for c in six["claims"]] == ["reproduced"] * 3, six["claims"]
  assert {s: six["seeds"][s] for s in five["seeds"]} == five["seeds"]


def test_the_report_counts_each_cpus_runs_and_their_recorded_seconds(study, tmp_path):
  runs = _seed(6, {"pipedream": 4.0, "nesterov": 3.0, "rotation": 2.0, "muon": 1.5})  # 8 read, 4 not
  runs += _seed(7, {"pipedream": 4.0, "nesterov": 3.0, "rotation": 2.0, "muon": 1.5}, cpu="cpu B",
                off_rate=False)
  for i, r in enumerate(runs):
    r["seconds"] = 100.0 * (i + 1) if i != 3 else None  # a run with no recorded time adds nothing
  summary = study(runs)
  a_seconds = sum(100.0 * (i + 1) for i in range(12) if i != 3)
  b_seconds = sum(100.0 * (i + 1) for i in range(12, 20))
  assert summary["compute"] == {"cpu A": {"runs": 12, "read": 8, "seconds": a_seconds},
                                "cpu B": {"runs": 8, "read": 8, "seconds": b_seconds}}
  report = (tmp_path / "out" / "report.md").read_text()
  assert (f"- on cpu A: 12 runs published (8 read by the claims), {a_seconds:,.0f} s of recorded "
          f"training, {a_seconds / 3600:.1f} CPU-hours") in report
  assert f"- on cpu B: 8 runs published (8 read by the claims), {b_seconds:,.0f} s" in report


def test_final_validation_losses_are_paired_within_each_seed():
  """The descriptive table: each run's last validation loss, averaged over seeds, and the P = 16
  differences and degradations taken within a seed, against a hand-written loop."""
  rng = np.random.default_rng(0)
  seeds = {}
  for s in lh.SEEDS:
    seeds[s] = {}
    for m in lh.METHODS:
      for p in (1, lh.TOP):
        seeds[s][(m, p)] = {"status": "finished", "val_losses": [9.0, float(rng.uniform(1.4, 1.8))]}
  got = lh.final_validation(seeds)
  last = lambda s, m, p: seeds[s][(m, p)]["val_losses"][-1]
  diff = [last(s, "muon", 16) - last(s, "rotation", 16) for s in lh.SEEDS]
  half = scipy.stats.t.ppf(0.975, 5) * np.std(diff, ddof=1) / np.sqrt(6)
  assert got["difference"]["muon minus rotation"]["mean"] == pytest.approx(np.mean(diff))
  assert got["difference"]["muon minus rotation"]["ci95"] == pytest.approx([np.mean(diff) - half,
                                                                            np.mean(diff) + half])
  degrade = [last(s, "nesterov", 16) - last(s, "nesterov", 1) for s in lh.SEEDS]
  assert got["degradation"]["nesterov"]["mean"] == pytest.approx(np.mean(degrade))
  assert got["loss"]["rotation P=1"]["min"] == min(last(s, "rotation", 1) for s in lh.SEEDS)
  seeds[8][("muon", 16)]["status"] = "diverged"  # a seed without a number: no mean, as everywhere
  assert lh.final_validation(seeds)["difference"]["muon minus rotation"] is None


def test_the_one_rate_reading_reads_the_p1_runs_at_the_p16_rates(study, monkeypatch):
  """Every method at its P = 16 rate at both P: the P = 1 runs at those rates are read (Muon's here
  1.25 times slower than at its P = 1 rate, so its one-rate slowdown is 1.5 / 1.25 and S1 moves)."""
  monkeypatch.setattr(lr_grid, "BLOCK", 2)  # block means fine enough for 600-step curves
  slow = {"pipedream": 4.0, "nesterov": 3.0, "rotation": 2.0, "muon": 1.5}
  runs = []
  for s in lh.SEEDS:
    runs += _seed(s, slow, off_rate=False)
    runs += [_run("muon", 1, RATES["muon"][16], s, 1.25), _run("nesterov", 1, RATES["nesterov"][16], s, 1.0)]
  summary = study(runs)
  tuned = {c["claim"]: c["mean"] for c in summary["claims"]}
  assert tuned[lh.S1] == pytest.approx(1.5 / 2.0, rel=0.05)  # rotation's 3 / 2 against Muon's 3 / 1.5
  same = summary["one_rate"]
  assert same["rates"] == {m: RATES[m][16] for m in lh.METHODS}
  assert same["gain"]["mean"] == pytest.approx(1.5, rel=0.05)
  assert same["rotation_over_muon"]["mean"] == pytest.approx(1.5 / 2.5, rel=0.05)
  assert same["rotation_over_muon"]["verdict"] == "refuted"
  # without those P = 1 runs there is no such reading, and no claim is made of it
  assert "one_rate" not in study(runs[:-2])


def test_the_best_baseline_of_every_confirmatory_seed_is_the_same_by_either_loss():
  """The protocol's one definition (lowest final smoothed training loss at P = 16, the code's) and
  amendment 8's first wording (final validation loss) pick the same baseline in every seed of the
  committed confirmatory runs, so the correction of 2026-12-07 moves no number."""
  folder = pathlib.Path(__file__).resolve().parents[1] / "docs" / "results" / "long-horizon"
  summary = json.loads((folder / "summary.json").read_text())
  rates = lh.chosen_rates(json.loads((folder.parent / "long-horizon-tuning" / "summary.json").read_text()))
  data = curves.read(folder / "confirmatory-amd-epyc")
  seeds, _ = lh.by_seed(data["runs"], rates)
  assert sorted(seeds) == list(lh.SEEDS)
  window = data["meta"]["window"]
  for s, runs in seeds.items():
    by_val = min(("pipedream", "nesterov"), key=lambda b: runs[(b, 16)]["val_losses"][-1])
    by_train = min(("pipedream", "nesterov"),
                   key=lambda b: metrics.final_smoothed(np.asarray(runs[(b, 16)]["losses"]), window))
    assert by_val == by_train == summary["seeds"][str(s)]["best_baseline"], s
