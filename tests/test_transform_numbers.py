"""rotation.basis_rotation's updates equal the ones frozen in tests/data/transform_numbers.json before
its code was rewritten (``tests/data/transform_numbers.py``): bit for bit on the CPU that froze them
(under the suite's XLA flags),
to 1e-4 in every step's norm elsewhere (another CPU's round-off, which warm refreshes amplify in the
bf16 state and the first-order source: docs/benchmarks.md, "Figures the code's comments cite");
eight configurations, 20 steps, cold and warm refreshes."""

import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

DATA = pathlib.Path(__file__).parent / "data"
spec = importlib.util.spec_from_file_location("transform_numbers", DATA / "transform_numbers.py")
numbers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(numbers)
FROZEN = json.loads((DATA / "transform_numbers.json").read_text())


@pytest.mark.parametrize("name", sorted(numbers.CONFIGS))
def test_updates_are_the_frozen_numbers(name):
  got = numbers.numbers(numbers.CONFIGS[name])
  want = FROZEN["configs"][name]
  assert len(got["norms"]) == numbers.STEPS == len(want["norms"])
  np.testing.assert_allclose(got["norms"], want["norms"], rtol=1e-4)
  if numbers.cpu() == FROZEN["cpu"] and os.environ.get("XLA_FLAGS") == FROZEN["xla_flags"]:
    assert got["sha256"] == want["sha256"], f"{name}: not bit-identical on {FROZEN['cpu']}"
