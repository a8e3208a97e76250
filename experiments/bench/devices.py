"""``python -m experiments.bench.devices``: the real pipeline across devices, measured in one run.

On the cpu-deep model with PipeDream's AdamW (batch 16) at P stages, ratios only:

- throughput of the asynchronous 1F1B stream against the same stages with a flush after every chunk
  of C micro-batches (a synchronous schedule, PipeDream-Flush / GPipe: ``2(P - 1)`` extra phases per
  flush), next to the ideal ratio ``(C + P - 1) / C``: the bubble that asynchrony removes;
- per-micro-batch time of the device pipeline against the emulator on one device;
- bytes moved between stages per micro-batch (``collective_bytes``, from the program's jaxpr) and
  the peak bytes each device holds while ``DevicePipeline.init`` runs (``sampled_peak_bytes``);
- memory: each device's share (its stage's parameters, optimizer state, weight stash and in-flight
  inputs) against the emulator's single device (every stage and every ring), from XLA's memory
  analysis of the two compiled programs, and the weight stash per stage.

``--cpu-devices N`` forces N host devices (set before JAX starts). Forced CPU devices share the
machine's cores, so an idle device lends its core to the others: the measured bubble is smaller than
on real accelerators, where an idle device's time is lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

from experiments.harness.config import RunConfig


def _timed(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return sorted(times)[len(times) // 2]


def collective_bytes(closed_jaxpr) -> dict:
  """Bytes one call of a traced program moves between devices, from its jaxpr: ``ppermute``
  operands times their source-target pairs (summed over the mesh's data columns by the caller),
  and ``psum``/``pmean`` operands per device (the gradient all-reduce over the data axis).

  A ``scan`` counts its body ``length`` times; a ``cond`` counts the mean of its branches (the
  pipeline's only collective-carrying cond alternates its two branches phase by phase)."""
  import numpy as np

  def nbytes(avals):
    return sum(int(np.prod(a.shape, dtype=int)) * a.dtype.itemsize for a in avals)

  def walk(jaxpr):
    total = {"ppermute": 0.0, "psum": 0.0}
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name == "ppermute":
        total["ppermute"] += nbytes(v.aval for v in eqn.invars) * len(eqn.params["perm"])
      elif name in ("psum", "pmean", "psum_invariant"):
        total["psum"] += nbytes(v.aval for v in eqn.invars)
      subs = []
      for v in eqn.params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
          inner = getattr(x, "jaxpr", x)
          if hasattr(inner, "eqns"):
            subs.append(walk(inner))
      if not subs:
        continue
      scale = eqn.params.get("length", 1) / (len(subs) if name == "cond" else 1)
      for sub in subs:
        for k in total:
          total[k] += scale * sub[k]
    return total

  return walk(closed_jaxpr.jaxpr)


def sampled_peak_bytes(fn):
  """``(fn(), {device: peak bytes})``: the largest total of live JAX arrays each device held while
  ``fn`` ran, sampled by a thread every millisecond (a lower bound of the allocator's peak: CPU
  devices report no memory statistics; temporaries inside one compiled computation are not seen)."""
  import threading

  import jax

  peak, stop = {}, threading.Event()

  def sample():
    while not stop.is_set():
      for d, b in resident().items():
        peak[d] = max(peak.get(d, 0), b)
      stop.wait(0.001)

  def resident():  # bytes per device, each buffer once (an array and its shards may share one)
    seen = {}
    for a in jax.live_arrays():
      try:
        for shard in a.addressable_shards:
          seen[(shard.device, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
      except Exception:  # noqa: BLE001 - an array deleted while sampled
        continue
    out = {}
    for (d, _), b in seen.items():
      out[d] = out.get(d, 0) + b
    return out

  before = resident()
  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  try:
    out = fn()
  finally:
    stop.set()
    thread.join()
  return out, {d: b - before.get(d, 0) for d, b in peak.items()}


def _memory(compiled) -> int:
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.temp_size_in_bytes) if m is not None else 0


def _data_parallel_line(emu, params, batches, devices) -> str:
  """The emulator data-parallel over ``devices``: XLA's memory per device, state replicated or fsdp."""
  import pipeline_sim as ps

  mesh = ps.data_mesh(devices)
  data_batches = ps.shard_batches(batches, mesh)
  replicated = _memory(emu.run.lower(ps.replicate(emu.init(params), mesh), data_batches).compile())
  sharded = _memory(emu.run.lower(ps.fsdp(emu.init(params), mesh), data_batches).compile())
  return (f"emulator data-parallel over {len(devices)} devices, memory per device: replicated state "
          f"{replicated / 2**20:.2f} MiB, fsdp {sharded / 2**20:.2f} MiB (ratio {sharded / replicated:.3f})")


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.bench.devices", description=__doc__)
  parser.add_argument("--stages", type=int, default=4)
  parser.add_argument("--chunk", type=int, default=32, help="micro-batches between flushes")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--cpu-devices", type=int, help="force this many host devices (CPU)")
  args = parser.parse_args(argv)
  if args.cpu_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.cpu_devices}")
  import jax
  import numpy as np

  from experiments.harness import data as data_lib
  from experiments.harness import runs

  devices = jax.local_devices()[:args.stages]
  if len(devices) < args.stages:
    raise SystemExit(f"{args.stages} stages need {args.stages} devices; found {len(devices)} "
                     "(on a CPU: --cpu-devices)")
  config = RunConfig(stages=args.stages, model="cpu-deep", batch_size=16,
                          steps=args.chunk, chunk=args.chunk)
  ds = data_lib.default_corpus(config.model_config(256).context)
  batches = ds.batches(0, 0, args.chunk, config.batch_size, config.model_config(256).context)

  emu, emu_state, _, _ = runs.build(config, ds)
  params = jax.tree.map(np.asarray, emu_state.params)  # (the timed calls donate the state)
  emu_state = jax.device_put(emu_state, devices[0])
  emu_compiled = emu.run.lower(emu_state, batches).compile()
  box = {"emu": emu_state}

  def emulated():
    box["emu"], out = emu_compiled(box["emu"], batches)
    jax.block_until_ready(out)

  emulated()
  t_emu = _timed(emulated, args.repeats)

  pipe, state, _, _ = runs.build(dataclasses.replace(config, execution="devices"), ds, devices)
  dev_memory = _memory(pipe.lower(state, batches).compile())
  moved = collective_bytes(jax.make_jaxpr(pipe._run_impl, static_argnums=2)(state, batches, True))
  message = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves((pipe._message, pipe._act)))
  first = jax.tree.map(lambda x: x[0], batches)
  _, init_peak = sampled_peak_bytes(lambda: jax.block_until_ready(pipe.init(params, first)))
  own = sum(x[0, 0].nbytes for x in state.carry.values())
  box["dev"] = state

  def stream():
    box["dev"], out = pipe.run(box["dev"], batches)
    jax.block_until_ready(out)

  def flushed():
    stream()
    box["dev"], _ = pipe.finish(box["dev"])

  stream()
  flushed()  # compiles the drain
  t_stream = _timed(stream, args.repeats)
  t_flush = _timed(flushed, args.repeats)
  mem = pipe.memory(box["dev"])
  p, c = args.stages, args.chunk
  print(f"backend {jax.default_backend()}, {len(devices)} devices; cpu-deep, batch 16, AdamW, P={p}, "
        f"chunk C={c}, median of {args.repeats}")
  print(f"throughput async stream / flush every C: {t_flush / t_stream:.3f}x "
        f"(ideal (C + P - 1) / C = {(c + p - 1) / c:.3f}x)")
  print(f"time per micro-batch, devices / emulator on one device: {t_stream / t_emu:.3f}x")
  print(f"memory per device (XLA: arguments + temporaries): devices {dev_memory / 2**20:.2f} MiB, "
        f"emulator's one device {_memory(emu_compiled) / 2**20:.2f} MiB "
        f"(ratio {dev_memory / max(_memory(emu_compiled), 1):.3f})")
  print(f"bytes between stages per micro-batch (jaxpr): {moved['ppermute'] / c / 2**10:.1f} KiB, only live "
        f"messages; every pair in every phase would be {2 * (p - 1) * message / 2**10:.1f} KiB; gradient "
        f"all-reduce operands per device {moved['psum'] / c / 2**10:.1f} KiB (no-op: 1-device data axis)")
  print("init, peak live bytes per device (sampled): "
        + ", ".join(f"{init_peak.get(d, 0) / 2**20:.2f}" for d in devices)
        + f" MiB; each stage's own carry {own / 2**20:.2f} MiB")
  print(_data_parallel_line(emu, params, batches, devices))
  stash = np.asarray(mem["stash_per_stage"])
  print(f"weight stash per stage (tau_k + 1 versions): {', '.join(f'{b / 2**10:.0f}' for b in stash)} KiB; "
        f"largest on one device {stash.max() / 2**10:.0f} KiB vs the emulator's rings "
        f"{emu.buffer_bytes(box['emu']) / 2**10:.0f} KiB on its one device")


if __name__ == "__main__":
  from experiments import cli

  cli.exit_process(cli.run(main))
