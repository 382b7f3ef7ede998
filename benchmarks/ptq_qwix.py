"""Post-training quantization next to qwix's on one trained model, in one run.

The float MLP of ``ptq_digits.py`` (64-256-256-10, gelu, scikit-learn's 8x8
digits, trained in float with the same seed, split and steps, so the same
float params) is quantized by ``fl.ptq`` and by qwix's PTQ from the same float
params and, where a method calibrates, the same 4 batches of 64 training rows.
Arms with matching semantics:

* weight-only int8 / int4 per output channel, int4 per group of 32 inputs
  (qwix: ``QuantizationRule(weight_qtype=..., tile_size=32)``), round to
  nearest;
* the same int4 arms with GPTQ (``fl.PtqConfig(weights='gptq')``; qwix:
  ``qwix.contrib.gptq``);
* w8a8 int8 with static activation ranges from the calibration batches (ours:
  one scale per tensor from the min/max of all batches; qwix: its static-range
  path, ``act_static_scale=True``, statistics collected by a ``QtProvider``
  model and turned into scales by ``qwix.quantize_params``);
* w8a8 int8 with dynamic activation ranges: qwix only (a scale per row of
  each activation, computed in the served forward); fp8_linen has no
  dynamic integer activation scaling.
* a control: qwix's int4 round to nearest with fp8_linen's grid (its range
  widened by 7.5/7, so its scale is max|w| / 7 as ours), which serves our
  int4 logits: the two libraries' int4 gap is the grid.

For every arm and library: the served test loss and accuracy, the relative
error of the served logits against the float model's, the stored bytes of the
served params (``fl.weight_bytes`` for both: 4-bit codes at half a byte), what
the compiled CPU program of the served forward multiplies (the operand types
of every dot), and the served forward's time on CPU, all arms jitted and timed
interleaved in this process (medians, ratio to the float model's forward).
Not part of ``run_all.py``.

  PYTHONPATH=. python benchmarks/ptq_qwix.py --out benchmarks/results/cpu-ptq-qwix.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import ptq_digits  # noqa: E402  (the float model)

import fp8_linen as fl  # noqa: E402
from fp8_linen.testing import hlo as hlo_text  # noqa: E402
from fp8_linen.testing import hlo_products  # noqa: E402

FP8_LINEN = "fp8_linen"
FP8_LINEN_S8 = "fp8_linen gemm='int8'"
QWIX = "qwix"
# qwix with its weight range widened by 7.5/7, i.e. fp8_linen's int4 grid (scale max|w| / 7):
# a control arm that shows how much of the int4 difference the grid explains.
QWIX_OUR_GRID = "qwix, absmax x 15/14"


@dataclasses.dataclass(frozen=True)
class Arm:
  """One quantization method, as each library spells it.

  Attributes:
    name: the row label.
    ours: ``{library label: (recipe, PtqConfig, the call in words)}`` for
      ``fl.ptq`` (empty when fp8_linen has no such method).
    qwix: keyword arguments of ``qwix.QuantizationRule`` plus ``gptq``
      (bool), or None when qwix has no such method.
    activations: ``{'fp8_linen': ..., 'qwix': ...}``: how each library
      quantizes the activations, in words (None: weight-only, float
      activations).
    qwix_extra: ``{library label: qwix spec}``: more qwix variants of the arm.
  """

  name: str
  ours: dict
  qwix: dict | None
  activations: dict | None = None
  qwix_extra: dict = dataclasses.field(default_factory=dict)


def arms() -> dict[str, Arm]:
  """The arms, by short key (``--arms``)."""
  wo8, wo4 = "fl.weight_only(8)", "fl.weight_only(4)"
  g32_txt = "fl.weight_only(4, granularity='group', group_size=32)"
  g32 = fl.weight_only(4, granularity="group", group_size=32)
  rtn, gptq = fl.PtqConfig(), fl.PtqConfig(weights="gptq")
  gptq_txt = ", config=fl.PtqConfig(weights='gptq')"
  w8a8 = fl.IntRecipe(kernel=fl.IntQuantConfig(granularity="channel"))
  widen = f"absmax,{7.5 / 7!r}"
  w8a8_txt = "fl.IntRecipe(kernel=fl.IntQuantConfig(granularity='channel')"
  static = {FP8_LINEN: "static, one scale per tensor: max |x| over all calibration batches "
                      "/ 127 (PtqConfig(activation='minmax'))",
            QWIX: "static, one scale per tensor: the mean over the calibration rows and "
                  "batches of each row's max |x|, / 127.5"}
  return {
      "int8": Arm("int8 weight-only, channel",
                  {FP8_LINEN: (fl.weight_only(8), rtn, wo8)},
                  {"weight_qtype": jnp.int8}),
      "int4": Arm("int4 weight-only, channel",
                  {FP8_LINEN: (fl.weight_only(4), rtn, wo4)},
                  {"weight_qtype": jnp.int4},
                  qwix_extra={QWIX_OUR_GRID: {"weight_qtype": jnp.int4,
                                              "weight_calibration_method": widen}}),
      "int4_g32": Arm("int4 weight-only, group 32",
                      {FP8_LINEN: (g32, rtn, g32_txt)},
                      {"weight_qtype": jnp.int4, "tile_size": 32},
                      qwix_extra={QWIX_OUR_GRID: {"weight_qtype": jnp.int4, "tile_size": 32,
                                                  "weight_calibration_method": widen}}),
      "int4_gptq": Arm("int4 weight-only, channel, GPTQ",
                       {FP8_LINEN: (fl.weight_only(4), gptq, wo4 + gptq_txt)},
                       {"weight_qtype": jnp.int4, "gptq": True}),
      "int4_g32_gptq": Arm("int4 weight-only, group 32, GPTQ",
                           {FP8_LINEN: (g32, gptq, g32_txt + gptq_txt)},
                           {"weight_qtype": jnp.int4, "tile_size": 32, "gptq": True}),
      "w8a8_static": Arm("w8a8 int8, static activation scale",
                         {FP8_LINEN: (w8a8, rtn, w8a8_txt + ")")},
                         {"weight_qtype": jnp.int8, "act_qtype": jnp.int8,
                          "act_static_scale": True},
                         activations=static),
      # The same as fp8_linen's w8a8 arm but for the product: gemm='auto' multiplies the
      # int8 codes as exact bf16 products on CPU (XLA:CPU's faster kernel), 'int8' as s8.
      "w8a8_static_s8": Arm("w8a8 int8, static activation scale",
                            {FP8_LINEN_S8: (dataclasses.replace(w8a8, gemm="int8"), rtn,
                                            w8a8_txt + ", gemm='int8')")},
                            None, activations=static),
      "w8a8_dynamic": Arm("w8a8 int8, dynamic activation scale", {},
                          {"weight_qtype": jnp.int8, "act_qtype": jnp.int8},
                          activations={QWIX: "dynamic, one scale per row (token): the row's "
                                             "max |x| / 127.5, computed in the served forward"}),
  }


# How the two libraries' methods differ (read from qwix 0.1.8's source), for the JSON.
DIFFERENCES = {
    "weight_grid": "Both round to nearest on a symmetric grid with codes in [-2**(b-1), "
                   "2**(b-1) - 1]. fp8_linen: scale = max|w| / (2**(b-1) - 1) (127, 7): the "
                   "largest weight lands on the top code. qwix: scale = max|w| / (2**(b-1) - "
                   "0.5) (127.5, 7.5): a finer step (7% at int4), +max|w| saturates at the top "
                   "code (7 steps) and -max|w| rounds to the bottom one (-8). The arms "
                   f"'{QWIX_OUR_GRID}' give qwix fp8_linen's int4 grid "
                   "(weight_calibration_method='absmax,1.0714...': the range widened by 7.5/7).",
    "activation_scale": "fp8_linen: static, one scale per tensor from the min/max of every "
                        "calibration batch. qwix static: one scale per tensor from the mean "
                        "of the rows' max |x| (rows above the mean clip). qwix dynamic: a "
                        "scale per row computed in the served forward.",
    "calibration_inputs": "fp8_linen records every product's input on the float model. qwix's "
                          "static activation statistics come from a QtProvider (QAT) model, "
                          "whose later layers see the outputs of the fake-quantized earlier "
                          "ones; its GPTQ Hessians come from the float model.",
    "gptq": "Both: damping 1% of mean(diag H), the input rows in order, per-channel scales "
            "from the unmodified weight. fp8_linen takes a group's scale from its rows as the "
            "updates left them when the group is reached; qwix from the weight as it stood at "
            "the start of the 128-row block holding the group (updates within the block not "
            "yet applied).",
    "served_product": "Weight-only (both): the codes are dequantized to f32 and multiplied in "
                      "an f32 dot. w8a8: qwix multiplies s8 x s8 -> s32 and rescales; "
                      "fp8_linen gemm='auto' multiplies the int8 codes as exact bf16 products "
                      "on CPU (f32 accumulation; s8 on GPU/TPU), gemm='int8' as s8 x s8 -> s32. "
                      "qwix falls back to dequantize-then-float-dot for tiles under 128 inputs "
                      "(so for w8a8 per group of 32).",
}

QUICK_ARMS = ("int8", "int4", "w8a8_static", "w8a8_dynamic")  # one fl.ptq compile each


def train_float(steps: int, seed: int = 0) -> dict:
  """The float MLP of ``ptq_digits.py``, trained as it trains it (same data, split and steps)."""
  return ptq_digits.train_float(steps, seed)


loss_of = ptq_digits.loss_of


def qwix_ptq(model, params: dict, batches: list, spec: dict) -> tuple[object, dict, str]:
  """qwix's PTQ of the float ``params``: ``(served model, served params, method)``.

  The served model is ``qwix.quantize_model(model, PtqProvider([rule]))``; its
  params come from ``qwix.quantize_params`` (round to nearest: absmax per
  output channel or tile), or ``qwix.contrib.gptq.quantize_params`` with the
  Hessians a ``GptqCalibrationProvider`` collected on the float model. Static
  activation scales come from the ``quant_stats`` a ``QtProvider`` model
  (the same rule, QAT mode) records on the calibration batches.

  Args:
    model: the float Linen model.
    params: its float variables (``{'params': ...}``).
    batches: the calibration batches.
    spec: ``qwix.QuantizationRule`` fields, plus ``gptq`` (bool).

  Returns:
    The served model, its params (``{'params': ...}``) and a description.
  """
  import qwix  # pylint: disable=import-outside-toplevel
  from qwix.contrib import gptq  # pylint: disable=import-outside-toplevel

  spec = dict(spec)
  use_gptq = spec.pop("gptq", False)
  rule = qwix.QuantizationRule(module_path=".*", **spec)
  served = qwix.quantize_model(model, qwix.PtqProvider([rule]))
  abstract = jax.eval_shape(served.init, jax.random.key(0), batches[0])["params"]
  fields = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in spec.items())
  if use_gptq:
    calib = qwix.quantize_model(model, gptq.GptqCalibrationProvider(
        [gptq.GptqRule(module_path=".*", **spec)]))
    stats = _collect_stats(calib, params, batches)
    qparams = gptq.quantize_params(params["params"], abstract, stats)
    method = (f"qwix.contrib.gptq: GptqRule({fields}), GptqCalibrationProvider on the float "
              "model, gptq.quantize_params (block 128, damping 1% of mean diag H)")
  elif spec.get("act_static_scale"):
    qat = qwix.quantize_model(model, qwix.QtProvider([qwix.QtRule(module_path=".*", **spec)]))
    stats = _collect_stats(qat, params, batches)
    qparams = qwix.quantize_params(params["params"], abstract, stats)
    method = (f"QuantizationRule({fields}); quant_stats from a QtProvider model on the "
              "calibration batches, then qwix.quantize_params")
  else:
    qparams = qwix.quantize_params(params["params"], abstract)
    method = f"QuantizationRule({fields}); qwix.quantize_params"
  # GPTQ's int4 codes are read from a jax Ref eagerly and come back in an unpacked
  # layout that an AOT-compiled forward refuses ("compiled for input layouts that
  # disagree"): a round trip through the host gives them the default one.
  qparams = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), qparams)
  return served, {"params": qparams}, method


def _collect_stats(model, params: dict, batches: list) -> dict:
  """Runs ``model`` over ``batches`` with ``quant_stats`` mutable; returns that collection."""
  run = jax.jit(lambda v, x: model.apply(v, x, mutable=["quant_stats"])[1]["quant_stats"])
  stats = None
  for x in batches:
    v = {"params": params["params"]} if stats is None else {"params": params["params"],
                                                             "quant_stats": stats}
    stats = run(v, x)
  return stats


def cpu_dots(hlo: str) -> list[str]:
  """``'lhs x rhs -> out'`` of every dot of an optimized XLA:CPU module."""
  return sorted(f"{p.operands[0]} x {p.operands[1]} -> {p.out}"
                for p in hlo_products.products(hlo_text.parse(hlo)) if p.kind == "dot")


def _rel_err(logits, ref) -> float:
  return float(jnp.linalg.norm(logits - ref) / jnp.linalg.norm(ref))


def run(steps: int, seed: int, keys: tuple[str, ...], batch_sizes: tuple[int, ...],
        reps: int, warmup: int) -> dict:
  """Trains, quantizes with both libraries, evaluates and times; returns the JSON payload.

  Args:
    steps: float training steps.
    seed: the training seed.
    keys: which arms (keys of :func:`arms`).
    batch_sizes: rows of the timed forwards (the first ``min(n, 397)`` are
      the test set, the rest drawn from it).
    reps: timed rounds per batch size.
    warmup: untimed rounds first.

  Returns:
    The payload written to ``--out``.
  """
  data = train_float(steps, seed)
  model, params, xte, yte = data["model"], data["params"], data["xte"], data["yte"]
  batches = [data["xtr"][i * 64:(i + 1) * 64] for i in range(4)]
  xte = jnp.asarray(xte)
  served: dict[tuple[str, str], tuple[Callable, dict]] = {("float", "float"): (model.apply,
                                                                              params)}
  cache: dict = {}

  def compiled(arm: tuple[str, str], x):
    """The served forward of ``arm`` compiled for ``x``'s shape (once per shape)."""
    if (arm, x.shape) not in cache:
      apply, p = served[arm]
      cache[(arm, x.shape)] = jax.jit(apply).lower(p, x).compile()
    return cache[(arm, x.shape)]

  ref = compiled(("float", "float"), xte)(params, xte)
  rows: dict = {"float": {"float": {
      "test_loss": float(loss_of(ref, yte)),
      "test_accuracy": float((ref.argmax(-1) == yte).mean()),
      "logits_rel_err": 0.0, "weight_bytes": fl.weight_bytes(params), "method": "float32"}}}
  catalogue = arms()
  for key in keys:
    arm = catalogue[key]
    out = {}
    for label, (recipe, config, text) in arm.ours.items():
      t = time.perf_counter()
      res = fl.ptq(model, params, batches, recipe=recipe, config=config)
      out[label] = {"method": f"fl.ptq(model, params, batches, recipe={text})",
                    "ptq_seconds": time.perf_counter() - t}
      served[(key, label)] = (res.served.apply, res.served_params)
    qwix_specs = ({QWIX: arm.qwix} if arm.qwix is not None else {}) | arm.qwix_extra
    for label, spec in qwix_specs.items():
      t = time.perf_counter()
      qmodel, qparams, method = qwix_ptq(model, params, batches, spec)
      out[label] = {"method": method, "ptq_seconds": time.perf_counter() - t}
      served[(key, label)] = (qmodel.apply, qparams)
    for label, row in out.items():
      p = served[(key, label)][1]
      logits = compiled((key, label), xte)(p, xte)
      row.update(test_loss=float(loss_of(logits, yte)),
                 test_accuracy=float((logits.argmax(-1) == yte).mean()),
                 logits_rel_err=_rel_err(logits, ref), weight_bytes=fl.weight_bytes(p),
                 activations=(arm.activations or {}).get(
                     QWIX if label.startswith(QWIX) else FP8_LINEN, "float (weight-only)"))
    rows[key] = out
    print(f"{arm.name}: PTQ " + ", ".join(f"{k} {r['ptq_seconds']:.1f} s" for k, r in out.items()),
          flush=True)
  # What each served forward multiplies, and its time: all arms interleaved per batch size.
  rng = np.random.default_rng(seed + 1)
  for n in batch_sizes:
    x = xte[:n] if n <= len(xte) else np.concatenate(
        [xte, xte[rng.integers(0, len(xte), n - len(xte))]])
    x = jnp.asarray(x)
    fns = {}
    for (key, label), (_, p) in served.items():
      c = compiled((key, label), x)
      rows[key][label]["cpu_dots"] = cpu_dots(c.as_text())
      fns[f"{key}/{label}"] = (lambda c=c, p=p, x=x: c(p, x))
    times = common.time_interleaved(fns, reps=reps, warmup=warmup)
    base = times["float/float"]["median_ms"]
    for (key, label) in served:
      t = times[f"{key}/{label}"]
      rows[key][label].setdefault("timing", {})[f"batch_{n}"] = dict(
          t, ratio_vs_float=t["median_ms"] / base)
  base_bytes = rows["float"]["float"]["weight_bytes"]
  for out in rows.values():
    for row in out.values():
      row["weight_bytes_ratio_vs_float"] = row["weight_bytes"] / base_bytes
  return {"rows": rows, "names": {"float": "float", **{k: catalogue[k].name for k in keys}}}


def table(payload: dict) -> str:
  """A markdown table: one line per arm and library, the arms with one name together."""
  batches = payload["batch_sizes"]
  head = ("| arm | library | test loss | accuracy | logits rel. err | weight bytes (vs f32) | "
          + " | ".join(f"forward, batch {n} (vs f32)" for n in batches) + " | CPU dots |")
  lines = [head, "|" + " --- |" * 2 + " ---: |" * (4 + len(batches)) + " --- |"]
  by_name: dict[str, list] = {}
  keys = ["float", *(k for k in arms() if k in payload["arms"])]  # the JSON's keys are sorted
  for key in keys:
    by_name.setdefault(payload["arm_names"][key], []).extend(payload["arms"][key].items())
  order = {"float": 0, FP8_LINEN: 1, FP8_LINEN_S8: 2, QWIX: 3, QWIX_OUR_GRID: 4}
  for name, rows in by_name.items():
    for label, r in sorted(rows, key=lambda lr: order[lr[0]]):
      times = " | ".join(f"{r['timing'][f'batch_{n}']['ratio_vs_float']:.2f}x" for n in batches)
      lines.append(
          f"| {name} | {label} | {r['test_loss']:.4f} | {100 * r['test_accuracy']:.2f}% | "
          f"{100 * r['logits_rel_err']:.2f}% | {r['weight_bytes']:,} "
          f"({r['weight_bytes_ratio_vs_float']:.3f}) | {times} | "
          f"{', '.join(sorted(set(r['cpu_dots'])))} |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  """Runs the comparison, prints the table and writes the JSON (``--out``)."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=None, help="float training steps (600)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--arms", nargs="+", choices=tuple(arms()), default=None)
  ap.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                  help="rows of the timed forward (397: the test set; default 397 4096)")
  ap.add_argument("--reps", type=int, default=None, help="timed rounds (100)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--quick", action="store_true",
                  help="a smoke run: 150 steps, the arms " + " ".join(QUICK_ARMS)
                  + ", one timed round at batch 397")
  ap.add_argument("--out", default=None, help="the JSON file to write")
  args = ap.parse_args(argv)
  quick = args.quick
  steps = args.steps if args.steps is not None else (150 if quick else 600)
  keys = tuple(args.arms or (QUICK_ARMS if quick else arms()))
  batch_sizes = tuple(args.batch_sizes or ((397,) if quick else (397, 4096)))
  reps = args.reps if args.reps is not None else (1 if quick else 100)
  warmup = 1 if quick else args.warmup
  import qwix  # pylint: disable=import-outside-toplevel
  result = run(steps, args.seed, keys, batch_sizes, reps, warmup)
  env = dict(common.environment(), qwix=qwix.__version__)
  payload = {
      "benchmark": "ptq_qwix",
      "device": "CPU" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind,
      "env": env,
      "model": "MLP 64-256-256-10 gelu (benchmarks/ptq_digits.py), sklearn digits, "
               "1400 train / 397 test",
      "steps": steps, "seed": args.seed, "quick": quick,
      "calibration": "the same 4 batches of 64 training rows for both libraries",
      "batch_sizes": list(batch_sizes),
      "timing": f"jitted served forward (params as arguments), every arm and the float model "
                f"interleaved in one process, median of {reps} runs after {warmup} warm-up "
                "rounds; ratio_vs_float = median / the float32 model's median",
      "weight_bytes": "fl.weight_bytes of the served params (codes, scales, float biases, "
                      "activation scales; 4-bit codes counted at half a byte) for both "
                      "libraries",
      "cpu_dots": "operand and result types of every dot in the optimized XLA:CPU program of "
                  "the served forward",
      "ptq_seconds": "wall time of each PTQ call in this process, compilation included: the "
                     "first call down a path pays for compiling its ops (qwix's GPTQ runs its "
                     "column loop eagerly, op by op), so the figures depend on the arms' order",
      "differences": DIFFERENCES,
      "arm_names": result["names"],
      "arms": result["rows"],
  }
  print(table(payload))
  if args.out:
    print("wrote", common.write_json_to(args.out, payload))
  return payload


if __name__ == "__main__":
  main()
