"""``fp8_linen.testing.hlo`` and its readers (``hlo_products``, ``hlo_collectives``,
``hlo_kernels``) on hand-written optimized HLO (needs no plugin)."""

import pytest

from fp8_linen.testing import hlo, hlo_collectives, hlo_kernels, hlo_products

# A TPU-style module: every product is a `convolution`, some inside fusions; a batched
# matmul written as a windowed convolution over dilated inputs; an all-reduce over a
# tuple and an async all-gather; a while loop with a known trip count.
_TPU = """\
HloModule m

%fused_gemm (p0: f8e4m3fn[64,32], p1: f8e5m2[32,16]) -> f32[64,16] {
  %p0 = f8e4m3fn[64,32]{1,0:T(8,128)} parameter(0)
  %p1 = f8e5m2[32,16]{1,0:T(8,128)} parameter(1)
  ROOT %c = f32[64,16]{1,0:T(8,128)} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%fused_batched (q: bf16[4,512,2,128], k: bf16[4,512,2,128]) -> f32[4,2,512,512] {
  %q = bf16[4,512,2,128]{3,2,1,0} parameter(0)
  %k = bf16[4,512,2,128]{3,2,1,0} parameter(1)
  ROOT %s = f32[4,2,512,512]{3,2,1,0} convolution(%q, %k), window={size=4x2 stride=3x1 lhs_dilate=4x2}, dim_labels=0b1f_0o1i->01bf
}

%body (t: (s32[], bf16[8,8])) -> (s32[], bf16[8,8]) {
  %t = (s32[], bf16[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %a = bf16[8,8]{1,0} get-tuple-element(%t), index=1
  %m = bf16[8,8]{1,0} convolution(%a, %a), dim_labels=bf_io->bf
  ROOT %r = (s32[], bf16[8,8]{1,0}) tuple(%i, %m)
}

%cond (t.1: (s32[], bf16[8,8])) -> pred[] {
  %t.1 = (s32[], bf16[8,8]{1,0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (a: f8e4m3fn[64,32], b: f8e5m2[32,16], q: bf16[4,512,2,128], g: f32[1024], h: f32[256], w: bf16[8,8]) -> f32[64,16] {
  %a = f8e4m3fn[64,32]{1,0} parameter(0)
  %b = f8e5m2[32,16]{1,0} parameter(1)
  %q = bf16[4,512,2,128]{3,2,1,0} parameter(2)
  %g = f32[1024]{0} parameter(3)
  %h = f32[256]{0} parameter(4)
  %w = bf16[8,8]{1,0} parameter(5)
  %f1 = f32[64,16]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_gemm
  %f2 = f32[4,2,512,512]{3,2,1,0} fusion(%q, %q), kind=kOutput, calls=%fused_batched
  %ar = (f32[1024]{0}, f32[256]{0}) all-reduce(%g, %h), channel_id=1, to_apply=%cond
  %ags = ((f8e4m3fn[64,32]{1,0}), (f8e4m3fn[256,32]{1,0}), u32[]) all-gather-start(%a), channel_id=2, dimensions={0}
  %agd = f8e4m3fn[256,32]{1,0} all-gather-done(%ags)
  %init = (s32[], bf16[8,8]{1,0}) tuple(%h, %w)
  %loop = (s32[], bf16[8,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %out = f32[64,16]{1,0} copy(%f1)
}
"""


def test_tpu_products_read_the_operand_dtypes_inside_fusions():
  ps = {p.name: p for p in hlo_products.products(hlo.parse(_TPU))}
  assert ps["c"].operands == ("f8e4m3fn", "f8e5m2") and ps["c"].operand_class == "fp8"
  assert ps["c"].kind == "convolution" and ps["c"].low_precision
  assert ps["s"].operands == ("bf16", "bf16") and not ps["s"].low_precision


def test_flops_of_a_gemm_written_as_a_convolution():
  ps = {p.name: p for p in hlo_products.products(hlo.parse(_TPU))}
  assert ps["c"].flops == 2 * 64 * 16 * 32


def test_flops_of_a_batched_matmul_written_as_a_dilated_window_convolution():
  # (b=4, h=2) batches of 512x128 @ 128x512: the window only ever finds one real element.
  ps = {p.name: p for p in hlo_products.products(hlo.parse(_TPU))}
  assert ps["s"].flops == 2 * 4 * 2 * 512 * 512 * 128


def test_collectives_count_each_operation_once_with_its_full_bytes():
  cs = hlo_collectives.collectives(hlo.parse(_TPU))
  assert hlo_collectives.collective_totals(cs) == {"all-gather": (1, 256 * 32),
                                                   "all-reduce": (1, 1280 * 4)}
  (gather,) = [c for c in cs if c.kind == "all-gather"]
  assert gather.dtypes == ("f8e4m3fn",)


def test_kernels_take_loop_trip_counts_and_skip_bookkeeping():
  ks = {k.name: k for k in hlo_kernels.kernels(hlo.parse(_TPU))}
  assert set(ks) == {"f1", "f2", "m", "out"}
  assert ks["m"].count == 5 and ks["m"].flops == (("bf16", 2 * 8 * 8 * 8),)
  assert ks["f1"].flops == (("fp8", 2 * 64 * 16 * 32),)
  assert ks["f1"].bytes_read == 64 * 32 + 32 * 16 and ks["f1"].bytes_written == 64 * 16 * 4
  assert not ks["out"].is_product


# A loop as XLA:TPU writes a scan: no trip count in its config; `i < 7` on a counter
# copied in from a constant 2.
_SCAN = """\
HloModule s

%body (t: (s32[], bf16[8,8])) -> (s32[], bf16[8,8]) {
  %t = (s32[], bf16[8,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %a = bf16[8,8]{1,0} get-tuple-element(%t), index=1
  %m = bf16[8,8]{1,0} convolution(%a, %a), dim_labels=bf_io->bf
  ROOT %r = (s32[], bf16[8,8]{1,0}) tuple(%i, %m)
}

%cond (t.1: (s32[], bf16[8,8])) -> pred[] {
  %n = s32[] constant(7)
  %t.1 = (s32[], bf16[8,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%t.1), index=0
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (w: bf16[8,8], k: s32[]) -> (s32[], bf16[8,8]) {
  %w = bf16[8,8]{1,0} parameter(0)
  %k = s32[] parameter(1)
  %two = s32[] constant(2)
  %start = s32[] copy(%two)
  %init = (s32[], bf16[8,8]{1,0}) tuple(%start, %w)
  ROOT %loop = (s32[], bf16[8,8]{1,0}) while(%init), condition=%cond, body=%body
}
"""


def _loop_count(text):
  m = hlo.parse(text)
  (loop,) = [i for i in m.computations["main"] if i.opcode == "while"]
  return hlo_kernels.trip_count(m, "main", loop)


def test_trip_count_of_a_loop_without_one_in_its_config():
  assert _loop_count(_SCAN) == 5                                  # 2, 3, ..., 6
  # The kernels of the loop body run that many times per step.
  assert {k.name: k.count for k in hlo_kernels.kernels(hlo.parse(_SCAN))}["m"] == 5
  # A counter that does not start at a constant: unknown, taken as 1.
  assert _loop_count(_SCAN.replace("tuple(%start, %w)", "tuple(%k, %w)")) == 1
  assert _loop_count(_TPU) == 5                                   # from its backend config


@pytest.mark.parametrize("lhs,rhs,want", [("f8e4m3fn", "f8e5m2", "fp8"), ("s8", "s8", "int8"),
                                          ("f4e2m1fn", "f4e2m1fn", "fp4"), ("f32", "bf16", "f32"),
                                          ("bf16", "bf16", "bf16"), ("f8e4m3fn", "bf16", "bf16")])
def test_operand_class(lhs, rhs, want):
  assert hlo_products.operand_class(lhs, rhs) == want


def test_sub_byte_and_fp8_array_sizes():
  assert hlo.ArrayType("f4e2m1fn", (16, 2)).nbytes == 16
  assert hlo.ArrayType("f8e8m0fnu", (10,)).nbytes == 10
  assert hlo.ArrayType("bf16", (3, 4)).nbytes == 24


# An optimized XLA:GPU program written by hand: GEMMs by route and operand dtypes.
_GPU = """\
HloModule m

%nested (n0: f8e4m3fn[16,16]) -> f8e4m3fn[16,16] {
  ROOT %n0 = f8e4m3fn[16,16]{1,0} parameter(0)
}

%f8_dot (p0: f8e4m3fn[16,16], p1: f8e5m2[16,16]) -> f32[16,16] {
  %p0 = f8e4m3fn[16,16]{1,0} parameter(0)
  %p1 = f8e5m2[16,16]{1,0} parameter(1)
  %n = f8e4m3fn[16,16]{1,0} fusion(%p0), kind=kCustom, calls=%nested
  ROOT %d = f32[16,16]{1,0} dot(%n, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%bf16_dot (q0: bf16[16,16], q1: bf16[16,16]) -> f32[16,16] {
  %q0 = bf16[16,16]{1,0} parameter(0)
  %q1 = bf16[16,16]{1,0} parameter(1)
  ROOT %d.1 = f32[16,16]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%loop (l0: f32[16], l1: f32[16]) -> f32[] {
  %l0 = f32[16]{0} parameter(0)
  %l1 = f32[16]{0} parameter(1)
  ROOT %d.2 = f32[] dot(%l0, %l1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

ENTRY %main (a: f8e4m3fn[16,16], b: f8e5m2[16,16], c: bf16[16,16], x: f8e4m3fn[1,8,8,16], w: f8e4m3fn[16,3,3,16], xf: f32[1,8,8,16], v: f32[16]) -> f32[16,16] {
  %a = f8e4m3fn[16,16]{1,0} parameter(0)
  %b = f8e5m2[16,16]{1,0} parameter(1)
  %c = bf16[16,16]{1,0} parameter(2)
  %x = f8e4m3fn[1,8,8,16]{3,2,1,0} parameter(3)
  %w = f8e4m3fn[16,3,3,16]{3,2,1,0} parameter(4)
  %xf = f32[1,8,8,16]{3,2,1,0} parameter(5)
  %v = f32[16]{0} parameter(6)
  %g1 = (f32[16,16]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8", backend_config={"x":1}
  %g2 = (f32[16,16]{1,0}, s8[0]{0}) custom-call(bf16[16,16]{1,0} %c, bf16[16,16]{1,0} %c), custom_call_target="__cublas$lt$matmul"
  %cv = (f32[1,8,8,16]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForwardGraph"
  %cv2 = (f32[16,3,3,16]{3,2,1,0}, u8[0]{0}) custom-call(%xf, %xf), window={size=8x8}, custom_call_target="__cudnn$convBackwardFilter"
  %t1 = f32[16,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%f8_dot, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %t2 = f32[16,16]{1,0} fusion(%c, %c), kind=kCustom, calls=%bf16_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %l = f32[] fusion(%v, %v), kind=kLoop, calls=%loop
  ROOT %r = f32[16,16]{1,0} get-tuple-element(%g1), index=0
}
"""


def test_count_products_reads_optimized_gpu_hlo():
  c = hlo_products.count_products(_GPU)
  assert (c.fp8_gemms, c.gemms) == (1, 2)
  assert (c.fp8_convs, c.convs) == (1, 2)
  assert (c.fp8_triton_gemms, c.triton_gemms) == (1, 2)
  assert c.other_dots == 1
  assert (c.fp8_products, c.products) == (3, 7)
  assert dict(c.custom_calls)["__cublas$lt$matmul$f8"] == 1


def test_a_computation_closed_with_attributes_ends_there():
  """TPU7x's SparseCore computations close with ``}, execution_thread=...``: the ENTRY after
  one is still found, with its own instructions."""
  text = """\
HloModule m

%on_sparsecore (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %c = f32[8]{0} copy(%p)
}, execution_thread="sparsecore"

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%a)
}
"""
  module = hlo.parse(text)
  assert module.entry == "main"
  assert [i.name for i in module.computations["main"]] == ["a", "n"]
  assert [i.name for i in module.computations["on_sparsecore"]] == ["p", "c"]
