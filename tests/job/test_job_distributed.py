"""The job's LM train step on an 8-device mesh (FSDP x TP) matches one device.

The README's "Distributed training" recipe as a test: weights sharded over
the data axis (FSDP) and over the model axis (tensor parallel: column-parallel
``qkv``/``fc1``/``head``, row-parallel ``out``/``fc2``), the batch over the
data axis, the job's own ``make_train_step`` under ``jit``. The fp8 state is
replicated and its amaxes are the global maxima, so it equals the one-device
state; losses and gradient norms agree to float rounding.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8_linen as fl
from fp8_linen import monitor
from fp8_linen_job import arms as arms_lib
from fp8_linen_job import config as config_lib
from fp8_linen_job import quant_state
from fp8_linen_job import tasks as tasks_lib
from fp8_linen_job import train

COLUMN, ROW = ("qkv", "fc1", "head"), ("out", "fc2")


def _close(a, b):
  """Equal up to float noise, which fp8 rounding can raise to a few percent in
  single elements downstream (a factor of the device count is far outside)."""
  np.testing.assert_array_less(np.linalg.norm(np.asarray(a) - np.asarray(b)),
                               2e-2 * np.linalg.norm(np.asarray(b)) + 1e-12)


def _spec(path, leaf):
  """FSDP x TP layout of one train-state leaf (params and their optimizer state alike)."""
  names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
  owner = names[-2] if len(names) > 1 else None
  if leaf.ndim == 2 and names[-1] == "kernel":
    if owner in COLUMN:
      return P("data", "model")
    if owner in ROW:
      return P("model", "data")
  if leaf.ndim == 2 and names[-1] == "embedding":
    return P(None, "model")
  if leaf.ndim == 1 and names[-1] == "bias" and owner in COLUMN:
    return P("model")
  return P()  # fp8 state, layer norms, step counters: replicated


def test_lm_step_with_fsdp_and_tensor_parallelism_matches_one_device():
  assert jax.device_count() == 8
  cfg = config_lib.load_config("tiny")
  cfg = dataclasses.replace(cfg, arms=("fp8",), progress=False,
                            lm=dataclasses.replace(cfg.lm, batch_size=8))
  task = tasks_lib.build_task("lm", cfg)
  # float32 compute, so that the comparison is not about bfloat16 rounding.
  arm = dataclasses.replace(arms_lib.build_arm("fp8", cfg), dtype=jnp.float32)
  state0 = train.init_state(task, arm, cfg.seed)
  modules = monitor.pick_evenly(quant_state.quantized_modules(state0.params), 2)
  step = jax.jit(train.make_train_step(modules))
  batches = [task.train_batch(i) for i in range(2)]

  single, single_metrics = state0, []
  for batch in batches:
    single, metrics = step(single, batch)
    single_metrics.append(metrics)

  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharded = jax.tree_util.tree_map_with_path(
      lambda p, a: jax.device_put(a, NamedSharding(mesh, _spec(p, a))), state0)
  assert sharded.params["params"]["block0"]["mlp"]["fc1"]["kernel"].sharding.spec == P(
      "data", "model")
  for batch, want in zip(batches, single_metrics):
    sharded, got = step(sharded, jax.device_put(batch, NamedSharding(mesh, P("data"))))
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-4)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2),
               sharded.params[fl.OWG], single.params[fl.OWG])
  # Adam turns gradients that are pure rounding noise (the key bias: softmax
  # ignores it) into full-size steps of either sign: bound by the learning rate.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3,
                                                       atol=2 * cfg.lm.learning_rate),
               sharded.params["params"], single.params["params"])


def test_lm_gradients_under_shard_map_are_the_mean_over_devices():
  # Inside shard_map the step is written per device; fl.reduce_gradients then
  # averages the parameter gradients and max-reduces the fp8 state. With
  # check_vma (shard_map's default) JAX has already summed the gradients of the
  # replicated variables, and the mean must not become that sum.
  cfg = config_lib.load_config("tiny")
  cfg = dataclasses.replace(cfg, arms=("fp8",), progress=False,
                            lm=dataclasses.replace(cfg.lm, batch_size=8))
  task = tasks_lib.build_task("lm", cfg)
  arm = dataclasses.replace(arms_lib.build_arm("fp8", cfg), dtype=jnp.float32)
  state = train.init_state(task, arm, cfg.seed)
  batch = task.train_batch(0)

  def grads_of(variables, batch):
    loss = lambda v: tasks_lib.loss_and_accuracy(state.apply_fn(v, batch["x"]), batch["y"])[0]
    return jax.grad(loss)(variables)

  def per_device(variables, batch):
    return fl.reduce_gradients(grads_of(variables, batch), "data")

  mesh = jax.make_mesh((8,), ("data",))  # Explicit axes, jax.make_mesh's default
  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(per_device, in_specs=(P(), P("data")), out_specs=P()))
    sharded = f(jax.device_put(state.params, NamedSharding(mesh, P())),
                jax.device_put(batch, NamedSharding(mesh, P("data"))))
  # Each device's loss is the mean over its own rows: the mean over devices of
  # those gradients is the full batch's gradient.
  single = jax.jit(grads_of)(state.params, batch)
  jax.tree.map(_close, sharded["params"], single["params"])
  # Amaxes are global maxima. Each device's loss is a mean over 1/8 of the
  # rows, so the gradients it quantized (output_grad) were 8 times larger.
  def same_state(path, a, b):
    factor = 8.0 if path[-1].key.startswith("output_grad_") else 1.0
    np.testing.assert_allclose(a, factor * b, rtol=2e-2, err_msg=jax.tree_util.keystr(path))
  jax.tree_util.tree_map_with_path(same_state, sharded[fl.OWG], single[fl.OWG])
