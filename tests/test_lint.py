"""The code passes the project's ruff configuration (pyproject.toml)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ruff_check_passes():
  proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."],
                        cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stdout + proc.stderr
