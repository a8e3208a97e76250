"""Every worked number of the tutorial exactly, and measured ratios within stated tolerances."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autodiff_demos import chain_order, checkpointing, costs, hvp, jvp_vjp, layers, modes, report


def test_jvp_vjp_worked_example_exact():
  v = jvp_vjp.values()
  np.testing.assert_array_equal(v["J"], [[13, 7], [144, 80]])
  np.testing.assert_array_equal(v["J_rev"], [[13, 7], [144, 80]])
  np.testing.assert_array_equal(v["J_f"], [[12, 4], [1, 3]])
  np.testing.assert_array_equal(v["J_g"], [[1, 1], [11, 12]])
  np.testing.assert_array_equal(v["Jv"], [27, 304])
  np.testing.assert_array_equal(v["uJ"], [301, 167])
  np.testing.assert_array_equal(v["uJ_g"], [23, 25])
  np.testing.assert_array_equal(v["J_f v"], [20, 7])


def test_dual_numbers_exact():
  v = jvp_vjp.values()
  assert [(a, float(b)) for a, b in v["dual_f"]] == [(12.0, 20.0), (11.0, 7.0)]
  assert [(a, float(b)) for a, b in v["dual_g"]] == [(23.0, 27.0), (132.0, 304.0)]
  np.testing.assert_array_equal(v["dual_columns"], [[13, 7], [144, 80]])
  np.testing.assert_array_equal(v["vmap_columns"], [[13, 7], [144, 80]])
  d = jvp_vjp.Dual(2.0, 1.0) * jvp_vjp.Dual(2.0, 1.0) * 3 + 1  # 3x^2 + 1 at 2: value 13, slope 12
  assert (d.a, d.b) == (13.0, 12.0)


def test_chain_order_counts_and_measured_ratio():
  right, left = chain_order.analytic()
  assert right == 99 * 4096**3 and left == 99 * 4096**2 and right // left == 4096
  assert abs(right - 6.8e12) / 6.8e12 < 0.01 and abs(left - 1.66e9) / 1.66e9 < 0.01
  r, l = chain_order.measured(width=64, layers=6)
  assert abs(r.flops / l.flops - 64) < 0.5


def test_layer_worked_numbers():
  w = layers.worked()
  assert w["fan"] == 54.0
  np.testing.assert_array_equal(w["bias_sum"], [9, 12])
  np.testing.assert_allclose(w["bias_mean"], [3, 4])
  assert w["accumulation_error"] < 1e-5 and w["residual_error"] < 1e-6 and w["passthrough_error"] == 0


def test_elementwise_vjp_is_linear_not_quadratic():
  vjp_flops, dense_flops = layers.elementwise_vjp_cost(width=512)
  assert vjp_flops <= 3 * 512 and dense_flops >= 2 * 512**2 * 0.99


def test_backward_forward_ratios_match_product_counts():
  ratios, both, step = layers.mlp_ratios(width=64, layers=8, batch=64)
  assert abs(both - 2.0) < 0.1
  assert abs(step - (1 + 15 / 8)) < 0.1
  for name, (measured, predicted) in ratios.items():
    assert abs(measured - predicted) < 0.1, (name, measured, predicted)


def test_forward_vs_reverse_jacobian_costs():
  rows = modes.jacobian_costs(sizes=(8, 64, 256))
  wide_in = [r for r in rows if r["m"] == 8 and r["n"] == 256][0]
  wide_out = [r for r in rows if r["n"] == 8 and r["m"] == 256][0]
  assert wide_in["fwd"] > 4 * wide_in["rev"]
  assert wide_out["rev"] > 4 * wide_out["fwd"]


def test_scalar_loss_years_and_multi_objective():
  assert abs(7e9 * 0.1 / modes.SECONDS_PER_YEAR - 22.2) < 0.1
  err, one, many, many_loop = modes.multi_objective(num_losses=8, n=64)
  assert err < 1e-5
  assert abs(many_loop / one - 4.5) < 0.45  # m = 8 VJPs sharing one forward: (1 + m) / 2


def test_square_jacobian_memory_growth():
  mem = modes.square_memory(depths=(4, 8, 16), width=32, batch=16)
  depths = [r["depth"] for r in mem]
  assert costs.growth_exponent(depths, [r["vjp"] for r in mem]) > 0.8
  assert costs.growth_exponent(depths, [max(r["jvp"], 1) for r in mem]) < 0.3


def test_hvp_worked_and_growth():
  H, Hv = hvp.worked()
  np.testing.assert_array_equal(H, [[6, 4], [4, 0]])
  np.testing.assert_array_equal(Hv, [14, 4])
  f = hvp.mlp_loss(8)
  x, v = jnp.linspace(-1, 1, 8), jnp.arange(8.0)
  np.testing.assert_allclose(hvp.hvp(f, x, v), jax.hessian(f)(x) @ v, rtol=1e-4, atol=1e-5)
  table = hvp.core_comparison(sizes=(16, 32, 64))
  exp = hvp.exponents(table)
  assert exp["jax.jacfwd(jax.grad)"] - exp["jax.vjp (gradient)"] > 0.7
  assert all(c.passed for c in hvp.claims(table)[:4])


def test_checkpointing_memory_and_compute():
  rows = checkpointing.measure(depths=(16, 36, 64), width=32, batch=64)
  depths = [r["depth"] for r in rows]
  assert costs.growth_exponent(depths, [r["ckpt_bytes"] for r in rows]) < 0.7
  assert costs.growth_exponent(depths, [r["plain_bytes"] for r in rows]) > 0.85
  ratio = rows[-1]["ckpt_flops"] / rows[-1]["plain_flops"]
  assert 1.15 < ratio < 1.45
  assert checkpointing.tutorial_counts(100) == (20, 100)


def test_report_rendering():
  claims = [report.check("t", "a | b", "1", "1", True), report.check("t", "c", "2", "3", False)]
  assert "1 passed, 1 failed" in report.text(claims)
  long = [report.check("topic", "a claim " * 20, "seed " * 30, "measured " * 25, True)]
  lines = report.text(long).splitlines()
  assert max(map(len, lines)) <= 100 and "".join(lines).count("measured") == 26
  md = report.markdown(claims)
  assert "a \\| b" in md and md.count("PASS") == 1 and md.count("FAIL") == 1


def test_figures_are_written(tmp_path):
  from autodiff_demos.__main__ import plots
  table = [{"method": m, "n": n, "flops": 10.0 * n, "seconds": 1e-3 * n}
           for m in ("jacfwd(grad)", "jacrev(grad)") for n in (64, 128, 256, 512, 1024)]
  ckpt = [{"depth": d, "plain_bytes": 100 * d, "ckpt_bytes": 100 * d**0.5} for d in (16, 64, 144)]
  assert plots(tmp_path, table, ckpt) == ["cost_vs_n.png", "memory_vs_depth.png"]
  assert all((tmp_path / f).stat().st_size > 0 for f in ("cost_vs_n.png", "memory_vs_depth.png"))


def test_bad_output_paths_fail_before_the_measurements(tmp_path, capsys):
  from autodiff_demos.__main__ import main

  a_file, a_folder = tmp_path / "figures", tmp_path / "report"
  a_file.write_text("")
  a_folder.mkdir()
  for argv, message in ((["--plots", str(a_file)], "is a file, not a folder"),
                        (["--markdown", str(a_folder)], "is a folder, not a file")):
    with pytest.raises(SystemExit) as exit_:
      main(argv)
    err = capsys.readouterr()
    assert exit_.value.code == 2 and message in err.err and "passed" not in err.out
