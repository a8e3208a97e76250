"""The run config's name (experiments/harness/config.py): built from the fields that differ from their
defaults, it must stay the name every committed run was published under, since ``--restore-from``
and the studies find runs by it."""

import dataclasses
import pathlib

import pytest

from experiments.harness.config import RunConfig, recorded
from experiments.harness.methods import spec
from experiments.harness.optimizers import Rotation
from experiments.report import curves

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "results"


def test_every_committed_run_keeps_its_name():
  checked = 0
  for path in sorted(RESULTS.rglob(curves.FILE)):
    for run in curves.read(path)["runs"]:
      config = recorded(run["config"])
      assert config.name == run["name"].rsplit("_", 1)[0], (path, run["name"])
      checked += 1
  assert checked > 1000  # every study's runs, not a lucky few


def test_the_name_written_by_hand():
  c = RunConfig(optimizer=spec("rotation", b2=0.99, shampoo_beta=0.95), stages=16, seed=3, lr=2e-3,
                steps=9600, warmup_steps=28, schedule="2bw", dtype="bfloat16", loss_chunk=2048, tag="tune")
  assert c.name == ("cpu-deep-bf16-2bw-wu28-b2_0.99-sb0.95-lc2048_weight_stashing_rotation_P16_lr0.002"
                    "_n9600_s3_tune")
  # the model's own width and block count, and 2BW at P = 1, are the plain run's name
  plain = RunConfig(optimizer=spec("pipedream"), stages=1, schedule="2bw", width=32, num_blocks=16)
  assert plain.name == "cpu-deep_weight_stashing_pipedream_P1_lr0.003_n1200_s0"
  assert RunConfig(width=64, num_blocks=8, execution="devices", fsdp=True, remat="nothing_saveable",
                   diagnose_every=50).name.startswith("cpu-deep-B8-W64-devices-fsdp-diag50-remat_")



def test_a_uniform_delay_names_its_runs_at_every_p_and_is_checked():
  # a schedule with a delay at P = 1 is not the synchronous run (2BW at P = 1 is, above)
  for stages in (1, 4):
    c = RunConfig(optimizer=spec("rotation"), stages=stages, schedule="uniform-2")
    assert c.name == f"cpu-deep-uniform-2_weight_stashing_rotation_P{stages}_lr0.003_n1200_s0"
    c.validate()
  with pytest.raises(ValueError, match="schedule 'uniform-2' needs mode 'weight_stashing'.*'no_stashing'"):
    RunConfig(schedule="uniform-2", mode="no_stashing", stages=2).validate()
  with pytest.raises(ValueError, match="unknown pipeline schedule 'uniform-0'"):
    RunConfig(schedule="uniform-0").validate()


def test_single_pass_sampling_names_its_runs_and_changes_their_identity():
  from experiments.harness.config import identity
  plain = RunConfig(width=64)
  once = dataclasses.replace(plain, sampling="single-pass")
  assert once.name == plain.name.replace("cpu-deep-W64_", "cpu-deep-W64-1pass_")
  assert "sampling" not in identity(plain, "sha", 256)["config"]  # earlier runs keep their identity
  assert identity(once, "sha", 256)["config"]["sampling"] == "single-pass"


def test_every_committed_run_keeps_its_identity_and_an_edited_method_gets_a_new_one(monkeypatch):
  """A run's whole folder name (its identity's hash) is rebuilt from its config for every committed
  study that records its corpus's hash; editing what a method name means (here rotation-fast's
  statistics decay, or a constant of its kind's builder) changes the identity of its runs only."""
  import re

  from experiments.harness import methods
  from experiments.harness.config import identity, run_name

  checked = 0
  for path in sorted(RESULTS.rglob(curves.FILE)):
    data = curves.read(path)
    setting = " ".join(data["meta"].get("setting", []))
    found = re.search(r"vocabulary (\d+), sha256 `([0-9a-f]{64})`", setting)
    if not found:  # a study merged from others (they are checked where they are held)
      continue
    for run in data["runs"]:
      config = recorded(run["config"])
      assert run_name(config, found.group(2), int(found.group(1))) == run["name"], (path, run["name"])
      checked += 1
  assert checked > 700
  assert set(methods.PUBLISHED) == set(methods.METHODS)  # every method of today, as it is today
  fast, plain = RunConfig(optimizer=spec("rotation-fast")), RunConfig(optimizer=spec("rotation"))
  before = {c.method: run_name(c, "sha", 256) for c in (fast, plain)}
  assert "optimizer" not in identity(fast, "sha", 256)
  monkeypatch.setitem(methods.METHODS, "rotation-fast",
                      dataclasses.replace(methods.METHODS["rotation-fast"], shampoo_beta=0.9))
  fast = RunConfig(optimizer=spec("rotation-fast"))  # the method as it is now
  assert run_name(fast, "sha", 256) != before["rotation-fast"]
  assert identity(fast, "sha", 256)["optimizer"]["shampoo_beta"] == 0.9
  assert run_name(plain, "sha", 256) == before["rotation"]
  # a constant of the kind (once a builder's, now a field of the value) edited in the method
  monkeypatch.setitem(methods.METHODS, "rotation",
                      dataclasses.replace(methods.METHODS["rotation"], max_precond_dim=4096))
  plain = RunConfig(optimizer=spec("rotation"))
  assert run_name(plain, "sha", 256) != before["rotation"]
  assert identity(plain, "sha", 256)["optimizer"]["max_precond_dim"] == 4096
  monkeypatch.setitem(methods.METHODS, "rotation-new", methods.METHODS["rotation"])  # a new name
  new = identity(RunConfig(optimizer=spec("rotation-new")), "sha", 256)
  assert new["optimizer"] == methods.definition("rotation-new")
  # a value built by hand: its kind's label, and the whole value in its identity
  hand = RunConfig(optimizer=Rotation(block_size=64))
  assert hand.method == "rotation" and identity(hand, "sha", 256)["optimizer"]["block_size"] == 64
  assert run_name(hand, "sha", 256) != run_name(RunConfig(optimizer=Rotation()), "sha", 256)
