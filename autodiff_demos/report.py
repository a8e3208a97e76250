"""Claims of the tutorial (docs/autodiff.md) with their measured values, as a text or Markdown table."""

from __future__ import annotations

import dataclasses
import textwrap


@dataclasses.dataclass(frozen=True)
class Claim:
  """One checked statement.

  Attributes:
    topic: section of the tutorial.
    claim: what the tutorial says.
    tutorial: the tutorial's own figure.
    measured: what JAX/XLA gave here.
    passed: whether ``measured`` agrees with ``tutorial`` within the stated tolerance.
  """

  topic: str
  claim: str
  tutorial: str
  measured: str
  passed: bool


def check(topic, claim, tutorial, measured, passed) -> Claim:
  return Claim(topic, claim, str(tutorial), str(measured), bool(passed))


def text(claims, width: int = 100) -> str:
  """One block per claim, no line wider than ``width``."""
  lines = []
  for c in claims:
    lines += textwrap.wrap(f"[{'PASS' if c.passed else 'FAIL'}] {c.topic}: {c.claim}", width,
                           subsequent_indent="       ")
    lines += textwrap.wrap(f"tutorial: {c.tutorial}", width, initial_indent="       ",
                           subsequent_indent="         ")
    lines += textwrap.wrap(f"measured: {c.measured}", width, initial_indent="       ",
                           subsequent_indent="         ")
  lines.append(f"{sum(c.passed for c in claims)} passed, {sum(not c.passed for c in claims)} failed")
  return "\n".join(lines)


def markdown(claims) -> str:
  esc = lambda s: s.replace("|", "\\|")
  lines = ["| topic | claim | the tutorial's figure | JAX / XLA here | |", "|---|---|---|---|---|"]
  for c in claims:
    lines.append(f"| {c.topic} | {esc(c.claim)} | {esc(c.tutorial)} | {esc(c.measured)} | "
                 f"{'PASS' if c.passed else 'FAIL'} |")
  return "\n".join(lines) + "\n"
