"""The paper's claims, checked with three verdicts from per-seed quantities and their 95% interval.

Every claim is reduced to one number per seed, paired across methods within the seed (for example
the smallest baseline slowdown over rotation's), and a threshold the paper puts it on one side of.
Over the seeds the claim gets Student's t 95% interval of the mean (``metrics.interval``) and:

- **reproduced** when the whole interval lies on the paper's side of the threshold;
- **refuted** when the whole interval lies on the other side;
- **inconclusive** otherwise (the interval contains the threshold, there is one seed and so no
  interval, or a seed has no number: a run diverged or never reached a level), with the reason and,
  where the interval straddles the threshold, about how many seeds would make it clear of it at the
  observed mean and spread.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.stats

from experiments.harness.methods import ALLOCATIONS, BASELINES, VARIANTS
from experiments.report import metrics
from experiments.report.tables import blocks_of, curves_by, seed_tables, stage_aware_rows

VERDICTS = ("reproduced", "refuted", "inconclusive")


@dataclasses.dataclass(frozen=True)
class Claim:
  """One checked claim (a row of the claims table and of ``summary.json``)."""

  claim: str  # what the paper says, at which P
  paper: str  # the paper's number
  evidence: str  # ours: the per-seed quantity's mean [min, max] and interval, or why none
  verdict: str  # one of VERDICTS
  why: str = ""  # for an inconclusive verdict: what is missing or how many seeds would settle it
  interval: dict | None = None  # the per-seed quantity's ``metrics.interval`` (None: none)

  def row(self) -> str:
    verdict = f"**{self.verdict}**" + (f" ({self.why})" if self.why else "")
    return f"| {self.claim} | {self.paper} | {self.evidence} | {verdict} |"

  def summary(self) -> dict:
    return {"claim": self.claim, "verdict": self.verdict, "evidence": self.evidence,
            "paper": self.paper, **({"why": self.why} if self.why else {})}


def seeds_needed(values, threshold: float) -> int | None:
  """Seeds for which the t interval at the observed mean and spread would clear ``threshold``
  (``None``: no spread, the mean on the threshold, or more than 1,000)."""
  x = np.asarray(values, np.float64)
  gap, sd = abs(float(x.mean()) - threshold), float(x.std(ddof=1)) if len(x) > 1 else 0.0
  if gap == 0 or sd == 0:
    return None
  for n in range(2, 1001):
    if scipy.stats.t.ppf(0.975, n - 1) * sd / np.sqrt(n) < gap:
      return n
  return None


def judge(values, threshold: float, side: int = 1) -> tuple[str, dict | None, str]:
  """``(verdict, interval, why)`` of per-seed ``values`` (``None`` or a string where a seed has no
  number: the string says why) against ``threshold``; ``side`` +1: the paper says above it, -1:
  below it."""
  missing = [(i, v) for i, v in enumerate(values) if v is None or isinstance(v, str)
             or not np.isfinite(v)]
  if not values:
    return "inconclusive", None, "not measured"
  if missing:
    reasons = "; ".join(dict.fromkeys(v if isinstance(v, str) else "no value" for _, v in missing))
    return "inconclusive", None, f"{len(missing)} of {len(values)} seeds without a number: {reasons}"
  iv = metrics.interval(values)
  if iv["ci95"] is None:
    return "inconclusive", iv, "one seed, no interval"
  lo, hi = (side * (c - threshold) for c in iv["ci95"])
  if min(lo, hi) > 0:
    return "reproduced", iv, ""
  if max(lo, hi) < 0:
    return "refuted", iv, ""
  n = seeds_needed(values, threshold)
  return "inconclusive", iv, ("interval contains the threshold" + (f"; about {n} seeds would clear it "
                                                                   "at this mean and spread" if n else ""))


def describe(values, interval: dict | None, spec: str = "{:.2f}") -> str:
  """``mean [min, max], CI lo to hi`` of the per-seed values, or the values themselves."""
  if interval is None:
    return "per seed: " + ", ".join(v if isinstance(v, str) else "none" if v is None
                                    else spec.format(v) for v in values)
  f = lambda x: spec.format(x)
  text = f"{f(interval['mean'])} [{f(interval['min'])}, {f(interval['max'])}]"
  return text + (f", CI {f(interval['ci95'][0])} to {f(interval['ci95'][1])}" if interval["ci95"] else "")


def check(claim: str, paper: str, values, threshold: float, side: int = 1, spec: str = "{:.2f}",
          context: str = "") -> Claim:
  """A claim from its per-seed quantity (see ``judge``); ``context`` is prepended to the evidence."""
  verdict, iv, why = judge(values, threshold, side)
  return Claim(claim, paper, context + describe(values, iv, spec), verdict, why, iv)


def _at(rows, method, p):
  return next((r for r in rows if r["method"] == method and r["stages"] == p), None)


def least_ratio(rows, field: str, method: str, others, p: int):
  """Per seed: the smallest ``field`` of ``others`` over ``method``'s (> 1: ``method``'s is the
  smallest); a diverged other counts as infinitely slow, a missing own value is the reason."""
  own = (_at(rows, method, p) or {}).get(field)
  if own is None:
    return f"{method} diverged or shares no levels"
  vals = [(_at(rows, m, p) or {}).get(field) for m in others]
  finite = [v for v in vals if v is not None]
  return min(finite) / own if finite else "every other method diverged"


def main_claims(tables, reading: str = "") -> list[Claim]:
  """The main study's claims at its largest P from its per-seed tables (``seed_tables``)."""
  if not tables:
    return []
  top = max(r["stages"] for r in tables[0])
  if top == 1:
    return [Claim("every claim about staleness", "P up to 32", "this sweep ran P = 1 only",
                  "inconclusive", "not measured")]
  base = [b for b in BASELINES if any(_at(t, b, top) for t in tables)]
  if not any(_at(t, "rotation", top) for t in tables) or not base:
    return []
  named = "" if tuple(base) == BASELINES else f" (baselines in this report: {', '.join(base)})"
  suffix = f"{named}{reading}"
  rows = lambda p, m: [(_at(t, m, p) or {}) for t in tables]
  field = lambda p, m, f: [r.get(f) for r in rows(p, m)]
  each = "; ".join(f"{m} " + describe(field(top, m, "slowdown_levels"),
                                      metrics.interval(field(top, m, "slowdown_levels")))
                   for m in ["rotation"] + base)
  out = [check(f"rotation slows down least from P = 1 to P = {top} (headline){suffix}",
               "1.27x vs PipeDream 5.81x, PipeDream-LR 4.24x, Nesterov ~4x (P = 32)",
               [least_ratio(t, "slowdown_levels", "rotation", base, top) for t in tables], 1.0,
               context=f"slowdowns: {each}; smallest baseline's over rotation's: ")]
  no_gain = "rotation or the best baseline diverged or shares no levels"
  out.append(check(f"rotation's lead over the best baseline grows with staleness (staleness gain, "
                   f"P = {top}){suffix}", "the lead is almost entirely specific to staleness (> 1)",
                   [no_gain if r.get("staleness_gain") is None else r["staleness_gain"]
                    for r in rows(top, "rotation")], 1.0))

  def fewer(r, p):
    if r.get("fewer_top") is not None:
      return r["fewer_top"]
    return ("rotation diverged" if r.get("final") is None
            else f"rotation never reached the P = {top} target at P = {p}")
  control = [fewer(r, 1) for r in rows(1, "rotation")]
  out.append(check(f"rotation needs fewer iterations than the best baseline at P = {top}{suffix}",
                   "71.6% fewer (95M, P = 32)", [fewer(r, top) for r in rows(top, "rotation")], 0.0,
                   spec="{:+.1f}%", context="control at P = 1, to the same target: " + describe(
                       control, metrics.interval(field(1, "rotation", "fewer_top")), "{:+.1f}%")
                   + f"; at P = {top}: "))
  if any(_at(t, "muon", top) for t in tables) and any(_at(t, "pipedream", top) for t in tables):
    gap = lambda t, m: (_final(_at(t, m, top)) - _final(_at(t, m, 1)))
    diffs = [gap(t, "pipedream") - gap(t, "muon") for t in tables]
    out.append(check(f"Muon degrades less than AdamW under the delay (final-loss gap to P = 1 at "
                     f"P = {top}){reading}", "AdamW's validation gap > 0.2, Muon's 0.012 (arXiv "
                     "2606.30634, PipeDream-2BW)", [d if np.isfinite(d) else "a run diverged" for d in diffs],
                     0.0, spec="{:+.3f}", context="AdamW's gap minus Muon's: "))
  return out


def _final(row) -> float:
  """A row's final smoothed loss; ``inf`` for a run that diverged or did not finish."""
  return np.inf if row is None or row["final"] is None else row["final"]


def ablation_claims(groups, window: int, main_tables) -> list[Claim]:
  """The claims of the ablations in ``groups`` (``{name: results}``), per seed, three verdicts."""
  out = []

  def study(name):
    tables = seed_tables(curves_by(groups[name]), window)
    return tables, max(r["stages"] for r in tables[0])

  if "variants" in groups:
    tables, top = study("variants")
    others = [v for v in VARIANTS if v != "rotation"]
    out.append(check(f"second-order bilateral slows down least of the 2 x 2 taxonomy (P = {top})",
                     "2nd/bi 1.27, 2nd/uni 1.66, 1st/bi 1.77, 1st/uni 2.55",
                     [least_ratio(t, "slowdown_levels", "rotation", others, top) for t in tables], 1.0,
                     context="smallest other variant's slowdown / rotation's: "))
  if "stage-aware" in groups:
    _, rows = stage_aware_rows(curves_by(groups["stage-aware"]), ALLOCATIONS, window)
    why = "an allocation diverged or never reached the target"
    for method, claim, paper, side in (
        ("rotation-sa", "stage-aware (proportional) refresh converges faster than uniform at equal "
         "budget", "+29.2%", 1), ("rotation-sa-reverse", "reverse allocation does worse than uniform",
                                  "worse", -1)):
      values = [why if v is None else 100 * (v - 1) for v in rows[method]["per_seed"]]
      out.append(check(claim, paper, values, 0.0, side, "{:+.1f}%", "speed-up over uniform: "))
  if "no-stashing" in groups and main_tables:
    tables, top = study("no-stashing")
    names = [m for m in BASELINES if any(_at(t, m, top) for t in main_tables)]

    def margin(a, b):  # smallest baseline degradation minus rotation's, final loss at top
      change = {m: _final(_at(b, m, top)) - _final(_at(a, m, top)) for m in names + ["rotation"]}
      if not np.isfinite(change["rotation"]):
        return "rotation diverged or did not finish"
      finite = [change[m] for m in names if np.isfinite(change[m])]
      return min(finite) - change["rotation"] if finite else "every baseline diverged"
    out.append(check(f"without weight stashing rotation degrades less than every baseline (P = {top})",
                     "baselines severely, rotation barely",
                     [margin(a, b) for a, b in zip(main_tables, tables)], 0.0, spec="{:+.3f}",
                     context="smallest baseline final-loss change minus rotation's: "))
  if "refresh-period" in groups:
    tables, top = study("refresh-period")
    out.append(check(f"refresh period 10 beats 100 (final loss, P = {top})", "T = 10 better",
                     [_final(_at(t, "rotation-T100", top)) - _final(_at(t, "rotation", top))
                      for t in tables], 0.0, spec="{:+.3f}",
                     context="final loss of T = 100 minus T = 10: "))
    if main_tables and max(r["stages"] for r in main_tables[0]) == top:
      best = lambda rows: min(_final(_at(rows, x, top)) for x in BASELINES)
      out.append(check(f"even with refresh period 100 rotation ends below every baseline (P = {top})",
                       "T = 100 still leads the baselines",
                       [best(m) - _final(_at(t, "rotation-T100", top)) for t, m in zip(tables, main_tables)],
                       0.0, spec="{:+.3f}", context="best baseline's final loss minus T = 100's: "))
  if "moe" in groups:
    tables, top = study("moe")
    out.append(check(f"rotation helps a mixture-of-experts model (P = {top})", "fewer iterations",
                     [(_at(t, "rotation", top) or {}).get("fewer") for t in tables], 0.0,
                     spec="{:+.1f}%", context="percent fewer than the best baseline: "))
  if "scaling" in groups:
    results = [r for r in groups["scaling"] if r["config"]["stages"] == blocks_of(r)]
    curves = curves_by(results)
    sizes = sorted({p for _, p in curves})
    seeds = sorted(set.intersection(*(set(v) for v in curves.values())))
    fin = lambda p, s: (metrics.final_smoothed(curves[("rotation", p)][s], window)
                        if ("rotation", p) in curves else np.nan)
    steps = [max(fin(b, s) - fin(a, s) for a, b in zip(sizes, sizes[1:])) for s in seeds]
    out.append(check("with rotation, bigger models (blocks = P grown together) reach lower loss",
                     "bigger is better", steps, 0.0, -1, "{:+.3f}",
                     "largest final-loss change from one size to the next: "))
  return out


def section(claims: list[Claim], plumbing: bool = False,
            heading: str = "The paper's claims, checked") -> list:
  """The claims table under ``## heading`` (or, for a plumbing check, why it has none)."""
  if plumbing:
    return ["## The paper's claims", "", "Not judged: this preset is a plumbing check (too few "
            "steps for the study's quantities to mean anything).", ""]
  if not claims:
    return []
  return [f"## {heading}", "",
          "Each claim is one number per seed (paired across methods within the seed); the verdict "
          "compares its Student's t 95% interval with the threshold the paper puts it beyond: "
          "reproduced (the interval on the paper's side), refuted (on the other side), inconclusive "
          "(otherwise, with the reason).", "",
          "| claim | paper | ours: mean [min, max] over seeds, 95% interval | verdict |",
          "|---|---|---|---|"] + [c.row() for c in claims] + [""]
