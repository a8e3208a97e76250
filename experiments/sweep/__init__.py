"""``python -m experiments.sweep``: the staleness study of a preset, resumable, with its report.

The files say what they hold: ``flags`` the command line (``CONFIG_FLAGS``, the one table from a
flag to the ``RunConfig`` field or the optimizers' run setting it sets), ``presets`` the named
studies, ``plan`` every run of a preset and the command line, validated before training,
``tuning`` ``--tune-lr``'s rate choice, ``workers`` the runs (resumable, several at a time in
worker processes), ``folders`` the results folder, its lock, publishing and restoring published
runs, ``description`` what the report says of how the runs were made, and ``command`` the command
itself (``main``: plan, train, report).
"""
