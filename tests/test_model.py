import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.harness import model as model_lib

TINY = model_lib.CONFIGS["cpu-tiny"]


@pytest.fixture(scope="module")
def tiny():
  graphdef, params = model_lib.init(TINY, seed=0)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, TINY.context), 0, TINY.vocab_size)
  return graphdef, params, tokens


def test_paper_95m_parameter_count_without_allocation():
  shapes = model_lib.abstract_params(model_lib.CONFIGS["paper-95m"])
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
  # Independent count: embeddings + head + 32 blocks (4 attention + 2 MLP matrices with biases,
  # two LayerNorms) + final LayerNorm.
  v, d, c, h = 50257, 384, 512, 4 * 384
  block = 4 * (d * d + d) + (d * h + h) + (h * d + d) + 2 * 2 * d
  expected = v * d + c * d + 32 * block + 2 * d + d * v + v
  assert model_lib.count_params(shapes) == expected
  assert abs(expected - 95.6e6) / 95.6e6 < 0.005


def test_forward_shapes_and_init_scale(tiny):
  graphdef, params, tokens = tiny
  logits, aux = jax.jit(lambda p, t: model_lib.forward(graphdef, p, t))(params, tokens)
  assert logits.shape == (2, TINY.context, TINY.vocab_size)
  assert float(aux) == 0.0
  kernel = np.asarray(params["blocks"][0]["mlp"]["fc1"]["kernel"])
  assert kernel.shape == (TINY.width, 4 * TINY.width)
  assert abs(kernel.std() - 0.02) < 0.004
  # Untied head: the output projection is a separate array from the token embedding.
  assert params["head"]["out"]["kernel"].shape == (TINY.width, TINY.vocab_size)


def test_forward_is_causal(tiny):
  graphdef, params, tokens = tiny
  f = jax.jit(lambda t: model_lib.forward(graphdef, params, t)[0])
  changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % TINY.vocab_size)
  np.testing.assert_allclose(f(tokens)[:, :-1], f(changed)[:, :-1], atol=1e-6)
  assert not np.allclose(f(tokens)[:, -1], f(changed)[:, -1])


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_stage_labels_cover_every_leaf_contiguously(tiny, num_stages):
  _, params, _ = tiny
  labels = model_lib.stage_labels(params, num_stages)
  assert jax.tree.structure(labels) == jax.tree.structure(params)
  flat = [l for _, l in jax.tree_util.tree_flatten_with_path(labels)[0]]
  assert set(flat) == set(range(num_stages))
  # Leaves in model order (embed, blocks 0.., head) have non-decreasing stages.
  order = ([("embed", l) for l in jax.tree.leaves(labels["embed"])]
           + [(i, l) for i in sorted(labels["blocks"]) for l in jax.tree.leaves(labels["blocks"][i])]
           + [("head", l) for l in jax.tree.leaves(labels["head"])])
  stages = [l for _, l in order]
  assert stages == sorted(stages)
  assert set(jax.tree.leaves(labels["embed"])) == {0}
  assert set(jax.tree.leaves(labels["head"])) == {num_stages - 1}
  per_stage = [sum(1 for i in labels["blocks"] if jax.tree.leaves(labels["blocks"][i])[0] == k)
               for k in range(num_stages)]
  assert per_stage == [TINY.num_blocks // num_stages] * num_stages


@pytest.mark.parametrize("num_stages", [2, 4])
def test_composed_stage_functions_equal_forward(tiny, num_stages):
  graphdef, params, tokens = tiny
  fns = model_lib.stage_functions(TINY, num_stages)
  labels = model_lib.stage_labels(params, num_stages)

  @jax.jit
  def composed(params):
    act = tokens
    for k, f in enumerate(fns):  # each stage sees only its own leaves
      act = f(jax.tree.map(lambda p, l, k=k: p if l == k else None, params, labels), act)
    return act

  logits, aux = composed(params)
  ref_logits, ref_aux = model_lib.forward(graphdef, params, tokens)
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
  np.testing.assert_allclose(aux, ref_aux)


@pytest.mark.parametrize("num_stages,match", [(0, ">= 1"), (5, "more than the model's 4 blocks"),
                                              (3, "4 blocks cannot be split into 3")])
def test_bad_stage_counts(tiny, num_stages, match):
  _, params, _ = tiny
  with pytest.raises(ValueError, match=match):
    model_lib.stage_labels(params, num_stages)
  with pytest.raises(ValueError, match=match):
    model_lib.stage_functions(TINY, num_stages)


def test_bad_config():
  with pytest.raises(ValueError, match="not divisible by num_heads 3"):
    model_lib.ModelConfig(width=32, num_heads=3)
  with pytest.raises(ValueError, match="unknown activation 'tanhh'"):
    model_lib.ModelConfig(activation="tanhh")
  with pytest.raises(ValueError, match="unknown remat policy 'everything'"):
    model_lib.ModelConfig(remat="everything")
  with pytest.raises(ValueError, match="loss_chunk must be None or >= 1, got 0"):
    model_lib.ModelConfig(loss_chunk=0)


def test_moe_routing_and_balance_loss():
  cfg = model_lib.ModelConfig(num_blocks=2, width=16, num_heads=2, context=8, vocab_size=32,
                      num_experts=4, top_k=2)
  graphdef, params = model_lib.init(cfg, seed=3)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (3, 8), 0, 32)
  logits, aux = jax.jit(lambda p: model_lib.forward(graphdef, p, tokens))(params)
  assert logits.shape == (3, 8, 32)
  from flax import nnx
  moe = nnx.merge(graphdef, params).blocks[0].mlp
  x = jax.random.normal(jax.random.PRNGKey(2), (3, 8, 16))
  gates, probs = moe.routing(x)
  assert gates.shape == (3, 8, 4)
  np.testing.assert_array_equal(np.sum(np.asarray(gates) > 0, -1), 2)
  np.testing.assert_allclose(np.sum(gates, -1), 1.0, rtol=1e-5)
  # Independent balance loss: E * sum_e (share of routing slots) * (mean router probability).
  g, p = np.asarray(gates).reshape(-1, 4), np.asarray(probs).reshape(-1, 4)
  expected = 4 * np.sum((g > 0).mean(0) / 2 * p.mean(0))
  _, aux_one = moe(x)
  np.testing.assert_allclose(aux_one, expected, rtol=1e-5)
  # Output is the gate-weighted sum of the experts' outputs.
  y, _ = moe(x)
  manual = sum(gates[..., e:e + 1] * moe.experts[e](x) for e in range(4))
  np.testing.assert_allclose(y, manual, atol=1e-6)
  # Two blocks contribute to the model's aux loss; each is >= 1 (uniform routing minimises it).
  assert float(aux) >= 2.0 - 1e-4


def test_sequences_longer_than_the_context_are_an_error_at_trace_time(tiny):
  graphdef, params, _ = tiny
  long = jax.numpy.zeros((2, TINY.context + 1), jax.numpy.int32)
  with pytest.raises(ValueError, match=f"sequence length {TINY.context + 1} is longer than the model's "
                                       f"context {TINY.context}"):
    jax.jit(lambda p, t: model_lib.forward(graphdef, p, t))(params, long)
  stage0 = model_lib.stage_functions(TINY, 2)[0]
  with pytest.raises(ValueError, match="longer than the model's context"):
    stage0(params, long)


def _reference_attention(q, k, v):
  """The model's attention before jax.nn.dot_product_attention: explicit scores, causal mask."""
  t, d = q.shape[1], q.shape[-1]
  logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d).astype(q.dtype)
  logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, jnp.finfo(logits.dtype).min)
  return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


def test_attention_equals_explicit_causal_softmax_attention(tiny, monkeypatch):
  graphdef, params, tokens = tiny
  loss = lambda p: model_lib.make_loss(graphdef)(p, (tokens, tokens))
  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  monkeypatch.setattr(jax.nn, "dot_product_attention",
                      lambda q, k, v, is_causal: _reference_attention(q, k, v))
  want, want_grads = jax.value_and_grad(loss)(params)
  np.testing.assert_allclose(value, want, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, want_grads)


@pytest.mark.parametrize("remat", ["nothing_saveable", "dots_with_no_batch_dims_saveable"])
def test_rematerialised_blocks_give_the_same_gradients(tiny, remat):
  graphdef, params, tokens = tiny
  cfg = dataclasses.replace(TINY, remat=remat)
  graphdef_r, params_r = model_lib.init(cfg, seed=0)
  jax.tree.map(np.testing.assert_array_equal, params_r, params)
  grad = lambda g: jax.jit(jax.grad(lambda p: model_lib.make_loss(g)(p, (tokens, tokens))))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grad(graphdef_r),
               grad(graphdef))
  # the staged functions (devices, no_stashing) rematerialise too, to the same numbers
  stages = model_lib.stage_functions(cfg, 2)
  act = tokens
  for f in stages:
    act = f(params, act)
  np.testing.assert_allclose(act[0], model_lib.forward(graphdef, params, tokens)[0], rtol=1e-5, atol=1e-6)
  # and the blocks run as one scan whose body is a checkpoint with the named policy
  eqns = jax.make_jaxpr(lambda p: model_lib.make_loss(graphdef_r)(p, (tokens, tokens)))(params).eqns
  scans = [e for e in eqns if e.primitive.name == "scan"]
  assert len(scans) == 1 and scans[0].params["length"] == TINY.num_blocks
  body = scans[0].params["jaxpr"].jaxpr.eqns
  assert [e.params["policy"] for e in body if e.primitive.name in ("checkpoint", "remat2")] == [
      getattr(jax.checkpoint_policies, remat)]


@pytest.mark.parametrize("chunk", [7, 16, 64, 10_000])  # ragged, even, whole and larger than the batch
def test_chunked_cross_entropy_equals_the_plain_one(tiny, chunk):
  graphdef, params, tokens = tiny
  graphdef_c, _ = model_lib.init(dataclasses.replace(TINY, loss_chunk=chunk), seed=0)
  plain = jax.jit(jax.value_and_grad(lambda p: model_lib.make_loss(graphdef)(p, (tokens, tokens))))
  chunked = jax.jit(jax.value_and_grad(lambda p: model_lib.make_loss(graphdef_c)(p, (tokens, tokens))))
  (v0, g0), (v1, g1) = plain(params), chunked(params)
  np.testing.assert_allclose(v1, v0, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g1, g0)
  # the chunk function is a checkpointed map: at most one chunk's logits, recomputed backwards
  hidden = jnp.zeros((64, 32))
  jaxpr = jax.make_jaxpr(lambda k: model_lib.chunked_cross_entropy(
      hidden, k, jnp.zeros(50257), jnp.zeros(64, jnp.int32), 16))(jnp.zeros((32, 50257)))
  assert not any(v.aval.shape[:1] == (64,) and 50257 in v.aval.shape
                 for e in jaxpr.jaxpr.eqns for v in e.outvars if hasattr(v.aval, "shape"))


def test_train_flops_counts_what_xla_counts():
  cfg = dataclasses.replace(model_lib.CONFIGS["cpu-small"], vocab_size=512)
  graphdef, params = model_lib.init(cfg)
  tokens = jax.ShapeDtypeStruct((4, cfg.context), jnp.int32)
  compiled = jax.jit(jax.grad(lambda p, t: model_lib.make_loss(graphdef)(p, (t, t)))).lower(
      params, tokens).compile()
  analysis = compiled.cost_analysis()
  xla = (analysis[0] if isinstance(analysis, (list, tuple)) else analysis)["flops"]
  assert abs(model_lib.train_flops(cfg, 4) - xla) < 0.05 * xla, (model_lib.train_flops(cfg, 4), xla)
  assert model_lib.train_flops(cfg, 4, remat=True) > model_lib.train_flops(cfg, 4)
