"""The report: per-run metrics (slowdowns, intervals), the paper's claims and their verdicts, the
tables and sections of ``report.md``, the committed curves, the figures, and ``build`` (the whole
report from a folder of curves). ``python -m experiments.report SOURCE`` is its command."""
