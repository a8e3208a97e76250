"""The README and docs/recipes.md stay true: each snippet and recipe runs on its own as pasted and
does what its text says, the commands exist, CI runs the README's test command."""

import json
import pathlib
import re
import runpy
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments.report import build, curves

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").rglob("*.md"))
PYTHON_BLOCKS = r"```python\n(.*?)```"
SNIPPETS = re.findall(PYTHON_BLOCKS, README, re.S)
RECIPES = re.findall(PYTHON_BLOCKS, (ROOT / "docs" / "recipes.md").read_text(), re.S)


def _run(code, name):
  scope = {}  # a fresh namespace: the snippet brings its own imports
  exec(compile(code, name, "exec"), scope)
  return scope


def test_quickstart_runs_on_its_own_and_learns():
  scope = _run(SNIPPETS[0], "README quickstart")
  losses = np.asarray(scope["losses"])
  assert losses.shape == (30,) and np.all(np.isfinite(losses))
  assert losses[-5:].mean() < 0.5 * losses[:5].mean(), losses
  dims = scope["paper_dims"](nnx_params(scope["net"]))
  chosen = jax.tree_util.tree_leaves_with_path(dims, is_leaf=lambda x: x is None or isinstance(
      x, scope["rotation"].RotationDimensionNumbers))
  assert sorted(jax.tree_util.keystr(p) for p, d in chosen if d is not None) == [
      "['hidden']['kernel'].value"]  # the paper's choice: hidden matrices only


def nnx_params(net):
  from flax import nnx
  return nnx.state(net, nnx.Param)


def test_snippets_need_only_the_installed_libraries(tmp_path):
  """From a folder of a user's own project with its own ``experiments/`` package, the snippets run
  and ``experiments`` is the user's: this project installs only ``rotation`` and ``pipeline_sim``."""
  import subprocess
  (tmp_path / "experiments").mkdir()
  (tmp_path / "experiments" / "__init__.py").write_text("MINE = True\n")
  code = "\n".join(SNIPPETS[:2]) + "\nimport experiments\nassert experiments.MINE\nprint('ok')\n"
  env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
  proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
  probe = "import importlib.util as u; print(u.find_spec('experiments'))"
  bare = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path.parent, env=env,
                        capture_output=True, text=True)
  assert bare.stdout.strip() == "None", bare.stdout  # the study is not installed under its name


def test_pipeline_snippet_runs_on_its_own():
  scope = _run(SNIPPETS[1], "README pipeline")
  losses = np.asarray(scope["losses"])
  assert scope["pipe"].num_stages == 4 and losses.shape == (20,) and np.all(np.isfinite(losses))
  assert int(scope["state"].step) == 20 and len(scope["state"].opt_states) == 4  # per-stage copies


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci" / "run").read_text()
  test_cmd = re.findall(r"```bash\n(python3 -m venv .*pytest.*)\n```", README)[0]
  assert test_cmd.split("&& ", 1)[1] in ci  # the same install and pytest invocation


def _modules_in(text: str) -> list:
  name = r"[a-z_][a-z_0-9]*"
  found = re.findall(rf"python -m ({name}(?:\.{name})*)(?![.\w<])", text)  # not experiments.<tool>
  ours = ("experiments", "autodiff_demos", "rotation", "pipeline_sim")
  return sorted({m for m in found if m.split(".")[0] in ours})


def _readme_modules():
  # docs/results/ records each study's command as it ran at its commit (which the report names)
  docs = [p.read_text() for p in DOCS if "results" not in p.relative_to(ROOT).parts]
  return _modules_in(README + "".join(docs))


def _report_modules():
  """The modules docs/results' reports cite (a moved module is named as it is now:
  ``experiments.report.curves.MOVED``)."""
  return _modules_in("".join(p.read_text() for p in (ROOT / "docs" / "results").glob("*/report.md")))


def test_readme_modules_exist():
  modules = _readme_modules()
  assert {"experiments.sweep", "autodiff_demos", "experiments.studies.hessian"} <= set(modules)
  for module in modules:
    path = ROOT / (module.replace(".", "/") + ".py")
    package = ROOT / module.replace(".", "/") / "__main__.py"
    assert path.exists() or package.exists(), module


def test_the_reports_cite_modules_that_exist():
  modules = _report_modules()
  assert {"experiments.sweep", "experiments.studies.regime", "experiments.studies.misalignment"} <= set(
      modules)
  assert "experiments.regime" not in modules and "experiments.misalignment" not in modules


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy on an imported module
@pytest.mark.parametrize("module", sorted(set(_readme_modules()) | set(_report_modules())))
def test_readme_modules_answer_help(module, monkeypatch, capsys):
  """``python -m <module> --help`` prints its usage and exits 0 (argparse formats every help
  string with ``%``: a stray percent sign in one breaks the whole page)."""
  monkeypatch.setattr(sys, "argv", [module, "--help"])
  with pytest.raises(SystemExit) as exit_:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  out = capsys.readouterr().out
  assert exit_.value.code == 0 and out.startswith("usage:"), out[-500:]


def test_generated_tables_equal_the_reports_they_name():
  from experiments.report import build as report

  for page in [ROOT / "README.md", *DOCS]:
    for _, path, heading, table, _ in report.GENERATED.findall(page.read_text()):
      # `python -m experiments.report --readme PAGE` rewrites them
      assert table == report.section_table((page.parent / path).read_text(), heading), (page, path, heading)


def test_every_relative_link_resolves():
  pages = [ROOT / "README.md", *DOCS]
  checked = 0
  for page in pages:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links, not code
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      path = (page.parent / target.split("#")[0]).resolve()
      assert path.exists(), f"{page.relative_to(ROOT)}: {target}"
      checked += 1
  assert checked > 10


def test_the_readme_is_a_front_door():
  assert len(README.splitlines()) <= 250
  # docs/results stays under 3,000,000 bytes of files (the developers' guide)
  assert sum(p.stat().st_size for p in _results_files()) < 3_000_000


def _results_files() -> list:
  """docs/results' files that a commit would hold: tracked or new, not those git ignores (an in-place
  rebuild also writes the per-run tables, which are ignored); every file outside a git checkout."""
  folder = ROOT / "docs" / "results"
  try:
    command = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", str(folder)]
    listed = subprocess.run(command, cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
  except (OSError, subprocess.CalledProcessError):
    return [p for p in folder.rglob("*") if p.is_file()]
  return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


def _summary_numbers() -> list[float]:
  found = []

  def walk(x):
    if isinstance(x, dict):
      for v in x.values():
        walk(v)
    elif isinstance(x, list):
      for v in x:
        walk(v)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
      found.append(float(x))

  for path in (ROOT / "docs" / "results").glob("*/summary.json"):
    walk(json.loads(path.read_text()))
  return found


def _tables(results, tmp_path) -> list:
  """The per-run tables (``results.csv``) of every study published as a sweep's report, rebuilt from
  its committed curves as ``python -m experiments.report`` writes them."""
  out = []
  for summary in sorted(results.glob("*/summary.json")):
    folder = summary.parent
    if (folder / curves.FILE).exists() and "headline" in json.loads(summary.read_text()):
      data = curves.read(folder)
      build.write_csv(tmp_path / f"{folder.name}.csv", data["runs"], data["meta"]["window"])
      out.append((tmp_path / f"{folder.name}.csv").read_text())
  return out


def test_every_decimal_of_the_study_write_up_is_in_a_committed_result(tmp_path):
  # docs/study.md quotes summaries, reports and per-run tables of docs/results (the paper's own
  # numbers included: every report's claims table states them); nothing else
  results = ROOT / "docs" / "results"
  text = " ".join(p.read_text() for pattern in ("*/report.md", "*/summary.json")
                  for p in results.glob(pattern))
  text += " ".join(_tables(results, tmp_path))
  held = set(re.findall(r"(?<![\w.])(\d+\.\d+)", text))
  numbers = np.asarray(_summary_numbers() + [float(t) for t in held])
  missing = []
  for line in (ROOT / "docs" / "study.md").read_text().splitlines():
    for m in re.finditer(r"(?<![\w.])(\d+\.\d+)(%?)", line):
      t, percent = m.group(1), m.group(2)
      value, decimals = float(t), len(t.split(".")[1])
      hits = np.round(numbers, decimals) == value
      if percent:
        hits |= np.round(numbers * 100, decimals) == value
      if not hits.any() and t not in held:
        missing.append(f"{t}{percent} in: {line.strip()[:80]}")
  assert not missing, missing


def _answer() -> str:
  """The README's answer: from "**Does basis rotation" to the next heading, less its generated tables
  (``test_generated_tables_equal_the_reports_they_name`` holds those to their reports)."""
  start = README.index("**Does basis rotation")
  text = README[start:README.index("\n## ", start)]
  return build.GENERATED.sub("", text)


def test_every_decimal_of_the_readmes_answer_is_in_a_committed_summary():
  answer = _answer()
  numbers = np.asarray(_summary_numbers())
  checked = 0
  for m in re.finditer(r"(?<![\w.])(\d+\.\d+)(%?)", answer):
    text, percent = m.group(1), m.group(2)
    value, decimals = float(text), len(text.split(".")[1])
    hits = np.round(np.abs(numbers), decimals) == value  # the sign stands before the digits
    if percent:  # a percentage may be stored as a fraction
      hits |= np.round(numbers * 100, decimals) == value
    assert hits.any(), f"README's answer quotes {text}{percent}, which no docs/results/*/summary.json holds"
    checked += 1
  assert checked >= 8


def _summary(name: str) -> dict:
  return json.loads((ROOT / "docs" / "results" / name / "summary.json").read_text())


def _claim(name: str, *words) -> str:
  """The verdict of the one claim of ``name``'s summary whose text holds every one of ``words``."""
  hits = [c for c in _summary(name)["claims"] if all(w in c["claim"] for w in words)]
  assert len(hits) == 1, (name, words, [c["claim"] for c in hits])
  return hits[0]["verdict"]


REMEDY_QUOTES = {"0.17 of Muon's gap": ("muon+predict", "1f1b, P = 16"),  # the README's quote: its claim
                 "0.35 of AdamW's": ("nesterov closes", "1f1b, P = 16"),
                 "-0.28": ("pipedream-lr closes", "2bw, P = 16")}


def test_the_readmes_verdict_words_are_the_summaries():
  # each quoted number of the answer is followed by the verdict its summary.json gives it
  answer = " ".join(_answer().split())
  horizon = {g["T"]: g for g in _summary("horizon")["gain_vs_horizon"]}
  expected = {
      "0.66 at 2,400 steps": horizon[2400]["verdict"],
      "0.85 at 9,600": horizon[9600]["verdict"],
      "1.16 at 38,400": horizon[38400]["verdict"],
      "seeds 3-5 alone 1.16": horizon[38400]["after_protocol"]["verdict"],
      "30.6% fewer than the best baseline": _claim("cpu", "fewer iterations", "P = 16", "main reading"),
      "from 6.10x to 3.56x": _claim("lag", "decay 0.95"),
      **{quote: _claim("remedies", *words) for quote, words in REMEDY_QUOTES.items()},
  }
  for quote, verdict in expected.items():
    assert quote in answer, quote
    said = re.search(r"reproduced|refuted|inconclusive", answer[answer.index(quote):]).group(0)
    assert said == verdict, f"README says {quote} ... {said}; the summary says {verdict}"
  # a remedies verdict that one left-out seed changes says "rests on one seed" in its parenthesis
  for quote, words in REMEDY_QUOTES.items():
    (c,) = [c for c in _summary("remedies")["claims"] if all(w in c["claim"] for w in words)]
    after = answer[answer.index(quote):]
    said = "rests on one seed" in after[:after.index(")")]
    assert said == bool(c["rests_on_one_seed"]), (quote, c["rests_on_one_seed"])
  # the relabelled horizon says so, and the seeds whose removal changes its verdict are the ones named
  assert bool(horizon[38400]["exploratory"]) == ("1.16 at 38,400 (6 seeds, 95% CI 1.02-1.33, reproduced, "
                                                  "exploratory"
                                                  in answer)
  full = horizon[38400]["verdict"]
  moved = [x["left_out"] for x in horizon[38400]["leave_one_out"] if x["verdict"] != full]
  assert "without seed " + ", ".join(map(str, moved[:-1])) + f" or {moved[-1]} inconclusive" in answer


VERDICT = r"reproduced|refuted|inconclusive"


def _long_horizon_problems(answer: str, summary: dict) -> list:
  """What the README's long-horizon sentences (from "Protocol amendment 8" to "Setting:") say that
  docs/results/long-horizon/summary.json does not: before its verdicts, no verdict word and "no
  confirmatory verdict yet"; after, the primary claim and S1 ("is the trend rotation's?") each quoted
  as "MEAN (LEVEL% CI LO-HI, VERDICT", with "rests on one seed" after it where a leave-one-out reading
  moves it, and S1's one-rate reading (``one_rate``, the pairing it depends on) quoted the same way."""
  text = " ".join(answer[answer.index("Protocol amendment 8"):answer.index("Setting:")].split())
  if not summary["claims"]:
    return ([] if "no confirmatory verdict yet" in text else ["no 'no confirmatory verdict yet'"]) + [
        f"says {w} before the summary has a verdict" for w in re.findall(VERDICT, text)]
  problems = ["still says 'no confirmatory verdict yet'"] if "no confirmatory verdict yet" in text else []
  paired = summary.get("one_rate", {}).get("rotation_over_muon")
  for c in summary["claims"] + ([paired] if paired else []):
    if "Muon's staleness gain" in c["claim"]:  # S2, the control, need not be on the first screen
      continue
    lo, hi = c["interval"]
    quote = f"{c['mean']:.2f} ({c.get('level', 0.95) * 100:g}% CI {lo:.2f}-{hi:.2f}, {c['verdict']}"
    if quote not in text:
      problems.append(f"no {quote!r} for {c['claim']}")
    elif c.get("rests_on_one_seed") and not text[text.index(quote):].startswith(
        quote + ", rests on one seed"):
      problems.append(f"{quote!r} without 'rests on one seed'")
  return problems


def test_the_readme_says_no_more_of_the_long_horizon_than_its_confirmatory_summary():
  assert _long_horizon_problems(README, _summary("long-horizon")) == []
  # the check itself, on a summary with verdicts
  claim = lambda name, mean, verdict, moved: {"claim": name, "mean": mean, "verdict": verdict,
                                              "interval": [mean - .1, mean + .1], "rests_on_one_seed": moved}
  decided = {"claims": [claim("rotation's staleness gain", 1.2, "reproduced", [8]),
                        claim("rotation's gain over Muon's gain", 0.95, "inconclusive", []),
                        claim("Muon's staleness gain over the best baseline", 1.3, "reproduced", [])]}
  good = ("Protocol amendment 8 settles it: rotation's gain 1.20 (95% CI 1.10-1.30, reproduced, rests on one "
          "seed), against Muon's 0.95 (95% CI 0.85-1.05, inconclusive). Setting:")
  assert _long_horizon_problems(good, decided) == []
  assert len(_long_horizon_problems(good.replace("reproduced", "refuted"), decided)) == 1
  assert len(_long_horizon_problems(good.replace(", rests on one seed", ""), decided)) == 1
  assert len(_long_horizon_problems(good, {"claims": []})) == 3  # two verdict words, no "not yet"
  # the reading at one rate per method, once the summary holds it, is quoted too
  paired = {**decided, "one_rate": {"rotation_over_muon": claim("rotation's gain over Muon's", 0.98,
                                                                 "inconclusive", [])}}
  assert len(_long_horizon_problems(good, paired)) == 1
  both = good.replace(". Setting:", "; at one rate 0.98 (95% CI 0.88-1.08, inconclusive). Setting:")
  assert _long_horizon_problems(both, paired) == []
  assert _long_horizon_problems(README, decided)  # today's README says no verdict


def _ladder_problems(readme: str, summary: dict) -> list:
  """What the README's width-ladder sentences (between ``<!-- ladder -->`` and ``<!-- /ladder -->``)
  say that docs/results/ladder/summary.json does not: before its verdicts, no verdict word and "no
  result yet"; after, the claims at a glance as a table generated from its report, and every verdict
  word in a quote "MEAN (LEVEL% CI LO to HI, VERDICT" of the claim with that mean, level, interval
  and verdict."""
  from experiments.studies.ladder import GLANCE

  text = " ".join(readme[readme.index("<!-- ladder -->"):readme.index("<!-- /ladder -->")].split())
  words = re.findall(VERDICT, text)
  if not summary["claims"]:
    return ([] if "no result yet" in text else ["no 'no result yet'"]) + [
        f"says {w} before the summary has a verdict" for w in words]
  problems = ["still says 'no result yet'"] if "no result yet" in text else []
  if f'<!-- generated from docs/results/ladder/report.md section "{GLANCE}" -->' not in readme:
    problems.append("no table of the ladder's claims generated from its report")
  number = r"([+-]?\d+\.\d+)"
  quotes = re.findall(rf"{number} \((\d+(?:\.\d+)?)% CI {number} to {number}, ({VERDICT})", text)
  if len(quotes) != len(words):
    problems.append(f"{len(words) - len(quotes)} verdict word(s) outside a quote of a claim")
  same = lambda x, quoted: round(x, len(quoted.split(".")[1]) if "." in quoted else 0) == float(quoted)
  for mean, level, lo, hi, verdict in quotes:
    if not any(same(c["mean"], mean) and same(c["level"] * 100, level) and same(c["interval"][0], lo)
               and same(c["interval"][1], hi) and c["verdict"] == verdict for c in summary["claims"]):
      problems.append(f"no claim {mean} ({level}% CI {lo} to {hi}, {verdict}")
  return problems


def test_the_readme_says_no_more_of_the_ladder_than_its_summary():
  assert _ladder_problems(README, _summary("ladder")) == []
  # the check itself, on a summary with verdicts
  claim = lambda mean, verdict: {"claim": "c", "mean": mean, "verdict": verdict, "level": 1 - 0.05 / 11,
                                 "interval": [mean - .05, mean + .05]}
  decided = {"claims": [claim(0.31, "reproduced"), claim(-0.004, "inconclusive")]}
  table = '<!-- generated from docs/results/ladder/report.md section "The ladder at a glance" -->'
  good = ("<!-- ladder --> Rotation ends below the best baseline by +0.310 (99.5% CI +0.260 to +0.360, "
          "reproduced) and ties Muon, -0.004 (99.5% CI -0.054 to +0.046, inconclusive). <!-- /ladder -->")
  assert _ladder_problems(good + table, decided) == []
  assert len(_ladder_problems(good.replace("reproduced", "refuted") + table, decided)) == 1
  assert len(_ladder_problems(good.replace("+0.310", "+0.320") + table, decided)) == 1
  assert len(_ladder_problems(good.replace("99.5%", "95%") + table, decided)) == 2
  assert len(_ladder_problems(good + table, {"claims": []})) == 3  # two verdict words, no "not yet"
  assert len(_ladder_problems(good, decided)) == 1  # no table
  stray = good.replace("ties Muon", "so rotation is reproduced as better; it ties Muon")
  assert _ladder_problems(stray + table, decided) == ["1 verdict word(s) outside a quote of a claim"]


def test_attention_and_scanned_stack_recipe_rotates_each_layer_as_the_paper_does():
  scope = _run(RECIPES[0], "docs/recipes.md attention recipe")
  losses = np.asarray(scope["losses"])
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses
  rotation, nnx = scope["rotation"], scope["nnx"]
  state = next(x for x in jax.tree.leaves(scope["opt"].opt_state, is_leaf=lambda x: isinstance(
      x, rotation.BasisRotationState)) if isinstance(x, rotation.BasisRotationState))
  params = nnx.state(scope["net"], nnx.Param)
  bases = rotation.leaf_bases(state, params)
  shapes = {jax.tree_util.keystr(p): None if e is None else [tuple(q.shape) for q in e[0]]
            for p, e in jax.tree_util.tree_leaves_with_path(
                bases, is_leaf=lambda x: x is None or isinstance(x, tuple))}
  layers, width = 3, 32
  for name in ("query", "key", "value", "out"):  # (3, 32, 4, 8) and (3, 4, 8, 32): 32 x 32 a layer
    assert shapes[f"['blocks']['attn']['{name}']['kernel']"] == [(layers, width, width)] * 2
    assert shapes[f"['blocks']['attn']['{name}']['bias']"] is None
  assert shapes["['blocks']['mlp']['layers'][0]['kernel']"] == [(layers, width, width),
                                                                 (layers, 4 * width, 4 * width)]
  assert shapes["['blocks']['mlp']['layers'][2]['kernel']"] == [(layers, 4 * width, 4 * width),
                                                                 (layers, width, width)]
  assert shapes["['embed']['kernel']"] is None and shapes["['head']['kernel']"] is None


def test_the_sharded_recipe_splits_the_state_over_eight_devices(forced_devices):
  code = RECIPES[1] + """
import json
leaves = jax.tree.leaves(state)
per_device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device.id == 0)
print(json.dumps({"spec": str(state[0].bases["embed"][0].left.sharding.spec),
                  "fraction": per_device / sum(x.nbytes for x in leaves),
                  "finite": all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))}))
"""
  got = forced_devices(code, 8)
  assert re.fullmatch(r"(PartitionSpec|P)\('fsdp'(, None)*,?\)", got["spec"]), got
  assert got["fraction"] <= 1.25 / 8 and got["finite"], got


@pytest.mark.parametrize("index", range(len(RECIPES)))
def test_each_recipe_runs_as_pasted_in_a_fresh_python(index):
  """As a user pastes it: a fresh interpreter, no XLA_FLAGS of the suite's; the sharded recipe gives
  itself 8 CPU devices and prints the spec its comment promises."""
  import os
  import subprocess
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  proc = subprocess.run([sys.executable, "-c", RECIPES[index]], cwd=ROOT.parent, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  promised = re.findall(r"print\(.*\)  # (.*)", RECIPES[index])
  if "fsdp" in RECIPES[index]:
    assert promised == ["P('fsdp', None, None): K = 8 blocks over \"fsdp\""]
    spec = proc.stdout.strip().splitlines()[-1]
    assert spec in ("P('fsdp', None, None)", "PartitionSpec('fsdp', None, None)"), spec
