"""The benchmarks, one module each (``python -m experiments.bench.<name>``): each prints ratios
measured in one run, medians of several repeats."""
