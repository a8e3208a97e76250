"""The paper's claims, checked under the confirmatory protocol (docs/protocol.md).

Every claim is reduced to one number per seed, paired across methods within the seed (for example
the smallest baseline slowdown over rotation's), and a threshold the paper puts it on one side of.
Ratios (slowdowns, the staleness gain) are taken on the log scale, differences (percent fewer, loss
gaps) as they are. Per claim, a two-sided one-sample Student's t test of "the mean is the threshold"
gives a p-value (``test``); across one report's claims (one *family*), Holm's step-down correction
(``holm``) adjusts them at a family-wise 5%, and each claim's interval is printed at its Holm level
(rank k of m: confidence ``1 - 0.05 / (m - k + 1)``). The verdicts:

- **reproduced**: the Holm-adjusted p is at most 0.05 and the mean lies on the paper's side;
- **refuted**: the adjusted p is at most 0.05 and the mean lies on the other side;
- **inconclusive** otherwise (the adjusted p above 0.05, one seed and so no test, or a seed without
  a number: a run diverged or never reached a level), with the reason.

The window rule (``robust``): a reproduced or refuted verdict must come out the same with the
smoothing window halved and doubled (each reading Holm-corrected as a family of its own), otherwise
it becomes inconclusive, "fragile". "About n seeds would clear it" is a power estimate for a future,
pre-registered study at the observed mean and spread, never a reason to add seeds to this one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import scipy.stats

from experiments.harness.methods import BASELINES
from experiments.report import metrics
from experiments.report.tables import seed_tables

VERDICTS = ("reproduced", "refuted", "inconclusive")
ALPHA = 0.05  # the family-wise error rate of one report's claims


@dataclasses.dataclass(frozen=True)
class Claim:
  """One checked claim (a row of the claims table and of ``summary.json``)."""

  claim: str  # what the paper says, at which P
  paper: str  # the paper's number
  evidence: str  # ours: the per-seed quantity's mean [min, max] and interval, or why none
  verdict: str  # one of VERDICTS
  why: str = ""  # for an inconclusive verdict: what is missing, or why the test did not decide
  interval: dict | None = None  # ``metrics.interval`` at the claim's level (None: no interval)
  values: tuple = ()  # the per-seed quantity (a number, or a string saying why a seed has none)
  threshold: float = 0.0
  side: int = 1  # +1: the paper says above the threshold, -1: below
  log: bool = False  # a ratio, tested on the log scale
  spec: str = "{:.2f}"
  context: str = ""  # prepended to the evidence
  p: float | None = None  # the uncorrected two-sided p-value (None: no test)
  p_holm: float | None = None  # Holm-adjusted over the claim's family (None: not corrected yet)
  family: int = 1  # claims with a test in the family
  blocks: tuple | None = None  # one label per seed (its CPU): a fixed blocking factor of the test

  def row(self) -> str:
    verdict = f"**{self.verdict}**" + (f" ({self.why})" if self.why else "")
    return f"| {self.claim} | {self.paper} | {self.evidence} | {verdict} |"

  def summary(self) -> dict:
    iv = self.interval
    extra = {} if iv is None or iv["ci95"] is None else {
        "mean": iv["mean"], "interval": iv["ci95"], "level": iv.get("level", 0.95),
        "scale": "log" if self.log else "linear"}
    if self.p is not None:
      extra.update(p=self.p, p_holm=self.p_holm, family=self.family)
    return {"claim": self.claim, "verdict": self.verdict, "evidence": self.evidence,
            "paper": self.paper, **({"why": self.why} if self.why else {}), **extra}


def _missing(values) -> list:
  return [v for v in values if v is None or isinstance(v, str) or not np.isfinite(v)]


def p_value(values, threshold: float, log: bool = False, blocks=None) -> float | None:
  """The two-sided p-value of Student's one-sample t test of "the mean of the per-seed ``values``
  (of their logs, with ``log``) is ``threshold``"; ``None`` when there is no test (a seed without a
  number, fewer than two seeds, a non-positive ratio, blocks that leave no degrees of freedom).
  ``blocks`` (one label per seed, its CPU): the pooled within-block spread with ``n - B`` degrees of
  freedom (``metrics.spread``)."""
  if len(values) < 2 or _missing(values) or (log and min(values) <= 0):
    return None
  y = np.log(np.asarray(values, np.float64)) if log else np.asarray(values, np.float64)
  t0 = np.log(threshold) if log else threshold
  sd, df = metrics.spread(y, blocks)
  if df < 1:
    return None
  if sd == 0:
    return 1.0 if float(y.mean()) == t0 else 0.0
  t = (float(y.mean()) - t0) / (sd / np.sqrt(len(y)))
  return float(2 * scipy.stats.t.sf(abs(t), df))


def seeds_needed(values, threshold: float, level: float = 0.95, log: bool = False) -> int | None:
  """Seeds for which the t interval at ``level``, at the observed mean and spread, would clear
  ``threshold`` (``None``: no spread, the mean on the threshold, or more than 1,000): a power
  estimate for a future study."""
  y = np.log(np.asarray(values, np.float64)) if log else np.asarray(values, np.float64)
  t0 = np.log(threshold) if log else threshold
  gap, sd = abs(float(y.mean()) - t0), float(y.std(ddof=1)) if len(y) > 1 else 0.0
  if gap == 0 or sd == 0:
    return None
  for n in range(2, 1001):
    if scipy.stats.t.ppf(0.5 + level / 2, n - 1) * sd / np.sqrt(n) < gap:
      return n
  return None


def describe(values, interval: dict | None, spec: str = "{:.2f}") -> str:
  """``mean [min, max], CI lo to hi`` of the per-seed values (``geometric mean`` and the level where
  they are not the plain mean and 95%), or the values themselves."""
  if interval is None:
    return "per seed: " + ", ".join(v if isinstance(v, str) else "none" if v is None
                                    else spec.format(v) for v in values)
  f = lambda x: spec.format(x)
  geo = "geometric mean " if interval.get("log") else ""
  text = f"{geo}{f(interval['mean'])} [{f(interval['min'])}, {f(interval['max'])}]"
  level = interval.get("level", 0.95)
  name = "CI" if level == 0.95 else f"{level:.2%} CI"
  return text + (f", {name} {f(interval['ci95'][0])} to {f(interval['ci95'][1])}"
                 if interval["ci95"] else "")


def glance(c: Claim, spec: str = "{:+.2f}") -> str:
  """``c`` as one cell of a README's claims-at-a-glance table: the verdict in bold, the mean (geometric
  for ratios) and its interval at the claim's level; or the verdict and why there is no interval."""
  iv = c.interval
  if iv is None or iv["ci95"] is None:
    return f"{c.verdict} ({c.why})"
  f = spec.format
  return f"**{c.verdict}** {f(iv['mean'])} ({f(iv['ci95'][0])} to {f(iv['ci95'][1])})"


def decide(c: Claim, p_holm: float | None = None, level: float = 0.95, family: int = 1) -> Claim:
  """``c`` with its verdict, interval (at ``level``) and evidence, given its adjusted p-value
  (default: its own, a family of one)."""
  values = list(c.values)
  p_holm = c.p if p_holm is None else p_holm
  iv = metrics.interval(values, level, c.log, c.blocks) if values and not _missing(values) else None
  evidence = c.context + describe(values, iv, c.spec)
  if not values:
    verdict, why = "inconclusive", "not measured"
  elif _missing(values):
    reasons = "; ".join(dict.fromkeys(v if isinstance(v, str) else "no value" for v in _missing(values)))
    verdict, why = "inconclusive", (f"{len(_missing(values))} of {len(values)} seeds without a number: "
                                    f"{reasons}")
  elif c.p is None:
    verdict, why = "inconclusive", ("one seed, no interval" if len(values) == 1 else "a ratio not positive")
  else:
    evidence += f"; p = {c.p:.2g}" + (f", Holm-adjusted {p_holm:.2g} over {family} claims" if family > 1
                                      else "")
    mean = float(np.mean(np.log(values))) - np.log(c.threshold) if c.log else np.mean(values) - c.threshold
    if p_holm <= ALPHA:
      verdict, why = ("reproduced" if c.side * mean > 0 else "refuted"), ""
    else:
      n = seeds_needed(values, c.threshold, level, c.log)
      why = ("interval contains the threshold" if iv["ci95"][0] <= c.threshold <= iv["ci95"][1]
             else "an earlier claim of the Holm step-down was not decided")
      why += f"; about {n} seeds would clear it at this mean and spread (a future study)" if n else ""
      verdict = "inconclusive"
  return dataclasses.replace(c, evidence=evidence, verdict=verdict, why=why, interval=iv,
                             p_holm=p_holm if c.p is not None else None, family=family)


def judge(values, threshold: float, side: int = 1, log: bool = False) -> tuple[str, dict | None, str]:
  """``(verdict, interval, why)`` of per-seed ``values`` (``None`` or a string where a seed has no
  number: the string says why) against ``threshold``, as a family of one (no correction); ``side``
  +1: the paper says above it, -1: below it."""
  c = check("", "", values, threshold, side, log=log)
  return c.verdict, c.interval, c.why


def check(claim: str, paper: str, values, threshold: float, side: int = 1, spec: str = "{:.2f}",
          context: str = "", log: bool = False, blocks=None) -> Claim:
  """A claim from its per-seed quantity, decided as a family of one (``holm`` corrects a report's
  claims together); ``context`` is prepended to the evidence; ``blocks``: each seed's CPU, a fixed
  blocking factor (``p_value``)."""
  values = tuple(values)
  blocks = None if blocks is None else tuple(blocks)
  c = Claim(claim, paper, "", "inconclusive", values=values, threshold=threshold, side=side, log=log,
            spec=spec, context=context, p=p_value(values, threshold, log, blocks), blocks=blocks)
  return decide(c)


def holm(claims: list[Claim], alpha: float = ALPHA) -> list[Claim]:
  """The claims of one family decided under Holm's step-down correction at family-wise ``alpha``:
  the claims with a test, sorted by p, rank k of m compared at ``alpha / (m - k + 1)`` (adjusted
  p = the running maximum of ``(m - k + 1) p``); each interval at its rank's level. Order kept."""
  ranked = sorted((i for i, c in enumerate(claims) if c.p is not None), key=lambda i: claims[i].p)
  m, out, running = len(ranked), list(claims), 0.0
  for k, i in enumerate(ranked):
    running = max(running, min(1.0, (m - k) * claims[i].p))
    out[i] = decide(claims[i], running, 1 - alpha / (m - k), m)
  return out


def robust(claims: list[Claim], readings: dict) -> list[Claim]:
  """The window rule: a reproduced or refuted claim becomes inconclusive ("fragile") unless every
  other reading (``{label: the same report's claims at another window}``, matched by claim text)
  gives it the same verdict."""
  out = []
  for c in claims:
    if c.verdict != "inconclusive":
      other = {label: next((o.verdict for o in alt if o.claim == c.claim), "not computed")
               for label, alt in readings.items()}
      off = {label: v for label, v in other.items() if v != c.verdict}
      if off:
        c = dataclasses.replace(c, verdict="inconclusive", why=f"fragile: {c.verdict} at the reported "
                                "window but " + ", ".join(f"{v} at {label}" for label, v in off.items()))
    out.append(c)
  return out


def row_at(rows, method, p):
  return next((r for r in rows if r["method"] == method and r["stages"] == p), None)


def least_ratio(rows, field: str, method: str, others, p: int):
  """Per seed: the smallest ``field`` of ``others`` over ``method``'s (> 1: ``method``'s is the
  smallest); a diverged other counts as infinitely slow, a missing own value is the reason."""
  own = (row_at(rows, method, p) or {}).get(field)
  if own is None:
    return f"{method} diverged or shares no levels"
  vals = [(row_at(rows, m, p) or {}).get(field) for m in others]
  finite = [v for v in vals if v is not None]
  return min(finite) / own if finite else "every other method diverged"


def main_claims(tables, reading: str = "", muon_tables=None) -> list[Claim]:
  """The main study's claims at its largest P from its per-seed tables (``seed_tables``);
  ``muon_tables``: the tables of the Muon claim's runs (default ``tables``)."""
  if not tables:
    return []
  top = max(r["stages"] for r in tables[0])
  if top == 1:
    return [Claim("every claim about staleness", "P up to 32", "this sweep ran P = 1 only",
                  "inconclusive", "not measured")]
  base = [b for b in BASELINES if any(row_at(t, b, top) for t in tables)]
  if not any(row_at(t, "rotation", top) for t in tables) or not base:
    return []
  named = "" if tuple(base) == BASELINES else f" (baselines in this report: {', '.join(base)})"
  suffix = f"{named}{reading}"
  rows = lambda p, m: [(row_at(t, m, p) or {}) for t in tables]
  field = lambda p, m, f: [r.get(f) for r in rows(p, m)]
  each = "; ".join(f"{m} " + describe(field(top, m, "slowdown_levels"),
                                      metrics.interval(field(top, m, "slowdown_levels"), log=True))
                   for m in ["rotation"] + base)
  out = [check(f"rotation slows down least from P = 1 to P = {top} (headline){suffix}",
               "1.27x vs PipeDream 5.81x, PipeDream-LR 4.24x, Nesterov ~4x (P = 32)",
               [least_ratio(t, "slowdown_levels", "rotation", base, top) for t in tables], 1.0,
               log=True, context=f"slowdowns: {each}; smallest baseline's over rotation's: ")]
  no_gain = "rotation or the best baseline diverged or shares no levels"
  out.append(check(f"rotation's lead over the best baseline grows with staleness (staleness gain, "
                   f"P = {top}){suffix}", "the lead is almost entirely specific to staleness (> 1)",
                   [no_gain if r.get("staleness_gain") is None else r["staleness_gain"]
                    for r in rows(top, "rotation")], 1.0, log=True))

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
  muon_tables = tables if muon_tables is None else muon_tables
  has = lambda m: any(row_at(t, m, top) for t in muon_tables)
  if has("muon") and has("pipedream"):
    gap = lambda t, m: (final_of(row_at(t, m, top)) - final_of(row_at(t, m, 1)))
    diffs = [gap(t, "pipedream") - gap(t, "muon") for t in muon_tables]
    out.append(check(f"Muon degrades less than AdamW under the delay (final-loss gap to P = 1 at "
                     f"P = {top}){reading}", "AdamW's validation gap > 0.2, Muon's 0.012 (arXiv "
                     "2606.30634, PipeDream-2BW)", [d if np.isfinite(d) else "a run diverged" for d in diffs],
                     0.0, spec="{:+.3f}", context="AdamW's gap minus Muon's: "))
  return out


def tables_by_seed(curves: dict, window: int, names, enough) -> dict:
  """``{seed: metrics.study_table}`` of the methods ``names``, for every seed whose methods holding
  runs at every P (``whole``) satisfy ``enough(whole)``; each table holds those methods only."""
  stages = {p for _, p in curves}
  sub = {k: v for k, v in curves.items() if k[0] in names}
  out = {}
  for s in sorted(set().union(*(v.keys() for v in sub.values()))) if sub else []:
    whole = {m for m, _ in sub if all(s in sub.get((m, p), {}) for p in stages)}
    if enough(whole):
      out[s] = metrics.study_table({k: v[s] for k, v in sub.items() if k[0] in whole}, BASELINES, window)
  return out


def with_a_baseline(subject: str):
  """The seed rule of a subject's claims: the subject and at least one baseline."""
  return lambda whole: subject in whole and bool(whole & set(BASELINES))


def seeded_claim_tables(curves: dict, window: int) -> tuple[dict, dict]:
  """``claim_tables`` keyed by seed: ``({seed: table of rotation and the baselines}, {seed: table of
  Muon and PipeDream})``."""
  return (tables_by_seed(curves, window, ("rotation",) + BASELINES, with_a_baseline("rotation")),
          tables_by_seed(curves, window, ("muon", "pipedream"), lambda m: {"muon", "pipedream"} <= m))


def claim_tables(curves: dict, window: int) -> tuple[list, list]:
  """Seeds per claim (docs/protocol.md): ``(tables of rotation and the baselines, tables of Muon and
  PipeDream)``, in seed order. A seed counts for a claim when it holds that claim's runs at every P:
  rotation's claims need rotation and at least one baseline (a seed's baselines are those it holds),
  the Muon claim Muon and PipeDream; so a seed without Muon's runs still counts for rotation's
  claims."""
  rotation, muon = seeded_claim_tables(curves, window)
  return list(rotation.values()), list(muon.values())


def leave_one_out(seeds, values, threshold: float, side: int = 1, log: bool = False,
                  blocks=None) -> list[dict]:
  """Per seed left out, the claim on the other seeds as a family of one: ``[{"left_out", "mean",
  "p", "verdict"}]`` (``mean``: the geometric mean with ``log``; ``None`` without a number)."""
  out = []
  for i, seed in enumerate(seeds):
    rest = [v for j, v in enumerate(values) if j != i]
    kept = None if blocks is None else [b for j, b in enumerate(blocks) if j != i]
    c = check("", "", rest, threshold, side, log=log, blocks=kept)
    out.append({"left_out": seed, "mean": c.interval["mean"] if c.interval else None, "p": c.p,
                "verdict": c.verdict})
  return out


def final_of(row) -> float:
  """A row's final smoothed loss; ``inf`` for a run that diverged or did not finish."""
  return np.inf if row is None or row["final"] is None else row["final"]


def seed_keyed_tables(curves: dict, window: int) -> dict:
  """``seed_tables`` keyed by seed (the seeds every curve in ``curves`` holds)."""
  seeds = sorted(set.intersection(*(set(v) for v in curves.values()))) if curves else []
  return dict(zip(seeds, seed_tables(curves, window)))


def slower(rows, method: str, others, p: int):
  """Per seed: ``method``'s slowdown over the largest of ``others``' (> 1: ``method``'s is the
  largest); a seed where any of them has no slowdown gets the reason."""
  vals = [(row_at(rows, m, p) or {}).get("slowdown_levels") for m in (method, *others)]
  if any(v is None for v in vals):
    return "a run diverged, shares no levels or has not run"
  return vals[0] / max(vals[1:])


def section(claims: list[Claim], plumbing: bool = False,
            heading: str = "The paper's claims, checked") -> list:
  """The claims table under ``## heading`` (or, for a plumbing check, why it has none)."""
  if plumbing:
    return ["## The paper's claims", "", "Not judged: this preset is a plumbing check (too few "
            "steps for the study's quantities to mean anything).", ""]
  if not claims:
    return []
  return [f"## {heading}", "",
          "Under the confirmatory protocol (docs/protocol.md). Each claim is one number per seed "
          "(paired across methods within the seed), ratios on the log scale (geometric mean and "
          "interval mapped back), differences as they are. Its two-sided t test against the "
          "threshold the paper puts it beyond is Holm-corrected across this table's claims (a "
          "family-wise 5%), and the interval is printed at the claim's Holm level: reproduced (the "
          "adjusted p at most 0.05, the mean on the paper's side), refuted (on the other side), "
          "inconclusive (otherwise, with the reason). A reproduced or refuted verdict that changes "
          "with the smoothing window halved or doubled is inconclusive (fragile).", "",
          "| claim | paper | ours: mean [min, max] over seeds, interval at the Holm level, p | verdict |",
          "|---|---|---|---|"] + [c.row() for c in claims] + [""]


def protocol(claims_at) -> list[Claim]:
  """The claims under the protocol, from ``claims_at(window_label)`` -> one family's raw claims for
  the labels ``"reported"``, ``"half"`` and ``"double"``: Holm within each reading, then the window
  rule (``robust``)."""
  main = holm(claims_at("reported"))
  return robust(main, {f"{label} the window": holm(claims_at(label)) for label in ("half", "double")})
