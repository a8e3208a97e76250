"""Every method's per-stage optimizers (experiments/harness/methods.py), checked by their behaviour."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.harness import methods
from experiments.harness import model as model_lib
from experiments.harness.methods import spec
from experiments.harness.optimizers import SETTINGS, describe
from experiments.harness.runs import RunConfig

P = 4


def _split(kw) -> tuple:
  """``kw`` as (run settings, the other RunConfig fields)."""
  return {k: v for k, v in kw.items() if k in SETTINGS}, {k: v for k, v in kw.items() if k not in SETTINGS}


def _first_update(method, k, kernel=None, **kw):
  settings, fields = _split(kw)
  config = RunConfig(optimizer=spec(method, **settings), stages=P, steps=100, lr=1e-2, warmup_steps=0,
                     **fields)
  opt = methods.run_optimizers(config)[k]
  params = {"mlp": {"kernel": jnp.zeros((4, 3))}, "b": jnp.zeros(3)}
  kernel = jnp.full((4, 3), 0.01).at[0, 0].set(0.02) if kernel is None else kernel
  grads = {"mlp": {"kernel": kernel}, "b": jnp.full(3, 0.01)}
  state = opt.init(params)
  updates, state = opt.update(grads, state, params)
  return updates, state


def test_rotation_lr_scales_each_stage_by_pipemare():
  # At step 1 PipeMare's rate is lr / tau_k (tau_k >= 1): stage 0 (tau 3) moves 1/3 of stage 3 (tau 0).
  u0, _ = _first_update("rotation-lr", 0)
  u3, _ = _first_update("rotation-lr", P - 1)
  plain, _ = _first_update("rotation", 0)
  np.testing.assert_allclose(np.asarray(u0["b"]) * 3, np.asarray(u3["b"]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(u3["b"]), np.asarray(plain["b"]), rtol=1e-6)


def test_nesterov_stage_momentum_grows_with_the_delay():
  def b1(k):  # after one step from zero the first moment is (1 - b1) g
    _, state = _first_update("nesterov-stage", k)
    mu = [x for x in jax.tree.leaves(state) if getattr(x, "shape", None) == (3,)][0]
    return 1 - float(mu[0]) / 0.01
  expected = [0.9 + (P - 1 - k) * (0.99 - 0.9) / P for k in range(P)]
  np.testing.assert_allclose([b1(k) for k in range(P)], expected, rtol=1e-4)


def test_random_bases_differ_by_stage_and_seed_and_freeze_is_set():
  def left(k, seed):
    _, state = _first_update("rotation-random", k, seed=seed)
    groups = [x for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "left")) if hasattr(x, "left")]
    return np.asarray(groups[0].left[0])
  a, b, c = left(0, 0), left(1, 0), left(0, 1)
  np.testing.assert_allclose(a.T @ a, np.eye(4), atol=1e-5)
  assert not np.allclose(a, b) and not np.allclose(a, c)
  np.testing.assert_array_equal(a, left(0, 0))
  assert dataclasses.asdict(methods.check_method("rotation-frozen"))["freeze_after"] == 100


def test_muon_orthogonalizes_the_rotated_kernels_and_runs_adamw_elsewhere():
  u, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(4, 3)))
  grad = u @ np.diag([1.0, 0.1, 0.01]) * 0.01  # singular values spread 100x
  updates, _ = _first_update("muon", 0, kernel=jnp.asarray(grad, jnp.float32))
  b = np.asarray(updates["b"])  # Adam's first step: -lr * sign(g) (times a bias-correction factor)
  assert np.all(b < 0) and np.ptp(b) == 0
  s = np.linalg.svd(np.asarray(updates["mlp"]["kernel"]), compute_uv=False)
  assert s.min() / s.max() > 0.3  # Newton-Schulz evens out the singular values (0.01 in the gradient)


def test_b1_sets_every_methods_momentum_and_none_keeps_its_own():
  def b1(method, **kw):  # after one step from zero the first moment of the bias "b" is (1 - b1) g
    _, state = _first_update(method, 0, **kw)
    mu = [x for x in jax.tree.leaves(state) if getattr(x, "shape", None) == (3,)][0]
    return 1 - float(mu[0]) / 0.01
  for method, own in (("pipedream", 0.9), ("nesterov", 0.99), ("rotation", 0.9), ("muon", 0.9)):
    np.testing.assert_allclose(b1(method), own, rtol=1e-4, err_msg=method)
    np.testing.assert_allclose(b1(method, b1=0.5), 0.5, rtol=1e-4, err_msg=method)
  base, momentum = RunConfig(), RunConfig(optimizer=spec("pipedream", b1=0.95))
  assert momentum.name == base.name.replace("cpu-deep_", "cpu-deep-b1_0.95_")


def test_shampoo_beta_sets_the_decay_of_rotations_statistics_only():
  def stat(method="rotation", **kw):  # after one step from zero the left statistic is (1 - beta) G G^T
    _, state = _first_update(method, 0, **kw)
    groups = [x for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "stat_left"))
              if hasattr(x, "stat_left")]
    return np.asarray(groups[0].stat_left[0])
  g = np.full((4, 3), 0.01)
  g[0, 0] = 0.02
  np.testing.assert_allclose(stat(), (1 - 0.999) * g @ g.T, rtol=1e-4)  # None: follows b2
  np.testing.assert_allclose(stat(shampoo_beta=0.9), (1 - 0.9) * g @ g.T, rtol=1e-4)
  np.testing.assert_allclose(stat("rotation-fast"), (1 - 0.95) * g @ g.T, rtol=1e-4)  # its own decay
  np.testing.assert_allclose(stat("rotation-fast", shampoo_beta=0.9), (1 - 0.9) * g @ g.T, rtol=1e-4)
  with pytest.raises(ValueError, match="method 'pipedream' has none"):
    RunConfig(optimizer=spec("pipedream", shampoo_beta=0.9)).validate()
  with pytest.raises(ValueError, match="shampoo_beta must be in"):
    RunConfig(optimizer=spec("rotation", shampoo_beta=1.0)).validate()


def test_the_study_rotation_keeps_its_numbers_through_the_library_rewrite():
  """The same leaves rotated, the same update, as at commit bbcc4f9 (before rotation's dimension
  numbers, blocks and parameter-shaped state): four steps of the study's optimizer on the study's
  Transformer, against the parameters that commit computed (tests/study_case.py), per leaf as the
  relative error of its whole update. The MLP kernels' long side has rank-deficient statistics at
  the cold start, whose null-space basis is round-off, so another CPU's kernels move those leaves'
  updates by 1.2e-3 (an AMD EPYC against the Intel Xeon the file was written on; 3.7e-4 in absolute
  terms); plain Adam in place of the rotation misses by far more, which the test checks too."""
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).parent))
  from study_case import study_case

  from experiments.harness import model as model_lib
  old = np.load(pathlib.Path(__file__).parent / "data" / "study_rotation_bbcc4f9.npz")
  cfg = model_lib.ModelConfig(num_blocks=2, width=32, num_heads=2, context=8, vocab_size=48, mlp_ratio=4)
  _, start = model_lib.init(cfg, seed=0)
  start = {jax.tree_util.keystr(p): np.asarray(x, np.float32)
           for p, x in jax.tree_util.tree_leaves_with_path(start)}

  def errors(new):
    assert sorted(old.files) == sorted(new)
    return {k: np.linalg.norm(new[k] - old[k]) / np.linalg.norm(old[k] - start[k])
            for k in new if np.linalg.norm(old[k] - start[k]) > 0}

  got = errors(study_case())
  assert max(got.values()) < 1e-2, max(got.items(), key=lambda kv: kv[1])
  adam = errors(study_case("pipedream"))
  rotated = [k for k in adam if "kernel" in k and "blocks" in k]
  assert rotated and min(adam[k] for k in rotated) > 0.1  # a leaf updated otherwise misses by > 10%


def test_rotation_stage_decay_gives_each_stage_the_memory_of_its_delay():
  def stat(method, k, **kw):  # after one step from zero the left statistic is (1 - beta) G G^T
    _, state = _first_update(method, k, **kw)
    groups = [x for x in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "stat_left"))
              if hasattr(x, "stat_left")]
    return np.asarray(groups[0].stat_left[0])
  g = np.full((4, 3), 0.01)
  g[0, 0] = 0.02
  for k, tau in enumerate((3, 2, 1, 0)):  # P = 4 under 1F1B: stage k lags P - 1 - k
    beta = 1 - (1 + tau) / 1000  # base memory 1,000 steps (b2 = 0.999) over 1 + tau
    np.testing.assert_allclose(stat("rotation-stage-decay", k), (1 - beta) * g @ g.T, rtol=1e-4)
  # from the run's shampoo_beta 0.95 as the base: memory 20 / (1 + 3) = 5 steps, floored at 10 (0.9)
  np.testing.assert_allclose(stat("rotation-stage-decay", 0, shampoo_beta=0.95), (1 - 0.9) * g @ g.T,
                             rtol=1e-4)


def test_remedy_methods_are_listed_refused_where_they_cannot_run_and_named_by_their_setting():
  for base in methods.REMEDY_BASES:
    for remedy in methods.REMEDIES:
      m = methods.check_method(f"{base}+{remedy}")
      assert m.remedy == remedy and describe(m.optimizer) == describe(m.base) == methods.definition(base)
  ok = RunConfig(optimizer=spec("pipedream+predict", predict_scale=0.5), stages=P)
  ok.validate()
  # a remedy's strength is in every name, its default too (every published remedy run gave it)
  assert "-ps0.5_" in ok.name and "-ps1_" in RunConfig(optimizer=spec("pipedream+predict"), stages=P).name
  bad = [("pipedream+predict", dict(execution="devices"), "emulated pipeline only"),
         ("muon+dc", dict(mode="stale_gradients"), "cannot mean mode 'stale_gradients'"),
         ("rotation+predict", dict(mode="no_stashing"), "cannot mean mode 'no_stashing'"),
         ("pipedream", dict(predict_scale=1.0), r"predict_scale=1.0 needs a '\+predict' method"),
         ("pipedream+dc", dict(dc_lambda=-1.0), r"dc_lambda=-1.0 needs .* finite value >= 0"),
         ("pipedream+dc", dict(predict_scale=1.0), r"predict_scale=1.0 needs a '\+predict'")]
  for method, kw, match in bad:
    settings, fields = _split(kw)
    with pytest.raises(ValueError, match=match):
      RunConfig(optimizer=spec(method, **settings), stages=P, **fields).validate()


def test_remedy_methods_wire_the_pipelines_prediction_and_wrap_each_stage_in_dc_asgd():
  import pipeline_sim as ps
  from experiments.harness import runs

  def pipe(method, **settings):
    config = RunConfig(optimizer=spec(method, **settings), stages=P, model="cpu-tiny")
    cfg = config.model_config(256)
    graphdef, params = model_lib.init(cfg, seed=0)
    return runs.pipeline_of(config, cfg, graphdef, params), params

  assert pipe("pipedream")[0].predict is None
  assert pipe("rotation+predict")[0].predict == (methods.PREDICT_SCALE,) * P
  assert pipe("muon+predict", predict_scale=0.25)[0].predict == (0.25,) * P
  p, params = pipe("pipedream+dc", dc_lambda=0.5)
  kinds = {type(x).__name__ for s in jax.eval_shape(lambda: p.init(params)).opt_states
           for x in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, ps.DelayCompensationState))}
  assert kinds == {"DelayCompensationState"}  # every stage's optimizer is wrapped
  # lambda reaches the wrapper: 0.5 + 50 * 0.25 * (1 - 2) < 0 turns the step around
  config = RunConfig(optimizer=spec("pipedream+dc"), stages=P, steps=100, lr=1e-2, warmup_steps=0)
  w = {"k": jnp.ones((3, 3))}
  g = {"k": jnp.full((3, 3), 0.5)}
  def update(lam):
    dc = dataclasses.replace(config, optimizer=spec("pipedream+dc", dc_lambda=lam))
    opt = methods.run_optimizers(dc)[0]
    return opt.update(g, opt.init(w), w, stale_params={"k": jnp.full((3, 3), 2.0)})[0]["k"]
  assert np.all(np.sign(update(0.0)) == -np.sign(update(50.0)))  # Adam's first step: the sign flips


def test_a_remedys_p1_reference_is_its_optimizers_run_in_the_plan_and_the_report():
  from experiments.report import tables
  from experiments.sweep import command as sweep

  names = ("rotation+dc", "muon+predict", "pipedream-lr", "rotation-stage-decay", "rotation-fast")
  assert [methods.reference(m) for m in names] == [
      "rotation", "muon", "pipedream-lr", "rotation", "rotation-fast"]
  plan = sweep.make_plan(sweep.parse_args(["--preset", "smoke", "--methods", "pipedream", "pipedream+dc",
                                           "rotation+predict", "--stages", "4", "--seeds", "0"]))
  assert sorted((c.method, c.stages) for c in plan.main) == [  # pipedream's P = 1 run planned once
      ("pipedream", 1), ("pipedream", 4), ("pipedream+dc", 4), ("rotation", 1), ("rotation+predict", 4)]
  run = lambda m, p, v: {"config": {"method": m, "stages": p, "seed": 0}, "status": "finished",
                         "losses": [v, v]}
  groups = tables.curves_by([run("muon", 1, 1.0), run("muon+dc", 4, 2.0), run("rotation+dc", 4, 3.0)])
  np.testing.assert_array_equal(groups[("muon+dc", 1)][0], [1.0, 1.0])
  assert ("rotation+dc", 1) not in groups  # no optimizer's run to stand in: left missing, not invented


def test_rotation_stage_decays_p1_run_is_rotations_in_the_plan_and_in_its_updates():
  from experiments.sweep import command as sweep

  args = ["--preset", "smoke", "--methods", "rotation", "rotation-stage-decay", "--stages", "4",
          "--seeds", "0"]
  plan = sweep.make_plan(sweep.parse_args(args))
  assert sorted((c.method, c.stages) for c in plan.main) == [
      ("rotation", 1), ("rotation", 4), ("rotation-stage-decay", 4)]
  # at its own rate it trains its own P = 1 run: rotation's would not stand for it
  plan = sweep.make_plan(sweep.parse_args(args + ["--lr", "rotation-stage-decay=1e-3"]))
  assert ("rotation-stage-decay", 1) in {(c.method, c.stages) for c in plan.main}
  # the two optimizers at P = 1 take the same steps, bit for bit
  w = {"k": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
  updates = {}
  for m in ("rotation", "rotation-stage-decay"):
    config = RunConfig(optimizer=spec(m), stages=1, steps=100, lr=1e-2, warmup_steps=0)
    opt = methods.run_optimizers(config)[0]
    state, got = opt.init(w), []
    for i in range(12):  # past the first refreshes
      g = {"k": jnp.sin(w["k"] * (i + 1))}
      u, state = opt.update(g, state, w)
      got.append(np.asarray(u["k"]))
    updates[m] = got
  np.testing.assert_array_equal(updates["rotation"], updates["rotation-stage-decay"])
