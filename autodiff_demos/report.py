"""Claims of the tutorial seed with their measured values, as a text or Markdown table."""

from __future__ import annotations

import dataclasses
import textwrap


@dataclasses.dataclass(frozen=True)
class Claim:
  """One checked statement.

  Attributes:
    topic: section of the seed.
    claim: what the seed says.
    seed: the seed's own figure.
    measured: what JAX/XLA gave here.
    passed: whether ``measured`` agrees with ``seed`` within the stated tolerance.
  """

  topic: str
  claim: str
  seed: str
  measured: str
  passed: bool


def check(topic, claim, seed, measured, passed) -> Claim:
  return Claim(topic, claim, str(seed), str(measured), bool(passed))


def text(claims, width: int = 100) -> str:
  """One block per claim, no line wider than ``width``."""
  lines = []
  for c in claims:
    lines += textwrap.wrap(f"[{'PASS' if c.passed else 'FAIL'}] {c.topic}: {c.claim}", width,
                           subsequent_indent="       ")
    lines += textwrap.wrap(f"seed: {c.seed}", width, initial_indent="       ", subsequent_indent="         ")
    lines += textwrap.wrap(f"measured: {c.measured}", width, initial_indent="       ",
                           subsequent_indent="         ")
  lines.append(f"{sum(c.passed for c in claims)} passed, {sum(not c.passed for c in claims)} failed")
  return "\n".join(lines)


def markdown(claims) -> str:
  esc = lambda s: s.replace("|", "\\|")
  lines = ["| topic | claim | seed's figure | JAX / XLA here | |", "|---|---|---|---|---|"]
  for c in claims:
    lines.append(f"| {c.topic} | {esc(c.claim)} | {esc(c.seed)} | {esc(c.measured)} | "
                 f"{'PASS' if c.passed else 'FAIL'} |")
  return "\n".join(lines) + "\n"
