"""``python -m autodiff_demos [--markdown PATH] [--plots DIR]``: every claim of the tutorial
(docs/autodiff.md), its figure beside JAX's value and XLA's measured cost, with PASS/FAIL."""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from autodiff_demos import chain_order, checkpointing, hvp, jvp_vjp, layers, modes, report


def plots(directory: pathlib.Path, hvp_table, ckpt_rows) -> list[str]:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  directory.mkdir(parents=True, exist_ok=True)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  styles = [("o", "-"), ("s", "--"), ("^", ":"), ("v", "-."), ("D", (0, (5, 1)))]
  names = list(dict.fromkeys(r["method"] for r in hvp_table))
  ns = sorted({r["n"] for r in hvp_table})
  for name, (marker, line) in zip(names, styles * len(names)):
    rows = [r for r in hvp_table if r["method"] == name]
    for ax, key in ((axes[0], "flops"), (axes[1], "seconds")):  # equal values stay visible
      ax.loglog([r["n"] for r in rows], [r[key] for r in rows], marker=marker, linestyle=line,
                markerfacecolor="none", label=name)
  for ax, ylabel, title in ((axes[0], "XLA FLOPs", "cost vs n on an MLP loss"),
                            (axes[1], "wall time (s)", "time vs n")):
    ax.set(xlabel="input size n", ylabel=ylabel, title=title)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.tick_params(axis="x", labelrotation=45)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(directory / "cost_vs_n.png", dpi=110)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(5.5, 4))
  depth = [r["depth"] for r in ckpt_rows]
  ax.loglog(depth, [r["plain_bytes"] for r in ckpt_rows], marker="o", label="no checkpointing")
  ax.loglog(depth, [r["ckpt_bytes"] for r in ckpt_rows], marker="o", label="sqrt(L) segments")
  ax.set(xlabel="layers L", ylabel="XLA temporary bytes", title="memory vs depth")
  ax.legend()
  fig.tight_layout()
  fig.savefig(directory / "memory_vs_depth.png", dpi=110)
  plt.close(fig)
  return ["cost_vs_n.png", "memory_vs_depth.png"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m autodiff_demos", description=__doc__)
  parser.add_argument("--markdown", type=pathlib.Path, help="also write the report as Markdown here")
  parser.add_argument("--plots", type=pathlib.Path, help="write PNG figures into this folder")
  args = parser.parse_args(argv)
  if args.plots is not None and args.plots.exists() and not args.plots.is_dir():
    parser.error(f"--plots {str(args.plots)!r} is a file, not a folder")
  if args.markdown is not None and args.markdown.is_dir():
    parser.error(f"--markdown {str(args.markdown)!r} is a folder, not a file")
  t0 = time.time()
  hvp_table = hvp.core_comparison()
  ckpt_rows = checkpointing.measure()
  claims = (chain_order.claims() + jvp_vjp.claims() + layers.claims() + modes.claims()
            + hvp.claims(hvp_table) + checkpointing.claims(ckpt_rows))
  print(report.text(claims))
  print(f"({time.time() - t0:.0f} s)")
  if args.markdown:
    table = "\n".join(f"| {r['n']} | {r['method']} | {r['flops']:.3g} | {r['temp_bytes']} | "
                      f"{r['seconds'] * 1e6:.0f} |" for r in hvp_table)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.markdown.write_text(
        "# Why deep learning differentiates in reverse: the tutorial's claims, measured\n\n"
        + report.markdown(claims) + "\n## Core comparison on an MLP loss\n\n"
        "| n | method | XLA FLOPs | temp bytes | time (us) |\n|---|---|---|---|---|\n" + table + "\n")
  if args.plots:
    plots(args.plots, hvp_table, ckpt_rows)
  return 0 if all(c.passed for c in claims) else 1


if __name__ == "__main__":
  sys.exit(main())
