"""The sweep's command line (experiments/sweep/flags.py): every flag of ``CONFIG_FLAGS`` reaches the
``RunConfig`` field or the optimizers' run setting it names, with the value written by hand here, in
the runs it applies to."""

import pytest

from experiments.harness.config import RunConfig
from experiments.harness.methods import spec
from experiments.harness.optimizers import SETTINGS
from experiments.sweep import command as sweep
from experiments.sweep import flags

# flag -> (command-line value, the field it sets, the field's value): written out by hand
EXPECTED = {
    "--batch-size": ("2", "batch_size", 2), "--model": ("cpu-tiny", "model", "cpu-tiny"),
    "--blocks": ("8", "num_blocks", 8), "--width": ("64", "width", 64),
    "--refresh-every": ("5", "refresh_every", 5), "--warmup": ("0.1", "warmup_fraction", 0.1),
    "--warmup-steps": ("7", "warmup_steps", 7), "--b2": ("0.99", "b2", 0.99),
    "--shampoo-beta": ("0.95", "shampoo_beta", 0.95), "--predict-scale": ("0.5", "predict_scale", 0.5),
    "--dc-lambda": ("2", "dc_lambda", 2.0), "--b1": ("0.8", "b1", 0.8),
    "--dtype": ("bfloat16", "dtype", "bfloat16"), "--remat": ("none", "remat", None),
    "--loss-chunk": ("0", "loss_chunk", None), "--mode": ("no_stashing", "mode", "no_stashing"),
    "--schedule": ("2bw", "schedule", "2bw"), "--execution": ("devices", "execution", "devices"),
    "--fsdp": (None, "fsdp", True), "--diagnose-every": ("20", "diagnose_every", 20),
    "--diagnose-steps": ("4", "diagnose_steps", 4), "--sampling": ("single-pass", "sampling", "single-pass"),
}
ONLY = {"--shampoo-beta": "rotation", "--refresh-every": "rotation-sa",
        "--predict-scale": "pipedream+predict", "--dc-lambda": "muon+dc"}


def test_the_table_covers_the_flags_written_here_and_every_run_setting():
  assert {f.flag for f in flags.CONFIG_FLAGS} == set(EXPECTED)
  assert set(SETTINGS) <= {f.field for f in flags.CONFIG_FLAGS}  # every optimizer knob has its flag


@pytest.mark.parametrize("flag", sorted(EXPECTED))
def test_each_flag_sets_its_field(flag):
  value, field, expected = EXPECTED[flag]
  args = sweep.parse_args(["--preset", "smoke", flag] + ([] if value is None else [value]))
  template = flags.template_fields(args, RunConfig())
  if field in SETTINGS:  # the optimizers of the methods that take it, and no other
    assert field not in template and flags.settings(args) == ((field, expected),)
    preset = flags.make_preset(args)
    assert preset.config(ONLY.get(flag, "muon"), 4, 0).optimizer.setting(field) == expected
    if flag in ONLY:
      assert preset.config("nesterov", 4, 0).optimizer == spec("nesterov")
  else:
    assert template == {field: expected}


def test_per_method_flags_reach_only_their_runs_in_the_plan():
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--shampoo-beta", "0.95"]))
  decay = {c.method: c.optimizer.setting("shampoo_beta") for c in plan.main}
  assert decay == {"pipedream": None, "rotation": 0.95}


@pytest.mark.parametrize("argv,match", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--loss-chunk", "-1"], r"--loss-chunk must be >= 0 \(0: off\), got -1"),
    (["--warmup", "1.5"], r"--warmup must be in \[0, 1\), got 1.5"),
    (["--warmup", "0.1", "--warmup-steps", "3"], "give one of --warmup and --warmup-steps"),
    (["--schedule", "gpipe"], "--schedule: unknown pipeline schedule 'gpipe'; choose from 1f1b, 2bw, "
                                "uniform-D"),
])
def test_a_bad_value_is_named_by_its_flag(argv, match):
  with pytest.raises(ValueError, match=match):
    flags.template_fields(sweep.parse_args(["--preset", "smoke"] + argv), RunConfig())
