"""``python -m experiments.bench_devices``: the real pipeline across devices, measured in one run.

On the cpu-deep model with PipeDream's AdamW (batch 16) at P stages, ratios only:

- throughput of the asynchronous 1F1B stream against the same stages with a flush after every chunk
  of C micro-batches (a synchronous schedule, PipeDream-Flush / GPipe: ``2(P - 1)`` extra phases per
  flush), next to the ideal ratio ``(C + P - 1) / C``: the bubble that asynchrony removes;
- per-micro-batch time of the device pipeline against the emulator on one device;
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


def _timed(fn, repeats):
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return sorted(times)[len(times) // 2]


def _memory(compiled) -> int:
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.temp_size_in_bytes) if m is not None else 0


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m experiments.bench_devices", description=__doc__)
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

  from experiments import data as data_lib
  from experiments import runs

  devices = jax.local_devices()[:args.stages]
  if len(devices) < args.stages:
    raise SystemExit(f"{args.stages} stages need {args.stages} devices; found {len(devices)} "
                     "(on a CPU: --cpu-devices)")
  config = runs.RunConfig(method="pipedream", stages=args.stages, model="cpu-deep", batch_size=16,
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
  import pipeline_sim as ps
  mesh = ps.data_mesh(devices)
  data_batches = ps.shard_batches(batches, mesh)
  fsdp_state = ps.fsdp(emu.init(params), mesh)
  replicated = _memory(emu.run.lower(ps.replicate(emu.init(params), mesh), data_batches).compile())
  sharded = _memory(emu.run.lower(fsdp_state, data_batches).compile())
  print(f"emulator data-parallel over {len(devices)} devices, memory per device: replicated state "
        f"{replicated / 2**20:.2f} MiB, fsdp {sharded / 2**20:.2f} MiB (ratio {sharded / replicated:.3f})")
  stash = np.asarray(mem["stash_per_stage"])
  print(f"weight stash per stage (tau_k + 1 versions): {', '.join(f'{b / 2**10:.0f}' for b in stash)} KiB; "
        f"largest on one device {stash.max() / 2**10:.0f} KiB vs the emulator's rings "
        f"{emu.buffer_bytes(box['emu']) / 2**10:.0f} KiB on its one device")


if __name__ == "__main__":
  main()
