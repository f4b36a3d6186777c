// The Python module: the entry points and the switches of the half products, with what each takes.
#include <torch/extension.h>

#include "checks.h"
#include "decode.h"
#include "kernel.h"
#include "products.h"

using namespace attnkit::band;

// The module's name is attnkit_band_<build key> in both builds: the one compiled on first use is named so, and
// setup.py defines ATTNKIT_BAND_MODULE so for the one built at install (its file is _band_kernel.*.so). The
// loader imports either by that name (pybind11 hands back the first module made under a name to any later one,
// so two builds must not share a name).
#ifndef ATTNKIT_BAND_MODULE
#define ATTNKIT_BAND_MODULE TORCH_EXTENSION_NAME
#endif

PYBIND11_MODULE(ATTNKIT_BAND_MODULE, m) {
  m.def("forward", &band_forward,
        "forward(q, k, v, starts, ends, bias, scale, softcap, q_rows, kv_chunk) -> [out, stats]: out [B, H, Lq, Ev] "
        "and stats [2, B, H, Lq] (row maxima, log row sums) of banded attention. Checks every argument first "
        "(RuntimeError naming it): q [B, H, Lq, E] float32/float64/bfloat16/float16, k [B, Hkv, Lk, E] and "
        "v [B, Hkv, Lk, Ev] in its dtype with H a multiple of Hkv, all dense CPU with rows the BLAS can read; "
        "starts/ends contiguous int64 [P, Lq, K >= 1], P 1, B or B*H, 0 <= start <= end <= Lk; bias [0, 0] or "
        "contiguous [1 or H, Lq + Lk - 1] in q's dtype (float32 for the half types); scale finite, softcap finite "
        ">= 0; q_rows, kv_chunk in [1, 2^20]. stats are in q's dtype (float32 for the half types)");
  m.def("backward", &band_backward,
        "backward(dout, q, k, v, out, stats, starts, ends, bias, scale, softcap, kv_rows, q_chunk, deterministic, "
        "bias_grad) -> [dq, dk, dv, dbias] of banded attention. Checks what forward checks, and dout, out "
        "[B, H, Lq, Ev] with rows the BLAS can read in q's dtype, stats the forward's contiguous [2, B, H, Lq] in the "
        "compute type; q float32 or float64, or bfloat16 or float16 while that type's products are on (then the "
        "five products of the backward take operands of that type, and gradients are summed in float32 and "
        "returned in q's type); kv_rows, q_chunk in [1, 2^20]");
  m.def("decode", &band_decode,
        "decode(q, k, v, mask, lo, hi, scale, softcap) -> [out, finite]: attention of a few queries (Lq <= 8) over a cache, "
        "each key and value read once for every query head that shares it; finite [B, Hkv] says whether every key "
        "and value read was finite (decode.h says what each argument must be; checked first)");
  m.def("decode_step", &band_decode_step,
        "decode_step(q, k, v, scale) -> out or None: the decode lane's plain step (one query, every key seen), "
        "checked in the call; None for any call it does not take or where something read was not finite (scale "
        "NaN for 1 / sqrt(E); decode.h says what it takes)");
  m.def("has_blas", &has_blas, "whether torch exposes the BLAS this module calls");
  m.def("has_bf16_gemm", &has_bf16_gemm,
        "whether the kernel has a bfloat16 product here: oneDNN's brgemm (at::native::cpublas::brgemm, where it "
        "runs) or MKL's cblas_gemm_bf16bf16f32");
  m.def("bf16_gemm", [] { return std::string(brgemm_bf16() ? "oneDNN brgemm" : has_mkl_bf16_gemm() ? "MKL" : ""); },
        "which bfloat16 product a tile of 8 or more rows takes ('' for none)");
  m.def("half_product", &half_product,
        "half_product(a, b, c, ta, tb, alpha, beta) -> alpha * op(a) op(b) + beta * c as a new float32 tensor, "
        "through the kernel's own product of a's type (a, b 2-D bfloat16, or float16 while its products are "
        "on; op(x) = x.T when stored transposed; c [m, n] float32)");
  m.def("has_f16_gemm", &has_f16_gemm, "whether torch exposes MKL's float16 product (cblas_gemm_f16f16f32)");
  m.def(
      "set_bf16_products",
      [](bool on) {
        TORCH_CHECK(!on || has_bf16_gemm(), "band kernel: bfloat16 products need oneDNN's brgemm or MKL's "
                    "cblas_gemm_bf16bf16f32, neither of which this torch has");
        bf16_products.store(on);
      },
      "whether the forward and the backward compute bfloat16 inputs with bfloat16 products (process-wide)");
  m.def(
      "set_f16_products",
      [](bool on) {
        TORCH_CHECK(!on || has_f16_gemm(), "band kernel: float16 products need MKL's cblas_gemm_f16f16f32, "
                    "which this torch does not export");
        f16_products.store(on);
      },
      "whether the forward and the backward compute float16 inputs with float16 products (process-wide)");
  m.def("has_f32_brgemm", &has_f32_brgemm, "whether oneDNN's brgemm computes float32 products here");
  m.def(
      "set_f32_brgemm",
      [](bool on) {
        TORCH_CHECK(!on || has_f32_brgemm(), "band kernel: float32 products through brgemm need oneDNN's float32 "
                    "brgemm, which this torch or CPU does not have");
        f32_brgemm.store(on);
      },
      "whether float32 products go through oneDNN's brgemm instead of the BLAS's sgemm, the transposed ones "
      "from transposed copies of their operands (process-wide)");
  m.def("f32_brgemm", [] { return f32_brgemm.load(); }, "what set_f32_brgemm set (False at first)");
  m.def("f32_product_times", &f32_product_times,
        "f32_product_times(reps) -> [sgemm seconds, brgemm seconds] for reps of a few tile products, best of three");
  m.def("bf16_products", [] { return bf16_products.load(); }, "what set_bf16_products set (False at first)");
  m.def("f16_products", [] { return f16_products.load(); }, "what set_f16_products set (False at first)");
}
