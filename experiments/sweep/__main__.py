"""``python -m experiments.sweep``: see ``experiments.sweep.executor``."""

from experiments import cli
from experiments.sweep import executor

if __name__ == "__main__":  # (not in a spawned worker, which imports this file as __mp_main__)
  cli.exit_process(cli.run(executor.main))
