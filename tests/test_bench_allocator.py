"""experiments/bench/allocator.py: the settings' environments, the summary against a hand computation,
and one fresh process measured end to end (the C library's malloc, a small block)."""

import pathlib

import pytest

from experiments.bench import allocator


def test_settings_and_their_environments():
  assert allocator.settings(None) == {"libc": {"LD_PRELOAD": None, "MALLOC_CONF": None}}
  both = allocator.settings("/lib/libjemalloc.so.2")
  assert both["jemalloc, pages kept"] == {"LD_PRELOAD": "/lib/libjemalloc.so.2",
                                          "MALLOC_CONF": "dirty_decay_ms:-1,muzzy_decay_ms:-1"}
  base = {"LD_PRELOAD": "/x.so", "MALLOC_CONF": "a:1", "HOME": "/h"}
  assert allocator.environment(both["libc"], base) == {"HOME": "/h"}
  assert allocator.environment(both["jemalloc, pages kept"], base) == {
      "LD_PRELOAD": "/lib/libjemalloc.so.2", "MALLOC_CONF": allocator.KEEP_PAGES, "HOME": "/h"}
  found = allocator.find_jemalloc()
  assert found is None or pathlib.Path(found).exists()


def test_summary_is_each_settings_median_over_libcs():
  def run(ua, ur, sa, sr, f):
    return {"update": {"adamw": ua, "rotation": ur}, "step": {"adamw": sa, "rotation": sr}, "faults": f}

  runs = {"libc": [run(2, 60, 1500, 1600, 12000), run(4, 62, 1400, 1500, 13000),
                   run(3, 70, 1450, 1700, 14000)],
          "jemalloc, pages kept": [run(1, 48, 1100, 1200, 50), run(3, 50, 1150, 1190, 40)]}
  got = allocator.summarize(runs)
  assert got["libc"]["update rotation"] == (62.0, 1.0)
  assert got["libc"]["step adamw"] == (1450.0, 1.0)
  assert got["jemalloc, pages kept"]["update rotation"] == (49.0, 49 / 62)
  assert got["jemalloc, pages kept"]["step rotation"] == (1195.0, 1195 / 1600)
  assert got["jemalloc, pages kept"]["update adamw"] == (2.0, 2 / 3)
  assert got["jemalloc, pages kept"]["faults"] == (45.0, 45 / 13000)


def test_one_process_end_to_end():
  r = allocator.measure(allocator.settings(None)["libc"], width=64, batch=1, rounds=1)
  assert r["allocator"] == "libc"
  assert set(r["update"]) == set(r["step"]) == {"adamw", "rotation"}
  assert all(v > 0 for v in [*r["update"].values(), *r["step"].values()]) and r["faults"] >= 0


def test_bad_arguments_are_refused():
  with pytest.raises(ValueError, match="--repeat"):
    allocator.main(["--repeat", "0"])
  with pytest.raises(ValueError, match="does not exist"):
    allocator.main(["--jemalloc", "/nonexistent/libjemalloc.so.2"])
