"""The README stays true: its quickstart runs, its commands exist, CI runs its test command."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_quickstart_runs():
  code = re.findall(r"```python\n(.*?)```", README, re.S)[0]
  scope = {}
  exec(compile(code, "README quickstart", "exec"), scope)
  cfg = scope["cfg"]
  tokens = (jnp.arange(cfg.context + 1)[None, :] * 5 + jnp.arange(4)[:, None]) % 11
  losses = [float(scope["train_step"](scope["net"], scope["opt"], tokens)) for _ in range(3)]
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_pipeline_snippet_runs():
  quickstart, pipeline = re.findall(r"```python\n(.*?)```", README, re.S)[:2]
  scope = {}
  exec(compile(quickstart, "README quickstart", "exec"), scope)
  exec(compile(pipeline, "README pipeline", "exec"), scope)
  losses = np.asarray(scope["losses"])
  assert scope["pipe"].num_stages == 4 and losses.shape == (20,) and np.all(np.isfinite(losses))
  assert int(scope["state"].step) == 20


def test_ci_runs_the_readme_test_command():
  ci = (ROOT / ".ci" / "run").read_text()
  test_cmd = re.findall(r"```bash\n(python3 -m venv .*pytest.*)\n```", README)[0]
  assert test_cmd.split("&& ", 1)[1] in ci  # the same install and pytest invocation


def test_readme_modules_exist():
  modules = {m for m in re.findall(r"python -m ([a-z_.]+)", README) if m.split(".")[0] in
             ("experiments", "autodiff_demos", "rotation", "pipeline_sim")}
  assert {"experiments.sweep", "autodiff_demos", "experiments.hessian"} <= modules
  for module in modules:
    path = ROOT / (module.replace(".", "/") + ".py")
    package = ROOT / module.replace(".", "/") / "__main__.py"
    assert path.exists() or package.exists(), module
