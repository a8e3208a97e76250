"""The paper's ablations, one entry each: what it asks, which runs it needs, how it is reported.

``runs(make, top)`` returns the runs of one seed, where ``make(method, P, **overrides)`` builds a
run config from the sweep's preset (its learning rates, mode and template) and ``top`` is the
sweep's largest P; ``section(ctx, name, results)`` renders the report lines (``experiments.report``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from experiments.harness.methods import ALLOCATIONS, BASELINES, BASES, VARIANTS
from experiments.report import sections, tables


@dataclasses.dataclass(frozen=True)
class Ablation:
  description: str
  runs: Callable  # (make, top) -> list of RunConfigs
  section: Callable  # (ctx, name, results) -> list of report lines


ABLATIONS = {
    "variants": Ablation(
        "The 2 x 2 taxonomy (source x geometry) at P = 1 and the largest P.",
        lambda make, top: [make(m, p) for m in VARIANTS for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, show_baselines=False,
                          bars=True)),
    "stage-aware": Ablation(
        "Uniform / proportional / reverse basis-refresh allocation at the largest P, equal budget.",
        lambda make, top: [make(m, top) for m in ALLOCATIONS],
        functools.partial(sections.stage_aware_section, methods=ALLOCATIONS)),
    "no-stashing": Ablation(
        "Baselines and rotation without weight stashing at P = 1 and the largest P.",
        lambda make, top: [make(m, p, mode="no_stashing") for m in BASELINES + ("rotation",)
                           for p in (1, top)],
        functools.partial(sections.study_section, fewer=True)),
    "refresh-period": Ablation(
        "Rotation with refresh period 100 against 10, at P = 1 and the largest P.",
        lambda make, top: [make(m, p) for m in ("rotation", "rotation-T100") for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, bars=True)),
    "bases": Ablation(
        "Adam in a random fixed basis, in the eigenbasis frozen after 100 steps, and rotation "
        "(refreshed), at P = 1 and the largest P, beside the coordinate basis (PipeDream's AdamW). "
        "The mechanism predicts slowdowns ordered random > coordinate > frozen >= refreshed.",
        lambda make, top: [make(m, p) for m in BASES for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, bars=True)),
    "rotation-lr": Ablation(
        "Rotation with PipeDream-LR's per-stage rate correction, at P = 1 and the largest P (the "
        "paper's appendix), beside rotation and the baselines.",
        lambda make, top: [make(m, p) for m in ("rotation", "rotation-lr") for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, fewer=True)),
    "muon": Ablation(
        "Muon (optax.contrib.muon, RMS-matched to AdamW) under the same staleness, at P = 1 and the "
        "largest P, beside rotation and the baselines (the paper's appendix).",
        lambda make, top: [make(m, p) for m in ("rotation", "muon") for p in (1, top)],
        functools.partial(sections.study_section, with_main_baselines=True, fewer=True)),
    "nesterov-stage": Ablation(
        "Without weight stashing: Nesterov with per-stage momentum (b1 from 0.9 at the last stage up "
        "to about 0.99 at the first) against Nesterov's one b1 = 0.99, beside PipeDream.",
        lambda make, top: [make(m, p, mode="no_stashing") for m in ("pipedream", "nesterov", "nesterov-stage")
                           for p in (1, top)],
        functools.partial(sections.study_section, fewer=False)),
    "width": Ablation(
        "Widths 32, 64 and 128 at the preset's depth, P = 1 and the largest P, for Nesterov and "
        "rotation: does rotation's robustness grow with size (the paper: 71.6% -> 76.8% -> 81.7% fewer "
        "iterations from 95M to 1B to 3B)?",
        lambda make, top: [make(m, p, width=w) for w in (32, 64, 128) for m in ("nesterov", "rotation")
                           for p in (1, top)],
        functools.partial(sections.size_section, size_of=tables.width_of, label="width")),
    "moe": Ablation(
        "The mixture-of-experts model (cpu-moe) at P = 1 and 8.",
        lambda make, top: [make(m, p, model="cpu-moe") for m in BASELINES + ("rotation",) for p in (1, 8)],
        functools.partial(sections.study_section, fewer=True)),
    "scaling": Ablation(
        "Blocks and P grown together (P = blocks = 4, 8, 16) for PipeDream, Nesterov and rotation, "
        "each size with its P = 1 control: is rotation's robustness larger in bigger models?",
        lambda make, top: [make(m, p, num_blocks=b) for b in (4, 8, 16)
                           for m in ("pipedream", "nesterov", "rotation") for p in (1, b)],
        functools.partial(sections.size_section, size_of=tables.blocks_of, label="blocks")),
}


def check_ablation(name: str) -> Ablation:
  if name not in ABLATIONS:
    raise ValueError(f"unknown ablation {name!r}; choose from {sorted(ABLATIONS)}")
  return ABLATIONS[name]
