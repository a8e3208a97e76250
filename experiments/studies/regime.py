"""``python -m experiments.studies.regime``: which CPU-sized regime shows the paper's staleness picture.

The paper trains its 95M model for 250 epochs at P up to 32, about 100x longer relative to the
largest delay than a CPU sweep can. This study measures how the slowdown from P = 1 to the largest
P depends on the regime, for PipeDream, Nesterov (the best other baseline of the default study at
large P) and rotation:

1. each method's peak learning rate is chosen at P = 1 from a grid (full runs at the base length,
   byte vocabulary; the choice is recorded in ``regime.json`` and used everywhere below);
2. training length: own-target slowdown from P = 1 to P = top, and rotation's percent fewer
   iterations than the best baseline at P = top, at lengths spanning 8x;
3. what the early loss plateau depends on (``--factor-steps``): a subword vocabulary (byte-level BPE
   trained offline on the corpus's training split, saved beside the results with its sha256)
   against bytes, and a longer context.

Writes ``regime.md``, ``regime.json`` and figures into ``--out``; finished runs are reused.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
import time

import numpy as np

from experiments import cli
from experiments.harness import data as data_lib
from experiments.report import plots, tables
from experiments.report import summary as summary_lib
from experiments.sweep import folders, presets, workers

METHODS = ("pipedream", "nesterov", "rotation")
# Centre of the learning-rate grid: the untuned rates of the earlier default study.
BASE_LR = {"pipedream": 3e-3, "nesterov": 1.5e-3, "rotation": 3e-3}


def parse_args(argv=None):
  p = argparse.ArgumentParser(prog="python -m experiments.studies.regime", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="cpu", help="preset whose template (model, batch) is used")
  p.add_argument("--lengths", nargs="+", type=int, default=[300, 600, 1200, 2400],
                 help="training lengths in steps (default 300 600 1200 2400: 8x)")
  p.add_argument("--base", type=int, default=1200, help="length of the learning-rate tuning runs")
  p.add_argument("--factor-steps", type=int, default=600, help="length of the vocabulary and context "
                 "runs (the plateau lies in the first few hundred steps)")
  p.add_argument("--top", type=int, default=16, help="the largest P (default 16)")
  p.add_argument("--methods", nargs="+", default=list(METHODS))
  p.add_argument("--grid", nargs="+", type=float, default=[0.5, 1.0, 2.0],
                 help="multipliers of the base learning rate (3e-3; Nesterov 1.5e-3) tried at P = 1")
  p.add_argument("--bpe-vocab", type=int, default=2048, help="subword vocabulary of the factor study")
  p.add_argument("--context", type=int, default=64, help="longer context of the factor study")
  p.add_argument("--seeds", nargs="+", type=int, default=[0])
  p.add_argument("--out", default="results/regime")
  return p.parse_args(argv)


def _config(preset, method, p, seed, steps, **kw):
  every = steps // 2 if steps % (2 * preset.template.chunk) == 0 else steps
  c = preset.config(method, p, seed, steps=steps, eval_every=every, checkpoint_every=every, **kw)
  c.validate()
  return c


def _rows(results, window):
  rows = tables.study_rows(tables.curves_by(results), window)
  return {(r["method"], r["stages"]): r for r in rows}


def check(args, preset) -> dict:
  """Every run the study will train, checked before the first one trains (at the methods' base
  rates: the rates chosen at P = 1 come later, each a multiple of a checked one). Returns the base
  rate of each method."""
  if args.top < 2:
    raise ValueError(f"--top must be >= 2, got {args.top}")
  data_lib.check_bpe_vocab(args.bpe_vocab)
  base = {m: BASE_LR.get(m, preset.learning_rate(m)) for m in args.methods}
  for m in args.methods:
    for g in args.grid:
      _config(preset, m, 1, 0, args.base, lr=base[m] * g)
  for steps, kw in [(n, {}) for n in args.lengths + [args.factor_steps]] + [
      (args.factor_steps, {"context": args.context})]:
    for s in args.seeds:
      for m in args.methods:
        for p in (1, args.top):
          _config(preset, m, p, s, steps, lr=base[m], **kw)
  return base


def main(argv=None) -> pathlib.Path:
  args = parse_args(argv)
  if args.preset not in presets.PRESETS:
    raise ValueError(f"unknown preset {args.preset!r}; choose from {sorted(presets.PRESETS)}")
  preset = presets.PRESETS[args.preset]
  base_lr = check(args, preset)
  out = folders.prepare_out(pathlib.Path(args.out))
  context = preset.template.model_config(256).context
  byte_ds = data_lib.default_corpus(max(context, args.context))
  t0 = time.time()
  record = {"preset": args.preset, "top": args.top, "methods": args.methods, "seeds": args.seeds}
  with folders.exclusive(out), workers.overall_bar(0, "regime") as overall:
    run = lambda c, ds: workers.run_one(c, ds, out, overall)

    def runs_of(configs, ds):
      overall.total += len(configs)
      overall.refresh()
      return [run(c, ds) for c in configs]

    # 1. Learning rates at P = 1 (base length, bytes).
    chosen, trials = {}, {}
    for m in args.methods:
      base = base_lr[m]
      configs = [_config(preset, m, 1, 0, args.base, lr=base * g) for g in args.grid]
      finals = {c.lr: tables.final_loss(r, preset.window(args.base))
                for c, r in zip(configs, runs_of(configs, byte_ds))}
      ok = {lr: f for lr, f in finals.items() if np.isfinite(f)}
      chosen[m] = min(ok, key=ok.get) if ok else base
      trials[m] = {str(k): v for k, v in finals.items()}
    record["learning_rates"] = {"chosen": chosen, "trials": trials, "grid": args.grid,
                                "tuned_at": {"stages": 1, "steps": args.base}}
    make = lambda m, p, s, steps, **kw: _config(preset, m, p, s, steps, lr=chosen[m], **kw)

    grid = lambda steps, ds, **kw: runs_of([make(m, p, s, steps, **kw) for s in args.seeds
                                            for m in args.methods for p in (1, args.top)], ds)
    # 2. Training length.
    lengths = {n: grid(n, byte_ds) for n in sorted(args.lengths)}
    # 3. Factors at the base length: vocabulary and context.
    bpe_path = data_lib.bpe_token_file(data_lib.default_corpus_bytes(), args.bpe_vocab, out / "tokenizer")
    bpe_ds = data_lib.token_file(bpe_path, max(context, args.context), args.bpe_vocab)
    tok_json = bpe_path.with_suffix(".json")
    record["tokenizer"] = {"path": str(tok_json), "vocab_size": args.bpe_vocab,
                           "sha256": hashlib.sha256(tok_json.read_bytes()).hexdigest(),
                           "tokens_sha256": bpe_ds.sha256, "tokens": bpe_ds.num_tokens}
    n = args.factor_steps
    factors = {
        f"bytes, context {context}": lengths.get(n) or grid(n, byte_ds),
        f"BPE {args.bpe_vocab}, context {context}": grid(n, bpe_ds),
        f"bytes, context {args.context}": grid(n, byte_ds, context=args.context),
    }
  record["wall_seconds"] = time.time() - t0
  write(out, preset, args, record, lengths, factors)
  print(f"done in {record['wall_seconds']:.0f}s: {out / 'regime.md'}")
  return out


def _table(rows_by, keys, top, methods, label):
  lines = [f"| {label} | " + " | ".join(f"{m} slowdown" for m in methods)
           + " | rotation fewer vs best baseline | final loss at P=top (" + ", ".join(methods) + ") |",
           "|---|" + "---|" * (len(methods) + 2)]
  for k in keys:
    rows = rows_by[k]
    cells = [tables.cell(rows[(m, top)], "slowdown_own") if (m, top) in rows else "" for m in methods]
    rot = rows.get(("rotation", top))
    fewer = tables.cell(rot, "fewer", "{:+.1f}%", "n/a") if rot else ""
    finals = ", ".join(tables.fmt(rows[(m, top)]["final"], "{:.3f}", "diverged") for m in methods
                       if (m, top) in rows)
    lines.append(f"| {k} | " + " | ".join(cells) + f" | {fewer} | {finals} |")
  return "\n".join(lines)


def write(out, preset, args, record, lengths, factors):
  smooth = preset.smooth_fraction
  window = lambda steps: max(1, int(steps * smooth))
  by_length = {n: _rows(rs, window(n)) for n, rs in lengths.items()}
  by_factor = {k: _rows(rs, window(args.factor_steps)) for k, rs in factors.items()}
  top, methods = args.top, args.methods
  lr = record["learning_rates"]
  lines = ["# Regime study", "",
           f"Template: preset `{args.preset}` (model `{preset.template.model}`, batch "
           f"{preset.template.batch_size}); P = 1 and P = {top}; seeds {args.seeds}; smoothing window "
           f"{smooth:.0%} of the steps (centred). Slowdown = own-target slowdown from P = 1 to P = {top}; "
           "'fewer' = rotation's percent fewer iterations than the best baseline at P = top. With several "
           "seeds: mean [min, max].", "",
           f"Learning rates chosen at P = 1, {args.base} steps, from {lr['grid']} x the base rates "
           f"({BASE_LR}): "
           + ", ".join(f"{m} {v:g}" for m, v in lr["chosen"].items()), "",
           "## Slowdown against training length (bytes)", "",
           _table(by_length, sorted(by_length), top, methods, "steps"), "",
           f"## What the plateau depends on ({args.factor_steps} steps)", "",
           _table(by_factor, list(by_factor), top, methods, "data"), "",
           f"Tokenizer: `{record['tokenizer']['path']}`, sha256 `{record['tokenizer']['sha256'][:16]}...`, "
           f"{record['tokenizer']['tokens']} tokens.", ""]
  record["by_length"] = {str(n): list(r.values()) for n, r in by_length.items()}
  record["by_factor"] = {k: list(r.values()) for k, r in by_factor.items()}
  fig = out / "regime_slowdown_vs_length.png"
  series = {m: [(n, by_length[n][(m, top)]["slowdown_own"]) for n in sorted(by_length)
                if (m, top) in by_length[n]] for m in methods}
  plots.series(series, fig, f"slowdown from P = 1 to P = {top} against training length",
               "training steps", "slowdown (own target)")
  lines += ["## Figures", "", f"![{fig.name}]({fig.name})", ""]
  for n, rs in sorted(lengths.items()):
    name = f"regime_loss_{n}.png"
    plots.loss_curves(tables.mean_curves(tables.curves_by(rs)), window(n), out / name, f"{n} steps")
    lines.append(f"![{name}]({name})")
  for i, (k, rs) in enumerate(factors.items()):
    name = f"regime_factor_{i}.png"
    plots.loss_curves(tables.mean_curves(tables.curves_by(rs)), window(args.factor_steps), out / name, k)
    lines.append(f"![{name}]({name})")
  (out / "regime.md").write_text("\n".join(lines) + "\n")
  summary_lib.write(out / "regime.json", record)


if __name__ == "__main__":
  cli.exit_process(cli.run(main))
