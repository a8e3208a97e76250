"""The studies beyond the sweep, one module each, each its own command
(``python -m experiments.studies.<name>``): ``horizon`` (the training horizon), ``pipedream_2bw``
(PipeDream-2BW against 1F1B), ``protocol``, ``regime``, ``misalignment``, and the diagnostics
``hessian`` and ``toy_quadratic``."""
