"""experiments/cli.py: what every command-line tool shares."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_reader_that_stops_early_gets_no_traceback():
  # ``... --next | head -1``: the tool's later lines meet a closed pipe
  script = ("from experiments import cli\n"
            "lines = lambda argv: [print(f'line {i}', flush=True) for i in range(10 ** 5)]\n"
            "cli.exit_process(cli.run(lines))")
  tool = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  first = tool.stdout.readline()
  tool.stdout.close()  # as head does after its line
  err = tool.stderr.read()
  assert tool.wait(timeout=60) == 0 and first == "line 0\n"
  assert "Traceback" not in err and "BrokenPipe" not in err, err
