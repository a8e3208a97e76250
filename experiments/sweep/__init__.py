"""The sweep: the study's presets, the ablations, and the executor that trains every run of a
preset (resumable, several at a time). ``python -m experiments.sweep`` is its command; studies
call ``executor.run_one`` and ``executor.run_all``."""
