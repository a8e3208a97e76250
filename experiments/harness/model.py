"""Decoder-only Transformer (Flax NNX) and its split into pipeline stages.

The model is the paper's: learned position embeddings, pre-LayerNorm blocks, a ReLU MLP of width
4x, an untied output head, every weight initialised N(0, 0.02). An optional mixture-of-experts MLP
(top-k routing, Switch-style load-balancing loss) serves the MoE experiment.

Pure-function view: ``params = nnx.split(model, nnx.Param)[1].to_pure_dict()`` is a nested dict;
``forward(graphdef, params, tokens)`` runs it. ``stage_labels`` gives every leaf its pipeline stage
and ``stage_functions`` returns P functions ``(stage_params, activations) -> activations`` whose
composition is the full forward. Activations between stages are ``(hidden, aux_loss)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import rotation

_INIT = nnx.initializers.normal(stddev=0.02)
_ACTIVATIONS = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape of the Transformer.

  Attributes:
    num_blocks: number of Transformer blocks.
    width: residual stream width.
    num_heads: attention heads (must divide ``width``).
    context: maximum sequence length (learned position embeddings).
    vocab_size: token vocabulary.
    mlp_ratio: MLP hidden width as a multiple of ``width``.
    activation: MLP nonlinearity, one of ``relu``, ``gelu``, ``silu``.
    num_experts: 0 for a dense MLP, else the number of MoE experts.
    top_k: experts per token when ``num_experts > 0``.
    remat: ``None`` (keep every activation for the backward pass) or the name of a
      ``jax.checkpoint_policies`` policy (``"nothing_saveable"``: keep only each block's input and
      recompute the block in the backward pass, one extra forward; ``"dots_with_no_batch_dims_saveable"``
      keeps the weight matmuls' outputs). Applied per Transformer block. Same gradients.
    loss_chunk: ``None`` (the loss from the full logits) or tokens per chunk: the output head and the
      cross-entropy are computed chunk by chunk and recomputed in the backward pass, so that the
      ``(tokens, vocab_size)`` logits never exist at once (a 50,257 vocabulary: 3.3 GB per
      micro-batch of 32 x 512 tokens). Same loss and gradients to float32 round-off.
  """

  num_blocks: int = 32
  width: int = 384
  num_heads: int = 6
  context: int = 512
  vocab_size: int = 50257
  mlp_ratio: int = 4
  activation: str = "relu"
  num_experts: int = 0
  top_k: int = 2
  remat: str | None = None
  loss_chunk: int | None = None

  def __post_init__(self):
    for name in ("num_blocks", "width", "num_heads", "context", "vocab_size", "mlp_ratio"):
      if getattr(self, name) < 1:
        raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.width % self.num_heads:
      raise ValueError(f"width {self.width} is not divisible by num_heads {self.num_heads}")
    if self.activation not in _ACTIVATIONS:
      raise ValueError(f"unknown activation {self.activation!r}; choose from {sorted(_ACTIVATIONS)}")
    if self.remat is not None and not callable(getattr(jax.checkpoint_policies, str(self.remat), None)):
      raise ValueError(f"unknown remat policy {self.remat!r}; choose a jax.checkpoint_policies name, "
                       "e.g. 'nothing_saveable'")
    if self.loss_chunk is not None and self.loss_chunk < 1:
      raise ValueError(f"ModelConfig.loss_chunk must be None or >= 1, got {self.loss_chunk}")
    if self.num_experts < 0 or (self.num_experts and not 1 <= self.top_k <= self.num_experts):
      raise ValueError(
          f"need num_experts >= 0 and 1 <= top_k <= num_experts, got {self.num_experts}, {self.top_k}")


CONFIGS = {
    # The paper's 95M model (about 95.6M parameters).
    "paper-95m": ModelConfig(),
    # CPU configs: deep and narrow, so that many pipeline stages fit.
    "cpu-tiny": ModelConfig(num_blocks=4, width=32, num_heads=2, context=32, vocab_size=256),
    "cpu-small": ModelConfig(num_blocks=16, width=64, num_heads=4, context=64, vocab_size=256),
    "cpu-deep": ModelConfig(num_blocks=16, width=32, num_heads=2, context=32, vocab_size=256),
    "cpu-moe": ModelConfig(num_blocks=8, width=64, num_heads=4, context=64, vocab_size=256,
                           num_experts=4, top_k=2),
}


def _linear(n_in, n_out, rngs):
  return nnx.Linear(n_in, n_out, kernel_init=_INIT, bias_init=nnx.initializers.zeros, rngs=rngs)


class Attention(nnx.Module):
  """Causal multi-head self-attention."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.num_heads = cfg.num_heads
    self.q = _linear(cfg.width, cfg.width, rngs)
    self.k = _linear(cfg.width, cfg.width, rngs)
    self.v = _linear(cfg.width, cfg.width, rngs)
    self.o = _linear(cfg.width, cfg.width, rngs)

  def __call__(self, x):
    b, t, d = x.shape
    split = lambda y: y.reshape(b, t, self.num_heads, d // self.num_heads)
    # JAX's fused attention: cuDNN's flash kernel on GPUs (no (t, t) scores kept), XLA elsewhere.
    out = jax.nn.dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
    return self.o(out.reshape(b, t, d))


class Mlp(nnx.Module):
  """Dense MLP ``act(x W1) W2``."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.act = _ACTIVATIONS[cfg.activation]
    self.fc1 = _linear(cfg.width, cfg.mlp_ratio * cfg.width, rngs)
    self.fc2 = _linear(cfg.mlp_ratio * cfg.width, cfg.width, rngs)

  def __call__(self, x):
    return self.fc2(self.act(self.fc1(x)))


class MoeMlp(nnx.Module):
  """Top-k mixture of dense MLP experts with the Switch Transformer load-balancing loss.

  Every expert is evaluated densely and combined with the (renormalised) top-k gates, which is
  exact and cheap at the small expert counts used here. Returns ``(output, aux_loss)`` where
  ``aux_loss = E * sum_e f_e * p_e`` (``f_e``: share of routing slots sent to expert e, ``p_e``: mean
  router probability of e); it equals 1 for perfectly uniform routing. Both means are over the
  tokens this call sees: on a device pipeline with several data devices (``--execution devices``)
  that is each device's shard of the micro-batch (``pipeline_sim.DevicePipeline``), in the
  emulator the whole micro-batch.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.top_k = cfg.top_k
    self.router = _linear(cfg.width, cfg.num_experts, rngs)
    self.experts = nnx.List([Mlp(cfg, rngs) for _ in range(cfg.num_experts)])

  def routing(self, x):
    """Returns (gates (..., E) with exactly top_k non-zeros per token, router probabilities)."""
    probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, self.top_k)
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    num_experts = probs.shape[-1]
    gates = jnp.sum(jax.nn.one_hot(top_i, num_experts) * top_p[..., None], axis=-2)
    return gates, probs

  def __call__(self, x):
    gates, probs = self.routing(x)
    outs = jnp.stack([expert(x) for expert in self.experts], axis=-2)  # (..., E, width)
    y = jnp.sum(outs * gates[..., None].astype(outs.dtype), axis=-2)
    num_experts = probs.shape[-1]
    share = jnp.mean((gates > 0).astype(jnp.float32), axis=tuple(range(gates.ndim - 1))) / self.top_k
    mean_prob = jnp.mean(probs, axis=tuple(range(probs.ndim - 1)))
    return y, num_experts * jnp.sum(share * mean_prob)


class Block(nnx.Module):
  """Pre-LN block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``; returns (x, aux_loss)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(cfg.width, rngs=rngs)
    self.attn = Attention(cfg, rngs)
    self.ln2 = nnx.LayerNorm(cfg.width, rngs=rngs)
    self.mlp = MoeMlp(cfg, rngs) if cfg.num_experts else Mlp(cfg, rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    out = self.mlp(self.ln2(x))
    y, aux = out if isinstance(out, tuple) else (out, jnp.zeros((), jnp.float32))
    return x + y, aux


class Embedding(nnx.Module):
  """Token plus learned position embeddings."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.tok = nnx.Embed(cfg.vocab_size, cfg.width, embedding_init=_INIT, rngs=rngs)
    self.pos = nnx.Embed(cfg.context, cfg.width, embedding_init=_INIT, rngs=rngs)

  def __call__(self, tokens):
    # Out-of-range positions or ids would read NaN rows (``nnx.Embed``) and give all-NaN logits:
    # the length is checked here, at trace time; ids are checked where data is loaded
    # (``experiments.harness.data``), since a check of traced values costs a reduction every step.
    if tokens.shape[-1] > self.pos.num_embeddings:
      raise ValueError(f"sequence length {tokens.shape[-1]} is longer than the model's context "
                       f"{self.pos.num_embeddings}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
    return self.tok(tokens) + self.pos(jnp.arange(tokens.shape[-1]))


class Head(nnx.Module):
  """Final LayerNorm and untied output projection."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.ln_f = nnx.LayerNorm(cfg.width, rngs=rngs)
    self.out = _linear(cfg.width, cfg.vocab_size, rngs)

  def __call__(self, x):
    return self.out(self.ln_f(x))


def run_blocks(block_graphdef, block_params: list, x, remat: str | None):
  """Transformer blocks in order: ``(x, sum of their aux losses)``.

  Without ``remat`` a plain loop. With it, a ``lax.scan`` over the blocks' stacked parameters whose
  body is ``jax.checkpoint``-ed with the named ``jax.checkpoint_policies`` policy: the backward pass
  keeps only each block's input and recomputes the block. (The scan matters: XLA schedules the
  recomputations of an unrolled loop of checkpoints early, and the CPU program's temporaries then
  stay those of no remat: 276 MiB per paper-95m block at batch 8 either way, against 20 MiB scanned.)
  """
  aux = jnp.zeros((), jnp.float32)
  if remat is None:
    for params in block_params:
      x, a = nnx.merge(block_graphdef, params)(x)
      aux = aux + a.astype(jnp.float32)
    return x, aux

  def body(carry, params):
    h, total = carry
    h, a = nnx.merge(block_graphdef, params)(h)
    return (h, total + a.astype(jnp.float32)), None

  body = jax.checkpoint(body, policy=getattr(jax.checkpoint_policies, remat))
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *block_params)
  (x, aux), _ = jax.lax.scan(body, (x, aux), stacked)
  return x, aux


class Transformer(nnx.Module):
  """Decoder-only Transformer; ``model(tokens) -> (logits, aux_loss)``.

  ``tokens``: integer ids in ``[0, vocab_size)``, shape ``(..., t)`` with ``t <= context`` (a longer
  sequence is a ``ValueError`` at trace time; ids outside the vocabulary give NaN logits, so data
  loaders must check them, as ``experiments.harness.data`` does).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embedding(cfg, rngs)
    self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_blocks)])
    self.head = Head(cfg, rngs)

  def __call__(self, tokens):
    x, aux = self.features(tokens)
    return self.head.out(x), aux

  def features(self, tokens):
    """``tokens -> (final hidden state after the last LayerNorm, aux_loss)``: everything but the
    output projection (which ``chunked_cross_entropy`` applies chunk by chunk)."""
    split = [nnx.split(block) for block in self.blocks]
    x, aux = run_blocks(split[0][0], [params for _, params in split], self.embed(tokens), self.cfg.remat)
    return self.head.ln_f(x), aux


def init(cfg: ModelConfig, seed: int = 0):
  """Returns ``(graphdef, params)`` with ``params`` a nested dict of arrays."""
  graphdef, state = nnx.split(Transformer(cfg, nnx.Rngs(seed)), nnx.Param)
  return graphdef, nnx.to_pure_dict(state)


def abstract_params(cfg: ModelConfig):
  """Parameter shapes (``jax.ShapeDtypeStruct``) without allocating anything."""
  return jax.eval_shape(lambda: init(cfg)[1])


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))


def forward(graphdef, params, tokens):
  """Full forward pass ``tokens -> (logits, aux_loss)``."""
  return nnx.merge(graphdef, params)(tokens)


def rotation_mask(params):
  """The paper's choice of rotated leaves: the 2-D kernels of attention and MLP (incl. experts)."""

  def keep(path, leaf):
    names = {getattr(k, "key", None) for k in path}
    return jnp.ndim(leaf) == 2 and bool(names & {"attn", "mlp"}) and "kernel" in names

  return jax.tree_util.tree_map_with_path(keep, params)


def rotation_dims(params):
  """``rotation_mask`` as ``weight_dimension_numbers``: the selected kernels as ``(in, out)``
  matrices (``rotation.LINEAR``), every other leaf plain Adam (``None``)."""
  return jax.tree.map(lambda rotate: rotation.LINEAR if rotate else None, rotation_mask(params))


def train_flops(cfg: ModelConfig, batch_size: int, remat: bool = False) -> float:
  """FLOPs of one forward and backward pass over ``batch_size`` sequences of ``cfg.context`` tokens,
  counted from the shapes (multiply-adds x 2; the backward twice the forward; ``remat`` adds one
  forward of the blocks): the matmuls of the blocks and the head, and attention's two
  ``(t x t)`` products per head. Where XLA's own count cannot be used (a scan's body counts once)."""
  tokens = batch_size * cfg.context
  hidden = cfg.mlp_ratio * cfg.width * max(1, cfg.top_k if cfg.num_experts else 1)
  block = 2 * tokens * (4 * cfg.width * cfg.width + 2 * cfg.width * hidden)
  block += 2 * 2 * batch_size * cfg.context * cfg.context * cfg.width  # q k^T and p v
  head = 2 * tokens * cfg.width * cfg.vocab_size
  forward = cfg.num_blocks * block + head
  return 3.0 * forward + (cfg.num_blocks * block if remat else 0.0)


def cross_entropy(logits, targets):
  """Mean next-token cross-entropy in float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def chunked_cross_entropy(hidden, kernel, bias, targets, chunk: int):
  """``cross_entropy(hidden @ kernel + bias, targets)`` without the full logits: the tokens are
  taken ``chunk`` at a time (the last chunk padded and masked), each chunk's logits computed, reduced
  and recomputed in the backward pass (``jax.checkpoint``), so at most one chunk's ``(chunk, vocab)``
  logits exist at once.

  Args:
    hidden: ``(..., width)`` final hidden states (after the last LayerNorm).
    kernel: ``(width, vocab)`` output projection.
    bias: ``(vocab,)``.
    targets: ``(...)`` integer ids.
    chunk: tokens per chunk.
  """
  h = hidden.reshape(-1, hidden.shape[-1])
  y = targets.reshape(-1)
  n = h.shape[0]
  chunk = min(chunk, n)
  pad = -n % chunk
  h = jnp.pad(h, ((0, pad), (0, 0))).reshape(-1, chunk, h.shape[-1])
  y = jnp.pad(y, (0, pad)).reshape(-1, chunk)
  valid = (jnp.arange(n + pad) < n).reshape(-1, chunk)

  @jax.checkpoint
  def nll(args):
    hc, yc, vc = args
    logits = (hc @ kernel.astype(hc.dtype) + bias.astype(hc.dtype)).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.where(vc, jnp.take_along_axis(logp, yc[:, None], axis=-1)[:, 0], 0.0))

  return jnp.sum(jax.lax.map(nll, (h, y, valid))) / n


DTYPES = ("float32", "bfloat16")


def compute_dtype(params, dtype: str = "float32"):
  """Parameters cast for the forward pass: ``bfloat16`` runs activations and matmuls in bf16 while
  the parameters (and their gradients and optimizer states) stay float32."""
  if dtype not in DTYPES:
    raise ValueError(f"unknown dtype {dtype!r}; choose from {DTYPES}")
  if dtype == "float32":
    return params
  return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x is not None else None, params)


def make_loss(graphdef, moe_coef: float = 0.01, dtype: str = "float32") -> Callable[[Any, Any], jax.Array]:
  """``loss(params, (inputs, targets))``: cross-entropy plus ``moe_coef`` x load-balancing loss,
  the forward in ``dtype`` (see ``compute_dtype``), the loss in float32."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, compute_dtype(params, dtype))
    if model.cfg.loss_chunk is None:
      logits, aux = model(batch[0])
      return cross_entropy(logits, batch[1]) + moe_coef * aux
    hidden, aux = model.features(batch[0])
    out = model.head.out
    return (chunked_cross_entropy(hidden, out.kernel[...], out.bias[...], batch[1], model.cfg.loss_chunk)
            + moe_coef * aux)

  return loss_fn


# ----------------------------------------------------------------------------- pipeline stages


def blocks_per_stage(num_blocks: int, num_stages: int) -> int:
  """Blocks in each of ``num_stages`` equal contiguous stages; ``ValueError`` if impossible."""
  if num_stages < 1:
    raise ValueError(f"number of stages must be >= 1, got {num_stages}")
  if num_stages > num_blocks:
    raise ValueError(f"{num_stages} stages is more than the model's {num_blocks} blocks")
  if num_blocks % num_stages:
    raise ValueError(
        f"{num_blocks} blocks cannot be split into {num_stages} equal stages "
        f"({num_blocks} % {num_stages} = {num_blocks % num_stages})")
  return num_blocks // num_stages


def stage_labels(params, num_stages: int):
  """Stage index (int) of every leaf of ``params``: embeddings in stage 0, block ``i`` in stage
  ``i // blocks_per_stage``, final norm and head in stage ``num_stages - 1``."""
  per = blocks_per_stage(len(params["blocks"]), num_stages)
  return {
      "embed": jax.tree.map(lambda _: 0, params["embed"]),
      "blocks": {i: jax.tree.map(lambda _, i=i: i // per, b) for i, b in params["blocks"].items()},
      "head": jax.tree.map(lambda _: num_stages - 1, params["head"]),
  }


def stage_functions(cfg: ModelConfig, num_stages: int, dtype: str = "float32"):
  """P functions ``f_k(stage_params, activations) -> activations`` composing to ``forward``.

  Stage 0 takes the token array; every other stage takes and returns ``(hidden, aux_loss)``; the
  last returns ``(logits, aux_loss)``. ``stage_params`` may be the full parameter dict or one with
  other stages' leaves replaced by ``None``: each function reads only its own leaves.
  """
  per = blocks_per_stage(cfg.num_blocks, num_stages)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
  emb_g, blk_g, head_g = (nnx.graphdef(m) for m in (abstract.embed, abstract.blocks[0], abstract.head))

  def make(k):
    def stage_fn(p, act):
      p = compute_dtype(p, dtype)
      if k == 0:
        act = (nnx.merge(emb_g, p["embed"])(act), jnp.zeros((), jnp.float32))
      h, aux = act
      h, a = run_blocks(blk_g, [p["blocks"][i] for i in range(k * per, (k + 1) * per)], h, cfg.remat)
      aux = aux + a
      if k == num_stages - 1:
        h = nnx.merge(head_g, p["head"])(h)
      return h, aux

    return stage_fn

  return [make(k) for k in range(num_stages)]
