"""Test setup: the CPU platform with 8 virtual devices, and the compile-only targets.

JAX_PLATFORMS=cpu keeps the CUDA plugin and libtpu of the `targets` extra
(installed for the compile-only proofs) from trying to start a GPU or TPU
backend, and XLA reads the device-count flag when the backend starts (on first
use); both are set here, before any test touches a device.

Tests that compile for a GPU or TPU this machine does not have take the
``require_target`` fixture. They are skipped only when the package the target
needs is not installed (the CUDA plugin for GPU targets, libtpu for TPU ones:
``pip install ".[targets]"``), and never where ``FP8_LINEN_REQUIRE_TARGETS=1``
(CI sets it); any other reason a target cannot compile (wrong plugin or libtpu
version, no ``ptxas``, ``JAX_PLATFORMS`` set to another platform) fails them
with that reason.

CPU programs are shared through one persistent compilation cache for the run.
Run in parallel (``python -m pytest -n auto``, ``--dist loadgroup`` from
pyproject), a program compiled for a target is kept only by the process that
compiled it (``fp8_linen.testing.cases.compile_case``): JAX's persistent
compilation cache cannot load compile-only programs back (jax 0.10:
"PjRtCompiler must be constructed with a Client"), so it cannot share them
between processes. Tests that read the same program therefore run
in one process: every test parametrized by ``target`` joins that target's
``xdist_group`` (see :func:`pytest_collection_modifyitems`), and a module
whose tests share another cache names its group itself.
"""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole run, shared by the xdist
# workers and the subprocesses tests start (they inherit the variable): many
# tests compile the same CPU programs from new closures (another seed, the
# same model in another test), which only a cache keyed by the program itself
# finds. Made by the first process to load this file, removed when it ends.
_OWN_CACHE_DIR = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE_DIR = tempfile.mkdtemp(prefix="fp8_linen-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE_DIR
# Every program, however quickly it compiles (JAX keeps only those over a second):
# the job's tests train the same small steps again and again (straight, stopped,
# resumed), each a program of under a second that a new closure compiles anew.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# Tests compile thousands of small CPU programs and run each a few times: LLVM's
# expensive passes cost more than they save here. XLA's HLO passes (fusion,
# layout, the GEMM forms the proofs read) still run, and compile-only targets
# read HLO, which the flag leaves as it is.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import pytest  # noqa: E402


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE_DIR is not None:
    shutil.rmtree(_OWN_CACHE_DIR, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist files each test under its groups
def pytest_collection_modifyitems(items):
  """Puts a test parametrized by ``target`` in that target's ``xdist_group``."""
  for item in items:
    callspec = getattr(item, "callspec", None)
    target = callspec.params.get("target") if callspec is not None else None
    if isinstance(target, str) and item.get_closest_marker("xdist_group") is None:
      item.add_marker(pytest.mark.xdist_group(target))


def targets_required() -> bool:
  """Whether compile-only targets must run (never skip): CI."""
  return os.environ.get("FP8_LINEN_REQUIRE_TARGETS") == "1"


@pytest.fixture(scope="session")
def require_target():
  """``require(name) -> Target``: skips (package absent) or fails (any other reason)."""
  from fp8_linen.testing import targets  # pylint: disable=import-outside-toplevel

  try:
    targets.use_cpu_platform()
    platform_error = None
  except targets.TargetUnavailable as e:
    platform_error = str(e)

  def require(name):
    t = targets.get_target(name)
    installed = (targets.plugin_installed() if t.platform == "gpu"
                 else targets.libtpu_installed())
    if not installed and not targets_required():
      what = "jax-cuda12-plugin" if t.platform == "gpu" else "libtpu"
      pytest.skip(f"{what} is not installed: pip install the fp8_linen[targets] extra to "
                  f"compile for {t.description} without the hardware")
    if platform_error:
      pytest.fail(platform_error)
    available = targets.availability(t)
    if not available:
      pytest.fail(f"compile-only {t.name} unavailable: {available.reason}")
    return t

  return require


def _float_gemm_dtypes(fn, *args, values=True):
  """``(lhs, rhs)`` dtype names of every float ``dot_general``/convolution in ``fn``'s jaxpr.

  With ``values``, an operand widened from a narrower float by
  ``convert_element_type`` counts as that float: its values are that dtype's,
  and XLA:TPU feeds them to the MXU as such. (Autodiff widens: JAX's
  convolution transposes cast a bf16 operand to the cotangent's dtype, and a
  float32 product output cast to bf16 gets a float32 cotangent holding bf16
  values.) Without it, operands count as their own dtype. Products of
  integers (codes, whatever float they were widened to) are left out.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def source(v, made_by):
    while True:
      e = made_by.get(id(v))
      if e is None or e.primitive.name != "convert_element_type":
        return v.aval.dtype
      src = e.invars[0].aval.dtype
      if jnp.issubdtype(src, jnp.floating) and (
          not values or src.itemsize >= v.aval.dtype.itemsize):
        return v.aval.dtype
      v = e.invars[0]

  out = []

  def walk(jaxpr):
    made_by = {id(o): e for e in jaxpr.eqns for o in e.outvars}
    for e in jaxpr.eqns:
      if e.primitive.name in ("dot_general", "conv_general_dilated"):
        dts = [source(v, made_by) for v in e.invars[:2]]
        if all(jnp.issubdtype(d, jnp.floating) for d in dts):
          out.append(tuple(jnp.dtype(d).name for d in dts))
      for p in e.params.values():
        for j in _subjaxprs(p):
          walk(j)

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def _subjaxprs(p):
  """The jaxprs an equation's parameter holds (jit, scan, cond, custom_vjp bodies)."""
  if hasattr(p, "eqns"):
    return [p]
  if hasattr(p, "jaxpr") and hasattr(p.jaxpr, "eqns"):
    return [p.jaxpr]
  if isinstance(p, (tuple, list)):
    return [j for q in p for j in _subjaxprs(q)]
  return []


def _all_eqns(jaxpr):
  """Every equation of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), nested bodies included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for j in _subjaxprs(p):
        yield from _all_eqns(j)


@pytest.fixture
def jaxpr_eqns():
  """:func:`_all_eqns`: every equation of a traced program, inside its sub-programs too."""
  return lambda jaxpr: list(_all_eqns(jaxpr))


@pytest.fixture
def float_gemm_dtypes():
  """:func:`_float_gemm_dtypes`: what a traced program's float products are fed."""
  return _float_gemm_dtypes


def _same_step_as_flax(model, opt, trained_opt, loss, tx):
  """One step of ``opt`` on ``model`` equals flax's own optimizer's on copies of both.

  ``trained_opt`` holds the optimizer state the switched ``opt`` goes on from;
  the reference is plain ``nnx.grad`` and ``nnx.Optimizer(tx)`` around clones.
  """
  import chex  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import fp8_linen as fl  # pylint: disable=import-outside-toplevel
  ref = nnx.clone(model)
  ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
  nnx.update(ref_opt, nnx.clone(nnx.state(trained_opt, nnx.OptState)))

  @nnx.jit
  def ours(m, o):
    o.update(m, fl.nnx.grad(loss)(m))

  @nnx.jit
  def theirs(m, o):
    o.update(m, nnx.grad(loss)(m))

  ours(model, opt)
  theirs(ref, ref_opt)
  chex.assert_trees_all_close(nnx.as_pure(nnx.state(model, nnx.Param)),
                              nnx.as_pure(nnx.state(ref, nnx.Param)), rtol=1e-6, atol=1e-7)


@pytest.fixture
def same_step_as_flax():
  """:func:`_same_step_as_flax`: a switched NNX model's step against flax's float step."""
  return _same_step_as_flax
