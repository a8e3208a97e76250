"""Learning-rate schedules of the study's runs."""

from __future__ import annotations

import optax


def warmup_cosine(config) -> optax.Schedule:
  """Linear warm-up from ``config.warmup_start`` over ``config.warmup_steps`` (or
  ``config.warmup_fraction`` of the steps; at least one), then cosine decay to
  ``config.final_lr_fraction`` of the peak ``config.lr`` (the paper's schedule)."""
  warmup = config.warmup_steps if config.warmup_steps is not None else int(config.steps *
                                                                           config.warmup_fraction)
  warmup = max(1, warmup)
  return optax.warmup_cosine_decay_schedule(config.warmup_start, config.lr, warmup,
                                            max(config.steps, warmup + 1),
                                            config.final_lr_fraction * config.lr)
