"""The training harness: the model, the data, the methods, one run's config and identity, the
resumable run, its checkpoints, provenance and processes, and its compiled memory.

This package, with ``rotation`` and ``pipeline_sim``, is the code that computes a run's numbers:
its source files are a run's code identity (``provenance.SOURCE_PACKAGES``), so an edit here
restarts unfinished runs and an edit anywhere else (the sweep, the report, the studies, the
benchmarks) does not."""
