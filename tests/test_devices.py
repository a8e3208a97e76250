"""The real 1F1B pipeline across devices (pipeline_sim/devices.py) computes the emulator's
trajectory. A subprocess with 4 forced CPU devices (the count is fixed when JAX starts), float64."""

import numpy as np
import pytest

SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np, optax
jax.config.update("jax_enable_x64", True)
import pipeline_sim as ps
import rotation
from experiments.bench.devices import collective_bytes

M, CHUNK, B, W = 8, 4, 8, 5
rng = np.random.default_rng(0)
xs, ys = (jnp.asarray(rng.normal(size=(M, B, W))) for _ in range(2))


def model(num_stages):
  params = {f"w{k}": jnp.asarray(rng.normal(size=(W, W)) * 0.6) for k in range(num_stages)}
  params.update({f"b{k}": jnp.asarray(rng.normal(size=(W,)) * 0.1) for k in range(num_stages)})
  labels = {f"w{k}": k for k in range(num_stages)} | {f"b{k}": k for k in range(num_stages)}
  fns = [lambda p, h, k=k: jnp.tanh(h @ p[f"w{k}"] + p[f"b{k}"]) for k in range(num_stages)]
  return params, labels, ps.Staged(fns, loss_of=lambda out, b: jnp.mean((out - b[1]) ** 2))


def device_run(pipe, params):
  state = pipe.init(params, (xs[0], ys[0]))
  steps, losses, norms = [], [], []
  for c in range(0, M, CHUNK):
    state, out = pipe.run(state, (xs[c:c + CHUNK], ys[c:c + CHUNK]))
    s, l, n = map(np.asarray, out)
    steps += list(s[s >= 0]); losses += list(l[s >= 0]); norms += list(n[s >= 0])
  state, (s, l, n) = pipe.finish(state)
  return state, steps + list(s), losses + list(l), norms + list(n)


def delayed_loop(opt, staged, labels, params, delay):
  # A plain optax loop: update t applies the gradient of batch t at the weights of update t - delay.
  loss = lambda p, b: staged.loss(ps.split_stages(p, labels, len(staged.stage_fns)), b)
  state, history, losses = opt.init(params), [params], []
  for t in range(M):
    at = history[max(0, t - delay)]
    value, g = jax.value_and_grad(loss)(at, (xs[t], ys[t]))
    updates, state = opt.update(g, state, history[-1])
    history.append(optax.apply_updates(history[-1], updates))
    losses.append(float(value))
  return history[-1], losses


def gradient_psums(closed, width):
  # the elements every psum/pmean averages, by how many conds enclose it (how rarely it runs), as
  # multiples of a stage's packed gradient width (the loss adds a scalar)
  found = {}
  def walk(jaxpr, conds):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ("psum", "pmean", "psum_invariant"):
        size = sum(int(np.prod(v.aval.shape, dtype=int)) for v in eqn.invars)
        found[conds] = found.get(conds, 0) + size
      for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
          inner = getattr(x, "jaxpr", x)
          if hasattr(inner, "eqns"):
            walk(inner, conds + (eqn.primitive.name == "cond"))
  walk(closed.jaxpr, 0)
  return {str(depth): size / width for depth, size in sorted(found.items())}


got = {}
cases = [("adam-ws-P4", 4, 1, "weight_stashing", "adam", "1f1b", None),
         ("adam-ws-P3", 3, 1, "weight_stashing", "adam", "1f1b", None),
         ("adam-ws-P2xD2", 2, 2, "weight_stashing", "adam", "1f1b", None),
         ("rotation-ns-P4", 4, 1, "no_stashing", "rotation", "1f1b", None),
         ("adam-2bw-P4", 4, 1, "weight_stashing", "adam", "2bw", None),
         ("adam-2bw-P3-M8", 3, 1, "weight_stashing", "adam", "2bw", 8),
         ("adam-2bw-P2xD2", 2, 2, "weight_stashing", "adam", "2bw", 2),
         ("adam-2bw-P1-M4", 1, 1, "weight_stashing", "adam", "2bw", 4),
         # a third schedule, a value beside the two (pipeline_sim.schedules): every stage D behind
         ("adam-uniform3-P4", 4, 1, "weight_stashing", "adam", "uniform-3", None),
         ("adam-uniform2-P2xD2-M4", 2, 2, "weight_stashing", "adam", "uniform-2", 4),
         ("adam-uniform2-P1-M2", 1, 1, "weight_stashing", "adam", "uniform-2", 2)]
for name, num_stages, n_data, mode, opt_name, schedule, micro in cases:
  params, labels, staged = model(num_stages)
  opt = optax.adam(3e-2) if opt_name == "adam" else rotation.basis_rotation(3e-2, refresh_every=3)
  emu = ps.Pipeline(None, opt, labels, mode=mode, staged=staged, grad_norms=True, schedule=schedule)
  st, (l_emu, n_emu) = emu.run(emu.init(params), (xs, ys))
  mesh = ps.pipeline_mesh(num_stages, jax.devices()[:num_stages * n_data])
  pipe = ps.DevicePipeline(staged, opt, labels, mode=mode, mesh=mesh, schedule=schedule,
                           micro_batches=micro)
  state, steps, losses, norms = device_run(pipe, params)
  final = pipe.params(state)
  vs_sync = vs_loop = None
  if name in ("adam-ws-P4", "rotation-ns-P4", "adam-2bw-P4", "adam-uniform3-P4"):  # the delays matter
    sync = ps.Pipeline(lambda p, b: staged.loss([p], b), opt, {k: 0 for k in labels})
    vs_sync = float(np.max(np.abs(np.array(losses) - np.asarray(sync.run(sync.init(params), (xs, ys))[1]))))
  if schedule != "1f1b":  # against a plain loop with the schedule's delay, written here (2BW: one,
    # none at P = 1; uniform-D: D at every P)
    delay = int(schedule.split("-")[1]) if schedule.startswith("uniform-") else int(num_stages > 1)
    w, loop_losses = delayed_loop(opt, staged, labels, params, delay)
    vs_loop = max(float(np.max(np.abs(np.array(losses) - np.array(loop_losses)))),
                  max(float(jnp.max(jnp.abs(final[k] - w[k]))) for k in params))
  carry = next(iter(state.carry.values()))
  chunk = (xs[:CHUNK], ys[:CHUNK])
  moved = collective_bytes(jax.make_jaxpr(pipe._run_impl, static_argnums=2)(state, chunk, True))
  message = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((pipe._message, pipe._act)))
  got[name] = {
      "moved_per_micro_batch": moved["ppermute"] * n_data / CHUNK, "live_bytes": (num_stages - 1) * message,
      "gradient_psums": gradient_psums(jax.make_jaxpr(pipe._run_impl, static_argnums=2)(state, chunk, True),
                                       sum(w for w in pipe._grad_widths.values())),
      "steps": [int(s) for s in steps],
      "loss": float(np.max(np.abs(np.array(losses) - np.asarray(l_emu)))),
      "norm": float(np.max(np.abs(np.array(norms) - np.asarray(n_emu)))),
      "params": max(float(jnp.max(jnp.abs(final[k] - st.params[k]))) for k in params),
      "vs_sync": vs_sync, "vs_loop": vs_loop, "programs": pipe._run._cache_size(),
      "shards": sorted({tuple(s.data.shape) for s in carry.addressable_shards}),
      "carry_shape": list(carry.shape),
      "stash": pipe.memory(state)["stash_per_stage"], "buffer_bytes": pipe.buffer_bytes(state),
      "emulator_buffer_bytes": emu.buffer_bytes(st),
  }

# Synchronous schedule: a flush after every chunk (PipeDream-Flush): each batch still completes
# once, and the first one after a flush sees every earlier update (1F1B and 2BW alike).
params, labels, staged = model(4)
for name, schedule in (("flush", "1f1b"), ("flush-2bw", "2bw")):
  pipe = ps.DevicePipeline(staged, optax.adam(3e-2), labels, mesh=ps.pipeline_mesh(4, jax.devices()[:4]),
                           schedule=schedule)
  state, steps, losses, direct = pipe.init(params, (xs[0], ys[0])), [], {}, []
  returned = []  # every (step, loss) that run returned with step >= 0: after a finish, none twice
  for c in range(0, M, CHUNK):
    parts = ps.split_stages(pipe.params(state), labels, 4)
    direct.append(float(staged.loss(parts, (xs[c], ys[c]))))  # at the weights after the flush
    state, out = pipe.run(state, (xs[c:c + CHUNK], ys[c:c + CHUNK]))
    for s, l in zip(*map(np.asarray, out[:2])):
      if s >= 0:
        returned.append((int(s), float(l)))
        steps.append(int(s)); losses[int(s)] = float(l)
    state, out = pipe.finish(state)
    steps += [int(i) for i in out[0]]
    losses.update(zip(map(int, out[0]), map(float, out[1])))
  got[name] = {"steps": steps, "first": [losses[c] for c in range(0, M, CHUNK)], "direct": direct,
               "returned": returned, "programs": pipe._run._cache_size()}

# One optimizer means per-stage copies in both pipelines: a global-norm clip clips each stage by
# its own norm (the emulator's merged=True clips over all stages, which no device pipeline can).
params, labels, staged = model(2)
clip = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(3e-2))
mesh = ps.pipeline_mesh(2, jax.devices()[:4])
finals = {}
for form, opt in (("one", clip), ("list", [clip, clip])):
  emu = ps.Pipeline(None, opt, labels, staged=staged)
  finals["emulator-" + form] = emu.run(emu.init(params), (xs, ys))[0].params
  pipe = ps.DevicePipeline(staged, opt, labels, mesh=mesh)
  finals["devices-" + form] = pipe.params(device_run(pipe, params)[0])
emu = ps.Pipeline(None, clip, labels, staged=staged, merged=True)
finals["emulator-merged"] = emu.run(emu.init(params), (xs, ys))[0].params
diff = lambda a, b: max(float(jnp.max(jnp.abs(finals[a][k] - finals[b][k]))) for k in params)
got["clip"] = {f"{a} vs {b}": diff(a, b) for a, b in (
    ("emulator-one", "devices-one"), ("emulator-list", "devices-list"), ("emulator-one", "emulator-list"),
    ("emulator-merged", "devices-one"))}

# A loss with a product of batch means (as the MoE load-balancing loss): with D data devices each
# device computes it on its own shard and the gradients are averaged, i.e. the emulator's run of the
# mean over the D shards' losses, not of the global batch's (documented in DevicePipeline).
aux = lambda out, b: jnp.mean((out - b[1]) ** 2) + jnp.sum(jnp.mean(out, axis=0) ** 2)
staged = ps.Staged(staged.stage_fns, loss_of=aux)
pipe = ps.DevicePipeline(staged, optax.adam(3e-2), labels, mesh=mesh)
_, _, dev_losses, _ = device_run(pipe, params)
halves = lambda p, b: 0.5 * sum(staged.loss(ps.split_stages(p, labels, 2), (b[0][h], b[1][h]))
                                for h in (slice(0, B // 2), slice(B // 2, B)))
whole = lambda p, b: staged.loss(ps.split_stages(p, labels, 2), b)
moe = {}
for name, fn in (("shards", halves), ("global", whole)):
  emu = ps.Pipeline(fn, optax.adam(3e-2), labels)
  moe[name] = float(np.max(np.abs(np.asarray(emu.run(emu.init(params), (xs, ys))[1]) - np.array(dev_losses))))
got["batch_means"] = moe

errors = []
params, labels, staged = model(2)
for make in (lambda: ps.pipeline_mesh(3, jax.devices()[:4]),
             lambda: ps.DevicePipeline(staged, optax.adam(1e-3), labels, mode="stale_gradients"),
             lambda: ps.DevicePipeline(staged, optax.adam(1e-3), labels,
                                       mesh=ps.pipeline_mesh(4, jax.devices()[:4])),
             lambda: ps.DevicePipeline(staged, optax.adam(1e-3), labels, mesh=ps.pipeline_mesh(
                 2, jax.devices()[:4])).init(params, (xs[0, :3], ys[0, :3])),
             lambda: ps.DevicePipeline(staged, optax.adam(1e-3), labels, schedule="gpipe"),
             lambda: ps.DevicePipeline(staged, optax.adam(1e-3), labels, mode="no_stashing", schedule="2bw"),
             lambda: ps.DevicePipeline(staged, optax.adam(1e-3), labels, schedule="2bw", micro_batches=1),
             lambda: ps.DevicePipeline(staged, optax.adam(1e-3), labels, micro_batches=2),
             lambda: ps.DevicePipeline(staged, optax.adam(1e-3), labels, schedule="2bw", micro_batches=3,
                                       mesh=ps.pipeline_mesh(2, jax.devices()[:2])).init(
                                           params, (xs[0], ys[0])),
             lambda: ps.DevicePipeline(staged, ps.per_stage(lambda k: optax.adam(1e-3), 2,
                                                            delays=ps.stage_delays(2, "1f1b")),
                                       labels, schedule="uniform-2",
                                       mesh=ps.pipeline_mesh(2, jax.devices()[:2]))):
  try:
    make()
    errors.append("")
  except ValueError as e:
    errors.append(str(e))
got["errors"] = errors

# A typed PRNG key in an optimizer state (optax.add_noise): packed as its key data, the same noise.
params, labels, staged = model(2)
mesh2 = ps.pipeline_mesh(2, jax.devices()[:2])
noisy = optax.chain(optax.add_noise(0.01, 0.55, 0), optax.adam(3e-2))
emu = ps.Pipeline(None, noisy, labels, staged=staged)
st, l_emu = emu.run(emu.init(params), (xs, ys))
pipe = ps.DevicePipeline(staged, noisy, labels, mesh=mesh2)
state, _, losses, _ = device_run(pipe, params)
final = pipe.params(state)
quiet = ps.Pipeline(None, optax.adam(3e-2), labels, staged=staged)
without = quiet.run(quiet.init(params), (xs, ys))[0].params
got["noise"] = {"loss": float(np.max(np.abs(np.array(losses) - np.asarray(l_emu)))),
                "params": max(float(jnp.max(jnp.abs(final[k] - st.params[k]))) for k in params),
                "vs_no_noise": max(float(jnp.max(jnp.abs(final[k] - without[k]))) for k in params)}

# A pipeline resumed from a saved state (a new object: init, then the restored arrays) can finish at
# once, and equals the original's finish; a consumed state is refused by name.
pipe = ps.DevicePipeline(staged, optax.adam(3e-2), labels, mesh=mesh2)
state, _ = pipe.run(pipe.init(params, (xs[0], ys[0])), (xs[:CHUNK], ys[:CHUNK]))
saved = jax.tree.map(np.asarray, state)
state, first = pipe.finish(state)
again = ps.DevicePipeline(staged, optax.adam(3e-2), labels, mesh=mesh2)
template = again.init(params, (xs[0], ys[0]))
restored = jax.tree.map(lambda t, x: jax.device_put(x, t.sharding), template, saved)
done, second = again.finish(restored)
try:
  again.run(restored, (xs[:CHUNK], ys[:CHUNK]))
  consumed = ""
except ValueError as e:
  consumed = str(e)
got["resumed"] = {"steps": [list(map(int, first[0])), list(map(int, second[0]))],
                  "loss": float(np.max(np.abs(first[1] - second[1]))),
                  "params": max(float(jnp.max(jnp.abs(pipe.params(state)[k] - again.params(done)[k])))
                                for k in params), "consumed": consumed}
print(json.dumps(got))
"""


@pytest.fixture(scope="module")
def got(forced_devices):
  return forced_devices(SCRIPT, 4)


def test_adam_trajectory_equals_the_emulator_in_float64(got):
  for name in ("adam-ws-P4", "adam-ws-P3", "adam-ws-P2xD2"):
    r = got[name]
    assert r["steps"] == list(range(8)), name  # every micro-batch completes once, in order
    assert r["loss"] < 1e-12 and r["norm"] < 1e-12 and r["params"] < 1e-12, (name, r)
  assert got["adam-ws-P4"]["vs_sync"] > 1e-3  # a synchronous run differs: equality is not trivial


def test_rotation_trajectory_equals_the_emulator_to_amplified_round_off(got):
  # Rotation's eigendecompositions amplify round-off (a different summation order of the same
  # gradient): measured 2e-9 on the losses and 2e-8 on the parameters in float64.
  r = got["rotation-ns-P4"]
  assert r["steps"] == list(range(8))
  assert r["loss"] < 1e-6 and r["norm"] < 1e-6 and r["params"] < 1e-6, r
  assert r["vs_sync"] > 1e-3, r


def test_each_device_holds_only_its_stage(got):
  r = got["adam-ws-P4"]
  assert r["carry_shape"][:2] == [4, 1] and r["shards"] == [[1, 1, r["carry_shape"][2]]]
  # stage k stashes tau_k + 1 = P - k versions of its (equal-sized) weights: 30 float64 each
  assert r["stash"] == [(4 - k) * 30 * 8 for k in range(4)]
  assert r["buffer_bytes"] == r["emulator_buffer_bytes"] == sum(r["stash"])
  assert got["adam-ws-P2xD2"]["carry_shape"][:2] == [2, 2]
  assert got["rotation-ns-P4"]["stash"] == [0, 0, 0, 0]


def test_only_live_messages_move_between_stages(got):
  # Per micro-batch (two phases) each of the P - 1 links carries one forward message and one
  # cotangent; sending every link in every phase (half of them zeros) would move twice as much.
  for name in ("adam-ws-P4", "adam-ws-P3", "adam-ws-P2xD2", "rotation-ns-P4"):
    r = got[name]
    n_data = 2 if name.endswith("D2") else 1
    assert r["moved_per_micro_batch"] == r["live_bytes"] * n_data, (name, r)


@pytest.mark.parametrize("name", ["flush", "flush-2bw"])
def test_a_flush_completes_the_micro_batches_in_flight_and_restarts_the_fill(got, name):
  r = got[name]
  assert r["steps"] == list(range(8))
  assert r["programs"] == 1  # the drain runs the chunk's program: one compile for runs and flushes
  assert max(abs(a - b) for a, b in zip(r["first"], r["direct"])) < 1e-12
  # run after finish returns no micro-batch that finish returned (and no NaN for a real index)
  returned = [s for s, _ in r["returned"]]
  assert len(returned) == len(set(returned)) and all(np.isfinite(l) for _, l in r["returned"])


def test_one_optimizer_means_per_stage_copies_in_both_pipelines(got):
  r = got["clip"]
  for pair in ("emulator-one vs devices-one", "emulator-list vs devices-list",
               "emulator-one vs emulator-list"):
    assert r[pair] < 1e-12, (pair, r)
  assert r["emulator-merged vs devices-one"] > 1e-3, r  # the control: a clip over all stages differs


def test_batch_mean_products_are_per_data_shard_on_devices(got):
  r = got["batch_means"]
  assert r["shards"] < 1e-12, r  # the emulator's run of the per-shard mean of losses
  assert r["global"] > 1e-4, r  # not the global batch's loss


def test_bad_layouts_are_refused(got):
  mesh, mode, stages, batch, schedule, no_stash, too_few, not_2bw, split, delays = got["errors"]
  assert "4 devices cannot hold 3 pipeline stages" in mesh
  assert "unknown device pipeline mode 'stale_gradients'" in mode
  assert "with 2 entries on 'stage'" in stages
  assert "batch size 3 is not divisible by the 2 devices" in batch
  assert "unknown pipeline schedule 'gpipe'; choose from 1f1b, 2bw, uniform-D" in schedule
  assert "schedule '2bw' needs mode 'weight_stashing'" in no_stash and "'no_stashing'" in no_stash
  assert "micro_batches >= P = 2" in too_few and "got 1" in too_few
  assert "micro_batches=2 needs a batched schedule such as '2bw'" in not_2bw
  # optimizers built for 1F1B's delays in a pipeline of another schedule: both named
  assert ("built for stage delays (1, 0), but the pipeline's schedule 'uniform-2' has delays (2, 2)"
          in delays), delays
  assert "batch size 8 is not divisible by the 1 devices of the 'data' axis times 3 micro-batches" in split


BATCHED = ("adam-2bw-P4", "adam-2bw-P3-M8", "adam-2bw-P2xD2", "adam-2bw-P1-M4", "adam-uniform3-P4",
           "adam-uniform2-P2xD2-M4", "adam-uniform2-P1-M2")


def test_batched_schedules_equal_the_emulator_and_a_delayed_loop_in_float64(got):
  # Every micro-batch of batch t runs on W(t - tau), the stage accumulates the batch's gradient and
  # applies it once: the emulator's step and a plain loop whose update t applies the gradient at
  # W(t - tau), to float64 round-off, with M = P, M > P and data parallelism; 2BW (tau = 1, none at
  # P = 1) and a uniform delay (tau = D at every P), the third schedule.
  for name in BATCHED:
    r = got[name]
    assert r["steps"] == list(range(8)), name  # every batch completes once, in order
    assert r["loss"] < 1e-12 and r["norm"] < 1e-12 and r["params"] < 1e-12, (name, r)
    assert r["vs_loop"] < 1e-12, (name, r)
    assert r["programs"] == 1, name  # one compile for the runs and the drain
  assert got["adam-2bw-P4"]["vs_sync"] > 1e-3  # one update behind is not synchronous
  assert got["adam-uniform3-P4"]["vs_sync"] > 1e-3


def test_batched_schedules_keep_their_versions_and_move_m_micro_batches_per_batch(got):
  for name, micro, versions in (("adam-2bw-P4", 4, 1), ("adam-2bw-P3-M8", 8, 1), ("adam-2bw-P2xD2", 2, 1),
                                ("adam-uniform3-P4", 4, 3), ("adam-uniform2-P2xD2-M4", 4, 2)):
    r = got[name]
    n_data = 2 if "D2" in name else 1
    # the earlier versions (2BW: one; uniform-D: D) and the gradient accumulator, copies of a
    # stage's 30 float64 weights, as the emulator's tau + 1 versions (1F1B's ring holds P - k)
    assert r["stash"] == [(versions + 1) * 30 * 8] * len(r["stash"]), (name, r)
    assert r["buffer_bytes"] == r["emulator_buffer_bytes"], (name, r)
    assert r["moved_per_micro_batch"] == micro * r["live_bytes"] * n_data, (name, r)


def test_a_typed_prng_key_in_the_optimizer_state_travels_with_the_stage(got):
  # optax.add_noise keeps a typed key: the device pipeline packs its key data and draws the
  # emulator's noise (and the noise is really there: the run differs from Adam without it)
  assert got["noise"]["loss"] < 1e-12 and got["noise"]["params"] < 1e-12, got["noise"]
  assert got["noise"]["vs_no_noise"] > 1e-4, got["noise"]


def test_a_resumed_pipeline_finishes_without_a_run_and_refuses_a_consumed_state(got):
  r = got["resumed"]
  assert r["steps"][0] == r["steps"][1] == [3]  # P = 2 after a chunk of 4: batch 3 in flight
  assert r["loss"] == 0.0 and r["params"] == 0.0, r
  assert "DevicePipeline.run/finish: this state was consumed by an earlier call" in r["consumed"]


def test_the_data_devices_average_each_gradient_once(got):
  # 1F1B: the one gradient all-reduce sits under a single cond, a stage's backward phases (it ran in
  # every phase before: twice the traffic); 2BW: under the update's batch-end cond as well, once
  # per batch of M micro-batches. Every P = 2 x D = 2 run equals the emulator (tests above).
  width = 5 * 5 + 5  # a stage's gradient: its 5 x 5 kernel and bias
  assert got["adam-ws-P2xD2"]["gradient_psums"] == {"1": (width + 1) / width}, got["adam-ws-P2xD2"]
  # (2BW: one all-reduce in each stage's update branch, a device runs its own stage's: P = 2 of them)
  assert got["adam-2bw-P2xD2"]["gradient_psums"] == {"1": 1 / width, "2": 2.0}, got["adam-2bw-P2xD2"]
