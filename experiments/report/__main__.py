"""``python -m experiments.report SOURCE``: see ``experiments.report.build``."""

from experiments import cli
from experiments.report import build

if __name__ == "__main__":
  cli.exit_process(cli.run(build.main))
