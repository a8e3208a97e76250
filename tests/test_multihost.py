"""Two processes (hosts) of 2 CPU devices each train one run together after
``jax.distributed.initialize()`` (Gloo collectives), and get the 1-process numbers; on their shared
folder only process 0 writes, probes or sets files aside."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import conftest

from experiments.harness import data, runs
from experiments.harness.config import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, pathlib, sys
import jax
from experiments.harness import data
from experiments.harness import processes
from experiments.harness import runs
from experiments.harness.config import RunConfig
assert processes.initialize_distributed()
from experiments.sweep import folders as sweep
root = pathlib.Path(sys.argv[1])
sweep.prepare_out(root / "out")  # process 0 probes the folder, the other waits
processes.write_json(root / "out" / "tuning.json", {"writer": jax.process_index()})  # process 0 only
config = RunConfig(stages=2, steps=10, batch_size=4, model="cpu-tiny", chunk=10,
                   eval_every=10, eval_batches=1, checkpoint_every=10)
result = runs.train(config, data.default_corpus(32), root / "run")
print(json.dumps({"process": jax.process_index(), "devices": [jax.device_count(), jax.local_device_count()],
                  "losses": result["losses"], "val": result["val_losses"]}))
"""


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_train_one_run_and_match_one_process(tmp_path):
  port = _free_port()
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "result.json").write_text('{"trunc')  # damaged: set aside once, by process 0
  procs = []
  for i in range(2):
    env = {**os.environ, "XLA_FLAGS": conftest.xla_flags(2), "JAX_PLATFORMS": "cpu",
           "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
    procs.append(subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  outs = [p.communicate(timeout=600) for p in procs]
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
  assert [g["process"] for g in got] == [0, 1] and all(g["devices"] == [4, 2] for g in got)
  assert got[0]["losses"] == got[1]["losses"]  # one SPMD program: both hosts see the same numbers
  assert json.loads((tmp_path / "out" / "tuning.json").read_text()) == {"writer": 0}
  assert (tmp_path / "run" / "result.damaged").read_text() == '{"trunc'
  assert not (tmp_path / "out" / ".write-test").exists()
  # process 0 alone wrote the run's files
  result = json.loads((tmp_path / "run" / "result.json").read_text())
  assert result["devices"] == 4 and result["losses"] == got[0]["losses"]
  assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 10
  config = RunConfig(stages=2, steps=10, batch_size=4, model="cpu-tiny", chunk=10, eval_every=10,
                     eval_batches=1, checkpoint_every=10)
  alone = runs.train(config, data.default_corpus(32), tmp_path / "alone")  # this process: 1 device
  assert max(abs(a - b) for a, b in zip(alone["losses"], got[0]["losses"])) < 1e-4


RESTORE = r"""
import json, pathlib, sys, warnings
import jax, numpy as np
from experiments.harness import checkpoints
from experiments.harness import data
from experiments.harness import processes
from experiments.harness import runs
from experiments.sweep import folders as sweep
from experiments.harness.config import RunConfig
assert processes.initialize_distributed()
root = pathlib.Path(sys.argv[1])
try:  # process 0 cannot write here: every process must hear of it (none may wait at a barrier)
  sweep.prepare_out(root / "readonly" / "out")
  refused = False
except ValueError as e:
  refused = "cannot be written" in str(e)
config = RunConfig(stages=2, steps=30, batch_size=4, model="cpu-tiny", chunk=10,
                        eval_every=10, eval_batches=1, checkpoint_every=10)
if sys.argv[2] == "interrupt":
  class Stop(Exception):
    pass
  class StopAt:
    def reset(self, total): pass
    def set_postfix(self, *a, **k): pass
    def update(self, n):
      self.n = getattr(self, "n", 0) + n
      if self.n >= 30: raise Stop
  try:
    runs.train(config, data.default_corpus(32), root / "run", progress=StopAt())
  except Stop:
    pass
  print(json.dumps({"process": jax.process_index(), "refused": refused}))
else:
  if jax.process_index() == 0:  # a damaged checkpoint that only process 0 sees: step 20
    verdict = checkpoints._Checkpoints._verdict
    def damaged_20(self, step, template):
      return ("damaged", "truncated file") if step == 20 else verdict(self, step, template)
    checkpoints._Checkpoints._verdict = damaged_20
  class First:
    first = None
    def reset(self, total): pass
    def set_postfix(self, *a, **k): pass
    def update(self, n):
      self.first = n if self.first is None else self.first
  bar = First()
  with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    result = runs.train(config, data.default_corpus(32), root / "run", progress=bar)
  print(json.dumps({"process": jax.process_index(), "refused": refused, "resumed_at": bar.first,
                    "losses": result["losses"]}))
"""


def _two_processes(script, *args):
  port = _free_port()
  procs = []
  for i in range(2):
    env = {**os.environ, "XLA_FLAGS": conftest.xla_flags(2), "JAX_PLATFORMS": "cpu",
           "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
    procs.append(subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  try:
    outs = [p.communicate(timeout=300) for p in procs]  # a hang (a process left at a barrier) fails
  finally:
    for p in procs:
      p.kill()
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def test_process_0_decides_restores_and_failures_for_every_process(tmp_path):
  (tmp_path / "readonly").write_text("a file where a folder should be made")
  got = _two_processes(RESTORE, str(tmp_path), "interrupt")  # checkpoints 10 and 20, then stopped
  assert [g["refused"] for g in got] == [True, True]
  got = _two_processes(RESTORE, str(tmp_path), "resume")
  # step 20 is damaged for process 0 only: both processes resume from 10, in step, and agree
  assert [g["resumed_at"] for g in got] == [10, 10] and got[0]["losses"] == got[1]["losses"]
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints.damaged").iterdir()) == ["20"]

