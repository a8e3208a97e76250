"""experiments/report/summary.py: a study's JSON is compact, its floats rounded to DIGITS significant
digits and nothing else changed."""

import json

import numpy as np

from experiments.report import summary


def test_floats_keep_ten_significant_digits_and_the_rest_is_untouched(tmp_path):
  obj = {"mean": 0.5498549999999999, "p": 5.0626838413311765e-05, "n": 3, "ok": True, "none": None,
         "inf": float("inf"), "np": np.float64(2.0 / 3.0), "i": np.int64(7), "rows": [(1.0 / 3.0, "a")],
         "nested": {"x": [0.1 + 0.2]}}
  back = summary.write(tmp_path / "summary.json", obj)
  text = (tmp_path / "summary.json").read_text()
  assert text.endswith("}\n") and "\n" not in text[:-1] and ": " not in text
  assert back == json.loads(text)
  assert back["mean"] == 0.549855 and back["p"] == 5.062683841e-05 and back["np"] == 0.6666666667
  assert back["rows"] == [[0.3333333333, "a"]] and back["nested"] == {"x": [0.3]}
  assert back["n"] == 3 and isinstance(back["n"], int) and back["i"] == 7 and back["ok"] is True
  assert back["none"] is None and back["inf"] == float("inf")
  for key in ("mean", "p", "np"):  # every value within half a unit of its tenth digit
    assert abs(back[key] - float(obj[key])) <= 5e-10 * abs(float(obj[key]))
