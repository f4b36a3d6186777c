// The kernel's matrix products: float64 through the BLAS torch links, float32 through it or oneDNN's batch-reduce
// GEMM micro-kernel (at::native::cpublas::brgemm), bfloat16 and float16 into float32 through brgemm or MKL's half
// products, with the packing brgemm reads. Templates and the one-product dispatch (product) are here,
// inline where the forward and backward call them per tile; the packing and brgemm's thread state are in
// products.cpp. This is where further product paths (AMX tiles, ...) belong.
#pragma once

#include "common.h"

namespace attnkit::band {

// float32 products through oneDNN's brgemm instead of the BLAS's sgemm: MKL runs AVX2 code on AMD CPUs, where
// brgemm's float32 micro-kernel runs AVX-512. Off until the Python side has timed both here, found brgemm faster
// and its self-check passed (set_f32_brgemm). brgemm reads both operands row-major: products with neither stored
// transposed (p v in the forward, dS k in the backward, ...) take it as they are; the transposed ones read
// transposed copies made once for all the products that read them (transposed_f32, transpose_f32: k^T once per
// call for the forward's q k^T; in the backward q^T and dout^T once per call, where dV and dK are summed
// transposed, and each key block's k^T and v^T once per block), since a transposed copy per product (keys of a
// long causal row) cost more than brgemm saved. Another summation order than sgemm's: results within the float32 tolerances, not bit for bit
// sgemm's.
extern std::atomic<bool> f32_brgemm;
// Whether brgemm computes float32 products here (checked once, exactly, on a small product; then: oneDNN on).
bool has_f32_brgemm();
// Row-major C[m x n] = alpha * A[m x k] * B[k x n] + beta * C through brgemm (a factor, or a beta other than 0 or
// 1, through a pass over the result in this thread's buffer).
void gemm_f32_brgemm(Index m, Index n, Index k, float alpha, const float* a, Index lda, const float* b, Index ldb,
                     float beta, float* c, Index ldc);
// Each (b, h)'s t ([B, H, L, E] float32) transposed, as float [B, H, E * ld], for brgemm (see products.cpp).
Tensor transposed_f32(const Tensor& t, Index& ld);
// a ([rows x cols] float32, rows la apart) transposed into to ([cols x rows], rows lt apart).
void transpose_f32(const float* a, Index rows, Index cols, Index la, float* to, Index lt);

// Row-major C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C; ta/tb: the operand is stored transposed.
template <typename T>
void gemm(bool ta, bool tb, Index m, Index n, Index k, T alpha, const T* a, Index lda, const T* b, Index ldb, T beta,
          T* c, Index ldc) {
  if constexpr (std::is_same_v<T, float>) {
    if (!ta && !tb && m > 0 && n > 0 && k > 0 && f32_brgemm.load(std::memory_order_relaxed)) {
      gemm_f32_brgemm(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
  }
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  if constexpr (std::is_same_v<T, float>) {
    sgemm_(&opb, &opa, &M, &N, &K, &alpha, b, &lb, a, &la, &beta, c, &lc);
  } else {
    dgemm_(&opb, &opa, &M, &N, &K, &alpha, b, &lb, a, &la, &beta, c, &lc);
  }
}

// Half products (see "half products" at forward_impl): whether torch exports MKL's bfloat16 and float16 products,
// and whether the kernel uses them for inputs of that type (each set by the Python side once its self-check passed).
bool has_mkl_bf16_gemm();
bool has_f16_gemm();
extern std::atomic<bool> bf16_products;
extern std::atomic<bool> f16_products;

// Whether t's type is a half type whose products are on: the kernel then computes it with them.
inline bool with_half_products(const Tensor& t) {
  return t.defined() && ((t.scalar_type() == at::kBFloat16 && bf16_products.load(std::memory_order_relaxed)) ||
                         (t.scalar_type() == at::kHalf && f16_products.load(std::memory_order_relaxed)));
}

// bfloat16 products through oneDNN's batch-reduce GEMM micro-kernel, as torch exports it for its own CPU flash
// attention (at::native::cpublas::brgemm): C[m x n] = A[m x k] B[k x n] (or C +=), A row-major, B in the VNNI
// layout that the CPU's bfloat16 dot-product instructions read ([k / 2][n][2]: each pair of B's rows interleaved).
// Each product of two bfloat16 numbers is exact in float32 and the sums are float32, as with MKL's product; but
// MKL's product did not use the bfloat16 instructions of an AMD CPU that has them (AVX512-BF16) and ran at
// float32's speed, where this one runs them on a CPU with AVX512-BF16 (`attnkit bench dtypes` times both; CPUs
// with AMX keep MKL's: see brgemm_bf16). The operands are packed for it per product into this thread's buffers
// (or once per call where many blocks read them: pack_keys, pack_rows, transposed_rows), n and k rounded up to
// BRGEMM_Q with zeros (the rounded sizes pick the micro-kernel, which torch builds once per
// shape and thread: rounding keeps them few). Fewer than BRGEMM_ROWS rows stay with MKL: packing all of B for a
// row or two costs about as much as their product (a decode step's forward takes float32 products instead: see
// band_forward).
constexpr Index BRGEMM_Q = 16, BRGEMM_ROWS = 8;  // (named by code that never runs without brgemm)

// Whether brgemm computes bfloat16 products here (checked once; then per call: oneDNN still enabled).
bool brgemm_bf16();

#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(__x86_64__)
using BF16 = c10::BFloat16;

// Row-major C[m x n] = alpha * A[m x kp] * B + beta * C through brgemm, B packed (VNNI): see products.cpp.
void brgemm_into(Index m, Index n, Index kp, const BF16* A, Index la, const BF16* B, Index ldb, float alpha,
                 float beta, float* c, Index ldc);
// n rows of x (float, ld apart; n even) rounded to bfloat16 into brgemm's VNNI layout: see products.cpp.
void pack_row_pairs(const float* x, Index ld, Index n, Index cols, Index cp, BF16* out);
// Row-major C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C through brgemm.
void gemm_bf16_brgemm(bool ta, bool tb, Index m, Index n, Index k, float alpha, const BF16* a, Index lda,
                      const BF16* b, Index ldb, float beta, float* c, Index ldc);
// Row-major C[m x n] = A[m x k] B[k x n] + beta * C through brgemm, B already packed (pack_keys, pack_rows).
void product_packed(Index m, Index n, Index k, const BF16* a, Index lda, const uint32_t* b, Index ldb, float beta,
                    float* c, Index ldc);
#else
template <typename KV>
void brgemm_into(Index, Index, Index, const KV*, Index, const KV*, Index, float, float, float*, Index) {
  TORCH_CHECK(false, "band kernel: no brgemm");
}
template <typename KV>
void pack_row_pairs(const float*, Index, Index, Index, Index, KV*) {
  TORCH_CHECK(false, "band kernel: no brgemm to pack for");
}
template <typename KV>
void product_packed(Index, Index, Index, const KV*, Index, const uint32_t*, Index, float, float*, Index) {
  TORCH_CHECK(false, "band kernel: no brgemm for packed operands");
}
#endif  // brgemm

// k, t ([B, H, L, E] bfloat16) packed once per call for brgemm (see products.cpp; they raise without brgemm).
Tensor pack_keys(const Tensor& k, Index& ld, Index& pairs, int e);
Tensor pack_rows(const Tensor& t, Index& ld, Index& pairs);
Tensor transposed_rows(const Tensor& t, Index& ld);

// Whether the kernel has a bfloat16 product: oneDNN's brgemm or MKL's.
bool has_bf16_gemm();

// Row-major C[m x n] (float) = alpha * op(A)[m x k] * op(B)[k x n] + beta * C, A and B of half type H (oneDNN's
// brgemm for bfloat16 where it runs, else MKL's product for the type); ta/tb: the operand is stored transposed.
template <typename H>
void gemm_half(bool ta, bool tb, Index m, Index n, Index k, float alpha, const H* a, Index lda, const H* b, Index ldb,
               float beta, float* c, Index ldc) {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(__x86_64__)
  if constexpr (std::is_same_v<H, c10::BFloat16>) {
    if ((m >= BRGEMM_ROWS || !has_mkl_bf16_gemm()) && brgemm_bf16()) {
      gemm_bf16_brgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
  }
#endif
  if constexpr (std::is_same_v<H, c10::BFloat16>) {  // oneDNN turned off (torch.backends.mkldnn) since products were
    TORCH_CHECK(has_mkl_bf16_gemm(), "band kernel: bfloat16 products need oneDNN (torch.backends.mkldnn.enabled) "
                "or MKL's cblas_gemm_bf16bf16f32");
  }
  constexpr int row_major = 101, no_trans = 111, trans = 112;
  const int opa = ta ? trans : no_trans, opb = tb ? trans : no_trans, M = static_cast<int>(m), N = static_cast<int>(n),
            K = static_cast<int>(k), la = static_cast<int>(lda), lb = static_cast<int>(ldb), lc = static_cast<int>(ldc);
  if constexpr (std::is_same_v<H, c10::BFloat16>) {
    cblas_gemm_bf16bf16f32(row_major, opa, opb, M, N, K, alpha, a, la, b, lb, beta, c, lc);
  } else {
    cblas_gemm_f16f16f32(row_major, opa, opb, M, N, K, alpha, a, la, b, lb, beta, c, lc);
  }
}

// The kernel's one product: C (T) = alpha * op(A) * op(B) + beta * C with A and B stored as KV, through gemm
// when KV is T, and through MKL's half product (T float) when KV is bfloat16 or float16.
template <typename T, typename KV>
inline void product(bool ta, bool tb, Index m, Index n, Index k, T alpha, const KV* a, Index lda, const KV* b,
                    Index ldb, T beta, T* c, Index ldc) {
  if constexpr (std::is_same_v<KV, T>) {
    gemm<T>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    static_assert(std::is_same_v<T, float> && (std::is_same_v<KV, c10::BFloat16> || std::is_same_v<KV, c10::Half>),
                  "products of one type, or of a half type into float32");
    gemm_half<KV>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

// A buffer the BLAS sees at the same (64-byte) alignment on every call: MKL picks its code path,
// and so the rounding of a product, by the alignment of its operands.
template <typename T>
T* scratch(Tensor& owner, Index n) {
  owner = at::empty({std::max<Index>(n, 1)}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  return owner.data_ptr<T>();
}

}  // namespace attnkit::band
