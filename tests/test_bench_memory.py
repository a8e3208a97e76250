"""experiments.bench_memory on a small preset: the table's rows, the options' effect on the compiled
program's temporaries, and the timing line."""

import dataclasses
import re

import pytest

from experiments import bench_memory, presets, runs


def test_memory_table_and_step_times(monkeypatch, capsys):
  smoke = presets.PRESETS["smoke"]
  small = dataclasses.replace(smoke, template=dataclasses.replace(
      smoke.template, model="cpu-small", batch_size=8, remat="nothing_saveable", loss_chunk=64))
  monkeypatch.setitem(presets.PRESETS, "small-mem", small)
  bench_memory.main(["--preset", "small-mem", "--method", "pipedream", "--stages", "1",
                     "--vocab-sizes", "2048", "--time-blocks", "2"])
  out = capsys.readouterr().out
  assert len(re.findall(r"^\s*1\s+2048 (before|after)\s+[\d.]+\s+[\d.]+", out, re.M)) == 2, out
  assert len(re.findall(r"vocab\s+2048: before [\d.]+ s, after [\d.]+ s, after / before [\d.]+x", out)) == 1
  # what the table shows: 16 rematerialised blocks and a chunked loss hold far fewer temporaries
  config = dataclasses.replace(small.template, method="pipedream", chunk=2, steps=2, eval_every=2,
                               checkpoint_every=2)
  temps = {name: runs.memory(runs.compile_chunk(dataclasses.replace(config, **over), 2048)[0])["temporaries"]
           for name, over in (("before", dict(remat=None, loss_chunk=None)), ("after", {}))}
  assert temps["after"] < 0.5 * temps["before"], temps


def test_a_preset_without_memory_options_is_refused():
  with pytest.raises(ValueError, match="turns no memory option on"):
    bench_memory.main(["--preset", "smoke"])
