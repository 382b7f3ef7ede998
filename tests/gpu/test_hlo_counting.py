"""``gpu_compile.count_products`` on hand-written optimized HLO (needs no plugin)."""

from fp8_linen.testing import gpu_compile

_HLO = """\
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


def test_count_products_reads_optimized_hlo():
  c = gpu_compile.count_products(_HLO)
  assert (c.fp8_gemms, c.gemms) == (1, 2)
  assert (c.fp8_convs, c.convs) == (1, 2)
  assert (c.fp8_triton_gemms, c.triton_gemms) == (1, 2)
  assert c.other_dots == 1
  assert (c.fp8_products, c.products) == (3, 7)
  assert dict(c.custom_calls)["__cublas$lt$matmul$f8"] == 1
