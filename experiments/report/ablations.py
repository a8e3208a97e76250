"""The paper's ablations, each declared once, here, and found by its name: what it asks, which runs
it needs, how it is reported and which of the paper's claims it checks.

``runs(make, top)`` returns the runs of one seed, where ``make(method, P, **overrides)`` builds a
run config from the sweep's preset (its learning rates, mode and template) and ``top`` is the
sweep's largest P (the sweep calls it); ``section(ctx, name, results)`` renders the report lines;
``claims(results, window, main_curves)`` returns its ``claims.Claim`` s, one number per seed, beside
the main study's curves (``tables.curves_by``) where a claim compares with them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from experiments.harness.methods import ALLOCATION_METHODS, BASELINES, BASES, VARIANTS
from experiments.report import metrics, sections
from experiments.report.claims import (
    Claim,
    check,
    final_of,
    least_ratio,
    row_at,
    seed_keyed_tables,
    slower,
)
from experiments.report.tables import blocks_of, curves_by, stage_aware_rows, width_of


def _stale(results) -> bool:
  """The ablation ran at some P > 1 (a claim about staleness needs it)."""
  return max(r["config"]["stages"] for r in results) > 1


def _study(results, window: int, main_curves: dict, borrowed=()):
  """``({seed: table}, largest P)`` of the ablation's runs plus the main study's runs of the
  ``borrowed`` methods at the same P."""
  curves = curves_by(results)
  stages = {p for _, p in curves}
  curves.update({k: v for k, v in main_curves.items()
                 if k[0] in borrowed and k[1] in stages and k not in curves})
  return seed_keyed_tables(curves, window), max(p for _, p in curves)


def _variants_claims(results, window: int, main_curves: dict) -> list:
  out = []
  if not _stale(results):
    return []
  tables, top = _study(results, window, main_curves)
  others = [v for v in VARIANTS if v != "rotation"]
  out.append(check(f"second-order bilateral slows down least of the 2 x 2 taxonomy (P = {top})",
                   "2nd/bi 1.27, 2nd/uni 1.66, 1st/bi 1.77, 1st/uni 2.55",
                   [least_ratio(t, "slowdown_levels", "rotation", others, top) for t in tables.values()],
                   1.0, log=True, context="smallest other variant's slowdown / rotation's: "))
  last = "rotation-1st-uni"
  out.append(check(f"first-order unilateral slows down most of the 2 x 2 taxonomy (P = {top})",
                   "1st/uni 2.55 against 1.27-1.77",
                   [slower(t, last, [v for v in VARIANTS if v != last], top) for t in tables.values()],
                   1.0, log=True, context="its slowdown / the largest other variant's: "))
  return out


def _stage_aware_claims(results, window: int, main_curves: dict) -> list:
  out = []
  _, rows = stage_aware_rows(curves_by(results), ALLOCATION_METHODS, window)
  why = "an allocation diverged or never reached the target"
  for method, claim, paper, side in (
      ("rotation-sa", "stage-aware (proportional) refresh converges faster than uniform at equal "
       "budget", "+29.2%", 1), ("rotation-sa-reverse", "reverse allocation does worse than uniform",
                                "worse", -1)):
    values = [why if v is None else v for v in rows[method]["per_seed"]]
    out.append(check(claim, paper, values, 1.0, side, "{:.3f}", "uniform's iterations over the "
                     "allocation's (1.292: +29.2%): ", log=True))
  return out


def _no_stashing_claims(results, window: int, main_curves: dict) -> list:
  out = []
  if not _stale(results):
    return []
  tables, top = _study(results, window, main_curves)
  main = seed_keyed_tables({k: v for k, v in main_curves.items()
                          if k[0] in BASELINES + ("rotation",) and k[1] in (1, top)}, window)
  names = [m for m in BASELINES if any(row_at(t, m, top) for t in main.values())]
  seeds = sorted(set(tables) & set(main))

  def changes(s):  # final loss at top without stashing minus with (NaN: the stashed run diverged)
    with_ = {m: final_of(row_at(main[s], m, top)) for m in names + ["rotation"]}
    return {m: final_of(row_at(tables[s], m, top)) - v if np.isfinite(v) else np.nan
            for m, v in with_.items()}

  def margin(s):  # smallest baseline degradation minus rotation's
    change = changes(s)
    if not np.isfinite(change["rotation"]):
      return "rotation diverged or did not finish"
    finite = [change[m] for m in names if np.isfinite(change[m])]
    return min(finite) - change["rotation"] if finite else "every baseline diverged"

  def hurt(s):  # the smallest degradation among the baselines that finished both ways
    finite = [v for m, v in changes(s).items() if m != "rotation" and np.isfinite(v)]
    return min(finite) if finite else "no baseline finished with and without stashing"
  if names:
    out.append(check(f"without weight stashing every baseline ends higher (P = {top})",
                     "the baselines degrade severely", [hurt(s) for s in seeds], 0.0, spec="{:+.3f}",
                     context="smallest baseline final-loss change (without minus with stashing): "))
    out.append(check(f"without weight stashing rotation degrades less than every baseline (P = {top})",
                     "baselines severely, rotation barely", [margin(s) for s in seeds], 0.0,
                     spec="{:+.3f}", context="smallest baseline final-loss change minus rotation's: "))
  return out


def _bases_claims(results, window: int, main_curves: dict) -> list:
  out = []
  if not _stale(results):
    return []
  tables, top = _study(results, window, main_curves, ("pipedream",))
  mechanism = "the misalignment mechanism: random > coordinate > frozen >= refreshed"
  for slow, fast, claim in (
      ("rotation-random", "pipedream", "a random fixed basis slows down more than the coordinate basis"),
      ("pipedream", "rotation-frozen", "the coordinate basis slows down more than the eigenbasis frozen "
       "after 100 steps"),
      ("rotation-frozen", "rotation", "the frozen eigenbasis slows down more than the refreshed one")):
    out.append(check(f"{claim} (P = {top})", mechanism,
                     [slower(t, slow, [fast], top) for t in tables.values()], 1.0, log=True,
                     context=f"{slow}'s slowdown / {fast}'s: "))
  return out


def _width_claims(results, window: int, main_curves: dict) -> list:
  out = []
  by_width = {}
  for r in results:
    by_width.setdefault(width_of(r), []).append(r)
  widths = sorted(by_width)
  if not (_stale(results) and len(widths) > 1):  # (a study in progress may hold one width so far)
    return []
  per = {w: seed_keyed_tables(curves_by(by_width[w]), window) for w in widths}
  top = max(r["config"]["stages"] for r in results)
  seeds = sorted(set.intersection(*(set(v) for v in per.values())))
  row = lambda w, s: row_at(per[w][s], "rotation", top)  # None: not run (yet)

  def lead(s):
    a, b = ((row(w, s) or {}).get("fewer") for w in (widths[0], widths[-1]))
    return "rotation or the baseline never reached a target" if a is None or b is None else b - a
  out.append(check(f"rotation's lead over the best baseline grows with width {widths[0]} -> "
                   f"{widths[-1]} (P = {top})", "71.6% -> 76.8% -> 81.7% fewer (95M, 1B, 3B)",
                   [lead(s) for s in seeds], 0.0, spec="{:+.1f}",
                   context="percent fewer iterations at the widest minus at the narrowest, points: "))
  steps = [max(final_of(row(b, s)) - final_of(row(a, s)) for a, b in zip(widths, widths[1:])) for s in seeds]
  out.append(check(f"with rotation, wider models reach lower loss (P = {top})", "bigger is better",
                   [v if np.isfinite(v) else "a rotation run diverged or has not run" for v in steps],
                   0.0, -1, "{:+.3f}", "largest final-loss change from one width to the next: "))
  return out


def _refresh_period_claims(results, window: int, main_curves: dict) -> list:
  out = []
  tables, top = _study(results, window, main_curves, BASELINES)
  out.append(check(f"refresh period 10 beats 100 (final loss, P = {top})", "T = 10 better",
                   [final_of(row_at(t, "rotation-T100", top)) - final_of(row_at(t, "rotation", top))
                    for t in tables.values()], 0.0, spec="{:+.3f}",
                   context="final loss of T = 100 minus T = 10: "))
  if any(row_at(t, b, top) for t in tables.values() for b in BASELINES):
    best = lambda rows: min(final_of(row_at(rows, x, top)) for x in BASELINES)
    out.append(check(f"even with refresh period 100 rotation ends below every baseline (P = {top})",
                     "T = 100 still leads the baselines",
                     [best(t) - final_of(row_at(t, "rotation-T100", top)) for t in tables.values()],
                     0.0, spec="{:+.3f}", context="best baseline's final loss minus T = 100's: "))
  return out


def _moe_claims(results, window: int, main_curves: dict) -> list:
  out = []
  if not _stale(results):
    return []
  tables, top = _study(results, window, main_curves)
  out.append(check(f"rotation helps a mixture-of-experts model (P = {top})", "fewer iterations",
                   [(row_at(t, "rotation", top) or {}).get("fewer") for t in tables.values()], 0.0,
                   spec="{:+.1f}%", context="percent fewer than the best baseline: "))
  return out


def _scaling_claims(results, window: int, main_curves: dict) -> list:
  out = []
  results = [r for r in results if r["config"]["stages"] == blocks_of(r)]
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


def _no_claims(results, window: int, main_curves: dict) -> list:
  return []


@dataclasses.dataclass(frozen=True)
class AblationGroup:
  description: str
  runs: Callable  # (make, top) -> list of RunConfigs
  section: Callable  # (ctx, name, results) -> list of report lines
  claims: Callable = _no_claims  # (results, window, main_curves) -> list of claims.Claim


ABLATIONS = {
    "variants": AblationGroup(
        "The 2 x 2 taxonomy (source x geometry) at P = 1 and the largest P.",
        lambda make, top: [make(m, p) for m in VARIANTS for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, show_baselines=False,
                          bars=True),
        _variants_claims),
    "stage-aware": AblationGroup(
        "Uniform / proportional / reverse basis-refresh allocation at the largest P, equal budget.",
        lambda make, top: [make(m, top) for m in ALLOCATION_METHODS],
        functools.partial(sections.stage_aware_section, methods=ALLOCATION_METHODS),
        _stage_aware_claims),
    "no-stashing": AblationGroup(
        "Baselines and rotation without weight stashing at P = 1 and the largest P.",
        lambda make, top: [make(m, p, mode="no_stashing") for m in BASELINES + ("rotation",)
                           for p in (1, top)],
        functools.partial(sections.study_section, fewer=True),
        _no_stashing_claims),
    "refresh-period": AblationGroup(
        "Rotation with refresh period 100 against 10, at P = 1 and the largest P.",
        lambda make, top: [make(m, p) for m in ("rotation", "rotation-T100") for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, bars=True),
        _refresh_period_claims),
    "bases": AblationGroup(
        "Adam in a random fixed basis, in the eigenbasis frozen after 100 steps, and rotation "
        "(refreshed), at P = 1 and the largest P, beside the coordinate basis (PipeDream's AdamW). "
        "The mechanism predicts slowdowns ordered random > coordinate > frozen >= refreshed.",
        lambda make, top: [make(m, p) for m in BASES for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, bars=True),
        _bases_claims),
    "rotation-lr": AblationGroup(
        "Rotation with PipeDream-LR's per-stage rate correction, at P = 1 and the largest P (the "
        "paper's appendix), beside rotation and the baselines.",
        lambda make, top: [make(m, p) for m in ("rotation", "rotation-lr") for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, fewer=True)),
    "muon": AblationGroup(
        "Muon (optax.contrib.muon, RMS-matched to AdamW) under the same staleness, at P = 1 and the "
        "largest P, beside rotation and the baselines (the paper's appendix).",
        lambda make, top: [make(m, p) for m in ("rotation", "muon") for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, fewer=True)),
    "nesterov-stage": AblationGroup(
        "Without weight stashing: Nesterov with per-stage momentum (b1 from 0.9 at the last stage up "
        "to about 0.99 at the first) against Nesterov's one b1 = 0.99, beside PipeDream.",
        lambda make, top: [make(m, p, mode="no_stashing") for m in ("pipedream", "nesterov", "nesterov-stage")
                           for p in (1, top)],
        functools.partial(sections.study_section, fewer=False)),
    "width": AblationGroup(
        "Widths 32, 64 and 128 at the preset's depth, P = 1 and the largest P, for Nesterov and "
        "rotation: does rotation's robustness grow with size (the paper: 71.6% -> 76.8% -> 81.7% fewer "
        "iterations from 95M to 1B to 3B)?",
        lambda make, top: [make(m, p, width=w) for w in (32, 64, 128) for m in ("nesterov", "rotation")
                           for p in (1, top)],
        functools.partial(sections.size_section, size_of=width_of, label="width"),
        _width_claims),
    "moe": AblationGroup(
        "The mixture-of-experts model (cpu-moe) at P = 1 and 8.",
        lambda make, top: [make(m, p, model="cpu-moe") for m in BASELINES + ("rotation",) for p in (1, 8)],
        functools.partial(sections.study_section, fewer=True),
        _moe_claims),
    "scaling": AblationGroup(
        "Blocks and P grown together (P = blocks = 4, 8, 16) for PipeDream, Nesterov and rotation, "
        "each size with its P = 1 control: is rotation's robustness larger in bigger models?",
        lambda make, top: [make(m, p, num_blocks=b) for b in (4, 8, 16)
                           for m in ("pipedream", "nesterov", "rotation") for p in (1, b)],
        functools.partial(sections.size_section, size_of=blocks_of, label="blocks"),
        _scaling_claims),
}


# The order the reports list the ablations' claims in (the claims table's rows; the committed reports').
CLAIM_ORDER = ("variants", "stage-aware", "no-stashing", "bases", "width", "refresh-period", "moe", "scaling")


def ablation_claims(groups, window: int, main_curves: dict) -> list[Claim]:
  """The claims of the ablations in ``groups`` (``{name: results}``), each by its entry's ``claims``,
  in ``CLAIM_ORDER`` and then the rest in ``ABLATIONS``' order."""
  order = [n for n in CLAIM_ORDER if n in groups]
  order += [n for n in ABLATIONS if n in groups and n not in CLAIM_ORDER]
  return [c for n in order for c in check_group(n).claims(groups[n], window, main_curves)]


def check_group(name: str) -> AblationGroup:
  if name not in ABLATIONS:
    raise ValueError(f"unknown ablation {name!r}; choose from {sorted(ABLATIONS)}")
  return ABLATIONS[name]
