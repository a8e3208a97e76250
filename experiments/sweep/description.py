"""What a sweep's report says of how its runs were made: the study's description in its curves file
(``study_meta``) and how the preset differs from the paper's setup (``deviations``)."""

from __future__ import annotations

from experiments.harness import model as model_lib
from experiments.harness import provenance
from experiments.harness.methods import RECORDED
from experiments.report import metrics


def deviations(preset, ds, stages) -> list:
  """How this preset's runs differ from the paper's setup (listed in the report)."""
  t = preset.template
  cfg = t.model_config(ds.vocab_size)
  paper = model_lib.CONFIGS["paper-95m"]
  out = []
  if (cfg.num_blocks, cfg.width, cfg.num_heads, cfg.context) != (paper.num_blocks, paper.width,
                                                                  paper.num_heads, paper.context):
    out.append(f"model: {cfg.num_blocks} blocks, width {cfg.width}, {cfg.num_heads} heads, context "
               f"{cfg.context} (paper: 32 blocks, width 384, 6 heads, context 512)")
  out.append("model details: q/k/v/output and MLP layers carry biases (Flax nnx.Linear default); "
             "the paper's nanoGPT-style model may not")
  out.append(f"data: {ds.name}, vocabulary {ds.vocab_size} (paper: OpenWebText, about 1B tokens, "
             "GPT-2 BPE vocabulary 50257)")
  out.append(f"training: {t.steps} steps of batch {t.batch_size} x {cfg.context} tokens (paper: "
             "250 epochs of its data at P up to 32)")
  out.append(f"learning rates: {dict(preset.learning_rates)} at every P (the cpu presets': one "
             "shared rate from `python -m experiments.studies.regime`'s P = 1 grid; paper: 1e-3 at 95M, its "
             "baselines' rates not published)")
  if max(stages) < 32:
    out.append(f"largest P = {max(stages)} (paper: 32)")
  return out


def study_meta(preset, ds, stages, command: str) -> dict:
  """The study's description in its curves file (``experiments.report.curves``): what a rebuilt report
  says of how the runs were made."""
  t = preset.template
  window = preset.window()
  warmup = f"{t.warmup_steps} steps" if t.warmup_steps is not None else f"{t.warmup_fraction:.1%}"
  settings = dict(preset.settings)
  b1 = format(settings["b1"], "g") if "b1" in settings else "each method's own"
  setting = [
      f"data: `{ds.name}`, {ds.num_tokens} tokens, vocabulary {ds.vocab_size}, sha256 `{ds.sha256}`",
      f"model `{t.model}`, {t.steps} steps of batch {t.batch_size}, warm-up {warmup} then cosine to "
      f"{t.final_lr_fraction:g} x peak, b2 {settings.get('b2', RECORDED['b2']):g}, b1 "
      f"{b1}, PipeDream-LR T_c = {t.pipemare_fraction:.1%} of "
      f"training; learning rates {dict(preset.learning_rates)}"
      + (f", tuned (second reading) {dict(preset.tuned_rates)}" if preset.tuned_rates else ""),
      f"smoothing: centred window of {2 * metrics.half_window(window) + 1} steps; a diverged or "
      "unfinished run is credited with nothing; with several seeds: mean [min, max] over seeds and "
      "Student's t 95% interval"]
  return {"preset": preset.name, "command": command, "code": provenance.code_version(), "window": window,
          "setting": setting, "deviations": deviations(preset, ds, stages), "plumbing": preset.plumbing}
