"""experiments/report/curves.py: the committed curves round-trip, long runs as block means, the same
content as the same bytes."""

import json

import numpy as np
import pytest

from experiments.report import curves


def _result(losses, name="r"):
  return {"name": name, "config": {"steps": len(losses)}, "status": "finished", "losses": losses,
          "val_steps": [len(losses)], "val_losses": [2.0], "seconds": 1.0}


def test_a_short_run_is_stored_per_step_and_read_back_exactly(tmp_path):
  x = np.random.default_rng(0).uniform(1, 3, curves.MAX_POINTS).tolist()
  x[7] = float("nan")
  curves.write(tmp_path / curves.FILE, {"window": 5}, [curves.record("main", _result(x))])
  run = curves.read(tmp_path)["runs"][0]
  assert "loss_every" not in run and len(run["losses"]) == len(x)
  assert run["losses"][7] == float("inf")  # a non-finite step is never credited
  np.testing.assert_allclose(np.delete(run["losses"], 7), np.round(np.delete(x, 7), curves.LOSS_DECIMALS),
                             atol=0)


def test_a_long_run_is_stored_as_block_means_repeated_back_to_one_loss_per_step(tmp_path):
  steps = 2 * curves.MAX_POINTS + 5  # blocks of 3, the last one of 2 steps
  x = np.random.default_rng(1).uniform(1, 3, steps)
  x[10] = np.inf  # the block of steps 9-11 holds a diverged step
  rec = curves.record("main", _result(x.tolist()))
  assert rec["loss_every"] == 3 and rec["num_losses"] == steps and len(rec["losses"]) == -(-steps // 3)
  curves.write(tmp_path / curves.FILE, {"window": 5}, [rec])
  run = curves.read(tmp_path / curves.FILE)["runs"][0]
  assert len(run["losses"]) == steps and "loss_every" not in run
  expected = np.repeat([x[i:i + 3].mean() for i in range(0, steps, 3)], 3)[:steps]
  finite = np.isfinite(expected)
  assert not finite[9:12].any() and all(v == float("inf") for v in run["losses"][9:12])
  want = np.round(expected[finite], curves.LOSS_DECIMALS)
  np.testing.assert_allclose(np.asarray(run["losses"])[finite], want, atol=1e-12)
  again = tmp_path / "again.xz"  # a study merging it writes the run as ``read`` returned it
  curves.write(again, {"window": 5}, [run])
  assert curves.read(again)["runs"][0]["losses"] == run["losses"]
  import lzma
  stored, = json.loads(lzma.decompress(again.read_bytes()).partition(b"\n")[0])["runs"]
  assert stored["loss_every"] == 3 and stored["losses_int32"] == len(rec["losses"])  # blocks again


def test_the_file_is_byte_identical_per_content(tmp_path):
  data = {"meta": {"window": 5}, "runs": [curves.record("main", _result([2.0, 1.5]))]}
  curves.write(tmp_path / "a.xz", data["meta"], data["runs"])
  curves.write(tmp_path / "b.xz", data["meta"], data["runs"])
  assert (tmp_path / "a.xz").read_bytes() == (tmp_path / "b.xz").read_bytes()
  assert curves.read(tmp_path / "a.xz")["runs"][0]["losses"] == [2.0, 1.5]


def test_a_damaged_curves_file_is_one_line_and_status_2(tmp_path):
  """Truncated, foreign, or without runs: one ``error:`` line naming the file, exit status 2 (as
  every other bad input), not a traceback."""
  import lzma
  import subprocess
  import sys

  good = lzma.compress(json.dumps({"meta": {}, "runs": []}).encode())
  cases = {"truncated": good[:len(good) // 2], "foreign": b"not a curves file at all",
           "no-runs": lzma.compress(json.dumps({"meta": {}}).encode()),
           "bad-run": lzma.compress(json.dumps({"meta": {}, "runs": [{"name": "r"}]}).encode())}
  for name, raw in cases.items():
    folder = tmp_path / name
    folder.mkdir()
    (folder / curves.FILE).write_bytes(raw)
    with pytest.raises(ValueError, match=f"is not a readable curves file.*{curves.FILE}"):
      curves.read(folder)
  out = subprocess.run([sys.executable, "-m", "experiments.report", str(tmp_path / "truncated")],
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 2, out.stderr
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), lines
  assert "not a readable curves file" in lines[0], lines


def test_compact_stores_block_means_that_read_repeats_and_compacting_twice_changes_nothing(tmp_path):
  losses = [float(i) for i in range(250)] + [float("inf")] + [1.0] * 9
  run = {"group": "main", "name": "r", "config": {"steps": 260}, "status": "diverged", "losses": losses,
         "val_steps": [0, 260], "val_losses": [5.0, float("inf")]}
  once = curves.compact(run, 100)
  assert once["losses"][:2] == [49.5, 149.5] and once["losses"][2] is None and once["num_losses"] == 260
  assert once["val_losses"] == [5.0, None]
  curves.write(tmp_path / curves.FILE, {"window": 5}, [once])
  back = curves.read(tmp_path)["runs"][0]
  assert back["losses"][:100] == [49.5] * 100 and len(back["losses"]) == 260
  assert curves.compact(back, 100)["losses"] == once["losses"]
  # a study reads the run alike from its full-resolution copy and from the published blocks
  rng = np.random.default_rng(0)
  fine = {**run, "status": "finished", "losses": list(np.round(2 + rng.random(260), 4))}
  curves.write(tmp_path / "fine.xz", {"window": 5}, [curves.compact(fine, 10)])
  published = curves.read(tmp_path / "fine.xz")["runs"][0]
  assert curves.at_blocks(fine, 10)["losses"] == published["losses"]
  assert curves.at_blocks(published, 10)["losses"] == published["losses"]
  # Merging such a file (``report --add``) stores its runs as the same blocks again, not per step.
  import lzma
  curves.write(tmp_path / "merged.xz", {"window": 5}, curves.merge([tmp_path / curves.FILE])["runs"])
  stored, = json.loads(lzma.decompress((tmp_path / "merged.xz").read_bytes()).partition(b"\n")[0])["runs"]
  assert stored["loss_every"] == 100 and stored["num_losses"] == 260 and "stored_every" not in stored
  assert curves.read(tmp_path / "merged.xz")["runs"][0]["losses"] == back["losses"]


def test_four_decimal_losses_go_to_the_binary_block_exactly_and_other_values_stay_json(tmp_path):
  import lzma

  rng = np.random.default_rng(3)
  decimal = [round(float(v), 4) for v in rng.uniform(0, 12, 2000)] + [None, float("inf"), 214748.3646]
  raw = rng.uniform(1, 3, 50).tolist()  # more than 4 decimals: kept as they are, in the JSON
  runs = [{"name": "a", "losses": decimal, "val_losses": [2.5]},
          {"name": "b", "losses": raw, "val_losses": [2.0]},
          {"name": "c", "losses": [1.5, -2.25, 300000.0], "val_losses": []}]  # 300000 overflows int32
  path = tmp_path / curves.FILE
  curves.write(path, {"window": 5}, runs)
  text, _, blob = lzma.decompress(path.read_bytes()).partition(b"\n")
  stored = json.loads(text)
  assert stored["loss_scale"] == 10**4
  stored_layout = stored["loss_layout"]
  stored = {r["name"]: r for r in stored["runs"]}
  assert stored["a"]["losses_int32"] == len(decimal) and "losses" not in stored["a"]
  assert stored["b"]["losses"] == raw and stored["c"]["losses"] == [1.5, -2.25, 300000.0]
  assert stored_layout == "byte-planes" and len(blob) == 4 * len(decimal)
  missing = np.iinfo(np.int32).min
  ints = np.array([missing if v in (None, float("inf")) else round(v * 10**4) for v in decimal],
                  "<i4").view(np.uint8)
  assert blob == b"".join(ints[k::4].tobytes() for k in range(4))  # lowest bytes first, then the next
  got = {r["name"]: r for r in curves.read(path)["runs"]}
  want = [float("inf") if v is None else v for v in decimal]
  assert got["a"]["losses"] == want  # exactly the same floats, not merely close
  assert got["b"]["losses"] == raw and got["c"]["losses"] == [1.5, -2.25, 300000.0]
  as_text = lzma.compress(json.dumps({"meta": {"window": 5}, "runs": runs[:1]}).encode(),
                          preset=9 | lzma.PRESET_EXTREME)
  curves.write(path, {"window": 5}, runs[:1])
  assert path.stat().st_size < 0.9 * len(as_text)  # the point of the binary block
  sequential = tmp_path / "sequential"  # a file written before the byte planes: int32 in sequence
  sequential.mkdir()
  text = json.dumps({"loss_scale": 10**4, "meta": {"window": 5},
                     "runs": [{"name": "a", "val_losses": [2.5], "losses_int32": len(decimal)}]})
  (sequential / curves.FILE).write_bytes(lzma.compress(text.encode() + b"\n" + ints.tobytes()))
  assert curves.read(sequential)["runs"][0]["losses"] == want


def test_a_file_of_five_decimal_integers_reads_exactly_and_merges_with_its_four_decimal_copy(tmp_path):
  """Files written before the 4-decimal rule (no ``loss_scale``: int32 multiples of 10^-5) read back
  as they were; a study merging such a file with the same run stored since rounds both alike."""
  import lzma

  five = [round(float(v), 5) for v in np.random.default_rng(4).uniform(1, 3, 500)]
  run = {"name": "a", "config": {}, "losses": five, "val_losses": [2.12345]}
  text = json.dumps({"meta": {"window": 5}, "runs": [{**{k: v for k, v in run.items() if k != "losses"},
                                                       "losses_int32": len(five)}]})
  old = tmp_path / "old"
  old.mkdir()
  ints = np.round(np.asarray(five) * 10**5).astype("<i4")
  (old / curves.FILE).write_bytes(lzma.compress(text.encode() + b"\n" + ints.tobytes()))
  assert curves.read(old)["runs"][0]["losses"] == five
  new = tmp_path / "new"
  new.mkdir()
  curves.write(new / curves.FILE, {"window": 5}, [{**run, "losses": [round(v, 4) for v in five]}])
  merged, = curves.merge([old, new])["runs"]
  assert merged["losses"] == [round(v, 4) for v in five] and merged["val_losses"] == [2.12345]
  # rounded twice (5, then 4 decimals) a loss may differ by one unit from one rounded once: the same run,
  # the first file's copy kept; two units apart is another run
  for shift, same in ((1e-4, True), (2e-4, False)):
    other = tmp_path / f"shift{shift}"
    other.mkdir()
    moved = [round(v, 4) for v in five]
    moved[3] = round(moved[3] + shift, 4)
    curves.write(other / curves.FILE, {"window": 5}, [{**run, "losses": moved}])
    if same:
      assert curves.merge([new, other])["runs"][0]["losses"] == [round(v, 4) for v in five]
    else:
      with pytest.raises(ValueError, match="differs between the files"):
        curves.merge([new, other])


def test_a_runs_model_revision_is_recorded_and_a_mix_of_revisions_is_said():
  result = {**_result([2.0, 1.5]), "identity": {"model_revision": 2}}
  assert curves.record("main", result)["model_revision"] == 2
  assert "model_revision" not in curves.record("main", _result([2.0, 1.5]))  # not recorded: absent
  same = [{"model_revision": 2}, {"model_revision": 2}]
  assert curves.revision_lines(same) == []
  line, = curves.revision_lines(same + [{"model_revision": 1}, {}])
  assert line.startswith("- **runs of more than one model revision**")
  assert "revision 1 (1 runs), revision 2 (2 runs), unrecorded (1 runs)" in line


def test_a_run_listed_by_the_main_study_and_an_ablation_keeps_both_records_through_a_merge(tmp_path):
  """An ablation lists main runs again (the taxonomy's rotation is the main study's): the sweep writes
  one record per group, and merging (``--block``, ``--add``) keeps each group's record."""
  x = [round(float(v), 4) for v in np.random.default_rng(5).uniform(1, 3, 300)]
  runs = [curves.record(group, _result(x, name="rotation_P16_s0")) for group in ("main", "variants")]
  runs.append(curves.record("main", _result(x[::-1], name="pipedream_P16_s0")))
  curves.write(tmp_path / curves.FILE, {"window": 5}, runs)
  merged = curves.merge([tmp_path, tmp_path], block=10)["runs"]
  assert sorted((r["group"], r["name"]) for r in merged) == [
      ("main", "pipedream_P16_s0"), ("main", "rotation_P16_s0"), ("variants", "rotation_P16_s0")]


def test_a_run_another_study_publishes_is_stored_as_a_link_and_read_back_from_there(tmp_path):
  rng = np.random.default_rng(3)
  shared, own = (curves.record("main", _result(rng.uniform(1, 3, 50).tolist(), name)) for name in "so")
  other = dict(curves.record("main", _result(rng.uniform(1, 3, 50).tolist(), "t")), seconds=9.0)
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  curves.write(tmp_path / "a" / curves.FILE, {"window": 5}, [shared, dict(other, seconds=1.0)])
  # the same run under another group is linked; one differing in its timing alone is copied
  runs = [own, dict(shared, group="variants"), other]
  curves.write(tmp_path / "b" / curves.FILE, {"window": 5}, runs, link=[tmp_path / "a"])
  plain = curves.read(tmp_path / "a")  # (the link's target, read alone)
  assert "linked" not in plain["meta"]
  back = curves.read(tmp_path / "b")
  assert back["meta"]["linked"] == {"../a": [["variants", "s"]]}
  assert [(r["group"], r["name"], r["seconds"]) for r in back["runs"]] == [
    ("main", "o", 1.0), ("main", "t", 9.0), ("variants", "s", 1.0)]
  assert back["runs"][2]["losses"] == plain["runs"][0]["losses"]
  # a rewrite of what it read (a rebuild without --link) copies every run and links none
  curves.write(tmp_path / "c.json.xz", back["meta"], back["runs"])
  again = curves.read(tmp_path / "c.json.xz")
  assert "linked" not in again["meta"] and len(again["runs"]) == 3
  with pytest.raises(ValueError, match="is the folder being written"):
    curves.write(tmp_path / "b" / curves.FILE, {"window": 5}, runs, link=[tmp_path / "b"])
  # the target losing the run is one clear error naming it
  curves.write(tmp_path / "a" / curves.FILE, {"window": 5}, [other])
  with pytest.raises(ValueError, match="links 1 runs that '../a' does not hold \\(first 's'\\)"):
    curves.read(tmp_path / "b")


def test_a_run_recorded_now_and_one_recorded_before_the_optimizer_value_share_a_setting():
  """A config recorded today holds the whole optimizer value; one recorded before holds its method and
  settings only, and older ones miss the options added since: a study that pairs them by setting
  (``curves.setting``: the rerun study, the remedies study) sees one setting, and another optimizer
  value or another run setting is another setting."""
  from experiments.harness.config import RunConfig, record
  from experiments.harness.methods import spec

  now = record(RunConfig(optimizer=spec("rotation", shampoo_beta=0.95), stages=16))
  before = {k: v for k, v in now.items() if k not in ("optimizer", "sampling", "diagnose_steps")}
  assert "optimizer" in now and curves.setting(now, ()) == curves.setting(before, ())
  other = record(RunConfig(optimizer=spec("rotation", shampoo_beta=0.9), stages=16))
  assert curves.setting(other, ()) != curves.setting(now, ())
  assert curves.setting(other, ("shampoo_beta",)) == curves.setting(now, ("shampoo_beta",))
  assert curves.setting(record(RunConfig(optimizer=spec("muon"), stages=16)), ()) != curves.setting(now, ())


@pytest.mark.parametrize("width", [None, 64, 128])
def test_the_regime_counts_the_models_parameters_and_the_passes_over_the_corpus(width):
  """cpu-deep at its width (32) or another, counted by hand: per block four W x W attention kernels
  and two W x 4W MLP kernels with their biases and two LayerNorms; token and position embeddings, a
  final LayerNorm and the output layer with its bias (220,992 at width 32, as the studies quote)."""
  from experiments.harness.config import RunConfig, record
  from experiments.harness.methods import spec

  config = record(RunConfig(optimizer=spec("rotation"), model="cpu-deep", width=width, steps=1000))
  got = curves.regime({"setting": ["data: `x`, 100000 tokens, vocabulary 256, sha256 `0`"]}, config)
  w, vocab, context, blocks = width or 32, 256, 32, 16
  block = 4 * (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w) + 2 * 2 * w
  by_hand = blocks * block + vocab * w + context * w + 2 * w + w * vocab + vocab
  if width is None:
    assert by_hand == 220_992
  assert got == {"parameters": by_hand, "tokens_per_step": config["batch_size"] * context,
                 "training_tokens": 90000, "passes": round(1000 * config["batch_size"] * context / 90000, 2)}
  assert curves.regime({"setting": []}, config) is None
