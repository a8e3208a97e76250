"""The README stays true: each snippet runs on its own, its commands exist, CI runs its test command."""

import pathlib
import re
import runpy
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)


def _run(code, name):
  scope = {}  # a fresh namespace: the snippet brings its own imports
  exec(compile(code, f"README {name}", "exec"), scope)
  return scope


def test_quickstart_runs_on_its_own_and_learns():
  scope = _run(SNIPPETS[0], "quickstart")
  losses = np.asarray(scope["losses"])
  assert losses.shape == (30,) and np.all(np.isfinite(losses))
  assert losses[-5:].mean() < losses[:5].mean() - 0.3, losses


def test_pipeline_snippet_runs_on_its_own():
  scope = _run(SNIPPETS[1], "pipeline")
  losses = np.asarray(scope["losses"])
  assert scope["pipe"].num_stages == 4 and losses.shape == (20,) and np.all(np.isfinite(losses))
  assert int(scope["state"].step) == 20 and len(scope["state"].opt_states) == 4  # per-stage copies


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci" / "run").read_text()
  test_cmd = re.findall(r"```bash\n(python3 -m venv .*pytest.*)\n```", README)[0]
  assert test_cmd.split("&& ", 1)[1] in ci  # the same install and pytest invocation


def _readme_modules():
  found = re.findall(r"python -m ([a-z_]+(?:\.[a-z_]+)*)(?![.\w<])", README)  # not experiments.<tool>
  ours = ("experiments", "autodiff_demos", "rotation", "pipeline_sim")
  return sorted({m for m in found if m.split(".")[0] in ours})


def test_readme_modules_exist():
  modules = _readme_modules()
  assert {"experiments.sweep", "autodiff_demos", "experiments.hessian"} <= set(modules)
  for module in modules:
    path = ROOT / (module.replace(".", "/") + ".py")
    package = ROOT / module.replace(".", "/") / "__main__.py"
    assert path.exists() or package.exists(), module


@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # runpy on an imported module
@pytest.mark.parametrize("module", _readme_modules())
def test_readme_modules_answer_help(module, monkeypatch, capsys):
  """``python -m <module> --help`` prints its usage and exits 0 (argparse formats every help
  string with ``%``: a stray percent sign in one breaks the whole page)."""
  monkeypatch.setattr(sys, "argv", [module, "--help"])
  with pytest.raises(SystemExit) as exit_:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  out = capsys.readouterr().out
  assert exit_.value.code == 0 and out.startswith("usage:"), out[-500:]


def test_generated_tables_equal_the_reports_they_name():
  from experiments import report

  blocks = report.GENERATED.findall(README)
  assert blocks, "the README has no generated table"
  for _, path, heading, table, _ in blocks:  # `python -m experiments.report` rewrites them
    assert table == report.section_table((ROOT / path).read_text(), heading), (path, heading)
