"""rotation.transform against an independent float64 NumPy transcription of docs/algorithms.md section 2."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from rotation_reference import B1, B2, EPS, LR, WD, gradient_sequence, reference, run, run_tree

import rotation


@pytest.mark.parametrize("source,geometry,shape,step", [
    (source, geometry, shape, "paper") for source in ("second", "first")
    for geometry, shape in (("bilateral", (6, 10)), ("unilateral", (6, 10)), ("unilateral", (10, 6)))
] + [("first", "unilateral", shape, "power") for shape in ((6, 10), (10, 6))])
def test_matches_numpy_reference(source, geometry, shape, step):
  grads = gradient_sequence(shape, 30, seed=hash((source, geometry, shape)) % 2**32)
  w0 = np.random.default_rng(1).normal(size=shape)
  period = 5  # refreshes at t = 1, 5, 10, ..., 30: one cold start and six warm ones
  ours, _ = run(rotation.basis_rotation(LR, weight_decay=WD, source=source, geometry=geometry,
                                        refresh_every=period, first_order_step=step), w0, grads)
  ref = reference(w0, grads, source=source, geometry=geometry, period=period, first_order_step=step)
  np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)
  # The rotation is doing something: plain AdamW differs.
  adamw, _ = run(optax.adamw(LR, B1, B2, EPS, weight_decay=WD), w0, grads)
  assert np.abs(adamw - ref).max() > 1e-3


@pytest.mark.parametrize("source,geometry,shape", [
    ("second", "bilateral", (6, 10)), ("second", "unilateral", (10, 6)), ("first", "bilateral", (10, 6)),
    ("first", "unilateral", (6, 10))])
def test_rotated_second_moments_match_the_reference(source, geometry, shape):
  grads = gradient_sequence(shape, 30, seed=7)
  w0 = np.random.default_rng(2).normal(size=shape)
  tx = rotation.basis_rotation(LR, weight_decay=WD, source=source, geometry=geometry, refresh_every=5,
                               second_moments="rotate")
  ref = reference(w0, grads, source=source, geometry=geometry, period=5, second_moments="rotate")
  np.testing.assert_allclose(run(tx, w0, grads)[0], ref, atol=2e-5, rtol=1e-4)
  permuted = reference(w0, grads, source=source, geometry=geometry, period=5)
  assert np.abs(permuted - ref).max() > 1e-4  # the two rules are different algorithms


def test_rotated_second_moments_keep_the_step_after_an_early_refresh_small():
  # The refresh spike: one exact SVD step leaves nu on the singular values' diagonal; a refresh at
  # step 2 re-expresses the first moment densely and, permuted, nu stays near zero elsewhere.
  rng = np.random.default_rng(3)
  grads = [rng.normal(size=(8, 8)) for _ in range(2)]
  step2 = {}
  for rule in rotation.SECOND_MOMENT_RULES:
    tx = rotation.basis_rotation(1.0, weight_decay=0.0, refresh_every=2, second_moments=rule)
    params = {"w": jnp.zeros((8, 8))}
    state = tx.init(params)
    for g in grads:
      u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
    step2[rule] = float(jnp.max(jnp.abs(u["w"])))
  assert step2["permute"] > 10 and step2["rotate"] < 3, step2  # times the learning rate (1.0)


@pytest.mark.parametrize("source,geometry,shape,step,batch", [
    ("second", "bilateral", (6, 10), "paper", True), ("second", "unilateral", (10, 6), "paper", False),
    ("first", "bilateral", (10, 6), "paper", False), ("first", "unilateral", (6, 10), "paper", True),
    ("first", "unilateral", (10, 6), "power", False)])
def test_cholesky_qr_and_batched_refresh_match_the_qr_reference(source, geometry, shape, step, batch):
  # Cholesky-QR's bases differ from Householder QR's in column signs only; the rotation's update does
  # not depend on them (moments are re-expressed exactly), so the float64 QR reference still holds.
  grads = gradient_sequence(shape, 30, seed=hash((source, geometry, shape, 1)) % 2**32)
  w0 = np.random.default_rng(1).normal(size=shape)
  opt = rotation.basis_rotation(LR, weight_decay=WD, source=source, geometry=geometry, refresh_every=5,
                                first_order_step=step, orthonormalization="cholesky_qr",
                                batch_refresh=batch)
  ours, _ = run(opt, w0, grads)
  ref = reference(w0, grads, source=source, geometry=geometry, period=5, first_order_step=step)
  np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("source", ["second", "first"])
@pytest.mark.parametrize("geometry", ["bilateral", "unilateral"])
def test_exact_first_step_on_square_matrices(source, geometry):
  """A non-zero first gradient, eps = 1e-8, square 16 x 16: the float32 transform follows the
  float64 algorithm over 20 steps with refreshes (float32 U^T G V at step 1 would not: its
  off-diagonal round-off divided by sqrt(nu) + eps makes O(1) update entries)."""
  shape = (16, 16)
  grads = gradient_sequence(shape, 20, seed=7, zero_first=False)
  w0 = np.random.default_rng(2).normal(size=shape)
  tx = rotation.basis_rotation(LR, weight_decay=WD, source=source, geometry=geometry, refresh_every=5)
  ours, _ = run(tx, w0, grads)
  ref = reference(w0, grads, source=source, geometry=geometry, period=5)
  np.testing.assert_allclose(ours[0], ref[0], atol=1e-6)  # step 1 exactly the algorithm's
  np.testing.assert_allclose(ours, ref, atol=5e-5, rtol=1e-4)
  # Step 1 of the exact algorithm moves every entry by lr * (wd * w + sign-like term): bilateral
  # only the diagonal of U^T (.) V is non-zero, so the update is U diag(+-1) V^T.
  if geometry == "bilateral":
    step = (w0 * (1 - LR * WD) - ref[0]) / LR
    assert np.linalg.matrix_rank(step, tol=1e-6) == 16


@pytest.mark.parametrize("plain,inner", [
    (optax.adam(LR, eps=1e-3), optax.scale_by_adam(eps=1e-3)),
    (optax.amsgrad(LR, eps=1e-3), optax.scale_by_amsgrad(eps=1e-3)),  # nu_max follows the basis
    (optax.sgd(LR, momentum=0.9), optax.trace(0.9)),  # trace is re-expressed like mu
], ids=["adam", "amsgrad", "trace"])
def test_signed_permutation_basis_equals_adam(plain, inner):
  """Gradients with one non-zero per row and column have diagonal G G^T and G^T G, so every basis
  is a signed permutation of the axes: rotation with optax's Adam inside must equal optax.adam.
  (eps = 1e-3: coordinates whose gradient is always zero hold float32 round-off of ~1e-9 in the
  rotated moments, which eps = 1e-8 would blow up to O(1).)"""
  rng = np.random.default_rng(0)
  grads = [np.zeros((4, 6))]
  for _ in range(25):
    g = np.zeros((4, 6))
    g[np.arange(4), np.arange(4)] = rng.normal(size=4) * np.array([3.0, 1.0, 0.3, 2.0])
    grads.append(g)
  w0 = rng.normal(size=(4, 6))
  adam, _ = run(plain, w0, grads)
  rotated, state = run(optax.chain(
      rotation.scale_by_basis_rotation(inner, refresh_every=3),
      optax.scale(-LR)), w0, grads)
  np.testing.assert_allclose(rotated, adam, atol=5e-5, rtol=1e-4)
  q = np.asarray(rotation.leaf_bases(state[0], {"w": w0})["w"][0])
  assert not np.allclose(q, np.eye(4))  # the basis really moved (sorted by eigenvalue)
  np.testing.assert_allclose(np.abs(q).sum(0), 1.0, atol=1e-6)
  unrotated, _ = run(optax.chain(
      rotation.scale_by_basis_rotation(inner, max_precond_dim=0),
      optax.scale(-LR)), w0, grads)
  np.testing.assert_allclose(unrotated, adam, atol=1e-6)


def _momentum_only():
  """An inner transformation whose update is its first moment ``mu`` alone."""

  def init(params):
    z = jax.tree.map(jnp.zeros_like, params)
    return optax.ScaleByAdamState(jnp.zeros([], jnp.int32), z, z)

  def update(g, state, params=None):
    mu = jax.tree.map(lambda m, x: 0.9 * m + 0.1 * x, state.mu, g)
    return mu, state._replace(mu=mu)

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("source", ["second", "first"])
def test_first_moment_is_exact_across_basis_changes(source):
  """Refreshing every step (arbitrary QR signs, reorderings): U M~ V^T must stay the plain EMA."""
  grads = gradient_sequence((5, 7), 12, seed=3)
  tx = rotation.scale_by_basis_rotation(_momentum_only(), source=source, refresh_every=1, b1=0.9)
  state = tx.init({"w": jnp.zeros((5, 7))})
  update = jax.jit(tx.update)
  ema = np.zeros((5, 7))
  for g in grads:
    u, state = update({"w": jnp.asarray(g, jnp.float32)}, state)
    ema = 0.9 * ema + 0.1 * g
    np.testing.assert_allclose(u["w"], ema, atol=1e-5)


def test_warm_refresh_matches_eigh_of_statistic_after_cold_start():
  grads = gradient_sequence((6, 4), 3, seed=5)[1:]
  tx = rotation.scale_by_basis_rotation()
  state = tx.init({"w": jnp.zeros((6, 4))})
  _, state = tx.update({"w": jnp.asarray(grads[0], jnp.float32)}, state)
  g = grads[0]
  vals, vecs = np.linalg.eigh((1 - B2) * g.T @ g)
  q = np.asarray(rotation.leaf_bases(state, {"w": 0})["w"][1])
  np.testing.assert_allclose(np.abs(q.T @ vecs[:, ::-1]), np.eye(4), atol=1e-4)


def test_per_leaf_periods_are_respected():
  params = {"a": jnp.zeros((3, 4)), "b": jnp.zeros((4, 3))}
  tx = rotation.scale_by_basis_rotation(refresh_every={"a": 2, "b": 3})
  state = tx.init(params)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(0)
  changed = {"a": [], "b": []}
  for t in range(1, 10):
    g = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
    _, new = update(g, state)
    old_bases, new_bases = rotation.leaf_bases(state, params), rotation.leaf_bases(new, params)
    for k in params:
      if not np.array_equal(new_bases[k][0], old_bases[k][0]):
        changed[k].append(t)
    state = new
  assert changed == {"a": [1, 2, 4, 6, 8], "b": [1, 3, 6, 9]}


def test_leaf_rules_and_dtypes():
  params = {"scalar": jnp.zeros(()), "bias": jnp.zeros(5), "mat": jnp.zeros((3, 8)),
            "big": jnp.zeros((2, 40)), "conv": jnp.zeros((2, 3, 4), jnp.bfloat16),
            "masked": jnp.zeros((3, 3))}
  dims = {"scalar": None, "bias": None, "mat": rotation.LINEAR, "big": rotation.LINEAR,
          "conv": rotation.RotationDimensionNumbers((0, 1), 2), "masked": None}
  tx = rotation.scale_by_basis_rotation(geometry="unilateral", max_precond_dim=16,
                                        weight_dimension_numbers=dims)
  state = tx.init(params)
  bases = rotation.leaf_bases(state, params)
  shape = lambda q: None if q is None else q.shape
  shapes = {k: None if v is None else (shape(v[0]), shape(v[1])) for k, v in bases.items()}
  assert shapes == {"scalar": None, "bias": None, "mat": ((3, 3), None), "big": ((2, 2), None),
                    "conv": (None, (4, 4)), "masked": None}  # (2,3,4) is the matrix (6, 4)
  grads = jax.tree.map(lambda x: jnp.ones_like(x), params)
  updates, state = jax.jit(tx.update)(grads, state)
  assert updates["conv"].dtype == jnp.bfloat16 and updates["mat"].dtype == jnp.float32
  pieces = [p for v in state.bases.values() if v is not None for p in v]
  assert all(p.stat_right.dtype == jnp.float32 for p in pieces if p.stat_right is not None)
  assert all(bool(jnp.all(jnp.isfinite(u.astype(jnp.float32)))) for u in jax.tree.leaves(updates))


def test_nonfinite_gradients():
  params = {"w": jnp.zeros((4, 5))}
  grads = [jnp.asarray(g, jnp.float32) for g in gradient_sequence((4, 5), 6, seed=2)]
  bad = jnp.full((4, 5), jnp.nan)
  # Wrapped in apply_if_finite: the bad step is skipped and the state is untouched.
  tx = optax.apply_if_finite(rotation.basis_rotation(LR, weight_decay=WD, refresh_every=2),
                             max_consecutive_errors=5)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads[:3]:
    _, state = update({"w": g}, state, params)
  u, after = update({"w": bad}, state, params)
  assert int(after.notfinite_count) == 1 and float(jnp.abs(u["w"]).max()) == 0.0
  jax.tree.map(np.testing.assert_array_equal, after.inner_state, state.inner_state)
  # Unwrapped, a NaN gradient at a refresh step does not install a NaN basis.
  raw = rotation.scale_by_basis_rotation(refresh_every=2)
  state = raw.init(params)
  _, state = raw.update({"w": grads[1]}, state)
  before = np.asarray(state.bases["w"][0].left)
  _, state = raw.update({"w": bad}, state)  # t = 2: a warm refresh
  np.testing.assert_array_equal(state.bases["w"][0].left, before)


_NONFINITE_FIRST_STEP = """
import jax, jax.numpy as jnp, numpy as np, optax, rotation
params = {"w": jnp.ones((8, 4)) * 0.1, "b": jnp.zeros(4)}
for source in rotation.SOURCES:
  for bad in (np.inf, -np.inf, np.nan):
    g = {"w": jnp.full((8, 4), 0.01).at[0, 0].set(bad), "b": jnp.zeros(4)}
    raw = rotation.scale_by_basis_rotation(source=source)
    _, state = jax.jit(raw.update)(g, raw.init(params))
    # the bases stay the initial identity: no non-finite value was installed
    for (piece,) in (state.bases["w"],):
      for q in (piece.left, piece.right):
        np.testing.assert_array_equal(q, np.broadcast_to(np.eye(q.shape[-1]), q.shape))
    tx = optax.apply_if_finite(rotation.basis_rotation(1e-3, source=source), 3)
    init = tx.init(params)
    u, after = jax.jit(tx.update)(g, init, params)
    assert int(after.notfinite_count) == 1 and float(jnp.abs(u["w"]).max()) == 0.0
    jax.tree.map(np.testing.assert_array_equal, after.inner_state, init.inner_state)
print("returned")
"""


def test_a_nonfinite_first_gradient_never_hangs():
  """An inf (or NaN) in the very first gradient: LAPACK's SVD loops for ever on inf mixed with
  finite values, so it must never see one. In a subprocess with a time limit (a hang in LAPACK
  cannot be interrupted in-process)."""
  out = subprocess.run([sys.executable, "-c", _NONFINITE_FIRST_STEP], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0 and "returned" in out.stdout, out.stderr[-2000:]


def _noisy_rotated_quadratic(a, b, curv, target):
  """``0.5 sum curv * (A^T W B - target - noise)^2``, noise N(0, 0.3^2) drawn in the eigenbasis."""

  def loss(w, noise):
    z = a.T @ w @ b - target - noise
    return 0.5 * jnp.sum(curv * z * z)

  def make_step(tx):
    @jax.jit
    def step(w, state, key):
      noise = 0.3 * jax.random.normal(key, target.shape)
      u, state = tx.update(jax.grad(loss)(w, noise), state, w)
      return optax.apply_updates(w, u), state, loss(w, 0.0)
    return step

  return make_step


def test_rotation_beats_adam_on_rotated_ill_conditioned_quadratic():
  rng = np.random.default_rng(0)
  a = np.linalg.qr(rng.normal(size=(8, 8)))[0]
  b = np.linalg.qr(rng.normal(size=(6, 6)))[0]
  curv = np.outer(np.logspace(0, 2, 8), np.logspace(0, 1, 6))  # Kronecker-factored spectrum
  make_step = _noisy_rotated_quadratic(a, b, curv, rng.normal(size=(8, 6)))

  def steps_to_1_percent(tx, limit=400):
    step, w = make_step(tx), jnp.zeros((8, 6))
    state, first = tx.init(w), None
    for i in range(limit):
      w, state, l = step(w, state, jax.random.PRNGKey(i))
      first = float(l) if first is None else first
      if float(l) < 0.01 * first:
        return i
    return limit

  adam = steps_to_1_percent(optax.adam(0.1))
  rot = steps_to_1_percent(rotation.basis_rotation(0.1, weight_decay=0.0, refresh_every=5))
  assert rot < 0.6 * adam, (rot, adam)


def test_equivariance_under_orthogonal_reparametrisation():
  """f(W) = h(A^T W B) with a separable h: the rotated optimizer's loss curve hardly depends on the
  orthogonal A, B (it is equivariant up to float32 round-off); Adam's does."""
  rng = np.random.default_rng(1)
  curv = np.outer(np.logspace(0, 1, 6), np.logspace(0, 0.5, 6))
  target, z0 = rng.normal(size=(6, 6)), rng.normal(size=(6, 6))

  def curve(tx, a, b, steps=60):
    step = _noisy_rotated_quadratic(a, b, curv, target)(tx)
    w = jnp.asarray(a @ z0 @ b.T, jnp.float32)
    state, out = tx.init(w), []
    for i in range(steps):
      w, state, l = step(w, state, jax.random.PRNGKey(i))
      out.append(float(l))
    return np.array(out)

  eye = np.eye(6)
  a = np.linalg.qr(rng.normal(size=(6, 6)))[0]
  b = np.linalg.qr(rng.normal(size=(6, 6)))[0]
  rot = rotation.basis_rotation(0.05, weight_decay=0.0)
  rel = lambda x, y: np.max(np.abs(x - y) / np.abs(x))
  rot_gap = rel(curve(rot, eye, eye), curve(rot, a, b))
  adam_gap = rel(curve(optax.adam(0.05), eye, eye), curve(optax.adam(0.05), a, b))
  assert rot_gap < 0.03 and adam_gap > 0.5, (rot_gap, adam_gap)


def test_stagger_spreads_refreshes_and_keeps_each_matrix_count():
  """Four same-shape matrices, period 4: by default all refresh at t % 4 == 0; staggered, one per
  step, and over whole periods each matrix refreshes exactly as often as without staggering."""
  params = {f"w{r}": jnp.zeros((3, 5)) for r in range(4)}
  rng = np.random.default_rng(0)
  grads = [{k: jnp.asarray(rng.normal(size=(3, 5)), jnp.float32) for k in params} for _ in range(13)]

  def refresh_steps(stagger):
    tx = rotation.scale_by_basis_rotation(refresh_every=4, stagger=stagger)
    state, update = tx.init(params), jax.jit(tx.update)
    seen = {k: [] for k in params}
    prev = rotation.leaf_bases(state, params)
    for t, g in enumerate(grads, start=1):
      _, state = update(g, state)
      bases = rotation.leaf_bases(state, params)
      for k in params:
        if not np.array_equal(np.asarray(bases[k][0]), np.asarray(prev[k][0])):
          seen[k].append(t)
      prev = bases
    return seen

  plain, staggered = refresh_steps(False), refresh_steps(True)
  assert all(v == [1, 4, 8, 12] for v in plain.values())
  warm = {k: [t for t in v if t > 1] for k, v in staggered.items()}
  assert sorted(tuple(v) for v in warm.values()) == [(2, 6, 10), (3, 7, 11), (4, 8, 12), (5, 9, 13)]
  per_step = [sum(t in v for v in warm.values()) for t in range(2, 14)]
  assert max(per_step) == 1  # never more than one matrix refreshes in a step


@pytest.mark.parametrize("kwargs", [{"geometry": "unilateral"}, {"max_precond_dim": 64}])
def test_cold_start_builds_no_basis_for_an_unrotated_side(kwargs):
  # A (12000, 32) leaf rotates only its 32-wide side; a full SVD would build the 12000 x 12000 left
  # basis (549 MiB of float32) that is never used. XLA's own count of the update's temporaries:
  shape = (12000, 32)
  tx = rotation.scale_by_basis_rotation(**kwargs)
  params = {"w": jnp.zeros(shape)}
  state = tx.init(params)
  (piece,) = state.bases["w"]
  assert piece.left is None and piece.right.shape == (1, 32, 32)
  compiled = jax.jit(tx.update).lower(params, state).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < 16 * 12000 * 32 * 4, temp / 2**20  # a few copies of the leaf, not 12000^2
  # and step 1 is still the exact algorithm's: in the basis V of the gradient's right singular
  # vectors, Adam's first update is sign(G V) (bias-corrected scale 1), so U~ = u V is +-1 (entries
  # of G V within float32 round-off of 0 may flip; the float64 reference tests cover small shapes).
  g = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
  u, _ = jax.jit(tx.update)({"w": g}, state)
  v = np.linalg.svd(np.asarray(g, np.float64), full_matrices=False)[2].T
  rotated = np.asarray(u["w"], np.float64) @ v
  assert np.mean(np.abs(np.abs(rotated) - 1) < 1e-3) > 0.999
  assert np.mean(np.sign(rotated) == np.sign(np.asarray(g, np.float64) @ v)) > 0.999


def test_fixed_bases_identity_is_adam_and_any_basis_is_adam_in_it():
  rng = np.random.default_rng(11)
  shape = (6, 5)
  grads = [jnp.asarray(rng.normal(size=shape), jnp.float32) for _ in range(6)]
  params = {"w": jnp.zeros(shape), "b": jnp.zeros(5)}
  adam = rotation.scale_by_adam()

  def run(tx, gs):
    state, out = tx.init(params), []
    for g in gs:
      u, state = tx.update({"w": g, "b": g[0]}, state)
      out.append(np.asarray(u["w"]))
    return np.stack(out)

  eye = {"w": (jnp.eye(6), jnp.eye(5)), "b": None}
  identity = rotation.scale_by_basis_rotation(ablation=rotation.Ablation(bases=eye))
  np.testing.assert_array_equal(run(identity, grads), run(adam, grads))
  u = np.linalg.qr(rng.normal(size=(6, 6)))[0]
  v = np.linalg.qr(rng.normal(size=(5, 5)))[0]
  fixed = rotation.scale_by_basis_rotation(
      ablation=rotation.Ablation(bases={"w": (jnp.asarray(u), jnp.asarray(v)), "b": None}))
  rotated = run(adam, [jnp.asarray(u.T @ np.asarray(g) @ v, jnp.float32) for g in grads])
  np.testing.assert_allclose(run(fixed, grads), u @ rotated @ v.T, atol=1e-5)
  state = fixed.init(params)
  assert state.bases["w"][0].stat_left is None and np.allclose(state.bases["w"][0].left[0], u)
  with pytest.raises(ValueError, match=r"parameter \[.w.\] of shape \(6, 5\) needs a right basis of "
                                       r"shape \(5, 5\), got \(6, 6\)"):
    rotation.scale_by_basis_rotation(
        ablation=rotation.Ablation(bases={"w": (jnp.eye(6), jnp.eye(6)), "b": None})).init(params)


def test_random_bases_from_a_key_are_orthogonal_fixed_and_reproducible():
  params = {"w": jnp.zeros((6, 5)), "b": jnp.zeros(5)}
  tx = rotation.scale_by_basis_rotation(ablation=rotation.Ablation(bases=jax.random.key(3)))
  state = tx.init(params)
  u, v = np.asarray(state.bases["w"][0].left[0]), np.asarray(state.bases["w"][0].right[0])
  np.testing.assert_allclose(u.T @ u, np.eye(6), atol=1e-5)
  np.testing.assert_allclose(v.T @ v, np.eye(5), atol=1e-5)
  assert not np.allclose(np.abs(u), np.eye(6), atol=0.1)  # not a signed permutation of the axes
  np.testing.assert_array_equal(u, np.asarray(tx.init(params).bases["w"][0].left[0]))  # same key, same bases
  other_tx = rotation.scale_by_basis_rotation(ablation=rotation.Ablation(bases=jax.random.key(4)))
  other = np.asarray(other_tx.init(params).bases["w"][0].left[0])
  assert not np.allclose(u, other)
  g = jnp.asarray(np.random.default_rng(0).normal(size=(6, 5)), jnp.float32)
  _, after = tx.update({"w": g, "b": g[0]}, state)
  np.testing.assert_array_equal(np.asarray(after.bases["w"][0].left[0]), u)  # never refreshed


def test_freeze_after_stops_the_refresh_and_changes_nothing_before():
  rng = np.random.default_rng(5)
  params = {"w": jnp.zeros((6, 5))}
  grads = [{"w": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)} for _ in range(9)]

  def bases(tx):
    state, out = tx.init(params), []
    for g in grads:
      _, state = tx.update(g, state)
      out.append(np.asarray(state.bases["w"][0].left[0]))
    return out

  free = bases(rotation.scale_by_basis_rotation(refresh_every=2))
  frozen = bases(rotation.scale_by_basis_rotation(refresh_every=2,
                                                        ablation=rotation.Ablation(freeze_after=4)))
  for t in range(4):  # steps 1-4: the same refreshes
    np.testing.assert_array_equal(frozen[t], free[t])
  for t in range(4, 9):  # no refresh after step 4, while the free run keeps refreshing
    np.testing.assert_array_equal(frozen[t], frozen[3])
  assert not np.allclose(free[8], free[3])
  with pytest.raises(ValueError, match="freeze_after must be None or an int >= 1, got 0"):
    rotation.scale_by_basis_rotation(ablation=rotation.Ablation(freeze_after=0))


# --- dimension numbers and blocks ----------------------------------------------------------


def test_blocked_leaf_matches_the_float64_reference_block_by_block():
  """A (10, 7) leaf with block_size 4 is six independent matrices (rows 4 + 4 + 2, columns 4 + 3),
  each with its own bases and moments: the float64 reference run on each block."""
  shape, period = (10, 7), 5
  grads = gradient_sequence(shape, 20, seed=7)
  w0 = np.random.default_rng(2).normal(size=shape)
  ours, state = run(rotation.basis_rotation(LR, weight_decay=WD, refresh_every=period, block_size=4),
                    w0, grads)
  assert [p.left.shape for p in state[0].bases["w"]] == [(2, 4, 4), (2, 4, 4), (1, 2, 2), (1, 2, 2)]
  ref = np.zeros_like(ours)
  for r in (slice(0, 4), slice(4, 8), slice(8, 10)):
    for c in (slice(0, 4), slice(4, 7)):
      ref[:, r, c] = reference(w0[r, c], [g[r, c] for g in grads], source="second",
                               geometry="bilateral", period=period)
  np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)
  whole, _ = run(rotation.basis_rotation(LR, weight_decay=WD, refresh_every=period), w0, grads)
  assert np.abs(whole - ref).max() > 1e-3  # blocks are not the whole matrix


def test_a_scanned_stack_equals_its_layers_as_separate_leaves():
  layers, shape = 3, (6, 10)
  seqs = [gradient_sequence(shape, 12, seed=20 + i) for i in range(layers)]
  w0 = np.random.default_rng(3).normal(size=(layers,) + shape)
  stack_tx = rotation.basis_rotation(LR, weight_decay=WD, refresh_every=4,
                                     weight_dimension_numbers={"w": rotation.stacked(rotation.LINEAR)})
  sep_tx = rotation.basis_rotation(LR, weight_decay=WD, refresh_every=4)
  stack_grads = [{"w": jnp.asarray(np.stack([s[t] for s in seqs]), jnp.float32)} for t in range(12)]
  sep_grads = [{f"l{i}": jnp.asarray(seqs[i][t], jnp.float32) for i in range(layers)} for t in range(12)]
  stacked, state = run_tree(stack_tx, {"w": jnp.asarray(w0, jnp.float32)}, stack_grads)
  separate, _ = run_tree(sep_tx, {f"l{i}": jnp.asarray(w0[i], jnp.float32) for i in range(layers)},
                          sep_grads)
  (piece,) = state[0].bases["w"]
  assert piece.left.shape == (layers, 6, 6) and piece.right.shape == (layers, 10, 10)
  for t in range(12):
    for i in range(layers):
      np.testing.assert_allclose(stacked[t]["w"][i], separate[t][f"l{i}"], atol=1e-6, rtol=1e-4)


def test_attention_kernels_get_the_projections_bases():
  """nnx.MultiHeadAttention's (64, 4, 16) query kernel with ATTENTION_QKV is the 64 x 64 matrix
  (in, heads * head_dim): bases 64 x 64 on both sides, and the update is that matrix's update; the
  out kernel (4, 16, 64) with ATTENTION_OUT likewise. A (4, 8, 16) stack has 4 + 4 bases."""
  attn = nnx.MultiHeadAttention(4, 64, decode=False, rngs=nnx.Rngs(0))
  q, o = attn.query.kernel[...], attn.out.kernel[...]
  assert q.shape == (64, 4, 16) and o.shape == (4, 16, 64)
  params = {"q": q, "o": o, "stack": jnp.zeros((4, 8, 16))}
  dims = {"q": rotation.ATTENTION_QKV, "o": rotation.ATTENTION_OUT,
          "stack": rotation.stacked(rotation.LINEAR)}
  tx = rotation.basis_rotation(LR, weight_dimension_numbers=dims, refresh_every=2)
  bases = rotation.leaf_bases(tx.init(params), params)
  assert [b.shape for b in bases["q"]] == [(64, 64), (64, 64)]
  assert [b.shape for b in bases["o"]] == [(64, 64), (64, 64)]
  assert [b.shape for b in bases["stack"][0]] == [(4, 8, 8), (4, 16, 16)]
  rng = np.random.default_rng(0)
  grads = [{k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
           for _ in range(4)]
  ours, _ = run_tree(tx, params, grads)
  flat = {"q": q.reshape(64, 64), "o": o.reshape(64, 64)}
  flat_grads = [{"q": g["q"].reshape(64, 64), "o": g["o"].reshape(64, 64)} for g in grads]
  plain, _ = run_tree(rotation.basis_rotation(LR, refresh_every=2), flat, flat_grads)
  for a, b in zip(ours, plain):
    np.testing.assert_allclose(a["q"].reshape(64, 64), b["q"], atol=1e-6)
    np.testing.assert_allclose(a["o"].reshape(64, 64), b["o"], atol=1e-6)


def test_the_default_rotates_2d_leaves_only_and_a_single_spec_every_leaf_with_two_axes():
  params = {"b": jnp.zeros(5), "w": jnp.zeros((3, 4)), "t": jnp.zeros((2, 3, 4))}
  kinds = lambda tx: {k: v is not None for k, v in rotation.leaf_bases(tx.init(params), params).items()}
  assert kinds(rotation.scale_by_basis_rotation()) == {"b": False, "w": True, "t": False}
  spec = rotation.RotationDimensionNumbers(reduction_axis=-2, output_axis=-1)
  assert kinds(rotation.scale_by_basis_rotation(weight_dimension_numbers=spec)) == {
      "b": False, "w": True, "t": True}
  with pytest.raises(ValueError, match=r"parameter \['t'\] of shape \(2, 3, 4\): output_axis 3 is out"):
    rotation.scale_by_basis_rotation(
        weight_dimension_numbers=rotation.RotationDimensionNumbers(0, 3)).init(params)
  with pytest.raises(ValueError, match="every entry must be a rotation.RotationDimensionNumbers"):
    rotation.scale_by_basis_rotation(weight_dimension_numbers={"b": None, "w": True, "t": None}).init(
        params)


def test_max_precond_dim_opts_a_long_side_out_and_blocks_cut_it_otherwise():
  params = {"embed": jnp.zeros((3000, 16))}
  blocked = rotation.scale_by_basis_rotation(block_size=1024).init(params).bases["embed"]
  assert [p.left.shape for p in blocked] == [(2, 1024, 1024), (1, 952, 952)]
  assert [p.right.shape for p in blocked] == [(2, 16, 16), (1, 16, 16)]
  (opted,) = rotation.scale_by_basis_rotation(max_precond_dim=1000).init(params).bases["embed"]
  assert opted.left is None and opted.right.shape == (1, 16, 16)  # the long side is never cut


@pytest.mark.parametrize("kwargs", [{}, {"source": "first"}, {"block_size": 4, "geometry": "unilateral"},
                                    {"precond_dtype": jnp.bfloat16, "stagger": True}])
def test_steps_between_refreshes_equal_the_refresh_switch_bit_for_bit(monkeypatch, kwargs):
  """Between refreshes the update takes a plain path (statistics and rotation in, the moments left
  alone) instead of the refresh's ``lax.switch``; forcing the switch at every step changes no bit."""
  from rotation import transform
  keys = jax.random.split(jax.random.key(0), 3)
  params = {"w": jax.random.normal(keys[0], (6, 10)), "v": jax.random.normal(keys[1], (10, 6)),
            "b": jnp.zeros(6)}

  def run():
    tx = rotation.basis_rotation(1e-2, refresh_every=3, **kwargs)
    state, update, p, out = tx.init(params), jax.jit(tx.update), params, []
    for t in range(8):
      g = jax.tree.map(lambda x, t=t: jnp.sin(x * (t + 1)) + 0.1 * x, p)
      u, state = update(g, state, p)
      p = optax.apply_updates(p, u)
      out.append(u)
    return jax.tree.leaves((out, state))

  plain = run()
  monkeypatch.setattr(transform, "refresh_due", lambda count, items, opts: jnp.ones([], bool))
  forced = run()
  assert len(plain) == len(forced)
  for a, b in zip(plain, forced):
    np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


def test_a_first_order_source_needs_a_first_moment_only_where_something_is_rotated():
  """``source="first"`` reads the inner first moment: refused at init when a rotated leaf has none
  (RMSProp keeps only ``nu``), accepted when nothing is rotated, as under ``optax.tree.map_params``."""
  tx = rotation.scale_by_basis_rotation(inner=optax.scale_by_rms(), source="first", b1=0.9)
  with pytest.raises(ValueError, match="source='first' needs an inner transformation with a first moment"):
    tx.init({"w": jnp.zeros((3, 2))})
  state = tx.init({"b": jnp.zeros((3,))})  # a 1-D leaf: plain inner, no rotation
  adam = rotation.basis_rotation(1e-2, source="first")
  mapped = optax.tree.map_params(adam, lambda v: v, adam.init(jnp.zeros((3, 2))))
  assert jax.tree.structure(mapped) == jax.tree.structure(adam.init(jnp.zeros((3, 2))))
  assert state is not None


def test_the_alias_forwards_every_option_by_name_with_the_same_default():
  """``basis_rotation`` spells its options out (``optax.inject_hyperparams`` sees each) and forwards
  them by name: every keyword option of ``scale_by_basis_rotation`` is one of its parameters with
  the same default, and its Adam hyper-parameters keep ``optax.adamw``'s order and defaults."""
  import inspect

  alias = inspect.signature(rotation.basis_rotation).parameters
  scale = inspect.signature(rotation.scale_by_basis_rotation).parameters
  adamw = inspect.signature(optax.adamw).parameters
  positional = ["learning_rate", "b1", "b2", "eps", "eps_root", "mu_dtype", "weight_decay", "mask"]
  assert list(alias)[:len(positional)] == positional
  for name in positional[1:6]:
    assert alias[name].default == adamw[name].default, name
  options = [n for n, p in scale.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
  assert set(options) - set(positional) <= set(alias)
  for name in set(options) - set(positional):
    assert alias[name].default == scale[name].default, name
  # forwarded, not dropped: each option reaches the transformation (here an invalid value is refused)
  for name, bad in (("source", "third"), ("geometry", "diagonal"), ("second_moments", "keep")):
    with pytest.raises(ValueError, match=name):
      rotation.basis_rotation(1e-3, **{name: bad})
