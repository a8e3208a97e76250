"""experiments.bench.memory on a small preset: the table's rows, the options' effect on the compiled
program's temporaries, and the timing line."""

import dataclasses
import re

import pytest

from experiments.bench import memory as bench_memory
from experiments.sweep import presets


def test_memory_table_and_step_times(monkeypatch, capsys):
  smoke = presets.PRESETS["smoke"]
  small = dataclasses.replace(smoke, template=dataclasses.replace(
      smoke.template, batch_size=8, remat="nothing_saveable", loss_chunk=16))
  monkeypatch.setitem(presets.PRESETS, "small-mem", small)
  rows = bench_memory.main(["--preset", "small-mem", "--method", "pipedream", "--stages", "1",
                            "--vocab-sizes", "4096", "--time-blocks", "1"])
  out = capsys.readouterr().out
  assert len(re.findall(r"^\s*1\s+4096 (before|after)\s+[\d.]+\s+[\d.]+", out, re.M)) == 2, out
  assert len(re.findall(r"vocab\s+4096: before [\d.]+ s, after [\d.]+ s, after / before [\d.]+x", out)) == 1
  # what the table shows: rematerialised blocks and a chunked loss (the (256 x 4096) logits 16
  # tokens at a time) hold far fewer temporaries in the compiled program
  temps = {r["setting"]: r["temporaries"] for r in rows}
  assert temps["after"] < 0.5 * temps["before"], temps


def test_a_preset_without_memory_options_is_refused():
  with pytest.raises(ValueError, match="turns no memory option on"):
    bench_memory.main(["--preset", "smoke"])
