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

import rotation

B1, B2, EPS, LR, WD = 0.9, 0.999, 1e-8, 1e-2, 0.01


def reference(w0, grads, *, source, geometry, period, b1=B1, b2=B2, eps=EPS, lr=LR, wd=WD,
              first_order_step="paper", second_moments="permute"):
  """The paper's algorithm (docs/algorithms.md) in float64 NumPy, first moment kept in original
  coordinates; unilateral geometry rotates the input (left) side of a square Flax kernel.
  ``second_moments="rotate"``: at a warm refresh ``nu <- (U_new^T U_old)^2 nu (V_old^T V_new)^2``
  instead of the permutations."""
  w = np.array(w0, np.float64)
  m_dim, n_dim = w.shape
  rot_l, rot_r = (True, True) if geometry == "bilateral" else (m_dim <= n_dim, m_dim > n_dim)
  ql, qr = np.eye(m_dim), np.eye(n_dim)
  stat_l, stat_r = np.zeros((m_dim, m_dim)), np.zeros((n_dim, n_dim))
  mom, nu = np.zeros_like(w), np.zeros_like(w)
  history = []

  def desc_eigh(s):
    return np.linalg.eigh(s + 1e-30 * np.eye(len(s)))[1][:, ::-1]

  for t, g in enumerate(grads, start=1):
    g = np.asarray(g, np.float64)
    if source == "second":
      stat_l = b2 * stat_l + (1 - b2) * g @ g.T
      stat_r = b2 * stat_r + (1 - b2) * g.T @ g
    if t == 1 or t % period == 0:
      ql_old, qr_old, nu_old = ql, qr, nu
      look = b1 * mom + (1 - b1) * g
      if t == 1 and source == "second":
        ql = desc_eigh(stat_l) if rot_l else ql
        qr = desc_eigh(stat_r) if rot_r else qr
      elif t == 1:
        u, _, vt = np.linalg.svd(look)
        ql, qr = (u if rot_l else ql), (vt.T if rot_r else qr)
      elif source == "second":
        for side, s in ((0, stat_l), (1, stat_r)):
          if not (rot_l, rot_r)[side]:
            continue
          q = (ql, qr)[side]
          order = np.argsort(-np.diag(q.T @ s @ q), kind="stable")
          nu = np.take(nu, order, axis=side)
          q = np.linalg.qr(s @ q[:, order], mode="complete")[0]
          ql, qr = (q, qr) if side == 0 else (ql, q)
      else:
        if rot_l:
          order = np.argsort(-np.sum((look.T @ ql) ** 2, 0), kind="stable")
          ql, nu = ql[:, order], nu[order, :]
        if rot_r:
          order = np.argsort(-np.sum((look @ qr) ** 2, 0), kind="stable")
          qr, nu = qr[:, order], nu[:, order]
        if rot_l and rot_r:
          ql, qr = np.linalg.qr(look @ qr, mode="complete")[0], np.linalg.qr(look.T @ ql, mode="complete")[0]
        elif first_order_step == "paper" and rot_l:  # qr of M's columns sorted by norm
          ql = np.linalg.qr(look[:, np.argsort(-np.sum(look**2, 0), kind="stable")], mode="complete")[0]
        elif first_order_step == "paper":  # qr of M's rows sorted by norm
          qr = np.linalg.qr(look[np.argsort(-np.sum(look**2, 1), kind="stable")].T, mode="complete")[0]
        elif rot_l:
          ql = np.linalg.qr(look @ look.T @ ql, mode="complete")[0]
        else:
          qr = np.linalg.qr(look.T @ look @ qr, mode="complete")[0]
      if second_moments == "rotate" and t > 1:
        nu = (ql.T @ ql_old) ** 2 @ nu_old @ (qr_old.T @ qr) ** 2
    mom = b1 * mom + (1 - b1) * g
    uq = ql if rot_l else np.eye(m_dim)
    vq = qr if rot_r else np.eye(n_dim)
    g_rot, m_rot = uq.T @ g @ vq, uq.T @ mom @ vq
    nu = b2 * nu + (1 - b2) * g_rot**2
    step = np.sqrt(1 - b2**t) / (1 - b1**t) * uq @ (m_rot / (np.sqrt(nu) + eps)) @ vq.T
    w = w - lr * wd * w - lr * step
    history.append(w.copy())
  return np.stack(history)


def run(tx, w0, grads):
  params = {"w": jnp.asarray(w0, jnp.float32)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, g):
    updates, state = tx.update({"w": g}, state, params)
    return optax.apply_updates(params, updates), state

  out = []
  for g in grads:
    params, state = step(params, state, jnp.asarray(g, jnp.float32))
    out.append(np.asarray(params["w"]))
  return np.stack(out), state


def gradient_sequence(shape, steps, seed, zero_first=True):
  rng = np.random.default_rng(seed)
  mix = rng.normal(size=(shape[0], shape[0]))
  grads = [mix @ rng.normal(size=shape) * np.linspace(2.0, 0.5, shape[1]) for _ in range(steps)]
  if zero_first:
    grads[0] = np.zeros(shape)  # a zero first gradient must work
  return grads


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


def test_compositions_with_optax_and_no_recompilation():
  params = {"w": jnp.ones((4, 6)), "b": jnp.ones(6)}
  grads = {"w": jnp.full((4, 6), 0.5), "b": jnp.full(6, 0.5)}
  txs = [
      optax.chain(optax.clip_by_global_norm(1.0), rotation.basis_rotation(1e-3)),
      optax.inject_hyperparams(rotation.basis_rotation,
                               static_args=("refresh_every", "max_precond_dim"))(
          learning_rate=1e-3, b1=0.9, refresh_every=3),
      optax.MultiSteps(rotation.basis_rotation(1e-3), every_k_schedule=2),
      optax.apply_if_finite(rotation.basis_rotation(1e-3), 3),
  ]
  for tx in txs:
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(3):
      u, state = update(grads, state, params)
    assert update._cache_size() == 1
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
  # inject_hyperparams traces the learning rate: changing it does not recompile.
  tx = txs[1]
  state = tx.init(params)
  update = jax.jit(tx.update)
  u1, state = update(grads, state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(2e-3, jnp.float32)
  u2, _ = update(grads, state, params)
  assert update._cache_size() == 1 and not np.allclose(u1["w"], u2["w"])


def test_flax_nnx_optimizer_on_transformer():
  from experiments.harness import model as model_lib
  cfg = model_lib.CONFIGS["cpu-tiny"]
  net = model_lib.Transformer(cfg, nnx.Rngs(0))
  opt = nnx.Optimizer(net, rotation.basis_rotation(1e-2, refresh_every=2), wrt=nnx.Param)
  tokens = (jnp.arange(cfg.context + 1)[None, :] * 7 + jnp.arange(4)[:, None] * 3) % 13  # learnable

  @nnx.jit
  def train_step(net, opt):
    def loss_fn(net):
      logits, _ = net(tokens[:, :-1])
      return model_lib.cross_entropy(logits, tokens[:, 1:])
    loss, grads = nnx.value_and_grad(loss_fn)(net)
    opt.update(net, grads)
    return loss

  losses = [float(train_step(net, opt)) for _ in range(8)]
  assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("kwargs,match", [
    ({"source": "third"}, "unknown source 'third'"),
    ({"geometry": "trilateral"}, "unknown geometry 'trilateral'"),
    ({"second_moments": "shuffle"}, "unknown second_moments 'shuffle'"),
    ({"refresh_every": 0}, "refresh_every.*must be an int >= 1.*got 0"),
    ({"refresh_every": {"w": -2}}, "got -2"),
    ({"eps": -1e-8}, "eps must be >= 0, got -1e-08"),
    ({"orthonormalization": "svd"}, "unknown orthonormalization 'svd'"),
    ({"b1": 1.0}, r"b1 must be in \[0, 1\), got 1.0"),
    ({"b2": -0.5}, r"b2 must be in \[0, 1\), got -0.5"),
    ({"shampoo_beta": 2.0}, r"shampoo_beta must be in \[0, 1\), got 2.0"),
    ({"b1": np.float32(1.5)}, r"b1 must be in \[0, 1\), got np.float32\(1.5\)"),  # any scalar type
    ({"b2": np.asarray(1.0)}, r"b2 must be in \[0, 1\), got array\(1.\)"),  # a 0-d array
    ({"eps": np.float64(-1.0)}, r"eps must be >= 0, got np.float64\(-1.0\)"),
])
def test_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    rotation.scale_by_basis_rotation(**kwargs)
  if set(kwargs) <= {"b1", "b2"}:  # the alias and the plain Adam refuse them too
    with pytest.raises(ValueError, match=match):
      rotation.basis_rotation(1e-3, **kwargs)
    with pytest.raises(ValueError, match=match):
      rotation.scale_by_adam(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    ({"learning_rate": "abc"}, "learning_rate must be a real scalar, got 'abc'"),
    ({"learning_rate": 1e-3, "b1": "0.9"}, "b1 must be a real scalar, got '0.9'"),
    ({"learning_rate": 1e-3, "b2": np.array([0.9, 0.99])}, "b2 must be a real scalar"),
    ({"learning_rate": 1e-3, "shampoo_beta": 0.9 + 0j},
     r"shampoo_beta must be a real scalar, got \(0.9\+0j\)"),
])
def test_non_numeric_hyperparameters_are_refused_by_name(kwargs, match):
  with pytest.raises(TypeError, match=match):
    rotation.basis_rotation(**kwargs)


def test_numeric_learning_rates_and_schedules_are_accepted():
  for lr in (1e-3, np.float32(1e-3), jnp.asarray(1e-3), optax.constant_schedule(1e-3)):
    rotation.basis_rotation(lr).init({"w": jnp.zeros((2, 2))})


@pytest.mark.parametrize("tx", [rotation.basis_rotation(1e-3), rotation.scale_by_adam()])
def test_complex_leaves_are_refused_at_init(tx):
  with pytest.raises(TypeError, match=r"parameter \['z'\] has dtype complex64: .*real floating-point"):
    tx.init({"w": jnp.zeros((3, 3)), "z": jnp.zeros((3, 3), jnp.complex64)})


def test_mask_structure_mismatch():
  tx = rotation.scale_by_basis_rotation(weight_dimension_numbers={"w": rotation.LINEAR})
  with pytest.raises(ValueError, match="weight_dimension_numbers does not match the parameters"):
    tx.init({"w": jnp.zeros((2, 2)), "v": jnp.zeros((2, 2))})


@pytest.mark.parametrize("source", rotation.SOURCES)
@pytest.mark.parametrize("geometry", rotation.GEOMETRIES)
def test_state_round_trips_through_orbax(tmp_path, source, geometry):
  """Every configuration's state (unrotated sides, no statistics, sides over max_precond_dim) is
  saved and restored exactly by orbax's StandardCheckpointer."""
  import orbax.checkpoint as ocp
  params = {"a": jnp.ones((3, 8)), "b": jnp.ones((8, 3)), "bias": jnp.ones(4), "big": jnp.ones((2, 40))}
  tx = rotation.basis_rotation(1e-2, source=source, geometry=geometry, max_precond_dim=16)
  state = tx.init(params)
  rng = np.random.default_rng(0)
  grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
  _, state = tx.update(grads, state, params)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "state", state)
  ckpt.wait_until_finished()
  got = ckpt.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert jax.tree.structure(got) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, got, state)


def test_extra_args_reach_only_inner_transformations_that_take_them():
  """In a chain with reduce_on_plateau, update(..., value=loss) works (the default inner Adam
  takes no extra arguments) and an inner transformation that takes them receives them."""
  params = {"w": jnp.ones((4, 6))}
  grads = {"w": jnp.full((4, 6), 0.1)}
  tx = optax.chain(rotation.basis_rotation(1e-2), optax.contrib.reduce_on_plateau())
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(grads, state, params, value=jnp.asarray(1.0))
  assert np.all(np.isfinite(np.asarray(updates["w"])))
  seen = []

  def inner_update(updates, state, params=None, *, value):
    seen.append(value)
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), inner_update)
  rot = rotation.scale_by_basis_rotation(inner)
  rot.update(grads, rot.init(params), value=3.0)
  assert seen == [3.0]


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


def test_a_learning_rate_given_as_inner_is_a_clear_error():
  with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation.*basis_rotation"):
    rotation.scale_by_basis_rotation(1e-3)


@pytest.mark.parametrize("tx", [rotation.basis_rotation(1e-3), rotation.scale_by_adam()])
def test_integer_leaves_are_refused_at_init(tx):
  with pytest.raises(TypeError, match=r"parameter \['step'\] has dtype int32"):
    tx.init({"w": jnp.zeros((3, 3)), "step": jnp.zeros((), jnp.int32)})


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
  np.testing.assert_array_equal(run(rotation.scale_by_basis_rotation(bases=eye), grads), run(adam, grads))
  u = np.linalg.qr(rng.normal(size=(6, 6)))[0]
  v = np.linalg.qr(rng.normal(size=(5, 5)))[0]
  fixed = rotation.scale_by_basis_rotation(bases={"w": (jnp.asarray(u), jnp.asarray(v)), "b": None})
  rotated = run(adam, [jnp.asarray(u.T @ np.asarray(g) @ v, jnp.float32) for g in grads])
  np.testing.assert_allclose(run(fixed, grads), u @ rotated @ v.T, atol=1e-5)
  state = fixed.init(params)
  assert state.bases["w"][0].stat_left is None and np.allclose(state.bases["w"][0].left[0], u)
  with pytest.raises(ValueError, match=r"parameter \[.w.\] of shape \(6, 5\) needs a right basis of "
                                       r"shape \(5, 5\), got \(6, 6\)"):
    rotation.scale_by_basis_rotation(bases={"w": (jnp.eye(6), jnp.eye(6)), "b": None}).init(params)


def test_random_bases_from_a_key_are_orthogonal_fixed_and_reproducible():
  params = {"w": jnp.zeros((6, 5)), "b": jnp.zeros(5)}
  tx = rotation.scale_by_basis_rotation(bases=jax.random.key(3))
  state = tx.init(params)
  u, v = np.asarray(state.bases["w"][0].left[0]), np.asarray(state.bases["w"][0].right[0])
  np.testing.assert_allclose(u.T @ u, np.eye(6), atol=1e-5)
  np.testing.assert_allclose(v.T @ v, np.eye(5), atol=1e-5)
  assert not np.allclose(np.abs(u), np.eye(6), atol=0.1)  # not a signed permutation of the axes
  np.testing.assert_array_equal(u, np.asarray(tx.init(params).bases["w"][0].left[0]))  # same key, same bases
  other_tx = rotation.scale_by_basis_rotation(bases=jax.random.key(4))
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
  frozen = bases(rotation.scale_by_basis_rotation(refresh_every=2, freeze_after=4))
  for t in range(4):  # steps 1-4: the same refreshes
    np.testing.assert_array_equal(frozen[t], free[t])
  for t in range(4, 9):  # no refresh after step 4, while the free run keeps refreshing
    np.testing.assert_array_equal(frozen[t], frozen[3])
  assert not np.allclose(free[8], free[3])
  with pytest.raises(ValueError, match="freeze_after must be None or an int >= 1, got 0"):
    rotation.scale_by_basis_rotation(freeze_after=0)


# --- dimension numbers, blocks, dtypes and optax's contracts ---------------------------------


def _run_tree(tx, params, grads):
  """Updates of ``tx`` over a list of gradient trees (jitted once), as float64 NumPy trees."""
  state, out = tx.init(params), []
  update = jax.jit(tx.update)
  for g in grads:
    u, state = update(g, state, params)
    out.append(jax.tree.map(lambda x: np.asarray(x, np.float64), u))
  return out, state


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
  stacked, state = _run_tree(stack_tx, {"w": jnp.asarray(w0, jnp.float32)}, stack_grads)
  separate, _ = _run_tree(sep_tx, {f"l{i}": jnp.asarray(w0[i], jnp.float32) for i in range(layers)},
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
  ours, _ = _run_tree(tx, params, grads)
  flat = {"q": q.reshape(64, 64), "o": o.reshape(64, 64)}
  flat_grads = [{"q": g["q"].reshape(64, 64), "o": g["o"].reshape(64, 64)} for g in grads]
  plain, _ = _run_tree(rotation.basis_rotation(LR, refresh_every=2), flat, flat_grads)
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


def test_inject_hyperparams_needs_no_static_args_and_trains():
  """optax's contract: every numeric argument may be injected, the rest are static by construction."""
  a = jnp.asarray(np.random.default_rng(0).normal(size=(6, 6)), jnp.float32)
  loss = lambda p: jnp.sum((a @ p["w"] - jnp.eye(6)) ** 2) + jnp.sum(p["b"] ** 2)
  params = {"w": jnp.zeros((6, 6)), "b": jnp.ones(3)}
  tx = optax.inject_hyperparams(rotation.basis_rotation)(learning_rate=0.02, refresh_every=3)
  plain = rotation.basis_rotation(0.02, refresh_every=3)
  state, plain_state = tx.init(params), plain.init(params)

  @jax.jit
  def step(params, state):
    u, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, u), state

  losses, seen = [], []
  for t in range(1, 61):
    before = np.asarray(state.inner_state[0].bases["w"][0].left)
    if t <= 2:  # the same updates as the un-injected optimizer's (before a warm refresh, whose QR
      # amplifies their round-off by the statistics' condition number)
      g = jax.grad(loss)(params)
      ours, _ = tx.update(g, state, params)
      ref, plain_state = plain.update(g, plain_state, params)
      np.testing.assert_allclose(ours["w"], ref["w"], atol=1e-6)
    params, state = step(params, state)
    losses.append(float(loss(params)))
    if not np.array_equal(before, np.asarray(state.inner_state[0].bases["w"][0].left)):
      seen.append(t)
  assert losses[-1] < 0.2 * losses[0], losses
  assert seen[:4] == [1, 3, 6, 9]  # the injected period is honoured
  assert step._cache_size() == 1
  # a new rate takes effect, without a recompile
  state.hyperparams["learning_rate"] = jnp.zeros_like(state.hyperparams["learning_rate"])
  frozen, _ = step(params, state)
  jax.tree.map(np.testing.assert_array_equal, frozen, params)
  assert step._cache_size() == 1


def test_tree_map_params_reaches_the_moments_and_not_the_bases():
  params = {"w": jnp.ones((4, 5)), "b": jnp.ones(5)}
  tx = rotation.basis_rotation(1e-3)
  state = tx.init(params)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  _, state = tx.update(grads, state, params)
  same = optax.tree_map_params(tx, lambda p: p, state)
  jax.tree.map(np.testing.assert_array_equal, same, state)
  doubled = optax.tree_map_params(tx, lambda p: 2 * p, state)
  inner, new_inner = state[0].inner_state, doubled[0].inner_state
  np.testing.assert_array_equal(new_inner.mu["w"], 2 * inner.mu["w"])
  np.testing.assert_array_equal(new_inner.nu["b"], 2 * inner.nu["b"])
  jax.tree.map(np.testing.assert_array_equal, doubled[0].bases, state[0].bases)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dtypes_are_preserved_and_the_state_is_stable_through_refreshes(dtype):
  params = {"w": jnp.zeros((6, 4), dtype), "stack": jnp.zeros((2, 3, 5), dtype), "b": jnp.zeros(4, dtype)}
  dims = {"w": rotation.LINEAR, "stack": rotation.stacked(rotation.LINEAR), "b": None}
  tx = rotation.basis_rotation(1e-2, weight_dimension_numbers=dims, refresh_every=2, block_size=4)
  state = tx.init(params)
  types = jax.tree.map(jax.typeof, state)
  update = jax.jit(tx.update)
  rng = np.random.default_rng(0)
  for _ in range(5):  # cold start, keep, warm, keep, warm
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), dtype), params)
    u, state = update(g, state, params)
    assert jax.tree.map(lambda x: x.dtype, u) == jax.tree.map(lambda x: x.dtype, params)
    assert jax.tree.map(jax.typeof, state) == types
    assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(u))
  assert update._cache_size() == 1


def test_float64_leaves_keep_float64_through_the_state(tmp_path):
  script = """
import jax, jax.numpy as jnp, numpy as np, rotation
jax.config.update("jax_enable_x64", True)
params = {"w": jnp.zeros((5, 4), jnp.float64), "b": jnp.zeros(4, jnp.float64)}
tx = rotation.basis_rotation(1e-2)
state = tx.init(params)
g = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(5, 4))), "b": jnp.ones(4, jnp.float64)}
u, state = jax.jit(tx.update)(g, state, params)
assert {x.dtype for x in jax.tree.leaves(u)} == {jnp.dtype("float64")}
floats = [x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
assert set(floats) == {jnp.dtype("float64")}, floats
print("ok")
"""
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_bf16_moments_and_statistics():
  params = {"w": jnp.zeros((8, 6))}
  rng = np.random.default_rng(0)
  grads = [{"w": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32)} for _ in range(6)]
  full, _ = _run_tree(rotation.basis_rotation(1e-2, refresh_every=2), params, grads)
  for tx in (rotation.basis_rotation(1e-2, refresh_every=2, mu_dtype=jnp.bfloat16,
                                     precond_dtype=jnp.bfloat16, precision="default"),
             optax.chain(rotation.scale_by_basis_rotation(optax.scale_by_adam(mu_dtype=jnp.bfloat16),
                                                          refresh_every=2), optax.scale(-1e-2))):
    low, state = _run_tree(tx, params, grads)
    for a, b in zip(low, full):
      assert np.abs(a["w"] - b["w"]).max() < 0.1 * np.abs(b["w"]).max()  # bf16 state, same steps
  assert state[0].inner_state.mu["w"].dtype == jnp.bfloat16  # optax's Adam with a bf16 moment
  state = rotation.basis_rotation(1e-2, mu_dtype=jnp.bfloat16, precond_dtype=jnp.bfloat16).init(params)
  (p,) = state[0].bases["w"]
  assert {p.left.dtype, p.right.dtype, p.stat_left.dtype, p.stat_right.dtype} == {jnp.dtype("bfloat16")}
  assert state[0].inner_state.mu["w"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="precision must be a jax.lax.Precision or its name, got 'fast'"):
    rotation.scale_by_basis_rotation(precision="fast")


def test_an_inner_state_field_that_cannot_follow_the_basis_is_refused_by_name():
  def init(params):
    return {"velocity": jax.tree.map(jnp.zeros_like, params)}

  def update(g, state, params=None):
    return g, state

  with pytest.raises(ValueError, match=r"inner state field\(s\) \['velocity'\] \(velocity\)"):
    rotation.scale_by_basis_rotation(optax.GradientTransformation(init, update)).init(
        {"w": jnp.zeros((3, 3)), "b": jnp.zeros(3)})


def test_schedules_and_multisteps():
  params = {"w": jnp.ones((4, 3))}
  rng = np.random.default_rng(0)
  grads = [{"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)} for _ in range(4)]
  sched = optax.linear_schedule(1e-2, 0.0, 4)
  scheduled, _ = _run_tree(rotation.basis_rotation(sched, weight_decay=0.0), params, grads)
  unit, _ = _run_tree(rotation.basis_rotation(1.0, weight_decay=0.0), params, grads)
  for t in range(4):
    np.testing.assert_allclose(scheduled[t]["w"], unit[t]["w"] * float(sched(t)), rtol=1e-6, atol=1e-9)
  multi = optax.MultiSteps(rotation.basis_rotation(1e-2, weight_decay=0.0), every_k_schedule=2)
  stepped, _ = _run_tree(multi, params, grads)
  mean = [{"w": (grads[0]["w"] + grads[1]["w"]) / 2}, {"w": (grads[2]["w"] + grads[3]["w"]) / 2}]
  direct, _ = _run_tree(rotation.basis_rotation(1e-2, weight_decay=0.0), params, mean)
  np.testing.assert_array_equal(stepped[0]["w"], 0.0)
  np.testing.assert_allclose(stepped[1]["w"], direct[0]["w"], rtol=1e-5, atol=1e-8)
  np.testing.assert_allclose(stepped[3]["w"], direct[1]["w"], rtol=1e-5, atol=1e-8)


def test_none_leaves_in_the_tree_do_not_shift_the_bases():
  """A per-stage tree keeps other stages' leaves as ``None`` (pipeline_sim.split_stages): each
  rotated leaf still meets its own bases, and the numbers equal the tree without the ``None``s."""
  rng = np.random.default_rng(3)
  w = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in (("a", (5, 3)), ("b", (4, 6)))}
  holey = {"x": None, "a": w["a"], "y": [None, w["b"]]}
  tx = rotation.basis_rotation(LR, refresh_every=2)
  s_full, s_holey = tx.init(w), tx.init(holey)
  for _ in range(4):
    g = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in w.items()}
    u_full, s_full = jax.jit(tx.update)(g, s_full, w)
    u_holey, s_holey = jax.jit(tx.update)({"x": None, "a": g["a"], "y": [None, g["b"]]}, s_holey, holey)
    np.testing.assert_allclose(u_holey["a"], u_full["a"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(u_holey["y"][1], u_full["b"], rtol=1e-6, atol=1e-7)
  assert rotation.leaf_bases(s_holey, holey)["y"][1][0].shape == (4, 4)
