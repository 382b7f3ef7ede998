"""fp8 products and planned memory of training steps compiled for an H100, without a GPU.

Every model's training step (``fp8_linen.testing.train_step``: loss
``sum(y * r)`` with a random cotangent ``r`` passed as an argument; it returns
the loss, dL/dx and the gradients of all variables, so forward, dgrad and wgrad
of every layer stay in the program; the fp8 scales and histories are jit
arguments) is compiled for one H100 SXM by XLA:GPU through the CUDA plugin's
compile-only topology (``fp8_linen.testing.compile``). Nothing runs. Per
arm it records fp8 products / all products (cuBLASLt fp8 GEMMs, cuDNN fp8
convolutions; Triton GEMMs are switched off because nothing can be autotuned
without a device) and ``compiled.memory_analysis()``: temp (XLA's peak of
temporary buffers), argument and output bytes.

Sections (``--only``):

* ``mlp``: a 4-layer MLP (Dense -> gelu, x4; d=4096, 8192 tokens, bf16
  activations, f32 params): bf16 ``nn.Dense``, ``fl.QDense`` (delayed and
  current scaling) and flax's ``nn.Dense(dot_general_cls=Fp8DirectDotGeneralOp)``.
* ``mlp_remat``: the same MLP under ``nn.remat``: bf16 without remat, bf16
  saving each layer input (bf16) or nothing, against ``fl.Fp8Activation`` at
  each layer input with ``save_only_these_names(fl.CHECKPOINT_NAME)``, with
  QDense or bf16 ``nn.Dense`` GEMMs, and QDense alone under that policy.
* ``mlp_remat_per_layer``: the same comparison with one remat region per
  layer (the region's bf16 input is then saved whatever the policy).
* ``mlp_8_layers``: the 8-layer variant DESIGN.md section 5 quotes.
* ``decoder``: a small pre-LN decoder (causal self-attention and a gelu MLP
  per block; d_model 1024, 8 heads, MLP 4096, 4 blocks, 8 x 1024 tokens): bf16,
  fp8 through ``fl.quantize_model`` (every product, or the projections only:
  attention score einsums left in bf16) and flax's op on every projection.

Proves which kernels XLA selects for an H100 (fp8 inputs into cuBLASLt/cuDNN fp8
kernels) and the memory it plans; says nothing about speed. Writes
``benchmarks/results/h100-compile.json`` (device "H100 (compile only)").

Needs the test extra on Linux (``pip install ".[test]"``: the CUDA PJRT plugin
at jaxlib's version and ``ptxas``); prints why and writes nothing otherwise.

Usage:
  python benchmarks/bench_h100_compile.py                # all sections, ~1-2 min on 2 cores
  python benchmarks/bench_h100_compile.py --quick --out-dir /tmp/q   # tiny shapes
  python benchmarks/bench_h100_compile.py --only mlp mlp_remat
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fp8_linen as fl  # noqa: E402
from fp8_linen.testing import targets  # noqa: E402
from fp8_linen.testing.compile import GPU_COMPILER_OPTIONS, compile_train_step  # noqa: E402

DEVICE = "H100 (compile only)"
"""How the figures' device is named in the JSON and the README."""

SECTIONS = ("mlp", "mlp_remat", "mlp_remat_per_layer", "mlp_8_layers", "decoder")

BF16_NAME = "bench.bf16_layer_input"
"""``checkpoint_name`` of the bf16 layer inputs a bf16 remat policy keeps."""

_SIZES = {
    "full": dict(d=4096, tokens=8192, layers=4, dec_d=1024, dec_heads=8, dec_mlp=4096,
                 dec_layers=4, dec_batch=8, dec_seq=1024),
    "quick": dict(d=256, tokens=512, layers=2, dec_d=128, dec_heads=2, dec_mlp=512,
                  dec_layers=1, dec_batch=2, dec_seq=64),
}

_DENSE = {
    "bf16": lambda f: nn.Dense(f, dtype=jnp.bfloat16),
    "qdense": lambda f: fl.QDense(f, dtype=jnp.bfloat16),
    "qdense_current": lambda f: fl.QDense(f, dtype=jnp.bfloat16, recipe=fl.current_scaling()),
    "flax_fp8": lambda f: nn.Dense(f, dtype=jnp.bfloat16,
                                   dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp),
}


class Layer(nn.Module):
  """Dense -> gelu, with the input optionally marked for a remat policy.

  Attributes:
    features: width.
    dense: which dense layer (a key of ``_DENSE``).
    keep: what marks the input for a remat policy: None, ``'fp8'`` (an
      ``fl.Fp8Activation``: the fp8 copy is named ``fl.CHECKPOINT_NAME``) or
      ``'bf16'`` (``checkpoint_name(x, BF16_NAME)``).
  """

  features: int
  dense: str = "bf16"
  keep: str | None = None

  @nn.compact
  def __call__(self, x):
    if self.keep == "fp8":
      x = fl.Fp8Activation()(x)
    elif self.keep == "bf16":
      x = jax.ad_checkpoint.checkpoint_name(x, BF16_NAME)
    return nn.gelu(_DENSE[self.dense](self.features)(x))


class MLP(nn.Module):
  """``layers`` x :class:`Layer`, all ``features`` wide.

  Attributes:
    layers: number of layers.
    features: width.
    dense: which dense layer (a key of ``_DENSE``).
    keep: see :class:`Layer`.
    layer_policy: if set, each layer is an ``nn.remat`` with this policy
      (else the layers are plain; wrap the whole MLP in ``nn.remat`` for one
      remat region).
  """

  layers: int
  features: int
  dense: str = "bf16"
  keep: str | None = None
  layer_policy: Any = None

  @nn.compact
  def __call__(self, x):
    cls = Layer if self.layer_policy is None else nn.remat(Layer, policy=self.layer_policy)
    for _ in range(self.layers):
      x = cls(self.features, self.dense, self.keep)(x)
    return x


class Block(nn.Module):
  """Pre-LN decoder block: causal self-attention and a gelu MLP, both residual.

  Attributes:
    num_heads: attention heads.
    mlp: hidden width of the MLP.
    dot_general_cls: given to every projection (q, k, v, out, both MLP
      layers); None for plain ``lax.dot_general``.
  """

  num_heads: int
  mlp: int
  dot_general_cls: object = None

  @nn.compact
  def __call__(self, x):
    bf16 = jnp.bfloat16
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm(dtype=bf16)(x)
    x = x + nn.SelfAttention(num_heads=self.num_heads, dtype=bf16, deterministic=True,
                             qkv_dot_general_cls=self.dot_general_cls,
                             out_dot_general_cls=self.dot_general_cls)(h, mask=mask)
    h = nn.LayerNorm(dtype=bf16)(x)
    h = nn.gelu(nn.Dense(self.mlp, dtype=bf16, dot_general_cls=self.dot_general_cls)(h))
    return x + nn.Dense(x.shape[-1], dtype=bf16, dot_general_cls=self.dot_general_cls)(h)


class Decoder(nn.Module):
  """``layers`` decoder blocks on a (batch, seq, d_model) bf16 input."""

  layers: int
  num_heads: int
  mlp: int
  dot_general_cls: object = None

  @nn.compact
  def __call__(self, x):
    for _ in range(self.layers):
      x = Block(self.num_heads, self.mlp, self.dot_general_cls)(x)
    return x


def _remat(policy, **kw):
  return nn.remat(MLP, policy=policy)(**kw)


def section_arms(section: str, s: dict) -> tuple[tuple, str, list]:
  """``(x shape, baseline arm, [(arm, model, expected fp8 products, what)])`` of a section."""
  n = s["layers"]
  mlp = lambda dense, **kw: MLP(layers=n, features=s["d"], dense=dense, **kw)
  fp8_names = jax.checkpoint_policies.save_only_these_names(fl.CHECKPOINT_NAME)
  if section in ("mlp", "mlp_8_layers"):
    n = 2 * n if section == "mlp_8_layers" else n  # 8 layers at the full sizes
    arms = [("bf16_dense", mlp("bf16"), 0, "nn.Dense, bf16"),
            ("qdense_delayed", mlp("qdense"), 3 * n, "fl.QDense, delayed scaling"),
            ("qdense_current", mlp("qdense_current"), 3 * n, "fl.QDense, current scaling"),
            ("flax_fp8_direct", mlp("flax_fp8"), 3 * n,
             "nn.Dense(dot_general_cls=Fp8DirectDotGeneralOp)")]
    if section == "mlp_8_layers":
      arms = [a for a in arms if a[0] != "qdense_current"]
    return (s["tokens"], s["d"]), "bf16_dense", arms
  if section == "mlp_remat":
    kw = dict(layers=n, features=s["d"])
    # Under remat the backward recomputes each forward GEMM (gelu's gradient
    # needs its output), so a layer has 4 products: fwd, recomputed fwd, dgrad, wgrad.
    remat_fp8 = 4 * n
    return (s["tokens"], s["d"]), "bf16_dense", [
        ("bf16_dense", mlp("bf16"), 0, "nn.Dense, bf16, no remat"),
        ("bf16_remat_inputs", _remat(
            jax.checkpoint_policies.save_only_these_names(BF16_NAME), dense="bf16", keep="bf16",
            **kw), 0, "nn.Dense bf16, remat saving each layer input in bf16"),
        ("bf16_remat_nothing", _remat(jax.checkpoint_policies.nothing_saveable, dense="bf16",
                                      **kw), 0,
         "nn.Dense bf16, remat saving nothing (the whole forward recomputed)"),
        ("fp8act_qdense_remat", _remat(fp8_names, dense="qdense", keep="fp8", **kw), remat_fp8,
         "Fp8Activation -> QDense, remat saving only fl.CHECKPOINT_NAME"),
        ("fp8act_bf16_dense_remat", _remat(fp8_names, dense="bf16", keep="fp8", **kw), 0,
         "Fp8Activation -> nn.Dense bf16, remat saving only fl.CHECKPOINT_NAME"),
        ("qdense_remat", _remat(fp8_names, dense="qdense", **kw), remat_fp8,
         "QDense (its own fp8 residuals), remat saving only fl.CHECKPOINT_NAME"),
    ]
  if section == "mlp_remat_per_layer":
    # Each layer its own remat region: the region's input (the bf16 output of
    # the layer below) is saved whatever the policy says.
    per = lambda policy, dense, keep=None: MLP(layers=n, features=s["d"], dense=dense, keep=keep,
                                               layer_policy=policy)
    return (s["tokens"], s["d"]), "bf16_dense", [
        ("bf16_dense", mlp("bf16"), 0, "nn.Dense, bf16, no remat"),
        ("bf16_remat_inputs", per(jax.checkpoint_policies.save_only_these_names(BF16_NAME),
                                  "bf16", "bf16"), 0,
         "nn.Dense bf16, per-layer remat saving the layer input in bf16"),
        ("fp8act_qdense_remat", per(fp8_names, "qdense", "fp8"), 4 * n,
         "Fp8Activation -> QDense, per-layer remat saving only fl.CHECKPOINT_NAME"),
        ("qdense_remat", per(fp8_names, "qdense"), 4 * n,
         "QDense, per-layer remat saving only fl.CHECKPOINT_NAME"),
    ]
  if section == "decoder":
    dec = lambda cls=None: Decoder(layers=s["dec_layers"], num_heads=s["dec_heads"],
                                   mlp=s["dec_mlp"], dot_general_cls=cls)
    per_block, projections = 8 * 3, 6 * 3  # 6 projections + 2 attention einsums, 3 products each
    nb = s["dec_layers"]
    no_einsums = [fl.QuantizationRule(module_path=".*", ops=("einsum",), quantize=False),
                  fl.QuantizationRule(module_path=".*")]
    return (s["dec_batch"], s["dec_seq"], s["dec_d"]), "bf16", [
        ("bf16", dec(), 0, "flax layers, bf16"),
        ("fp8_quantize_model", fl.quantize_model(dec(), fl.delayed_scaling()), per_block * nb,
         "fl.quantize_model, delayed: projections and attention einsums"),
        ("fp8_quantize_model_projections",
         fl.quantize_model(dec(), fl.delayed_scaling(), rules=no_einsums), projections * nb,
         "fl.quantize_model, delayed: projections only (attention einsums bf16)"),
        ("flax_fp8_direct", dec(fp8_ops.Fp8DirectDotGeneralOp), projections * nb,
         "Fp8DirectDotGeneralOp on every projection (attention einsums bf16)"),
    ]
  raise ValueError(f"unknown section {section!r}; choose from {SECTIONS}")


def run_section(section: str, sizes: dict) -> dict:
  """Compiles every arm of a section; rows with counts, memory and ratios to the baseline."""
  shape, baseline, arms = section_arms(section, sizes)
  rows = {}
  for name, model, expected, what in arms:
    try:
      report = compile_train_step(model, shape, jnp.bfloat16, target="h100")
    except targets.TargetUnavailable:
      raise
    except Exception as e:  # pylint: disable=broad-except  # a failed compile is a result
      rows[name] = {"what": what, "failed": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
      print(f"{section:20s} {name:31s} FAILED {rows[name]['failed']}", flush=True)
      continue
    rows[name] = {"what": what, **common.compile_report_row(report),
                  "expected_fp8_products": expected,
                  "as_expected": report.fp8_products == expected}
  base = rows.get(baseline, {}).get("temp_size_in_bytes")
  for name, row in rows.items():
    if "failed" in row:
      continue
    if base:
      row["temp_ratio_vs_baseline"] = row["temp_size_in_bytes"] / base
    print(f"{section:20s} {name:31s} fp8 {row['fp8_products']:3d}/{row['products']:<3d} "
          f"(expected {row['expected_fp8_products']:3d}{'' if row['as_expected'] else ' !'})  "
          f"temp {row['temp_size_in_bytes'] / 2**20:8.1f} MiB"
          + (f" (x{row['temp_ratio_vs_baseline']:.3f})" if base else "")
          + f"  args {row['argument_size_in_bytes'] / 2**20:7.1f} MiB  out "
          f"{row['output_size_in_bytes'] / 2**20:7.1f} MiB  [{row['compile_s']:.1f} s]",
          flush=True)
  return {"input_shape": list(shape), "input_dtype": "bfloat16", "baseline": baseline,
          "arms": rows}


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def main(argv=None) -> dict | None:
  """Compiles the selected sections, writes ``h100-compile.json``; returns the payload.

  Returns None (and writes nothing) when the deviceless compile is not
  available here; the reason is printed.
  """
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
  p.add_argument("--only", nargs="+", choices=SECTIONS, default=None,
                 help="compile only these sections")
  p.add_argument("--out-dir", default=None,
                 help="folder for h100-compile.json (default: benchmarks/results)")
  args = p.parse_args(argv)
  try:
    targets.use_cpu_platform()
  except targets.TargetUnavailable as e:
    print(f"skipped: deviceless H100 compile unavailable: {e}")
    return None
  available = targets.availability("h100")
  if not available:
    print(f"skipped: deviceless H100 compile unavailable: {available.reason}")
    return None
  sizes = _SIZES["quick" if args.quick else "full"]
  t0 = time.perf_counter()
  results = {section: run_section(section, sizes) for section in args.only or SECTIONS}
  seconds = time.perf_counter() - t0
  payload = {
      "benchmark": "h100_compile", "device": DEVICE,
      "target": "one NVIDIA H100 SXM (XLA's h100_sxm.txtpb: compute capability 9.0, cuDNN 9.8, "
                "CUDA 12.8), compile-only topology of the CUDA PJRT plugin; nothing ran",
      "compiler_options": dict(GPU_COMPILER_OPTIONS),
      "step": "fp8_linen.testing.train_step.make_train_step: loss = sum(y * r) with random r as an argument; "
              "returns loss, dL/dx and the gradients of all variables (fwd + dgrad + wgrad); "
              "no optimizer update",
      "memory": "compiled.memory_analysis(): temp = XLA's peak of temporary buffers; "
                "arguments (params, fp8 state, x, r) and outputs (loss, dL/dx, grads) apart",
      "sizes": dict(sizes, quick=args.quick), "seconds": seconds,
      "host": common.environment(),
      "plugin": {d: _version(d) for d in ("jax-cuda12-plugin", "jax-cuda12-pjrt",
                                          "nvidia-cuda-nvcc-cu12")},
      "results": results}
  print(f"compiled in {seconds:.0f} s")
  print("wrote", common.write_json("compile", payload, args.out_dir, device="h100"))
  return payload


if __name__ == "__main__":
  main()
