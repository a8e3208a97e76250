"""The project's modules import each other without a circle (one of them makes the import order
matter and hides which module a concept lives in)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("rotation", "pipeline_sim", "experiments", "autodiff_demos")


def _module(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict:
  """``{module: {project modules it imports anywhere in its file}}``."""
  files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
  graph = {}
  for name, path in files.items():
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    graph[name] = {d for d in deps if d in files and d != name and d not in PACKAGES}
  return graph


def _cycle(graph):
  state, stack = {}, []

  def visit(n):
    state[n] = "open"
    stack.append(n)
    for m in sorted(graph[n]):
      if state.get(m) == "open":
        return stack[stack.index(m):] + [m]
      if m not in state and (found := visit(m)):
        return found
    state[n] = "done"
    stack.pop()
    return None

  for n in sorted(graph):
    if n not in state and (found := visit(n)):
      return found
  return None


def test_no_import_cycle_among_the_projects_modules():
  graph = _graph()
  assert {"experiments.report", "experiments.sweep", "experiments.report.ablations"} <= set(graph)
  assert "experiments.report.sections" in graph["experiments.report.ablations"]  # the graph sees real imports
  assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_import_runs_back_up_the_roles():
  """experiments' roles import downward only: harness < report < sweep < studies, bench (a report is
  built from curves, whoever trained them; the sweep and the studies write reports)."""
  rank = {"harness": 0, "report": 1, "sweep": 2, "studies": 3, "bench": 3}
  role = lambda m: m.split(".")[1] if m.startswith("experiments.") and m.count(".") >= 2 else None
  up = sorted((a, b) for a, deps in _graph().items() for b in deps
              if role(a) in rank and role(b) in rank and rank[role(b)] > rank[role(a)])
  assert up == [], up


def test_the_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_experiments_is_grouped_by_role_and_no_module_is_over_600_lines():
  roles = {p.name for p in (ROOT / "experiments").iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert roles == {"harness", "sweep", "report", "studies", "bench"}
  loose = sorted(p.name for p in (ROOT / "experiments").glob("*.py"))
  assert loose == ["__init__.py", "cli.py"], loose  # every other module lives in its role's folder
  long = {str(p.relative_to(ROOT)): n for p in (ROOT / "experiments").rglob("*.py")
          if (n := len(p.read_text().splitlines())) > 600}
  assert not long, long


def test_no_function_in_experiments_is_over_80_lines():
  long = {}
  for p in (ROOT / "experiments").rglob("*.py"):
    for node in ast.walk(ast.parse(p.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if (n := node.end_lineno - node.lineno + 1) > 80:
          long[f"{p.relative_to(ROOT)}:{node.name}"] = n
  assert long == {}, long
