"""The block formats' Pallas kernels compiled on a real GPU: bit-exact with jnp, and their speed.

``fp8_linen.core.block_kernels`` writes an operand's two block-code layouts
from one read. The tests check them bit for bit in Pallas' interpreter on the
CPU, and the B200 proofs count them in the compiled step; this script runs
them compiled by Triton on the GPU it finds (any NVIDIA GPU Triton targets:
the kernels use no Blackwell instruction, only the block-scaled GEMMs they
feed do) and, per kernel, on operands of the TransformerEngine dense layer
(x (16384, 8192) bf16, the float32 kernel (8192, 32768), the output gradient
(16384, 32768) bf16):

1. **bit-exactness**: codes and scales against the ``jnp`` reference
   (``block_numerics.block_quantize`` of the operand and of its transpose,
   rotated and rounded stochastically where the recipe does), compiled by XLA
   on the same GPU: the number of differing elements (NaN patterns aside);
2. **speed**: the kernel and the ``jnp`` reference timed interleaved (median
   of rounds of back-to-back calls), and the bandwidth each reaches counting
   the operand read once and every output written once (the kernel's minimum
   traffic; XLA's path moves more).

Writes ``<out-dir>/<device>-kernels-gpu.json``. ``--smoke`` runs tiny shapes
in Pallas' interpreter, so the script is checked on any machine.

``--sweep`` times each kernel under every launch choice of ``SWEEP`` (tile and
warps; ``block_kernels._LAUNCH`` holds the ones the library uses), each checked
bit for bit against the reference, and writes ``<device>-kernels-sweep.json``.

Usage:
  python benchmarks/bench_kernels_gpu.py --out-dir /tmp/k          # on a GPU (~1 min)
  python benchmarks/bench_kernels_gpu.py --sweep --out-dir /tmp/k  # on a GPU (~4 min)
  python benchmarks/bench_kernels_gpu.py --smoke --out-dir /tmp/k  # any machine
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen.core import block_kernels, block_numerics, randomness  # noqa: E402

# (name, shape (B, P, Q), dtype) of the operands; --smoke shrinks them.
OPERANDS = {"x": ((1, 16384, 8192), jnp.bfloat16), "kernel": ((1, 8192, 32768), jnp.float32),
            "grad": ((1, 16384, 32768), jnp.bfloat16)}
SMOKE = {"x": ((1, 64, 128), jnp.bfloat16), "kernel": ((1, 128, 64), jnp.float32),
         "grad": ((1, 64, 64), jnp.bfloat16)}


# The kernels each case launches, and the launch choices --sweep tries for them.
KERNELS = {"mx": ("mx_codes_both",), "nv": ("nvfp4_amaxes", "nvfp4_codes_both"),
           "nv_tiles": ("nvfp4_tile_codes_both",)}
SWEEP = {
    "mx": [{"tile": t, "num_warps": w} for t in ((128, 128), (64, 128), (128, 64), (64, 64),
                                                 (32, 128), (32, 32)) for w in (4, 8)],
    "nv": [{"tile": t, "num_warps": w} for t in ((32, 32), (16, 32), (32, 16), (16, 16),
                                                 (64, 32)) for w in (2, 4, 8)],
    "nv_tiles": [{"tile": t, "num_warps": w} for t in ((32, 32), (64, 64), (32, 64), (64, 32),
                                                       (128, 128)) for w in (4, 8)],
}
# Tiles other than the library's that the smoke operands are whole tiles of
# (the rotated NVFP4 kernels' sweep is the same loop; their interpreted runs are slow).
SMOKE_SWEEP = {"mx": [{"tile": (32, 64), "num_warps": 4}],
               "nv_tiles": [{"tile": (64, 32), "num_warps": 4}]}


def _differing(got, want) -> jnp.ndarray:
  """Elements whose bits differ (two NaNs count as equal; e2m1 compared through float32)."""
  g, w = got.astype(jnp.float32), want.astype(jnp.float32)
  both_nan = jnp.isnan(g) & jnp.isnan(w)
  same = (g == w) & (jnp.signbit(g) == jnp.signbit(w))
  return jnp.sum(~(same | both_nan))


def cases(ops: dict) -> list[tuple[str, str, object, object, str]]:
  """``(name, operand, kernel fn, reference fn, family)`` per kernel (``KERNELS[family]``)."""
  seed = jnp.uint32(7)
  keys = (randomness.noise_key(seed, 1), randomness.noise_key(seed, 2))
  factor, factor_t = jnp.float32(1e-3), jnp.float32(5e-4)

  def mx(dtype):
    kern = lambda t: block_kernels.mx_codes_both(t, dtype, 32)

    def ref(t):
      return (block_numerics.block_quantize(t, 32, dtype),
              block_numerics.block_quantize(jnp.swapaxes(t, 1, 2), 32, dtype),
              jnp.max(jnp.abs(t.astype(jnp.float32))))
    return kern, ref

  def nv_ref(t, hadamard, noise):
    rot = randomness.random_hadamard(jnp.swapaxes(t, 1, 2), hadamard)
    u = lambda a, salt: randomness.uniform_noise(a.shape, seed, salt) if noise else None
    amaxes = jnp.max(jnp.abs(t.astype(jnp.float32))), jnp.max(jnp.abs(rot))
    return (block_numerics.block_quantize(t, 16, jnp.float4_e2m1fn, tensor_scale=factor,
                                          noise=u(t, 1)),
            block_numerics.block_quantize(rot, 16, jnp.float4_e2m1fn, tensor_scale=factor_t,
                                          noise=u(rot, 2))), amaxes

  def nv(hadamard, noise):
    def kern(t):
      amaxes = block_kernels.nvfp4_amaxes(t, hadamard)
      codes = block_kernels.nvfp4_codes_both(t, factor, factor_t, hadamard=hadamard,
                                             keys=keys if noise else None)
      return codes, amaxes
    return kern, lambda t: nv_ref(t, hadamard, noise)

  def nv_tiles(t):
    return block_kernels.nvfp4_tile_codes_both(t, factor)

  def nv_tiles_ref(t):
    q = lambda a: block_numerics.block_quantize(a, 16, jnp.float4_e2m1fn, tensor_scale=factor,
                                                tile=True)
    return q(t), q(jnp.swapaxes(t, 1, 2))

  return [(name, operand, kern, ref, family) for name, operand, (kern, ref), family in [
      ("mx_codes_both e4m3 (MXFP8 input)", "x", mx(jnp.float8_e4m3fn), "mx"),
      ("mx_codes_both e4m3 (MXFP8 weight)", "kernel", mx(jnp.float8_e4m3fn), "mx"),
      ("mx_codes_both e5m2 (MXFP8 gradient)", "grad", mx(jnp.float8_e5m2), "mx"),
      ("nvfp4_amaxes + nvfp4_codes_both (NVFP4 input: rotated wgrad copy)", "x", nv(16, False),
       "nv"),
      ("nvfp4_amaxes + nvfp4_codes_both (NVFP4 gradient: rotated, stochastic rounding)",
       "grad", nv(16, True), "nv"),
      ("nvfp4_tile_codes_both (NVFP4 weight, 16 x 16 tiles)", "kernel", (nv_tiles, nv_tiles_ref),
       "nv_tiles"),
  ]]


def _bytes(tree) -> int:
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _check(name, fk, x, want) -> tuple[dict, object]:
  """Runs the compiled kernel fn on ``x``: (differing elements per output vs ``want``, its outputs)."""
  got = fk(x)
  g_leaves, w_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  if len(g_leaves) != len(w_leaves):
    raise ValueError(f"{name}: {len(g_leaves)} outputs vs the reference's {len(w_leaves)}")
  diffs = [int(_differing(g, w)) for g, w in zip(g_leaves, w_leaves)]
  return {"outputs": [f"{a.dtype}{list(a.shape)}" for a in g_leaves],
          "differing_elements": diffs, "bit_exact": not any(diffs),
          "compiled_pallas_calls": fk.lower(x).compile().as_text().count("__gpu$xla.gpu.triton")
          }, got


def run_case(name, operand, kern, ref, x, rounds, calls) -> dict:
  """Compiles both paths, counts differing elements per output, times both."""
  t0 = time.perf_counter()
  fk, fr = jax.jit(kern), jax.jit(ref)
  checked, got = _check(name, fk, x, fr(x))
  row = {"operand": operand, "shape": list(x.shape), "dtype": str(x.dtype),
         **checked, "compile_and_check_s": time.perf_counter() - t0}
  if rounds:
    t = common.time_calls({"kernel": lambda: fk(x), "jnp": lambda: fr(x)}, rounds, calls)
    moved = x.size * x.dtype.itemsize + _bytes(got)
    row.update({"kernel_ms": t["kernel"]["median_ms"], "kernel_min_ms": t["kernel"]["min_ms"],
                "jnp_ms": t["jnp"]["median_ms"], "jnp_min_ms": t["jnp"]["min_ms"],
                "kernel_over_jnp": t["kernel"]["median_ms"] / t["jnp"]["median_ms"],
                "minimum_bytes": moved,
                "kernel_gb_per_s": moved / (t["kernel"]["median_ms"] * 1e-3) / 1e9,
                "jnp_gb_per_s": moved / (t["jnp"]["median_ms"] * 1e-3) / 1e9})
  return row


def sweep_case(name, operand, family, x, choices, rounds, calls) -> dict:
  """Times the case's kernels under each launch choice, each checked bit for bit; names the fastest."""
  ref = next(c[3] for c in cases({operand: x}) if c[0] == name)
  want = jax.jit(ref)(x)
  rows = []
  for choice in choices:
    saved = {k: block_kernels._LAUNCH[k] for k in KERNELS[family]}  # pylint: disable=protected-access
    block_kernels._LAUNCH.update({k: dict(choice) for k in KERNELS[family]})  # pylint: disable=protected-access
    try:
      # New closures per choice: jit's cache is keyed by the function, not the launch table.
      fk = jax.jit(next(c[2] for c in cases({operand: x}) if c[0] == name))
      row = {"launch": {"tile": list(choice["tile"]), "num_warps": choice["num_warps"]},
             **_check(name, fk, x, want)[0]}
      if rounds:
        row["kernel_ms"] = common.time_calls({"k": lambda: fk(x)}, rounds, calls)["k"]["median_ms"]
    except Exception as e:  # pylint: disable=broad-except  # a launch Triton rejects is a result
      row = {"launch": {"tile": list(choice["tile"]), "num_warps": choice["num_warps"]},
             "error": f"{type(e).__name__}: {e}"[:500]}
    finally:
      block_kernels._LAUNCH.update(saved)  # pylint: disable=protected-access
    rows.append(row)
    print(f"  {name} {row['launch']}: "
          + (row.get("error", "")[:120] or f"{'bit-exact' if row['bit_exact'] else 'DIFFERS'}"
             + (f" {row['kernel_ms']:.3f} ms" if rounds else "")), flush=True)
  ok = [r for r in rows if r.get("bit_exact") and "kernel_ms" in r]
  ok.sort(key=lambda r: r["kernel_ms"])
  current = block_kernels._LAUNCH[KERNELS[family][-1]]  # pylint: disable=protected-access
  return {"operand": operand, "shape": list(x.shape), "kernels": list(KERNELS[family]),
          "library_launch": {"tile": current["tile"], "num_warps": current["num_warps"]},
          "fastest": ok[0]["launch"] if ok else None, "rows": rows}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out-dir", default=None, help="folder for the JSON (default benchmarks/results)")
  p.add_argument("--rounds", type=int, default=7, help="timed rounds per kernel")
  p.add_argument("--calls", type=int, default=10, help="back-to-back calls per round")
  p.add_argument("--smoke", action="store_true",
                 help="tiny operands in Pallas' interpreter, not timed (any machine)")
  p.add_argument("--sweep", action="store_true",
                 help="time every launch choice of SWEEP per kernel instead of kernel vs jnp")
  args = p.parse_args(argv)
  env = common.environment()
  on_gpu = env["platform"] == "gpu"
  if not on_gpu and not args.smoke:
    p.error(f"no GPU here (JAX sees {env['platform']!r}): run with --smoke")
  shapes = SMOKE if args.smoke else OPERANDS
  rounds = 0 if args.smoke else args.rounds
  mode = "interpret" if args.smoke else "auto"
  ops = {}
  for i, (k, (shape, dtype)) in enumerate(shapes.items()):
    # Magnitudes over 2**-20 .. 2**20, so block scales differ between blocks.
    k1, k2 = jax.random.split(jax.random.key(i))
    mag = jnp.exp2(jax.random.randint(k2, shape, -20, 20).astype(jnp.float32))
    ops[k] = (jax.random.normal(k1, shape, jnp.float32) * mag * 1e-3).astype(dtype)
  payload = {"benchmark": "block_kernels_on_gpu", "env": env,
             "mode": "Pallas interpreter (smoke)" if args.smoke else "compiled (Triton)",
             "timing": f"median of {rounds} rounds of {args.calls} back-to-back calls, "
                       "kernel and jnp interleaved", "cases": {}}
  name = "kernels-" + ("sweep" if args.sweep else "gpu") + ("-smoke" if args.smoke else "")
  if args.sweep:
    choices = SMOKE_SWEEP if args.smoke else SWEEP
    with fl.pallas_kernels(mode):
      for case, operand, _, _, family in cases(ops):
        if family not in choices:
          continue
        payload["cases"][case] = sweep_case(case, operand, family, ops[operand],
                                            choices[family], rounds, args.calls)
        common.write_json(name, payload, args.out_dir)
    path = common.write_json(name, payload, args.out_dir)
    print(f"wrote {path}")
    return payload
  with fl.pallas_kernels(mode):
    for case, operand, kern, ref, _ in cases(ops):
      try:
        row = run_case(case, operand, kern, ref, ops[operand], rounds, args.calls)
      except Exception as e:  # pylint: disable=broad-except  # one kernel must not end the run
        row = {"error": f"{type(e).__name__}: {e}"[:2000]}
      payload["cases"][case] = row
      common.write_json(name, payload, args.out_dir)
      if "error" in row:
        print(f"{case}: ERROR {row['error'][:400]}", flush=True)
        continue
      speed = (f"kernel {row['kernel_ms']:.3f} ms ({row['kernel_gb_per_s']:.0f} GB/s) vs jnp "
               f"{row['jnp_ms']:.3f} ms: x{row['kernel_over_jnp']:.2f}") if rounds else "not timed"
      print(f"{case}: {'bit-exact' if row['bit_exact'] else 'DIFFERS ' + str(row['differing_elements'])}"
            f"; {speed}", flush=True)
  path = common.write_json(name, payload, args.out_dir)
  print(f"wrote {path}")
  return payload


if __name__ == "__main__":
  main()
