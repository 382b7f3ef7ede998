"""Pure-JAX quantization: numerics and custom-gradient ops. Never imports flax.

Its modules, each importing only modules listed above it:

* ``settings``: settings read while a function is traced (part of every jit key);
* ``uses``: the uses of one quantization state in a step, under any JAX transform;
* ``dims``: dimension-number algebra: canonical forms, gradient products, einsum plans;
* ``mesh``: on a mesh, a product's operands move as 1-byte codes (``multiply_codes``);
* ``lowering``: which GEMM form a backend gets, output shardings, the GEMM calls;
* ``hoist``: a loop's work on its invariant inputs, split out to run once before it;
* ``numerics``: fp8 per tensor and per row: saturating casts, amax histories, scales;
* ``block_numerics``: the block formats (MXFP8, NVFP4): codes with their block scales;
* ``randomness``: NVFP4's stochastic-rounding noise and random Hadamard rotation;
* ``block_kernels``: Pallas kernels: an operand's block codes in both layouts from one read;
* ``grouped_kernels``: Pallas grouped GEMMs for a GPU (``ragged_dot``: each row by its group's weight);
* ``int_numerics``: integer grids (affine, symmetric, power-of-two scales), LSQ's steps;
* ``int_kernels``: a Pallas TPU kernel: a weight's per-channel int8 codes from one read;
* ``owg``: the state protocol: new state leaves a step as its "gradient" (``RoleState``);
* ``qdq``: the fp8 quantize/dequantize pair (``fl.quantize``, ``Fp8Activation``);
* ``fp8_vjp``: the custom_vjp every fp8 GEMM and convolution runs under (``Fp8Spec``);
* ``block_dot``: the block-scaled fp8 ``dot_general`` (``BlockDot``);
* ``dot_general``: ``fp8_dot_general``: per-tensor and row-wise specs, the block one's entry;
* ``conv``: ``fp8_conv_general_dilated``;
* ``ragged_dot``: ``fp8_ragged_dot``: grouped GEMMs (``jax.lax.ragged_dot``, an MoE's experts);
* ``int_ops``: integer fake quantization with custom gradients: STE, LSQ, LSQ+, observers;
* ``int_codes``: an operand as int8 codes with the parameters that make it exact;
* ``int_gemm``: the exact integer GEMM and convolution of codes, and their lowering;
* ``int_product``: the integer product's custom_vjp (``int_dot_general``, ...);
* ``serve``: what serving stores (the arrays' names) and the conversion records both APIs share;
* ``fp8_serve``: fp8 served products: the QAT forward from stored fp8 codes, their records;
* ``int_serve``: integer served products: the QAT forward from stored int8/int4 codes, records;
* ``fp8_weight``: weight-only fp8: fake-quantized weights in QAT, their codes in serving;
* ``calibration``: post-training quantization's activation ranges (min/max, percentile, MSE);
* ``gptq``: GPTQ: a weight rounded row by row with its error spread by the inputs' Hessian;
* ``lora``: low-rank adapters beside a frozen served weight, and the served products' gradient.

Numerics modules are ``jnp`` functions without autodiff rules (they read the
traced-for backend and ``shard_map``'s axes through ``lowering``); the ops
are custom_vjp functions that take their state as inputs (``owg``).

Nothing here knows a layer: :mod:`fp8_linen.families` runs these ops on a
layer's variables, for both Flax APIs.
"""
