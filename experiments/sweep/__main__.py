"""``python -m experiments.sweep``: see ``experiments.sweep.command``."""

from experiments import cli
from experiments.sweep import command

if __name__ == "__main__":  # (not in a spawned worker, which imports this file as __mp_main__)
  cli.exit_process(cli.run(command.main))
