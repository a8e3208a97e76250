"""Claims of the tutorial seed with their measured values, as a text or Markdown table."""

from __future__ import annotations

import dataclasses


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


def text(claims) -> str:
  width = max(len(c.claim) for c in claims)
  lines = []
  for c in claims:
    lines.append(f"[{'PASS' if c.passed else 'FAIL'}] {c.topic:<14} {c.claim:<{width}}  "
                 f"seed: {c.seed}  |  measured: {c.measured}")
  lines.append(f"{sum(c.passed for c in claims)} passed, {sum(not c.passed for c in claims)} failed")
  return "\n".join(lines)


def markdown(claims) -> str:
  esc = lambda s: s.replace("|", "\\|")
  lines = ["| topic | claim | seed's figure | JAX / XLA here | |", "|---|---|---|---|---|"]
  for c in claims:
    lines.append(f"| {c.topic} | {esc(c.claim)} | {esc(c.seed)} | {esc(c.measured)} | "
                 f"{'PASS' if c.passed else 'FAIL'} |")
  return "\n".join(lines) + "\n"
