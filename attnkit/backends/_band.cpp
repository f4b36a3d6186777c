// Banded attention on CPU, built on first use by attnkit/backends/_band.py.
//
// Query row i of batch element b, head h attends the keys in a few intervals, starts[p, i, k] <= j
// < ends[p, i, k] with p = 0, b or b * H + h (the intervals shared, per batch element, or per head
// too; each row's sorted and disjoint, empty ones last; rows in any order: a window, causal,
// padding, packed documents, a window plus global tokens, dilated or strided patterns, a block
// layout), with an optional bias per head and diagonal, bias[h, j - i + L - 1] (ALiBi,
// relative positions), and optional tanh soft-capping of the scores, t <- c * tanh(t / c) after the
// scale and bias (Gemma 2, Grok): the backward multiplies dS by 1 - (t / c)^2 before dQ, dK and
// the bias gradient take it (the bias is inside the tanh). Forward: for each block of query rows,
// the union of the rows' intervals as a few segments of keys (gaps shorter than the block closed,
// so a sliding window is one segment, exactly its first row's start to its last row's end), in
// chunks merged by an online softmax; only the columns a row may see are exponentiated, the rest
// are zero. Backward (FlashAttention-2): for each block of keys, the runs of query rows that see
// one of its keys (found once per call from the intervals); probabilities are recomputed from the
// saved row maximum and log-sum, dK and dV belong to the block, dQ rows are shared with neighbouring blocks
// and added under a lock per LOCK_ROWS rows, in whatever order the threads arrive, so dQ (and a
// bias gradient, summed per thread) may change from run to run. Under
// torch.use_deterministic_algorithms(True) dQ comes from a second pass over query blocks instead
// (like the forward), each block owning its rows, and with a learned bias threads take fixed shares
// of the key blocks: every result is then bitwise repeatable run to run at a given thread count,
// for one more recomputation of the probabilities. Across thread counts results may differ in the
// last bits in either mode: torch's BLAS rounds differently with the thread count, and the bias
// gradient is summed per thread.
//
// Global tokens (a row that sees every key, a key that every row sees, beside a window): such a row
// would make its whole block of rows compute every key, such a key its whole block of keys every
// row, and a lone key or row far from the window would be a product of its own. So the forward
// computes rows far wider than the rest of their block (mark_wide) apart, gathered in groups, and
// gathers each block's short key segments into one chunk (key_chunks; the deterministic dQ pass,
// which walks query blocks, too); the backward does the same with keys far wider than the rest of
// their block, and gathers each key block's lone rows.
//
// Large scores: a score is scaled (biased, capped) once, stored, and every later step works on that
// stored value: exp(t - m) with m the maximum of the same stored t. Computing s * scale - m in one
// expression lets the compiler fuse it into an FMA whose unrounded product differs from the rounded
// one m came from, by up to half an ulp of the score (256 at 7e9): exp of that is 0 or inf. The
// backward subtracts m and log(l) separately for the same reason (m + log(l) rounds to m there).
//
// Non-finite inputs: the forward gives every row of a block NaN statistics when a key or value it read
// for the block is not finite, and a row NaN statistics when its visible scores' maximum is not finite.
// A NaN or infinite key makes its raw score with any finite query NaN or infinite, visible or not, so
// one row of raw scores per chunk tells for the chunk's keys; a value that is not finite reaches every
// row of the accumulator (p * inf, 0 * inf), so one accumulator row tells for the block's values; a
// query that is not finite makes its row's scores NaN or infinite, whose maximum then is (capped scores
// are finite, so capped rows add up their raw scores instead). So statistics free of NaN mean that every
// row of q, k and v the forward read was finite (a false alarm when a finite score overflows), and the
// output is the finite formula's. The caller (attnkit.nonfinite) uses that in place of reading q, k and
// v once more before the call.
//
// Matrix products go to the BLAS that torch itself links (sgemm_/dgemm_, looked up weakly so that
// a torch without them still loads this module: has_blas() then says no and nothing here is used).
// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: gemm() swaps the operands.

#include <torch/extension.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*, const int*,
            const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*, const int*,
            const double*, const int*, const double*, double*, const int*) __attribute__((weak));
// MKL's product of bfloat16 matrices into float32 (layout, transa, transb as CBLAS's enums; MKL_INT is int in
// the LP64 interface torch links): every product exact in float32, sums in float32.
void cblas_gemm_bf16bf16f32(int, int, int, int, int, int, float, const c10::BFloat16*, int, const c10::BFloat16*, int,
                            float, float*, int) __attribute__((weak));
// The same for float16 operands (each product of two float16 numbers is exact in float32 too).
void cblas_gemm_f16f16f32(int, int, int, int, int, int, float, const c10::Half*, int, const c10::Half*, int, float,
                          float*, int) __attribute__((weak));
}

namespace {

using at::Tensor;
using Index = int64_t;
constexpr Index LOCK_ROWS = 64;
// Segments of keys shorter than this are gathered together (key_chunks), and in the backward runs
// of rows shorter than this (a key block's lone rows).
constexpr Index LONE = 32;

// Work item -> block: 0, n-1, 1, n-2, ... so that short and long rows alternate (under a causal mask
// late query blocks and early key blocks carry the most work) and no thread is left with a long tail.
inline Index interleaved(Index t, Index n) { return t % 2 == 0 ? t / 2 : n - 1 - t / 2; }

// Work items [0, n) for the threads: body(next) is run once per thread and takes items while
// next(it) is true. They are handed out one at a time from a shared counter, so a thread slowed by
// another process on its core simply takes fewer (with a fixed share each, the whole call waits
// for the slowest thread: twice the time with one of two cores busy). `fixed`: a contiguous share
// per thread instead, for a result that depends on which thread did which item (the bias
// gradient's per-thread sums, which must repeat bit for bit under deterministic algorithms).
inline void release_products();

template <typename F>
void each_item(Index n, bool fixed, const F& body) {
  if (fixed) {
    at::parallel_for(0, n, 1, [&](Index begin, Index end) {
      Index at = begin;
      body([&](Index& it) { it = at++; return it < end; });
      release_products();
    });
    return;
  }
  std::atomic<Index> counter{0};
  at::parallel_for(0, std::min<Index>(n, at::get_num_threads()), 1, [&](Index, Index) {
    body([&](Index& it) { it = counter.fetch_add(1, std::memory_order_relaxed); return it < n; });
    release_products();
  });
}

// Row-major C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C; ta/tb: the operand is stored transposed.
template <typename T>
void gemm(bool ta, bool tb, Index m, Index n, Index k, T alpha, const T* a, Index lda, const T* b, Index ldb, T beta,
          T* c, Index ldc) {
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
bool has_mkl_bf16_gemm() { return cblas_gemm_bf16bf16f32 != nullptr; }
bool has_f16_gemm() { return cblas_gemm_f16f16f32 != nullptr; }
std::atomic<bool> bf16_products{false};
std::atomic<bool> f16_products{false};

// Whether t's type is a half type whose products are on: the kernel then computes it with them.
bool with_half_products(const Tensor& t) {
  return t.defined() && ((t.scalar_type() == at::kBFloat16 && bf16_products.load(std::memory_order_relaxed)) ||
                         (t.scalar_type() == at::kHalf && f16_products.load(std::memory_order_relaxed)));
}

// Two vectors of float rounded to nearest as one vector of P, stored at to (2 Vec::size() values). For bfloat16
// on a CPU with AVX512-BF16 (the kernel is then built with -mavx512bf16) one instruction does what
// convert_from_float does in a dozen; it reads and writes subnormals as zero, where only weights and dS pass
// through here (a weight below 1e-38 beside the row's largest, 1, is 0 either way to the product's sum).
// `count`: how many of the 2 x 16 (or 2 x 8) values are written.
template <typename P>
inline void round_pair(at::vec::Vectorized<float> x0, at::vec::Vectorized<float> x1, P* to,
                       int count = 2 * at::vec::Vectorized<float>::size()) {
#if defined(__AVX512BF16__) && defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<P, c10::BFloat16>) {
    const __m512i r = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // x0 in the low half
    if (count >= 32) {
      _mm512_storeu_si512(to, r);
    } else {
      _mm512_mask_storeu_epi16(to, static_cast<__mmask32>((1u << count) - 1), r);
    }
    return;
  }
#endif
  at::vec::convert_from_float<P>(x0, x1).store(to, count);
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
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(__x86_64__)
constexpr Index BRGEMM_Q = 16, BRGEMM_ROWS = 8;
using BF16 = c10::BFloat16;

struct BrgemmBuffers {
  std::vector<BF16> a, b, t;
  std::vector<float> c;
  bool used = false;  // the thread set up a micro-kernel: brgemm_release() before the thread's work ends
};
thread_local BrgemmBuffers brgemm_buffers;

// v with room for n values. Never shrunk: resize() down and up again would fill the regrown part with zeros
// on every call where products of two sizes alternate.
template <typename X>
X* room(std::vector<X>& v, Index n) {
  if (static_cast<Index>(v.size()) < n) v.resize(n);
  return v.data();
}

inline Index round_up(Index x, Index q) { return (x + q - 1) / q * q; }

inline uint32_t pair_at(const BF16* p) {  // two adjacent bfloat16 values as one 32-bit word (any alignment)
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// A bfloat16 value (its bits) times 2^e: through float, rounded to nearest (exact unless it leaves the normal
// range, as a product of two floats is).
inline uint16_t times_pow2(uint16_t x, int e) {
  return c10::BFloat16(static_cast<float>(c10::BFloat16(x, c10::BFloat16::from_bits())) * std::ldexp(1.f, e)).x;
}

inline uint32_t times_pow2(uint32_t pair, int e) {  // both halves of a pair
  const uint16_t lo = times_pow2(static_cast<uint16_t>(pair & 0xFFFF), e);
  const uint16_t hi = times_pow2(static_cast<uint16_t>(pair >> 16), e);
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

#if defined(__AVX512F__)
// 32 bfloat16 values times 2^e, the same as times_pow2: where a value and its product are both normal, its
// exponent field moved by e; zeros, infinities and NaNs as they are; the rest (subnormal, overflow) one by one.
inline __m512i times_pow2(__m512i v, int e) {
  const __m512i field = _mm512_and_si512(_mm512_srli_epi16(v, 7), _mm512_set1_epi16(0xFF));
  const __m512i lo = _mm512_set1_epi16(static_cast<int16_t>(std::max(1, 1 - e)));
  const __m512i hi = _mm512_set1_epi16(static_cast<int16_t>(std::min(254, 254 - e)));
  const __mmask32 normal = _mm512_cmpge_epi16_mask(field, lo) & _mm512_cmple_epi16_mask(field, hi);
  const __mmask32 kept = _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x7FFF)) |  // +-0
                         _mm512_cmpeq_epi16_mask(field, _mm512_set1_epi16(0xFF));  // inf, NaN
  __m512i out = _mm512_mask_add_epi16(v, normal, v, _mm512_set1_epi16(static_cast<int16_t>(e * 128)));
  const __mmask32 rest = ~(normal | kept);
  if (rest != 0) {
    alignas(64) uint16_t x[32];
    _mm512_store_si512(x, out);
    for (int i = 0; i < 32; ++i) {
      if ((rest >> i) & 1u) x[i] = times_pow2(x[i], e);
    }
    out = _mm512_load_si512(x);
  }
  return out;
}

// 16 rows of 16 32-bit words (row r at from + r * ld bfloat16 values) written transposed: word c of row r to
// to[c * ldo + r], each bfloat16 value times 2^e. Three rounds of shuffles: 4 x 4 blocks within each 128-bit
// lane, then the lanes.
inline void transpose_16x16(const BF16* from, Index ld, uint32_t* to, Index ldo, int e = 0) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(from + i * ld);
  if (e != 0) {
    for (int i = 0; i < 16; ++i) r[i] = times_pow2(r[i], e);
  }
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4 i + c], lane l: rows 4 i .. 4 i + 3 of column 4 l + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4 l + c: lane l of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(to + c * ldo, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(to + (4 + c) * ldo, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(to + (8 + c) * ldo, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(to + (12 + c) * ldo, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}
#endif

// op(B) ([k x n]; stored [n x k] when tb) into VNNI [kp / 2][np][2], zeros past k and n. e (tb only): each
// value times 2^e (times_pow2).
void pack_vnni(bool tb, Index k, Index n, const BF16* b, Index ldb, Index kp, Index np, BF16* out, int e = 0) {
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  const Index pairs = k / 2;
  TORCH_CHECK(tb || e == 0, "band kernel: pack_vnni scales only a transposed operand");
  if (tb) {  // row j of the stored B holds column j of op(B): its pairs go down column j of the packed one,
    // 16 rows at a time, so that each packed row is written 64 bytes at once (a row at a time, the writes land
    // np * 4 bytes apart: with 1024 columns every one of them in the same set of the L1 cache)
    for (Index j0 = 0; j0 < n; j0 += 16) {
      const Index j1 = std::min<Index>(j0 + 16, n);
      Index p2 = 0;
#if defined(__AVX512F__)
      if (j1 - j0 == 16) {
        for (; p2 + 16 <= pairs; p2 += 16) transpose_16x16(b + j0 * ldb + 2 * p2, ldb, o + p2 * np + j0, np, e);
      }
#endif
      for (; p2 < pairs; ++p2) {
        uint32_t* dst = o + p2 * np;
        for (Index j = j0; j < j1; ++j) {
          dst[j] = e == 0 ? pair_at(b + j * ldb + 2 * p2) : times_pow2(pair_at(b + j * ldb + 2 * p2), e);
        }
      }
      if (k % 2) {
        for (Index j = j0; j < j1; ++j) {
          o[pairs * np + j] = e == 0 ? b[j * ldb + k - 1].x : times_pow2(b[j * ldb + k - 1].x, e);
        }
      }
    }
    for (Index p2 = 0; p2 < kp / 2; ++p2) {
      std::fill(o + p2 * np + (p2 < (k + 1) / 2 ? n : 0), o + (p2 + 1) * np, 0u);
    }
    return;
  }
  for (Index p2 = 0; p2 < kp / 2; ++p2) {  // rows 2 p2 and 2 p2 + 1 of B, interleaved
    uint32_t* dst = o + p2 * np;
    const Index r = 2 * p2;
    const uint16_t* r0 = r < k ? reinterpret_cast<const uint16_t*>(b + r * ldb) : nullptr;
    const uint16_t* r1 = r + 1 < k ? reinterpret_cast<const uint16_t*>(b + (r + 1) * ldb) : nullptr;
    Index j = 0;
    if (r0 != nullptr && r1 != nullptr) {
#if defined(__AVX512F__)
      for (; j + 16 <= n; j += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + j)));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + j)));
        _mm512_storeu_si512(dst + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
#endif
      for (; j < n; ++j) dst[j] = uint32_t(r0[j]) | (uint32_t(r1[j]) << 16);
    } else if (r0 != nullptr) {
      for (; j < n; ++j) dst[j] = r0[j];
    }
    std::fill(dst + j, dst + np, 0u);
  }
}

// m rows of k values (lda apart) into buf as rows of kp, zeros past k.
const BF16* zero_padded(const BF16* a, Index lda, Index m, Index k, Index kp, std::vector<BF16>& buf) {
  BF16* out = room(buf, m * kp);
  for (Index i = 0; i < m; ++i) {
    std::memcpy(out + i * kp, a + i * lda, k * sizeof(BF16));
    std::memset(out + i * kp + k, 0, (kp - k) * sizeof(BF16));  // +0.0
  }
  return out;
}

// Whether brgemm computes bfloat16 products here: once, a small product with odd sizes over several blocks of
// 16 columns checked exactly (torch built without oneDNN's micro-kernel, or a CPU below AVX-512, raises). Not
// on a CPU with AMX (could_pack): its micro-kernel reads B in a blocked layout of its own, which this packing
// does not make, and MKL's product runs AMX there. Then per call: oneDNN still enabled.
bool brgemm_bf16() {
  static const bool works = [] {
    try {
      if (at::native::cpublas::could_pack(at::kBFloat16)) return false;
      constexpr Index m = 9, n = 37, k = 35, kp = 48, np = 48;
      std::vector<BF16> a(m * kp, BF16(0.f)), b(k * n), packed(kp * np);
      std::vector<float> c(m * np);
      for (Index i = 0; i < m; ++i) for (Index p = 0; p < k; ++p) a[i * kp + p] = BF16(float((i + 2 * p) % 5) - 2.f);
      for (Index p = 0; p < k; ++p) for (Index j = 0; j < n; ++j) b[p * n + j] = BF16(float((3 * p + j) % 7) - 3.f);
      pack_vnni(false, k, n, b.data(), n, kp, np, packed.data());
      at::native::cpublas::brgemm(m, np, kp, kp, np, np, false, a.data(), packed.data(), c.data(), true);
      at::native::cpublas::brgemm_release(true);
      for (Index i = 0; i < m; ++i) {
        for (Index j = 0; j < n; ++j) {
          float want = 0.f;
          for (Index p = 0; p < k; ++p) want += float(a[i * kp + p]) * float(b[p * n + j]);
          if (c[i * np + j] != want) return false;
        }
      }
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works && at::globalContext().userEnabledMkldnn();
}

// Row-major C[m x n] = alpha * A[m x kp] * B + beta * C through brgemm: A's rows la apart, B packed (VNNI, ldb
// 32-bit words apart, zeros past kp and with room for n rounded up to BRGEMM_Q). Straight into C when it is
// C = A B or C += A B with as many columns as the micro-kernel's, else through this thread's buffer.
void brgemm_into(Index m, Index n, Index kp, const BF16* A, Index la, const BF16* B, Index ldb, float alpha,
                 float beta, float* c, Index ldc) {
  BrgemmBuffers& w = brgemm_buffers;
  const Index np = round_up(n, BRGEMM_Q);
  const bool direct = n == np && alpha == 1.f && (beta == 0.f || beta == 1.f);
  float* C = direct ? c : room(w.c, m * np);
  const Index lc = direct ? ldc : np;
  w.used = true;
  at::native::cpublas::brgemm(m, np, kp, la, ldb, lc, direct && beta == 1.f, A, B, C, true);
  if (direct) return;
  for (Index i = 0; i < m; ++i) {  // beta 0: C is not read (it may hold anything), as in BLAS
    float* ci = c + i * ldc;
    const float* pi = C + i * lc;
    if (beta == 0.f) {
      for (Index j = 0; j < n; ++j) ci[j] = alpha * pi[j];
    } else {
      for (Index j = 0; j < n; ++j) ci[j] = alpha * pi[j] + beta * ci[j];
    }
  }
}

// a ([k x m], rows lda apart) transposed into out ([mp x kp], rows kp apart; mp: m rounded up to BRGEMM_Q),
// zeros past k: its pairs of rows interleaved (pack_vnni, into this thread's buffer), then that transposed as
// 32-bit words.
void transposed_into(Index m, Index k, Index kp, const BF16* a, Index lda, BF16* to) {
  const Index mp = round_up(m, BRGEMM_Q), pairs = kp / 2;
  uint32_t* t = reinterpret_cast<uint32_t*>(room(brgemm_buffers.t, kp * mp));
  uint32_t* out = reinterpret_cast<uint32_t*>(to);
  pack_vnni(false, k, m, a, lda, kp, mp, reinterpret_cast<BF16*>(t));  // t[p2][i] = (a[2 p2][i], a[2 p2 + 1][i])
  for (Index i0 = 0; i0 < m; i0 += 16) {  // out[i][p2] = t[p2][i]: row i of op(A), with zeros past k
    Index p2 = 0;
#if defined(__AVX512F__)
    for (; p2 + 16 <= pairs; p2 += 16) {
      transpose_16x16(reinterpret_cast<const BF16*>(t + p2 * mp + i0), 2 * mp, out + i0 * pairs + p2, pairs);
    }
#endif
    for (; p2 < pairs; ++p2) {
      for (Index i = i0; i < std::min<Index>(i0 + 16, m); ++i) out[i * pairs + p2] = t[p2 * mp + i];
    }
  }
}

// op(A)[m x k] as brgemm reads it: row-major, k rounded up to kp with zeros, rows *la apart. A itself where it
// is so already; else this thread's buffer (ta: A stored [k x m], transposed_into it).
const BF16* brgemm_a(bool ta, Index m, Index k, Index kp, const BF16* a, Index lda, Index* la) {
  BrgemmBuffers& w = brgemm_buffers;
  if (ta) {
    BF16* out = room(w.a, round_up(m, BRGEMM_Q) * kp);
    transposed_into(m, k, kp, a, lda, out);
    *la = kp;
    return out;
  }
  if (k != kp) {
    *la = kp;
    return zero_padded(a, lda, m, k, kp, w.a);
  }
  *la = lda;
  return a;
}

// n rows of x (float, ld apart; n even) as the right operand of a product that sums over them, in brgemm's VNNI
// layout: rows 2 r2 and 2 r2 + 1 rounded to bfloat16 (round_pair's rounding) and interleaved into
// out[r2][cp][2], zeros past cols (cp: cols rounded up to BRGEMM_Q). The weights and dS of the backward's tile
// so become the operand of dV^T += dout^T P and dK^T += q^T dS without a transpose.
void pack_row_pairs(const float* x, Index ld, Index n, Index cols, Index cp, BF16* out) {
#if defined(CPU_CAPABILITY_AVX512)
  using Vec = at::vec::Vectorized<float>;
  alignas(64) static constexpr uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(order);
  alignas(64) BF16 pair[32];
  for (Index r2 = 0; r2 < n / 2; ++r2) {
    const float* x0 = x + 2 * r2 * ld;
    const float* x1 = x0 + ld;
    BF16* o = out + 2 * r2 * cp;
    for (Index c = 0; c < cp; c += 16) {
      const int w = static_cast<int>(std::max<Index>(0, std::min<Index>(16, cols - c)));
      round_pair<BF16>(w > 0 ? Vec::loadu(x0 + c, w) : Vec(0.f), w > 0 ? Vec::loadu(x1 + c, w) : Vec(0.f), pair);
      _mm512_storeu_si512(o + 2 * c, _mm512_permutexvar_epi16(idx, _mm512_load_si512(pair)));
    }
  }
#else
  for (Index r2 = 0; r2 < n / 2; ++r2) {
    BF16* o = out + 2 * r2 * cp;
    for (Index c = 0; c < cp; ++c) {
      o[2 * c] = c < cols ? BF16(x[2 * r2 * ld + c]) : BF16(0.f);
      o[2 * c + 1] = c < cols ? BF16(x[(2 * r2 + 1) * ld + c]) : BF16(0.f);
    }
  }
#endif
}

// Row-major C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C through brgemm (see above).
void gemm_bf16_brgemm(bool ta, bool tb, Index m, Index n, Index k, float alpha, const BF16* a, Index lda,
                      const BF16* b, Index ldb, float beta, float* c, Index ldc) {
  const Index kp = round_up(std::max<Index>(k, 1), BRGEMM_Q), np = round_up(n, BRGEMM_Q);
  Index la = 0;
  const BF16* A = brgemm_a(ta, m, k, kp, a, lda, &la);
  BF16* packed = room(brgemm_buffers.b, kp * np);
  pack_vnni(tb, k, n, b, ldb, kp, np, packed);
  brgemm_into(m, n, kp, A, la, packed, np, alpha, beta, c, ldc);
}

// The end of a thread's share of a call: a micro-kernel's hardware state (AMX's tile configuration) let go.
inline void release_products() {
  if (brgemm_buffers.used) {
    brgemm_buffers.used = false;
    at::native::cpublas::brgemm_release(true);
  }
}
struct Rows;
bool few_reads(const Tensor& q, const Tensor& k, Index q_rows, const Rows& R);
template <typename T>
const T* row_ptr(const Tensor& t, Index b, Index h, Index i);

// Whether the forward packs k^T once for the call: bfloat16 products through brgemm, where many blocks of rows
// read each key (not few_reads).
bool packs_keys(const Tensor& q, const Tensor& k, Index q_rows, const Rows& R) {
  return brgemm_bf16() && q_rows >= BRGEMM_ROWS && !few_reads(q, k, q_rows, R);
}

// out: t's heads ([B, H, L, E] bfloat16), each made into `size` bfloat16 values by pack(its first row, its part
// of out), side by side in one bfloat16 tensor [B, H, size]. In parallel over (b, h).
template <typename Pack>
Tensor packed_per_head(const Tensor& t, Index size, const Pack& pack) {
  const Index B = t.size(0), H = t.size(1);
  Tensor out = at::empty({B, H, size}, t.options().dtype(at::kBFloat16));
  BF16* base = out.data_ptr<BF16>();
  at::parallel_for(0, B * H, 1, [&](Index begin, Index end) {
    for (Index x = begin; x < end; ++x) pack(row_ptr<BF16>(t, x / H, x % H, 0), base + x * size);
  });
  return out;
}

// k ([B, Hkv, S, E] bfloat16) as op(B) of q k^T for every (b, hkv), in brgemm's VNNI layout, laid out as
// uint32 [B, Hkv, pairs, ld] (pairs: E rounded up to BRGEMM_Q, halved; ld: S and one more BRGEMM_Q rounded up
// to 256, so that columns c0 .. c0 + n rounded up stay inside and the leading dimension, which picks the
// micro-kernel, takes few values), zeros past E and S, each key times 2^e (a score scale that is a power of
// two: see forward_impl). In parallel over (b, hkv).
Tensor pack_keys(const Tensor& k, Index& ld, Index& pairs, int e) {
  const Index S = k.size(2), E = k.size(3), kp = round_up(E, BRGEMM_Q);
  ld = round_up(S + BRGEMM_Q, 256);
  pairs = kp / 2;
  return packed_per_head(k, pairs * ld * 2, [&](const BF16* rows, BF16* to) {
    pack_vnni(true, E, S, rows, k.stride(2), kp, ld, to, e);
  });
}

// Row-major C[m x n] = A[m x k] B[k x n] + beta * C through brgemm, B already packed (VNNI, ldb 32-bit words
// apart, zeros past k rounded up and far enough past n); A padded with zeros past k where brgemm_a needs it.
void product_packed(Index m, Index n, Index k, const BF16* a, Index lda, const uint32_t* b, Index ldb, float beta,
                    float* c, Index ldc) {
  const Index kp = round_up(k, BRGEMM_Q);
  Index la = 0;
  const BF16* A = brgemm_a(false, m, k, kp, a, lda, &la);
  brgemm_into(m, n, kp, A, la, reinterpret_cast<const BF16*>(b), ldb, 1.f, beta, c, ldc);
}

// Each (b, h)'s rows of t ([B, H, L, E] bfloat16) as op(B) of a product that sums over rows (p v), in brgemm's
// VNNI layout, laid out as uint32 [B, H, pairs, ld] (pairs: L rounded up to BRGEMM_Q, halved; ld: E rounded up to
// BRGEMM_Q), zeros past L and E. Rows i0 .. i0 + n of (b, h), i0 even and n a multiple of BRGEMM_Q, are then
// the operand at pair i0 / 2, with nothing past them to pad. In parallel over (b, h).
Tensor pack_rows(const Tensor& t, Index& ld, Index& pairs) {
  const Index L = t.size(2), E = t.size(3), lp = round_up(L, BRGEMM_Q);
  ld = round_up(E, BRGEMM_Q);
  pairs = lp / 2;
  return packed_per_head(t, pairs * ld * 2, [&](const BF16* rows, BF16* to) {
    pack_vnni(false, L, E, rows, t.stride(2), lp, ld, to);
  });
}

// Each (b, h)'s t ([B, H, L, E] bfloat16) transposed, laid out as bfloat16 [B, H, Ep, ld] (Ep: E rounded up to
// BRGEMM_Q; ld: L and one more BRGEMM_Q rounded up to 256, as pack_keys's: the leading dimension picks the
// micro-kernel, which torch builds and keeps per shape and thread, so calls of many lengths share few), zeros
// past L and E.
// Columns i0 .. i0 + n of row e (i0 even, n a multiple of BRGEMM_Q) are then row e of a left operand over rows
// i0 .. i0 + n of t. In parallel over (b, h).
Tensor transposed_rows(const Tensor& t, Index& ld) {
  const Index L = t.size(2), E = t.size(3);
  ld = round_up(L + BRGEMM_Q, 256);
  return packed_per_head(t, round_up(E, BRGEMM_Q) * ld, [&](const BF16* rows, BF16* to) {
    transposed_into(E, L, ld, rows, t.stride(2), to);
  });
}
#else
bool brgemm_bf16() { return false; }
inline void release_products() {}
constexpr Index BRGEMM_Q = 16, BRGEMM_ROWS = 8;  // (named by code that never runs without brgemm)
struct Rows;
bool packs_keys(const Tensor&, const Tensor&, Index, const Rows&) { return false; }
Tensor pack_keys(const Tensor&, Index&, Index&, int) { TORCH_CHECK(false, "band kernel: no brgemm to pack keys for"); }
Tensor pack_rows(const Tensor&, Index&, Index&) { TORCH_CHECK(false, "band kernel: no brgemm to pack rows for"); }
Tensor transposed_rows(const Tensor&, Index&) { TORCH_CHECK(false, "band kernel: no brgemm to transpose rows for"); }
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

// Whether the kernel has a bfloat16 product: oneDNN's brgemm or MKL's.
bool has_bf16_gemm() { return has_mkl_bf16_gemm() || brgemm_bf16(); }

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

#if defined(CPU_CAPABILITY_AVX512)
// exp of 16 floats: x = n ln 2 + r (|r| <= ln 2 / 2, ln 2 in two parts), e^r by a degree-5 polynomial with
// constant term 1 fitted for least maximum relative error on that interval (over every float, within the
// error of a degree-6 Taylor polynomial, with one multiply-add fewer), times 2^n by one scalef. As exp_u20:
// 0 below ln(FLT_MIN) (the mask also catches -inf, whose r is NaN), and a NaN clamped to ln(FLT_MAX), whose
// exp overflows to +inf (so a NaN score's row sums to inf and its output comes out NaN: see "Non-finite
// inputs" above). About three fifths of exp_u20's instructions.
// bounded = false: for inputs known to be neither positive nor NaN (a score minus a maximum it is under),
// without the clamp (a NaN would come out 0 there, not +inf).
// rounded = true: for weights that are rounded to a half type next (half products): ln 2 in one part and a
// degree-4 polynomial fitted the same way, two multiply-adds fewer. Over every float its relative error is at
// most 3.2e-6 (near ln(FLT_MIN), where n is largest; against 1.64e-7 for the degree-5 one), a thousand
// times below bfloat16's rounding (2^-9) and over a hundred below float16's (2^-12), so the rounded weights
// are the same but for a rare tie; the row sum l takes the same relative error.
template <bool bounded = true, bool rounded = false>
inline at::vec::Vectorized<float> exp_avx512(at::vec::Vectorized<float> v) {
  // (a NaN takes the bound: min's second operand)
  const __m512 x = bounded ? _mm512_min_ps(v, _mm512_set1_ps(88.72283935546875f)) : __m512(v);
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365447505531f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 p;
  if constexpr (rounded) {  // r = x - n ln2 with ln2 in one float (off by 2e-9: n times that in r)
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182464599609375f), x);
    p = _mm512_set1_ps(4.151187465e-02f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.678757668e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.000303984e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999668002e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  } else {
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // n ln2_hi exact: 9 bits times 8
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    p = _mm512_set1_ps(8.290315047e-03f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.189793020e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666763574e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999915063e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999997020e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  }
  return _mm512_maskz_scalef_ps(normal, p, n);
}
#endif

// bounded = false: x known to be neither positive nor NaN; rounded: weights rounded to a half type next (see
// exp_avx512; only float on AVX-512 has the shorter form).
template <typename T, bool bounded = true, bool rounded = false>
inline at::vec::Vectorized<T> vexp(at::vec::Vectorized<T> x) {
  if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    return exp_avx512<bounded, rounded>(x);
#else
    return x.exp_u20();  // what PyTorch's own flash kernel uses for float
#endif
  } else {
    return x.exp();
  }
}

// t -> cap * tanh(t / cap) over t[0:n). Kept out of line, like capped_probabilities, so that the
// uncapped loops around the calls compile as they would without capping.
template <typename T>
__attribute__((noinline)) void cap_row(T* t, Index n, T cap) {
  using Vec = at::vec::Vectorized<T>;
  const Vec vc(cap), inv(T(1) / cap);
  at::vec::map([=](Vec x) { return vc * (x * inv).tanh(); }, t, t, n);
}

// Raw scores s[0:n) -> s * scale (+ bias[j], one fused multiply-add), then cap * tanh(t / cap)
// when cap > 0: the one place a score is rounded, shared by the forward and both backward passes
// so that they see the same numbers.
template <typename T>
void score_row(T* s, Index n, T scale, const T* bias, T cap) {
  using Vec = at::vec::Vectorized<T>;
  const Vec vs(scale);
  if (bias != nullptr) {
    at::vec::map2([=](Vec x, Vec y) { return at::vec::fmadd(x, vs, y); }, s, s, bias, n);
  } else if (scale != T(1)) {
    at::vec::map([=](Vec x) { return x * vs; }, s, s, n);
  }
  if (cap > T(0)) cap_row<T>(s, n, cap);
}

// x[0:n) added up into z: finite unless an x is not (or the sum overflows: a false alarm, which costs
// the caller only its exact path). See "Non-finite inputs" above.
template <typename T>
inline at::vec::Vectorized<T> add_up(const T* x, Index n, at::vec::Vectorized<T> z) {
  using Vec = at::vec::Vectorized<T>;
  Index j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) z = z + Vec::loadu(x + j);
  if (j < n) z = z + Vec::loadu(x + j, static_cast<int>(n - j));  // the lanes past n load as 0
  return z;
}

template <typename T>
inline bool not_finite(at::vec::Vectorized<T> z) {
  return !std::isfinite(at::vec::vec_reduce_all<T>([](auto a, auto b) { return a + b; }, z));
}

// A running maximum of vectors that ends NaN where any of them held a NaN. at::vec::maximum keeps a NaN in
// every step (a maximum, a compare, a select and an or); with AVX-512, floats take the plain maximum and
// gather the lanes that were NaN in a mask instead, two instructions a vector. `add(x, w)`: the first w lanes.
template <typename T>
struct RunningMax {
  using Vec = at::vec::Vectorized<T>;
  Vec a = Vec(-std::numeric_limits<T>::infinity());
  void add(Vec x) { a = at::vec::maximum(a, x); }
  void add(Vec x, int w) { a = Vec::set(a, at::vec::maximum(a, x), w); }  // the lanes past w keep theirs
  void add(const RunningMax& o) { a = at::vec::maximum(a, o.a); }
  T result() const { return at::vec::vec_reduce_all<T>([](Vec u, Vec v) { return at::vec::maximum(u, v); }, a); }
};
#if defined(CPU_CAPABILITY_AVX512)
template <>
struct RunningMax<float> {
  using Vec = at::vec::Vectorized<float>;
  __m512 a = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  void add(Vec x) {
    a = _mm512_max_ps(a, x);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  }
  void add(Vec x, int w) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << w) - 1);
    a = _mm512_mask_max_ps(a, lanes, a, x);
    nan |= _mm512_mask_cmp_ps_mask(lanes, x, x, _CMP_UNORD_Q);
  }
  void add(const RunningMax& o) {
    a = _mm512_max_ps(a, o.a);
    nan |= o.nan;
  }
  float result() const { return nan != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(a); }
};
#endif

// The maximum of x[0:n), NaN where one is. Four running maxima side by side: with one, each vector waits for
// the maximum before it, and this pass took as long as the exponentials after it. A maximum is exact in any
// order.
template <typename T>
T row_max(const T* x, Index n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr Index V = Vec::size();
  RunningMax<T> a0, a1, a2, a3;
  Index j = 0;
  for (; j + 4 * V <= n; j += 4 * V) {
    a0.add(Vec::loadu(x + j));
    a1.add(Vec::loadu(x + j + V));
    a2.add(Vec::loadu(x + j + 2 * V));
    a3.add(Vec::loadu(x + j + 3 * V));
  }
  for (; j + V <= n; j += V) a0.add(Vec::loadu(x + j));
  if (j < n) {
    const int w = static_cast<int>(n - j);
    a1.add(Vec::loadu(x + j, w), w);
  }
  a0.add(a1);
  a2.add(a3);
  a0.add(a2);
  return a0.result();
}

// score_row, and the maximum of the scores it leaves, in one pass over the row instead of two (the
// same operations on the same values: the scores are those score_row stores, and a maximum is exact
// in any order). Capped rows take the two passes.
template <typename T>
T score_row_max(T* s, Index n, T scale, const T* bias, T cap) {
  using Vec = at::vec::Vectorized<T>;
  constexpr Index V = Vec::size();
  if (cap > T(0)) {
    score_row<T>(s, n, scale, bias, cap);
    return row_max<T>(s, n);
  }
  if (scale == T(1) && bias == nullptr) return row_max<T>(s, n);  // stored as they are
  const Vec vs(scale);
  const auto scored = [&](Index j, int w) {
    const Vec x = Vec::loadu(s + j, w);
    const Vec t = bias != nullptr ? at::vec::fmadd(x, vs, Vec::loadu(bias + j, w)) : x * vs;
    t.store(s + j, w);
    return t;
  };
  RunningMax<T> a0, a1;  // two running maxima: see row_max
  Index j = 0;
  for (; j + 2 * V <= n; j += 2 * V) {
    a0.add(scored(j, V));
    a1.add(scored(j + V, V));
  }
  for (; j < n; j += V) {
    const int w = static_cast<int>(std::min<Index>(V, n - j));
    if (w == V) {
      a0.add(scored(j, w));
    } else {
      a0.add(scored(j, w), w);
    }
  }
  a0.add(a1);
  return a0.result();
}

struct Shape {
  Index B, H, L, E, Hkv, S, Ev;
  Shape(const Tensor& q, const Tensor& k, const Tensor& v)
      : B(q.size(0)), H(q.size(1)), L(q.size(2)), E(q.size(3)), Hkv(k.size(1)), S(k.size(2)), Ev(v.size(3)) {}
  Index groups() const { return H / Hkv; }
};

// Head h's diagonal bias [1 or H, L + S - 1] from column c on.
template <typename T>
inline const T* diagonal_row(const Tensor& bias, Index h, Index c) {
  return bias.data_ptr<T>() + (bias.size(0) == 1 ? 0 : h) * bias.size(1) + c;
}

// The dtypes were checked on entry: the untyped pointer, without data_ptr<T>()'s check on every row (for
// the half types that check builds strings).
template <typename T>
const T* row_ptr(const Tensor& t, Index b, Index h, Index i) {
  return static_cast<const T*>(t.data_ptr()) + b * t.stride(0) + h * t.stride(1) + i * t.stride(2);
}

// row_ptr for many rows of one tensor: the pointer and strides read once. data_ptr() is a call into torch,
// which took as long per output row as writing the row.
template <typename T>
struct RowView {
  T* base;
  Index sb, sh, si;
  explicit RowView(const Tensor& t)
      : base(static_cast<T*>(t.data_ptr())), sb(t.stride(0)), sh(t.stride(1)), si(t.stride(2)) {}
  T* operator()(Index b, Index h, Index i) const { return base + b * sb + h * sh + i * si; }
};

// n values of storage type S read into the compute type T (S == T: a copy); store_scaled_row writes them
// back. Half types are computed in float: the forward converts each block's queries as
// it reads them and each output row as it writes it (each once), and the keys and values once per call
// before it starts (a block reads its keys again for every block of rows that sees them: converting them
// there would convert each key as many times; without bf16 products a float copy is the fastest read),
// unless few blocks read each key (few_reads: a decode step), where a chunk is widened as it is read.
template <typename T, typename S>
inline void load_row(const S* from, T* to, Index n) {
  if constexpr (std::is_same_v<S, T>) {
    std::copy_n(from, n, to);
  } else {
    using VS = at::vec::Vectorized<S>;
    using VT = at::vec::Vectorized<T>;
    Index j = 0;
    for (; j + VS::size() <= n; j += VS::size()) {
      auto [a, b] = at::vec::convert_to_float<S>(VS::loadu(from + j));
      a.store(to + j);
      b.store(to + j + VT::size());
    }
    for (; j < n; ++j) to[j] = static_cast<T>(from[j]);
  }
}

// t ([B, H, L, width], stored as S, unit stride along width) as a contiguous float tensor, a row at a
// time with load_row, in parallel.
template <typename S>
Tensor to_float(const Tensor& t) {
  Tensor out = at::empty(t.sizes(), t.options().dtype(at::kFloat));
  const Index H = t.size(1), L = t.size(2), width = t.size(3);
  float* dst = out.data_ptr<float>();
  const RowView<const S> rows(t);
  at::parallel_for(0, t.size(0) * H * L, 1024, [&](Index begin, Index end) {
    for (Index r = begin; r < end; ++r) {
      load_row<float, S>(rows(r / (H * L), (r / L) % H, r % L), dst + r * width, width);
    }
  });
  return out;
}

// to[0:n) = from[0:n) * factor, written back in S (rounded to nearest), in one pass: an output row divided by
// its sum, queries or dQ times the score scale.
template <typename T, typename S>
inline void store_scaled_row(const T* from, T factor, S* to, Index n) {
  using VT = at::vec::Vectorized<T>;
  const VT f(factor);
  if constexpr (std::is_same_v<S, T>) {
    at::vec::map([=](VT x) { return x * f; }, to, from, n);
  } else {
    using VS = at::vec::Vectorized<S>;
    Index j = 0;
    for (; j + VS::size() <= n; j += VS::size()) {
      at::vec::convert_from_float<S>(VT::loadu(from + j) * f, VT::loadu(from + j + VT::size()) * f).store(to + j);
    }
    for (; j < n; ++j) to[j] = static_cast<S>(from[j] * factor);
  }
}

// n rows of t ([B, H, L, width], unit stride along width) from row i0 of head h of batch element b, as a
// product of KV operands reads them: in place (stored as KV; ld their stride), or widened from their storage
// type S into buf (n x width; ld = width). The backward of a half type without its products reads its
// inputs a tile at a time this way (no float32 copy of a whole tensor).
template <typename KV, typename S>
inline const KV* rows_as(const Tensor& t, Index b, Index h, Index i0, Index n, KV* buf, Index& ld) {
  if constexpr (std::is_same_v<KV, S>) {
    ld = t.stride(2);
    return row_ptr<KV>(t, b, h, i0);
  } else {
    const Index width = t.size(3);
    const RowView<const S> rows(t);
    for (Index r = 0; r < n; ++r) load_row<KV, S>(rows(b, h, i0 + r), buf + r * width, width);
    ld = width;
    return buf;
  }
}

// n values of x (weights or dS) as a product's operand of type KV: x itself when KV is T, else rounded to
// nearest into buf (round_pair).
template <typename T, typename KV>
inline const KV* operand(const T* x, Index n, KV* buf) {
  if constexpr (std::is_same_v<KV, T>) {
    return x;
  } else {
    using Vec = at::vec::Vectorized<T>;
    Index j = 0;
    for (; j + 2 * Vec::size() <= n; j += 2 * Vec::size()) {
      round_pair<KV>(Vec::loadu(x + j), Vec::loadu(x + j + Vec::size()), buf + j);
    }
    if (j < n) {  // the last 1 .. 2V - 1, rounded the same way
      const int w0 = static_cast<int>(std::min<Index>(Vec::size(), n - j)), w1 = static_cast<int>(n - j) - w0;
      round_pair<KV>(Vec::loadu(x + j, w0), w1 > 0 ? Vec::loadu(x + j + Vec::size(), w1) : Vec(T(0)), buf + j,
                     static_cast<int>(n - j));
    }
    return buf;
  }
}

// The rows' key intervals, [P, L, K] int64 with P 1, B or B*H (one set for all, one per batch
// element, or one per batch element and head, b * H + h): row i of set p sees the keys
// starts[p, i, k] <= j < ends[p, i, k]; each row's intervals sorted and disjoint, empty ones last.
struct Rows {
  const int64_t* s;
  const int64_t* e;
  Index Bp, L, K, H;
  bool per_head;
  Rows(const Tensor& starts, const Tensor& ends, Index B, Index H)
      : s(starts.data_ptr<int64_t>()), e(ends.data_ptr<int64_t>()), Bp(starts.size(0)), L(starts.size(1)),
        K(starts.size(2)), H(H), per_head(H > 1 && starts.size(0) == B * H) {}
  // The set of intervals batch element b, head h reads.
  Index set(Index b, Index h) const { return Bp == 1 ? 0 : per_head ? b * H + h : b; }
  Index at(Index p, Index i) const { return (p * L + i) * K; }
  // Row i of set p: its visible columns within the sorted, disjoint key segments segs[0..n), laid
  // side by side (segment x's keys from the sum of the lengths before it), as (first, end) pairs in
  // `out` (grown as needed); returns how many. One pass over the row's intervals and the segments.
  Index ranges_in(Index p, Index i, const std::pair<Index, Index>* segs, Index n, std::vector<Index>& out) const {
    const Index o = at(p, i);
    Index count = 0, placed = 0, k = 0;
    for (Index x = 0; x < n; ++x) {
      const auto [a, z] = segs[x];
      while (k < K && s[o + k] < e[o + k] && e[o + k] <= a) ++k;
      for (Index t = k; t < K && s[o + t] < e[o + t] && s[o + t] < z; ++t) {
        const Index lo = std::max(s[o + t], a), hi = std::min(e[o + t], z);
        if (lo >= hi) continue;
        if (static_cast<Index>(out.size()) < 2 * (count + 1)) out.resize(2 * (count + 1));
        out[2 * count] = lo - a + placed;
        out[2 * count + 1] = hi - a + placed;
        ++count;
      }
      placed += z - a;
    }
    return count;
  }
  // Row i of set p: its visible columns within [c0, c0 + n), relative to c0 (ranges_in of one segment).
  Index ranges(Index p, Index i, Index c0, Index n, std::vector<Index>& out) const {
    const std::pair<Index, Index> seg{c0, c0 + n};
    return ranges_in(p, i, &seg, 1, out);
  }
};

// This thread's share of the bias gradient of head h ([threads, 1 or H, L + S - 1]), from diagonal
// column c on (a nested call runs serially, in slot 0).
template <typename T>
T* bias_grad_row(Tensor& dbias, const Tensor& bias, Index h, Index c) {
  const Index slot = std::min<Index>(at::get_thread_num(), dbias.size(0) - 1);
  return dbias.data_ptr<T>() + (slot * dbias.size(1) + (bias.size(0) == 1 ? 0 : h)) * dbias.size(2) + c;
}

// Keys in sorted, disjoint segments segs[0..n), side by side: their rows of t ([L, width] of head h, stored
// as S) copied to out as T (widened where S is a half type and T is not).
template <typename T, typename S = T>
void gather_keys(const Tensor& t, Index b, Index h, const std::pair<Index, Index>* segs, Index n, T* out) {
  const Index width = t.size(3);
  const RowView<const S> rows(t);
  for (Index x = 0; x < n; ++x) {
    for (Index j = segs[x].first; j < segs[x].second; ++j, out += width) {
      load_row<T, S>(rows(b, h, j), out, width);
    }
  }
}

// Row i's bias of head h at the keys of segs[0..n), side by side (bias[h, j - i + L - 1] for key j),
// written to bias_out.
template <typename T>
const T* gathered_bias(const Tensor& bias, Index h, Index i, Index L, const std::pair<Index, Index>* segs, Index n,
                       T* bias_out) {
  T* at = bias_out;
  for (Index x = 0; x < n; ++x) {
    const Index len = segs[x].second - segs[x].first;
    at = std::copy_n(diagonal_row<T>(bias, h, segs[x].first - i + L - 1), len, at);
  }
  return bias_out;
}

// The keys rows row(0), ..., row(rows - 1) of set p see (a row(r) < 0 is left out), as few segments:
// the union of their intervals, with gaps shorter than `gap` closed (a window that moves by one key
// per row stays one segment, exactly [first row's start, last row's end) as in a one-interval band).
// iv and out: the caller's buffers, reused from block to block (no allocation per block; no sort
// when rows come in order).
template <typename RowOf>
const std::vector<std::pair<Index, Index>>& segments(const Rows& R, Index p, Index rows, const RowOf& row, Index gap,
                                                     std::vector<std::pair<Index, Index>>& iv,
                                                     std::vector<std::pair<Index, Index>>& out) {
  iv.clear();
  out.clear();
  Index before = -1;  // the row before's intervals: those it repeats add nothing (global keys in every row)
  for (Index r = 0; r < rows; ++r) {
    if (row(r) < 0) continue;
    const Index o = R.at(p, row(r));
    for (Index k = 0; k < R.K && R.s[o + k] < R.e[o + k]; ++k) {
      if (before < 0 || R.s[before + k] != R.s[o + k] || R.e[before + k] != R.e[o + k]) {
        iv.emplace_back(R.s[o + k], R.e[o + k]);
      }
    }
    before = o;
  }
  const auto by_start = [](const auto& x, const auto& y) { return x.first < y.first; };
  if (!std::is_sorted(iv.begin(), iv.end(), by_start)) std::sort(iv.begin(), iv.end(), by_start);
  for (const auto& x : iv) {
    if (!out.empty() && x.first <= out.back().second + gap) {
      out.back().second = std::max(out.back().second, x.second);
    } else {
      out.push_back(x);
    }
  }
  return out;
}

// A thread's buffers for key_chunks, made once and reused. KV: how keys and values are stored (T, or
// bfloat16 for the forward's bfloat16 products).
template <typename T, typename KV = T>
struct KeyScratch {
  Tensor kg_buf, vg_buf;
  KV *kg, *vg;  // gathered keys and values
  std::vector<T> bg;  // a row's bias at the gathered keys
  std::vector<std::pair<Index, Index>> iv, segs, lone;
  KeyScratch(Index chunk, Index E, Index Ev)
      : kg(scratch<KV>(kg_buf, chunk * E)), vg(scratch<KV>(vg_buf, chunk * Ev)), bg(chunk) {}
};

// The keys rows row(0..g-1) of set p see (segments, gaps shorter than `gap` closed), in chunks of at
// most `chunk` keys of head hkv of batch element b: each segment of LONE keys or more (or more than a
// chunk) read in place, then the shorter ones (a global token's key far from the rows' window)
// gathered, up to `chunk` keys together, so that they take one product instead of one each (each
// fits in a chunk: a longer one would never be taken, and the gathering would not end). For each chunk,
// body(kp, ldk, vp, ldv, kc, visible, bias_of, c0): its keys and values (rows ldk, ldv apart),
// visible(i, rg) row i's visible columns as ranges in rg (returns how many), bias_of(i) row i's
// bias of head h at the chunk's columns, c0 the chunk's first key where it is read in place (-1: gathered).
// S: how k and v are stored (KV, or a half type that the backward without its products widens per chunk).
template <typename T, typename KV, typename S = KV, typename RowOf, typename Body>
void key_chunks(const Rows& R, Index p, Index g, const RowOf& row, Index gap, Index chunk, const Tensor& k,
                const Tensor& v, const Tensor& bias, Index b, Index h, Index hkv, KeyScratch<T, KV>& w,
                const Body& body) {
  w.lone.clear();
  for (const auto& seg : segments(R, p, g, row, gap, w.iv, w.segs)) {
    if (seg.second - seg.first < LONE && seg.second - seg.first <= chunk) {
      w.lone.push_back(seg);
      continue;
    }
    for (Index c0 = seg.first; c0 < seg.second; c0 += chunk) {
      const Index kc = std::min(chunk, seg.second - c0);
      Index ldk = 0, ldv = 0;
      const KV* kp = rows_as<KV, S>(k, b, hkv, c0, kc, w.kg, ldk);
      const KV* vp = rows_as<KV, S>(v, b, hkv, c0, kc, w.vg, ldv);
      body(kp, ldk, vp, ldv, kc,
           [&](Index i, std::vector<Index>& rg) { return R.ranges(p, i, c0, kc, rg); },
           // bias[h, j - i + L - 1]: a contiguous slice along the row
           [&](Index i) { return diagonal_row<T>(bias, h, c0 - i + R.L - 1); }, c0);
    }
  }
  for (std::size_t x0 = 0; x0 < w.lone.size();) {
    std::size_t x1 = x0;
    Index kc = 0;
    for (; x1 < w.lone.size() && kc + (w.lone[x1].second - w.lone[x1].first) <= chunk; ++x1) {
      kc += w.lone[x1].second - w.lone[x1].first;
    }
    const auto* segs = w.lone.data() + x0;
    const Index n = static_cast<Index>(x1 - x0);
    gather_keys<KV, S>(k, b, hkv, segs, n, w.kg);
    gather_keys<KV, S>(v, b, hkv, segs, n, w.vg);
    body(static_cast<const KV*>(w.kg), k.size(3), static_cast<const KV*>(w.vg), v.size(3), kc,
         [&](Index i, std::vector<Index>& rg) { return R.ranges_in(p, i, segs, n, rg); },
         [&](Index i) { return gathered_bias<T>(bias, h, i, R.L, segs, n, w.bg.data()); }, Index(-1));
    x0 = x1;
  }
}

// For each set of rows and block of `block` keys, the runs [first, end) of query rows that see
// one of its keys, its wide keys (wide_keys; computed apart) left out (one pass over the rows'
// intervals; rows come in order, so runs come sorted).
std::vector<std::vector<std::vector<std::pair<Index, Index>>>> key_block_rows(
    const Rows& R, Index S, Index block, const std::vector<std::vector<char>>& wide) {
  const Index blocks = (S + block - 1) / block;
  std::vector<std::vector<std::vector<std::pair<Index, Index>>>> out(R.Bp);
  std::vector<Index> plain;  // plain[j]: the keys before j that are not wide
  for (Index p = 0; p < R.Bp; ++p) {
    auto& runs = out[p];
    runs.resize(blocks);
    const bool some_wide = !wide[p].empty();
    if (some_wide) {
      plain.assign(S + 1, 0);
      for (Index j = 0; j < S; ++j) plain[j + 1] = plain[j] + (wide[p][j] ? 0 : 1);
    }
    for (Index i = 0; i < R.L; ++i) {
      const Index o = R.at(p, i);
      Index last = -1;  // the last key block this row was added to (its intervals are sorted)
      for (Index k = 0; k < R.K && R.s[o + k] < R.e[o + k]; ++k) {
        for (Index kb = std::max(last + 1, R.s[o + k] / block); kb <= (R.e[o + k] - 1) / block; ++kb) {
          if (some_wide && plain[std::min(R.e[o + k], (kb + 1) * block)] == plain[std::max(R.s[o + k], kb * block)]) {
            continue;  // only wide keys of this block: computed apart
          }
          auto& r = runs[kb];
          if (!r.empty() && r.back().second == i) {
            r.back().second = i + 1;
          } else {
            r.emplace_back(i, i + 1);
          }
          last = kb;
        }
      }
    }
  }
  return out;
}

// Whether a row's ranges are many, in order, and cover at least a quarter of their span: then one
// vectorised pass over the span with the gaps masked beats a pass per range (a dilated window's
// ranges are one key long: per range, the vector loops never fill a register).
inline bool dense_span(const Index* rg, Index count) {
  if (count < 4) return false;
  Index covered = 0;
  for (Index c = 0; c < count; ++c) {
    if (rg[2 * c] > rg[2 * c + 1] || (c > 0 && rg[2 * c] < rg[2 * c - 1])) return false;
    covered += rg[2 * c + 1] - rg[2 * c];
  }
  return rg[2 * count - 1] - rg[0] <= 4 * covered;
}

// online_softmax_row over the span [first start, last end) of in-order ranges: the same scores
// (score_row is elementwise), the gaps -inf for the maximum and 0 after the exponential.
template <typename T>
T span_softmax_row(T* s, const Index* rg, Index count, T scale, const T* bias, T cap, T& m, T& l, bool& bad) {
  using Vec = at::vec::Vectorized<T>;
  const Index a = rg[0], z = rg[2 * count - 1];
  const T ninf = -std::numeric_limits<T>::infinity();
  if (cap > T(0)) bad = bad || not_finite<T>(add_up<T>(s + a, z - a, Vec(T(0))));  // see online_softmax_row
  score_row<T>(s + a, z - a, scale, bias != nullptr ? bias + a : nullptr, cap);
  for (Index c = 1; c < count; ++c) std::fill(s + rg[2 * c - 1], s + rg[2 * c], ninf);
  const T mx = row_max<T>(s + a, z - a);
  bad = bad || !std::isfinite(mx);
  const T m_new = std::isnan(mx) ? mx : std::max(m, mx);
  const T factor = m == ninf ? T(0) : std::exp(m - m_new);
  const Vec vm(m_new);
  at::vec::map([=](Vec x) { return vexp<T>(x - vm); }, s + a, s + a, z - a);
  for (Index c = 1; c < count; ++c) std::fill(s + rg[2 * c - 1], s + rg[2 * c], T(0));  // exp(-inf) exactly 0
  l = l * factor + at::vec::reduce_all<T>([](Vec x, Vec y) { return x + y; }, s + a, z - a);
  m = m_new;
  return factor;
}

// A row whose maximum online_softmax_row finds while it computes the weights of the row before (pipelined rows,
// in forward_impl): its raw scores s, visible over [a, e), and their maximum (NaN where one is) once it returns.
template <typename T>
struct NextRow {
  const T* s;
  Index a, e;
  T max = 0;
};

// One row of raw scores s[0:n) whose visible columns are the `count` ranges in rg: scale (and bias)
// them, zero the rest, and fold them into the running max m and sum l (online softmax); returns the
// factor for the row's accumulator. A NaN score makes m (and so the row's output) NaN: exp_u20
// clamps NaN to a finite value. `bad` is set when the maximum of the visible scores is not finite (a
// NaN, +inf, or every one -inf), or, capped, when a visible raw score is not: the row's query or one
// of its keys is not finite (see "Non-finite inputs" above).
// With P a half type, the row's weights are also written rounded to nearest into pout[0:n) (zeros where
// not visible) for the half product p v, in the pass that computes them, without storing the float row and
// reading it back (a row of many ranges, span_softmax_row, is computed in float and rounded after by operand).
// Those weights, and so l, come from exp_avx512's shorter form (rounded), good to 3.2e-6.
// Pipelined rows (rounds, one range, scores as stored): known_max is the row's maximum, found by the row before;
// `next` asks for the next row's, found in the loop of this row's exponentials (the loads and maxima run beside
// their multiply-adds, and bring the next row into L1), the same maximum as row_max's.
template <typename T, typename P = T>
T online_softmax_row(T* s, Index n, const Index* rg, Index count, T scale, const T* bias, T cap, T& m, T& l,
                     bool& bad, P* pout = nullptr, const T* known_max = nullptr, NextRow<T>* next = nullptr) {
  using Vec = at::vec::Vectorized<T>;
  constexpr bool rounds = !std::is_same_v<P, T>;
  static_assert(!rounds || std::is_same_v<T, float>, "weights rounded from float");
  Index at = 0;
  for (Index c = 0; c < count; ++c) {  // zeros where not visible: in the product's operand (only pout, if rounds)
    // max(): intervals out of order or overlapping (the caller's error) give wrong sums, never a reversed range
    if constexpr (rounds) {
      std::fill(pout + at, pout + std::max(at, rg[2 * c]), P(0));
    } else {
      std::fill(s + at, s + std::max(at, rg[2 * c]), T(0));
    }
    at = std::max(at, rg[2 * c + 1]);
  }
  if constexpr (rounds) {
    std::fill(pout + at, pout + n, P(0));
  } else {
    std::fill(s + at, s + n, T(0));
  }
  if (count == 0) return T(1);
  if (dense_span(rg, count)) {
    const T factor = span_softmax_row<T>(s, rg, count, scale, bias, cap, m, l, bad);
    if constexpr (rounds) operand<T, P>(s + rg[0], rg[2 * count - 1] - rg[0], pout + rg[0]);
    return factor;
  }
  T mx = -std::numeric_limits<T>::infinity();
  for (Index c = 0; c < count && known_max == nullptr; ++c) {
    const Index a = rg[2 * c], e = rg[2 * c + 1];
    // Capping maps an infinite score to a finite one: the raw scores are seen before it.
    if (cap > T(0)) bad = bad || not_finite<T>(add_up<T>(s + a, e - a, Vec(T(0))));
    const T x = score_row_max<T>(s + a, e - a, scale, bias != nullptr ? bias + a : nullptr, cap);
    mx = std::isnan(x) || std::isnan(mx) ? std::numeric_limits<T>::quiet_NaN() : std::max(mx, x);
  }
  if (known_max != nullptr) mx = *known_max;
  RunningMax<T> n0, n1;  // the next row's maximum, as row_max finds it
  Index nj = next != nullptr ? next->a : 0;
  const T m_new = std::isnan(mx) ? mx : std::max(m, mx);
  const T factor = m == -std::numeric_limits<T>::infinity() ? T(0) : std::exp(m - m_new);
  const Vec vm(m_new);
  bad = bad || !std::isfinite(mx);
  // With a finite maximum every score minus m_new is finite and at most 0: the exponential needs no clamp.
  const auto weights = [&](auto bounded_t) {
    constexpr bool bounded = decltype(bounded_t)::value;
    // weights rounded to P next (rounds) take exp_avx512's shorter form
    const auto weight = [&](Vec x) { return vexp<T, bounded, rounds>(x - vm); };
    T sum = 0;
    for (Index c = 0; c < count; ++c) {
      const Index a = rg[2 * c], e = rg[2 * c + 1];
      Vec acc(T(0));
      Index j = a;
      if constexpr (rounds) {  // two vectors of weights, rounded as one vector of P (same sums, in the same order)
        for (; j + 2 * Vec::size() <= e; j += 2 * Vec::size()) {
          if (next != nullptr && nj + 2 * Vec::size() <= next->e) {
            n0.add(Vec::loadu(next->s + nj));
            n1.add(Vec::loadu(next->s + nj + Vec::size()));
            nj += 2 * Vec::size();
          }
          const Vec x0 = weight(Vec::loadu(s + j));
          const Vec x1 = weight(Vec::loadu(s + j + Vec::size()));
          acc = acc + x0;
          acc = acc + x1;
          round_pair<P>(x0, x1, pout + j);
        }
      }
      if constexpr (rounds) {  // the last 1 .. 2V - 1 weights: the lanes past e zeroed after exp, and not written
        if (j < e) {
          const int w0 = static_cast<int>(std::min<Index>(Vec::size(), e - j));
          const int w1 = static_cast<int>(e - j) - w0;
          const Vec x0 = Vec::set(Vec(T(0)), weight(Vec::loadu(s + j, w0)), w0);
          const Vec x1 = w1 > 0 ? Vec::set(Vec(T(0)), weight(Vec::loadu(s + j + Vec::size(), w1)), w1)
                                : Vec(T(0));
          acc = acc + x0;
          acc = acc + x1;
          round_pair<P>(x0, x1, pout + j, static_cast<int>(e - j));
        }
      } else {
        for (; j + Vec::size() <= e; j += Vec::size()) {
          Vec x = weight(Vec::loadu(s + j));
          x.store(s + j);
          acc = acc + x;
        }
        if (j < e) {  // the last 1 .. V - 1: the lanes past e zeroed after exp, and not written
          const int w = static_cast<int>(e - j);
          const Vec x = Vec::set(Vec(T(0)), weight(Vec::loadu(s + j, w)), w);
          x.store(s + j, w);
          acc = acc + x;
        }
      }
      sum += at::vec::vec_reduce_all<T>([](Vec x, Vec y) { return x + y; }, acc);
    }
    return sum;
  };
  const T sum = std::isfinite(mx) && std::isfinite(m_new) ? weights(std::false_type{}) : weights(std::true_type{});
  if (next != nullptr) {  // what the loop left of the next row
    for (; nj + Vec::size() <= next->e; nj += Vec::size()) n0.add(Vec::loadu(next->s + nj));
    if (nj < next->e) {
      const int w = static_cast<int>(next->e - nj);
      n1.add(Vec::loadu(next->s + nj, w), w);
    }
    n0.add(n1);
    next->max = n0.result();
  }
  l = l * factor + sum;
  m = m_new;
  return factor;
}

// Of n entries in blocks of `block` (rows of a block of queries, or keys of a block of keys), each
// seen[x] wide, those far wider than most of their block: more than 4x the block's lower quartile
// plus 4 blocks (never more than half a block's entries). They are computed apart, in gathered
// groups, so that one row that sees every key (a global token's row beside a window's), or one key
// that every row sees (its key), does not make its whole block compute every key or every row.
// Marks them in `wide` (assigned n zeros at the first); returns whether it marked any.
bool mark_wide(const std::vector<Index>& seen, Index block, std::vector<char>& wide) {
  const Index n = static_cast<Index>(seen.size());
  std::vector<Index> sorted(block);
  bool any = false;
  for (Index x0 = 0; x0 < n; x0 += block) {
    const Index count = std::min(block, n - x0);
    std::copy_n(seen.begin() + x0, count, sorted.begin());
    std::nth_element(sorted.begin(), sorted.begin() + count / 4, sorted.begin() + count);
    const Index limit = 4 * sorted[count / 4] + 4 * block;
    const Index many = std::count_if(seen.begin() + x0, seen.begin() + x0 + count, [&](Index x) { return x > limit; });
    if (many == 0 || 2 * many > count) continue;
    if (wide.empty()) wide.assign(n, 0);
    for (Index x = x0; x < x0 + count; ++x) wide[x] = seen[x] > limit;
    any = true;
  }
  return any;
}

// Per set, the rows that see far more keys than most of their block of q_rows (mark_wide).
std::vector<std::vector<char>> wide_rows(const Rows& R, Index q_rows, bool& any) {
  std::vector<std::vector<char>> wide(R.Bp);
  std::vector<Index> seen(R.L);
  any = false;
  for (Index p = 0; p < R.Bp; ++p) {
    for (Index i = 0; i < R.L; ++i) {
      const Index o = R.at(p, i);
      seen[i] = 0;
      for (Index k = 0; k < R.K && R.s[o + k] < R.e[o + k]; ++k) seen[i] += R.e[o + k] - R.s[o + k];
    }
    any = mark_wide(seen, q_rows, wide[p]) || any;
  }
  return wide;
}

// Per set, the keys that far more rows see than most keys of their block of kv_rows (mark_wide),
// and whether there are any.
std::vector<std::vector<char>> wide_keys(const Rows& R, Index S, Index kv_rows, bool& any) {
  std::vector<std::vector<char>> wide(R.Bp);
  std::vector<Index> seen(S);
  any = false;
  for (Index p = 0; p < R.Bp; ++p) {
    std::vector<Index> change(S + 1, 0);  // rows starting to see a key, less those that stop
    for (Index i = 0; i < R.L; ++i) {
      const Index o = R.at(p, i);
      for (Index k = 0; k < R.K && R.s[o + k] < R.e[o + k]; ++k) {
        ++change[R.s[o + k]];
        --change[R.e[o + k]];
      }
    }
    Index rows = 0;
    for (Index j = 0; j < S; ++j) seen[j] = rows += change[j];
    any = mark_wide(seen, kv_rows, wide[p]) || any;
  }
  return wide;
}

// The wide rows of every batch element and head, in groups of at most `size`: `listed` gets each
// set's wide rows in order; returns each group as {b * H + h, first of its rows in listed, how many}.
std::vector<std::array<Index, 3>> wide_row_groups(const Rows& R, Index B, Index H,
                                                  const std::vector<std::vector<char>>& wide, Index size,
                                                  std::vector<std::vector<Index>>& listed) {
  listed.assign(R.Bp, {});
  for (Index p = 0; p < R.Bp; ++p) {
    for (Index i = 0; i < static_cast<Index>(wide[p].size()); ++i) {
      if (wide[p][i]) listed[p].push_back(i);
    }
  }
  std::vector<std::array<Index, 3>> groups;
  for (Index bh = 0; bh < B * H; ++bh) {
    const auto& rows = listed[R.set(bh / H, bh % H)];
    for (Index j = 0; j < static_cast<Index>(rows.size()); j += size) {
      groups.push_back({bh, j, std::min<Index>(size, static_cast<Index>(rows.size()) - j)});
    }
  }
  return groups;
}

// Half products (KV = Store = c10::BFloat16 or c10::Half, with T = float): q, k and v are read as they are
// stored, the two products of a chunk take half operands into float32 (gemm_half: each product exact, sums
// in float32), and the weights p are rounded to the half type for p v, as FlashAttention does on a GPU; the
// softmax, its running maximum and sum and the accumulator stay float32. No float copy of k and v is made,
// and a CPU with products of that type runs both products at their speed.
template <typename T, typename Store = T, typename KV = T, typename KS = KV>
void forward_impl(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& stats, const Rows& R,
                  const Tensor& bias, T scale, T cap, Index q_rows, Index kv_chunk) {
  constexpr bool halves = !std::is_same_v<KV, T>;  // half products
  static_assert(!halves || (std::is_same_v<T, float> && std::is_same_v<Store, KV>), "half products: float, half");
  const Shape d(q, k, v);
  const bool biased = bias.numel() > 0;
  const Index blocks = (d.L + q_rows - 1) / q_rows, G = d.groups(), K = R.K;
  using Vec = at::vec::Vectorized<T>;
  const T ninf = -std::numeric_limits<T>::infinity(), nan = std::numeric_limits<T>::quiet_NaN();
  bool any_wide = false;
  const auto wide = wide_rows(R, q_rows, any_wide);
  const RowView<const Store> q_rows_of(q);
  const RowView<Store> out_rows(out);
  // bfloat16 products through brgemm where many blocks of rows read each key: k^T packed once per call
  // (pack_vnni) instead of once for every block that reads a chunk of it.
  Tensor packed_buf;
  Index packed_ld = 0, packed_pairs = 0;
  bool keys_packed = false;
  // The values likewise, as the right operand of p v: a chunk of keys that starts on an even key and spans a
  // multiple of BRGEMM_Q reads them there (nothing past it to pad), any other is packed as it is read.
  Tensor values_buf;
  Index values_ld = 0, values_pairs = 0;
  // A scale that is a power of two (1/8 for 64-wide heads) is taken into an operand of q k^T: (q * scale) k^T
  // and q (k * scale)^T are exactly (q k^T) * scale, every product and sum scaled by the same power of two, and
  // the scores need no pass of their own before the maximum. Into the keys as they are packed (keys_scaled),
  // the queries then read in place; else into the queries as they are copied for a block (take_query). A
  // product over keys that are not packed (gathered, or a group too small for brgemm) then takes the scale as
  // its factor.
  int exponent = 0;
  const bool prescale = scale != T(1) && std::frexp(scale, &exponent) == T(0.5);
  const T s_eff = prescale ? T(1) : scale;
  bool keys_scaled = false;
  if constexpr (halves && std::is_same_v<KV, c10::BFloat16>) {
    keys_packed = packs_keys(q, k, q_rows, R);
    if (keys_packed) {
      keys_scaled = prescale;
      packed_buf = pack_keys(k, packed_ld, packed_pairs, keys_scaled ? exponent - 1 : 0);
      values_buf = pack_rows(v, values_ld, values_pairs);
    }
  }
  const bool queries_scaled = prescale && !keys_scaled;
  const T unpacked_factor = keys_scaled ? scale : T(1);  // of q k^T over keys not packed
  const auto packed_keys = [&](Index b, Index hkv) {
    return reinterpret_cast<const uint32_t*>(packed_buf.data_ptr()) + (b * d.Hkv + hkv) * packed_pairs * packed_ld;
  };
  const auto packed_values = [&](Index b, Index hkv, Index c0, Index kc) -> const uint32_t* {
    if (!values_buf.defined() || c0 < 0 || c0 % 2 != 0 || kc % BRGEMM_Q != 0) return nullptr;
    return reinterpret_cast<const uint32_t*>(values_buf.data_ptr()) + ((b * d.Hkv + hkv) * values_pairs + c0 / 2) *
                                                                           values_ld;
  };
  constexpr bool converted = !std::is_same_v<Store, T>;  // half types: read and written a tile at a time
  // A query row copied for a block (scaled where queries_scaled: see above); tmp: a row of E in T.
  const auto take_query = [&](const Store* from, KV* to, T* tmp) {
    if constexpr (halves) {  // scaled by a power of two in float, exactly, and stored back in the half type
      if (queries_scaled) {
        load_row<T, Store>(from, tmp, d.E);
        store_scaled_row<T, KV>(tmp, scale, to, d.E);
      } else {
        std::copy_n(from, d.E, to);
      }
    } else if constexpr (converted) {
      load_row<T, Store>(from, to, d.E);
      if (queries_scaled) store_scaled_row<T, T>(to, scale, to, d.E);
    } else if (queries_scaled) {
      store_scaled_row<T, T>(from, scale, to, d.E);
    } else {
      std::copy_n(from, d.E, to);
    }
  };
  struct Scratch {  // a thread's buffers, made once and reused from group to group
    Tensor s_buf, acc_buf, q_buf, p_buf;
    T *s, *acc;
    KV *qg, *pb;  // queries copied for a block; the weights rounded for p v (bfloat16 products)
    std::vector<T> qrow;  // a query row in the compute type, as it is scaled (bfloat16 products)
    std::vector<T> m, l;
    std::vector<bool> bad;  // a row's scores met a non-finite value (online_softmax_row)
    bool block_bad = false;  // a key or value of a chunk of the block is not finite
    std::vector<Index> rg, rg_next;  // a row's visible ranges, the next row's
    KeyScratch<T, KV> keys;
    Scratch(Index rows, Index chunk, const Shape& d, Index K)
        : s(scratch<T>(s_buf, rows * chunk)), acc(scratch<T>(acc_buf, rows * d.Ev)),
          qg(scratch<KV>(q_buf, rows * d.E)),
          pb(scratch<KV>(p_buf, halves ? rows * chunk : 1)), qrow(halves ? d.E : 0), m(rows), l(rows),
          bad(rows), rg(2 * K), rg_next(2 * K),
          keys(chunk, d.E, d.Ev) {}
  };
  // Rows row(0..g-1) of (b, h), their queries at qp + r * lda (a row(r) < 0 is left out): scores in
  // chunks of the keys they see (key_chunks), an online softmax per row, and their outputs and statistics.
  const auto attend = [&](Index b, Index h, const KV* qp, Index lda, Index g, const auto& row, Scratch& w) {
    T* const s = w.s;
    T* const acc = w.acc;
    T* const m = w.m.data();
    T* const l = w.l.data();
    std::fill(m, m + g, ninf);
    std::fill(l, l + g, T(0));
    std::fill(w.bad.begin(), w.bad.begin() + g, false);
    w.block_bad = false;
    bool first = true;
    key_chunks<T, KV, KS>(R, R.set(b, h), g, row, q_rows, kv_chunk, k, v, bias, b, h, h / G, w.keys,
                  [&](const KV* kp, Index ldk, const KV* vp, Index ldv, Index kc, const auto& visible,
                      const auto& bias_of, Index c0) {
      bool done = false;
      if constexpr (halves && std::is_same_v<KV, c10::BFloat16>) {
        if (keys_packed && c0 >= 0 && g >= BRGEMM_ROWS) {  // columns c0.. of the keys packed once for the call
          product_packed(g, kc, d.E, qp, lda, packed_keys(b, h / G) + c0, packed_ld, 0.f, s, kc);
          done = true;
        }
      }
      if (!done) product<T, KV>(false, true, g, kc, d.E, unpacked_factor, qp, lda, kp, ldk, T(0), s, kc);
      // One row's raw scores against every key of the chunk: a key that is not finite makes its score
      // with any finite query NaN or infinite (inf * 0 is NaN), whichever rows may see it.
      w.block_bad = w.block_bad || not_finite<T>(add_up<T>(s, kc, Vec(T(0))));
      // Pipelined rows (half products, scores as the product leaves them): a row of one range finds the maximum
      // of the next, if that is one range too, in its own exponentials' loop (online_softmax_row), which then
      // skips its own pass over the scores for it. rg holds row r's ranges, rg_next row r + 1's.
      const bool piped = halves && cap == T(0) && s_eff == T(1) && !biased;
      const auto ranges_of = [&](Index r, std::vector<Index>& rg) { return row(r) < 0 ? 0 : visible(row(r), rg); };
      Index count = ranges_of(0, w.rg);
      T known = 0;
      bool have_known = false;
      for (Index r = 0; r < g; ++r) {
        const Index i = row(r);
        const Index count_next = r + 1 < g ? ranges_of(r + 1, w.rg_next) : 0;
        const T* br = biased && i >= 0 ? bias_of(i) : nullptr;
        bool bad = w.bad[r];
        T factor;
        if constexpr (halves) {  // the weights rounded for p v as they are computed
          NextRow<T> next{s + (r + 1) * kc, w.rg_next[0], w.rg_next[1]};
          const bool pipe = piped && count == 1 && count_next == 1;
          factor = online_softmax_row<T, KV>(s + r * kc, kc, w.rg.data(), count, s_eff, br, cap, m[r], l[r], bad,
                                             w.pb + r * kc, have_known ? &known : nullptr, pipe ? &next : nullptr);
          have_known = pipe;
          known = next.max;
        } else {
          factor = online_softmax_row<T>(s + r * kc, kc, w.rg.data(), count, s_eff, br, cap, m[r], l[r], bad);
        }
        w.bad[r] = bad;
        if (!first && factor != T(1)) {
          for (Index j = 0; j < d.Ev; ++j) acc[r * d.Ev + j] *= factor;
        }
        std::swap(w.rg, w.rg_next);
        count = count_next;
      }
      // the rows' weights side by side (kc apart), rounded to nearest for half products (by online_softmax_row)
      const KV* weights = halves ? w.pb : reinterpret_cast<const KV*>(s);
      done = false;
      if constexpr (halves && std::is_same_v<KV, c10::BFloat16>) {
        const uint32_t* vpk = g >= BRGEMM_ROWS ? packed_values(b, h / G, c0, kc) : nullptr;
        if (vpk != nullptr) {
          product_packed(g, d.Ev, kc, weights, kc, vpk, values_ld, first ? 0.f : 1.f, acc, d.Ev);
          done = true;
        }
      }
      if (!done) product<T, KV>(false, false, g, d.Ev, kc, T(1), weights, kc, vp, ldv, first ? T(0) : T(1), acc, d.Ev);
      first = false;
    });
    T* const ms = stats.data_ptr<T>() + (b * d.H + h) * d.L;  // the row maximum, then log of the row sum
    T* const ls = ms + d.B * d.H * d.L;
    // A value that is not finite reaches every row of the product p v, as p * inf or 0 * inf (NaN), so
    // one row of the accumulator tells for the block (the self-check asks that the BLAS carries it).
    if (!first) w.block_bad = w.block_bad || not_finite<T>(add_up<T>(acc, d.Ev, Vec(T(0))));
    for (Index r = 0; r < g; ++r) {
      const Index i = row(r);
      if (i < 0) continue;
      Store* dst = out_rows(b, h, i);  // out is [B, L, H, Ev] in memory
      const bool bad = w.block_bad || w.bad[r];
      if (first || l[r] == T(0)) {  // nothing visible: zeros, like every other backend
        std::fill(dst, dst + d.Ev, Store(0));
        ms[i] = ls[i] = bad ? nan : ninf;
        continue;
      }
      store_scaled_row<T, Store>(acc + r * d.Ev, T(1) / l[r], dst, d.Ev);
      ms[i] = bad ? nan : m[r];
      ls[i] = bad ? nan : std::log(l[r]);
    }
  };
  // Work item -> its batch element, head and first row (blocks in interleaved order within each head).
  const auto item = [&](Index it) {
    return std::array<Index, 3>{it / (blocks * d.H), (it / blocks) % d.H, interleaved(it % blocks, blocks) * q_rows};
  };
  each_item(d.B * d.H * blocks, false, [&](const auto& next) {
    Scratch w(q_rows, kv_chunk, d, K);
    for (Index it = 0; next(it);) {
      const std::array<Index, 3> at = item(it);
      const Index b = at[0], h = at[1], i0 = at[2], rows = std::min(q_rows, d.L - i0);
      const char* skip = wide[R.set(b, h)].empty() ? nullptr : wide[R.set(b, h)].data() + i0;
      const Store* qs = q_rows_of(b, h, i0);
      const KV* qp = reinterpret_cast<const KV*>(qs);  // read in place unless converted or scaled
      Index lda = q.stride(2);
      if (queries_scaled || (converted && !halves)) {
        for (Index r = 0; r < rows; ++r) take_query(qs + r * lda, w.qg + r * d.E, w.qrow.data());
        qp = w.qg;
        lda = d.E;
      } else if (it + 1 < d.B * d.H * blocks) {
        // Read in place by the first product: the next block's queries asked for now, so that its product does
        // not wait for them (the blocks' order jumps: see interleaved).
        const std::array<Index, 3> na = item(it + 1);
        for (Index i = na[2]; i < std::min(na[2] + q_rows, d.L); ++i) {
          const char* row_at = reinterpret_cast<const char*>(q_rows_of(na[0], na[1], i));
          for (Index x = 0; x < d.E * Index(sizeof(Store)); x += 64) __builtin_prefetch(row_at + x, 0, 3);
        }
      }
      attend(b, h, qp, lda, rows, [=](Index r) { return skip != nullptr && skip[r] ? Index(-1) : i0 + r; }, w);
    }
  });
  if (!any_wide) return;
  // the wide rows of each (b, h), in groups of q_rows with their queries gathered
  std::vector<std::vector<Index>> listed;
  const auto groups = wide_row_groups(R, d.B, d.H, wide, q_rows, listed);
  each_item(static_cast<Index>(groups.size()), false, [&](const auto& next) {
    Scratch w(q_rows, kv_chunk, d, K);
    for (Index it = 0; next(it);) {
      const Index b = groups[it][0] / d.H, h = groups[it][0] % d.H, g = groups[it][2];
      const Index* rows = listed[R.set(b, h)].data() + groups[it][1];
      for (Index r = 0; r < g; ++r) take_query(q_rows_of(b, h, rows[r]), w.qg + r * d.E, w.qrow.data());
      attend(b, h, w.qg, d.E, g, [=](Index r) { return rows[r]; }, w);
    }
  });
}

// p = exp((t - m) - log l) and dp -> p * (dp - delta) * (1 - (t / cap)^2) over [0, n) of capped
// scores t in p, in one pass (p overwrites the t that dS needs).
template <typename T>
__attribute__((noinline)) void capped_probabilities(T* p, T* dp, Index n, T cap, T m, T ll, T dl) {
  using Vec = at::vec::Vectorized<T>;
  const Vec mm(m), l(ll), dd(dl), inv(T(1) / cap), one(T(1));
  for (Index j = 0; j < n; j += Vec::size()) {
    const int w = static_cast<int>(std::min<Index>(Vec::size(), n - j));
    const Vec t = Vec::loadu(p + j, w), u = t * inv, pp = vexp<T>((t - mm) - l);
    pp.store(p + j, w);
    (pp * (Vec::loadu(dp + j, w) - dd) * (one - u * u)).store(dp + j, w);
  }
}

// Probabilities and dS of one row of raw scores over its visible ranges, in place: p = exp((t - m)
// - log l) with t = score_row(s), dp -> p * (dp - delta), times 1 - (t / cap)^2 (the tanh's
// derivative) when capped; zeros elsewhere. m, ll, delta: the row's. rounded: p and dS are rounded to a half
// type next (half products), and p takes exp_avx512's shorter form, as the forward's weights did.
template <typename T, bool rounded = false>
void probabilities(T* p, T* dp, Index n, const Index* rg, Index count, T scale, const T* bias, T cap, T m, T ll,
                   T dl) {
  using Vec = at::vec::Vectorized<T>;
  Index at = 0;
  for (Index c = 0; c < count; ++c) {
    const Index a = rg[2 * c], e = rg[2 * c + 1];
    std::fill(p + at, p + std::max(at, a), T(0));  // max(): as in online_softmax_row
    std::fill(dp + at, dp + std::max(at, a), T(0));
    at = std::max(at, e);
    if (cap > T(0)) {
      score_row<T>(p + a, e - a, scale, bias != nullptr ? bias + a : nullptr, cap);
      capped_probabilities<T>(p + a, dp + a, e - a, cap, m, ll, dl);
      continue;
    }
    // p and dS in one pass over the scores. With a bias, each raw score is scored in a register by
    // score_row's own fmadd (the same rounded value, so the same t - m) instead of by a pass that
    // stores it first; scaled alone, the product is stored first (a product fused into the
    // subtraction of m would not be the rounded score m came from: see the top of this file).
    const Vec mm(m), l(ll), dd(dl), vs(scale);
    const auto pass = [&](auto score) {  // score(x, j, w): the score at j from what p holds there
      for (Index j = a; j < e; j += Vec::size()) {
        const int w = static_cast<int>(std::min<Index>(Vec::size(), e - j));
        const Vec pp = vexp<T, true, rounded>((score(Vec::loadu(p + j, w), j, w) - mm) - l);
        pp.store(p + j, w);
        (pp * (Vec::loadu(dp + j, w) - dd)).store(dp + j, w);
      }
    };
    if (bias != nullptr) {
      pass([&](Vec x, Index j, int w) { return at::vec::fmadd(x, vs, Vec::loadu(bias + j, w)); });
    } else {
      score_row<T>(p + a, e - a, scale, nullptr, cap);  // (scale 1: nothing to do)
      pass([](Vec x, Index, int) { return x; });
    }
  }
  std::fill(p + at, p + n, T(0));
  std::fill(dp + at, dp + n, T(0));
}

// x (contiguous float) times scale, rounded to nearest into a new tensor of half type `type`, in one pass.
Tensor scaled_as(const Tensor& x, float scale, at::ScalarType type) {
  Tensor out = at::empty(x.sizes(), x.options().dtype(type));
  const float* src = x.data_ptr<float>();
  AT_DISPATCH_REDUCED_FLOATING_TYPES(type, "scaled_as", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), 16384, [&](Index begin, Index end) {
      store_scaled_row<float, scalar_t>(src + begin, scale, dst + begin, end - begin);
    });
  });
  return out;
}

// delta[b, h, i] = dout[b, h, i, :] . out[b, h, i, :] (FlashAttention's D), in one pass over both
// (no [B, H, L, Ev] product in memory); rows may be strided, entries along a row contiguous. S: how dout and
// out are stored (a half type under its products, read into T as they are summed).
template <typename T, typename S = T>
void row_dots(const Tensor& x, const Tensor& y, Tensor& delta) {
  using Vec = at::vec::Vectorized<T>;
  const Index H = x.size(1), L = x.size(2), E = x.size(3);
  T* const dl = delta.data_ptr<T>();
  const RowView<const S> xs(x), ys(y);
  at::parallel_for(0, x.size(0) * H * L, 2048, [&](Index begin, Index end) {
    for (Index r = begin; r < end; ++r) {
      const Index b = r / (H * L), h = (r / L) % H, i = r % L;
      const S* a = xs(b, h, i);
      const S* c = ys(b, h, i);
      Vec acc(T(0));
      Index j = 0;
      if constexpr (std::is_same_v<S, T>) {
        for (; j + Vec::size() <= E; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(c + j), acc);
      } else {
        using VS = at::vec::Vectorized<S>;
        for (; j + VS::size() <= E; j += VS::size()) {
          auto [a0, a1] = at::vec::convert_to_float<S>(VS::loadu(a + j));
          auto [c0, c1] = at::vec::convert_to_float<S>(VS::loadu(c + j));
          acc = at::vec::fmadd(a1, c1, at::vec::fmadd(a0, c0, acc));
        }
      }
      T sum = at::vec::vec_reduce_all<T>([](Vec u, Vec w) { return u + w; }, acc);
      for (; j < E; ++j) sum += static_cast<T>(a[j]) * static_cast<T>(c[j]);
      dl[r] = sum;
    }
  });
}

// The factor of the products that sum dQ (dS k, times scale). Under half products 1: dQ is summed unscaled and
// scaled once as it is stored in q's type (scaled_as), since brgemm has no factor of its own and a product with
// one goes through a pass over its result (brgemm_into).
template <typename T, typename KV>
constexpr T dq_scale(T scale) {
  return std::is_same_v<KV, T> ? scale : T(1);
}

// The backward's share of the wide keys (wide_keys), left out of their key blocks: per batch
// element and key/value head, in groups of up to kv_rows keys (runs of consecutive wide keys as
// segments) with their keys and values gathered, over the runs of rows that see one of them, in
// chunks of q_chunk rows. dK and dV of a group are summed apart and added to its keys' rows, dQ to
// its rows (an item owns its heads' rows; deterministic, dQ comes from the pass over query blocks,
// which sees every key).
template <typename T, typename KV = T, typename S = KV>
void wide_key_pass(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& stats,
                   const Tensor& delta, Tensor& dq, Tensor& dk, Tensor& dv, const Rows& R, const Tensor& bias,
                   Tensor& dbias, T scale, T cap, Index kv_rows, Index q_chunk, bool deterministic,
                   const std::vector<std::vector<char>>& wide) {
  using Segments = std::vector<std::pair<Index, Index>>;
  const Shape d(q, k, v);
  const bool biased = bias.numel() > 0, bias_grad = biased && dbias.size(0) > 0;
  const Index G = d.groups();
  const T* m_all = stats.data_ptr<T>();
  const T* ll_all = m_all + d.B * d.H * d.L;
  const T* dl_all = delta.data_ptr<T>();
  std::vector<std::vector<Segments>> grouped(R.Bp);  // per set, groups of at most kv_rows wide keys
  for (Index p = 0; p < R.Bp; ++p) {
    Index in_group = kv_rows;
    for (Index j = 0; j < static_cast<Index>(wide[p].size()); ++j) {
      if (!wide[p][j]) continue;
      if (in_group == kv_rows) {
        grouped[p].emplace_back();
        in_group = 0;
      }
      auto& group = grouped[p].back();
      if (!group.empty() && group.back().second == j) {
        ++group.back().second;
      } else {
        group.emplace_back(j, j + 1);
      }
      ++in_group;
    }
  }
  each_item(d.B * d.Hkv, deterministic && bias_grad, [&](const auto& next) {
    constexpr bool rounds = !std::is_same_v<KV, T>;  // P and dS rounded for the products that take them
    constexpr bool widens = !std::is_same_v<KV, S>;  // q and dout read a chunk at a time into qb, dob
    Tensor kg_buf, vg_buf, dkg_buf, dvg_buf, p_buf, ds_buf, pk_buf, dsk_buf, qb_buf, dob_buf;
    KV* const qb = scratch<KV>(qb_buf, widens ? q_chunk * d.E : 1);
    KV* const dob = scratch<KV>(dob_buf, widens ? q_chunk * d.Ev : 1);
    KV* const kg = scratch<KV>(kg_buf, kv_rows * d.E);
    KV* const vg = scratch<KV>(vg_buf, kv_rows * d.Ev);
    T* const dkg = scratch<T>(dkg_buf, kv_rows * d.E);
    T* const dvg = scratch<T>(dvg_buf, kv_rows * d.Ev);
    T* const p = scratch<T>(p_buf, q_chunk * kv_rows);
    T* const ds = scratch<T>(ds_buf, q_chunk * kv_rows);
    KV* const pk = scratch<KV>(pk_buf, rounds ? q_chunk * kv_rows : 1);
    KV* const dsk = scratch<KV>(dsk_buf, rounds ? q_chunk * kv_rows : 1);
    std::vector<T> bg(kv_rows);
    std::vector<Index> rg(2 * R.K);
    Segments runs;
    for (Index it = 0; next(it);) {
      const Index hk = it % d.Hkv, b = it / d.Hkv;
      for (Index g = 0; g < G; ++g) {
        const Index h = hk * G + g, row0 = (b * d.H + h) * d.L, set = R.set(b, h);
        for (const Segments& group : grouped[set]) {
          const auto* segs = group.data();
          const Index n_segs = static_cast<Index>(group.size());
          Index cols = 0;
          for (const auto& seg : group) cols += seg.second - seg.first;
          gather_keys<KV, S>(k, b, hk, segs, n_segs, kg);
          gather_keys<KV, S>(v, b, hk, segs, n_segs, vg);
          std::fill(dkg, dkg + cols * d.E, T(0));
          std::fill(dvg, dvg + cols * d.Ev, T(0));
          runs.clear();
          for (Index i = 0; i < d.L; ++i) {
            if (R.ranges_in(set, i, segs, n_segs, rg) == 0) continue;
            if (!runs.empty() && runs.back().second == i) {
              runs.back().second = i + 1;
            } else {
              runs.emplace_back(i, i + 1);
            }
          }
          for (const auto& run : runs) {
            for (Index i0 = run.first; i0 < run.second; i0 += q_chunk) {
              const Index n = std::min(q_chunk, run.second - i0);
              Index ldq = 0, ldo = 0;
              const KV* qp = rows_as<KV, S>(q, b, h, i0, n, qb, ldq);
              const KV* dop = rows_as<KV, S>(dout, b, h, i0, n, dob, ldo);
              product<T, KV>(false, true, n, cols, d.E, T(1), qp, ldq, kg, d.E, T(0), p, cols);
              product<T, KV>(false, true, n, cols, d.Ev, T(1), dop, ldo, vg, d.Ev, T(0), ds, cols);
              for (Index r = 0; r < n; ++r) {
                const Index i = i0 + r, count = R.ranges_in(set, i, segs, n_segs, rg);
                const T* br = biased ? gathered_bias<T>(bias, h, i, d.L, segs, n_segs, bg.data()) : nullptr;
                probabilities<T, rounds>(p + r * cols, ds + r * cols, cols, rg.data(), count, scale, br, cap,
                                         m_all[row0 + i], ll_all[row0 + i], dl_all[row0 + i]);
                if (bias_grad && count > 0) {  // each gathered key's diagonal
                  T* gbias = bias_grad_row<T>(dbias, bias, h, d.L - 1 - i);
                  const T* dsr = ds + r * cols;
                  for (const auto& seg : group) {
                    for (Index j = seg.first; j < seg.second; ++j) gbias[j] += *dsr++;  // (0 where not seen)
                  }
                }
              }
              const KV* ds_op = operand<T, KV>(ds, n * cols, dsk);
              product<T, KV>(true, false, cols, d.Ev, n, T(1), operand<T, KV>(p, n * cols, pk), cols, dop, ldo, T(1),
                             dvg, d.Ev);
              product<T, KV>(true, false, cols, d.E, n, scale, ds_op, cols, qp, ldq, T(1), dkg, d.E);
              if (!deterministic) {  // (this item alone writes these heads' rows now: no lock)
                product<T, KV>(false, false, n, d.E, cols, dq_scale<T, KV>(scale), ds_op, cols, kg, d.E, T(1),
                               dq.data_ptr<T>() + (row0 + i0) * d.E, d.E);
              }
            }
          }
          const T* dkr = dkg;
          const T* dvr = dvg;
          for (const auto& seg : group) {
            for (Index j = seg.first; j < seg.second; ++j, dkr += d.E, dvr += d.Ev) {
              T* dkj = dk.data_ptr<T>() + ((b * d.Hkv + hk) * d.S + j) * d.E;
              T* dvj = dv.data_ptr<T>() + ((b * d.Hkv + hk) * d.S + j) * d.Ev;
              for (Index x = 0; x < d.E; ++x) dkj[x] += dkr[x];
              for (Index x = 0; x < d.Ev; ++x) dvj[x] += dvr[x];
            }
          }
        }
      }
    }
  });
}

// Half products (KV = c10::BFloat16 or c10::Half, T = float), as in the forward: q, k, v and dout are read as
// they are stored, and each of the five products of a tile (S = q k^T, dP = dout v^T, dV += P^T dout,
// dK += dS^T q, and dQ += dS k) takes half operands into float32 sums; P and dS are rounded to the half type
// for the products that take them (as FlashAttention does on a GPU), while the probabilities, dS itself and
// the sums of dQ, dK, dV and the bias gradient stay float32.
// S: how q, k, v and dout are stored: KV, or a half type without its products (KV = T = float), read a
// tile at a time and widened (rows_as, gather_keys): each key block once, each chunk of query rows once per
// key block that sees it (a row of E values against the block's E x kv_rows products).
template <typename T, typename KV = T, typename S = KV>
void backward_impl(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& stats,
                   const Tensor& delta, Tensor& dq, Tensor& dk, Tensor& dv, const Rows& R, const Tensor& bias,
                   Tensor& dbias, T scale, T cap, Index kv_rows, Index q_chunk, bool deterministic) {
  using Vec = at::vec::Vectorized<T>;
  constexpr bool rounds = !std::is_same_v<KV, T>;  // P and dS rounded for the products that take them
  const Shape d(q, k, v);
  const bool biased = bias.numel() > 0, bias_grad = biased && dbias.size(0) > 0;
  const Index blocks = (d.S + kv_rows - 1) / kv_rows, G = d.groups(), groups = (d.L + LOCK_ROWS - 1) / LOCK_ROWS;
  const T* m_all = stats.data_ptr<T>();
  const T* ll_all = m_all + d.B * d.H * d.L;
  const T* dl_all = delta.data_ptr<T>();
  bool any_wide = false;
  const auto wide = wide_keys(R, d.S, kv_rows, any_wide);
  const auto seen_by = key_block_rows(R, d.S, kv_rows, wide);
  std::vector<std::mutex> locks(deterministic ? 0 : d.B * d.H * groups);
  constexpr bool widens = !std::is_same_v<KV, S>;
  const RowView<const S> q_rows_of(q), dout_rows(dout);
  // bfloat16 products through brgemm: a key block's dV and dK are summed transposed, dV^T += dout^T P and
  // dK^T += q^T dS, into the thread's sums (added to dV and dK once the block's rows are done). Their right
  // operands are then P and dS with pairs of rows interleaved as they are rounded (pack_row_pairs), where
  // P^T and dS^T would be transposed for every chunk; their left ones, dout^T and q^T, are made once per call.
  Tensor q_t, do_t;
  Index t_ld = 0;
  if constexpr (std::is_same_v<KV, c10::BFloat16> && !widens) {
    if (brgemm_bf16() && q_chunk >= BRGEMM_ROWS) {
      q_t = transposed_rows(q, t_ld);
      do_t = transposed_rows(dout, t_ld);
    }
  }
  // rows i0 .. i0 + n of (b, h) as columns of q^T (or dout^T), where the transposed sums take them (else nullptr)
  const auto transposed_at = [&](const Tensor& t, Index b, Index h, Index i0, Index n) -> const KV* {
    if (!t.defined() || i0 < 0 || i0 % 2 != 0 || n % BRGEMM_Q != 0) return nullptr;
    return static_cast<const KV*>(t.data_ptr()) + (b * d.H + h) * t.size(2) + i0;  // (t: [B, H, Ep * t_ld])
  };
  each_item(d.B * d.Hkv * blocks, deterministic && bias_grad, [&](const auto& next) {
    Tensor p_buf, ds_buf, qg_buf, dog_buf, dqg_buf, pk_buf, dsk_buf, kb_buf, vb_buf;
    KV* const kb = scratch<KV>(kb_buf, widens ? kv_rows * d.E : 1);  // a key block widened (widens only)
    KV* const vb = scratch<KV>(vb_buf, widens ? kv_rows * d.Ev : 1);
    T* const p = scratch<T>(p_buf, kv_rows * q_chunk);
    T* const ds = scratch<T>(ds_buf, kv_rows * q_chunk);
    KV* const pk = scratch<KV>(pk_buf, rounds ? kv_rows * q_chunk : 1);
    KV* const dsk = scratch<KV>(dsk_buf, rounds ? kv_rows * q_chunk : 1);
    KV* const qg = scratch<KV>(qg_buf, q_chunk * d.E);
    KV* const dog = scratch<KV>(dog_buf, q_chunk * d.Ev);
    T* const dqg = scratch<T>(dqg_buf, q_chunk * d.E);
    std::vector<Index> rg(2 * R.K), wide_cols, lone;
    // the transposed sums of a key block (dK^T and dV^T, [E x cp] and [Ev x cp]) and a chunk's P or dS packed
    const Index cp_max = (kv_rows + 15) / 16 * 16;
    std::vector<float> dk_t(q_t.defined() ? d.E * cp_max : 0), dv_t(q_t.defined() ? d.Ev * cp_max : 0);
    std::vector<KV> pairs(q_t.defined() ? (q_chunk + 1) / 2 * 2 * cp_max : 0);
    for (Index it = 0; next(it);) {
      const Index blk = interleaved(it % blocks, blocks), hk = (it / blocks) % d.Hkv, b = it / (blocks * d.Hkv);
      const Index j0 = blk * kv_rows, cols = std::min(kv_rows, d.S - j0), cp = (cols + 15) / 16 * 16;
      Index ldk = 0, ldv = 0;
      const KV* kp = rows_as<KV, S>(k, b, hk, j0, cols, kb, ldk);
      const KV* vp = rows_as<KV, S>(v, b, hk, j0, cols, vb, ldv);
      T* dkp = dk.data_ptr<T>() + ((b * d.Hkv + hk) * d.S + j0) * d.E;
      T* dvp = dv.data_ptr<T>() + ((b * d.Hkv + hk) * d.S + j0) * d.Ev;
      bool summed_t = false;  // the transposed sums hold this block's share
      for (Index g = 0; g < G; ++g) {
        const Index h = hk * G + g, row0 = (b * d.H + h) * d.L;
        const Index set = R.set(b, h);
        wide_cols.clear();  // this block's wide keys: zero here, computed apart below
        for (Index c = 0; !wide[set].empty() && c < cols; ++c) {
          if (wide[set][j0 + c]) wide_cols.push_back(c);
        }
        // n rows row(0..n-1), their queries and output gradients at qp and dop (rows ldq, ldo apart),
        // against the block's keys: scores and dP, probabilities and dS, dV and dK of the block, and
        // the rows' dQ shares through add_dq(n, dS as the product's operand).
        // i0: the first of n consecutive rows (their packed operands may be read), or -1 (rows gathered).
        const auto rows_chunk = [&](Index n, Index i0, const KV* qp, Index ldq, const KV* dop, Index ldo,
                                    const auto& row, const auto& add_dq) {
          product<T, KV>(false, true, n, cols, d.E, T(1), qp, ldq, kp, ldk, T(0), p, cols);
          product<T, KV>(false, true, n, cols, d.Ev, T(1), dop, ldo, vp, ldv, T(0), ds, cols);
          for (Index r = 0; r < n; ++r) {
            const Index i = row(r);
            const Index count = R.ranges(set, i, j0, cols, rg);
            const T* br = biased ? diagonal_row<T>(bias, h, j0 - i + d.L - 1) : nullptr;
            probabilities<T, rounds>(p + r * cols, ds + r * cols, cols, rg.data(), count, scale, br, cap,
                                     m_all[row0 + i], ll_all[row0 + i], dl_all[row0 + i]);
            for (const Index c : wide_cols) p[r * cols + c] = ds[r * cols + c] = T(0);
            if (bias_grad && count > 0) {  // dBias of a diagonal: the sum of dS along it (this thread's share)
              T* gb = bias_grad_row<T>(dbias, bias, h, j0 - i + d.L - 1);
              for (Index c = 0; c < count; ++c) {
                const Index a = rg[2 * c], e = rg[2 * c + 1];
                at::vec::map2([](Vec x, Vec y) { return x + y; }, gb + a, gb + a, ds + r * cols + a, e - a);
              }
            }
          }
          bool done = false;
          if constexpr (std::is_same_v<KV, c10::BFloat16> && !widens) {
            const KV* dot = transposed_at(do_t, b, h, i0, n);
            const KV* qt = transposed_at(q_t, b, h, i0, n);
            if (dot != nullptr && qt != nullptr) {
              if (!summed_t) {
                std::fill(dk_t.begin(), dk_t.begin() + d.E * cp, 0.f);
                std::fill(dv_t.begin(), dv_t.begin() + d.Ev * cp, 0.f);
                summed_t = true;
              }
              pack_row_pairs(p, cols, n, cols, cp, pairs.data());
              brgemm_into(d.Ev, cp, n, dot, t_ld, pairs.data(), cp, 1.f, 1.f, dv_t.data(), cp);
              pack_row_pairs(ds, cols, n, cols, cp, pairs.data());
              brgemm_into(d.E, cp, n, qt, t_ld, pairs.data(), cp, 1.f, 1.f, dk_t.data(), cp);
              done = true;
            }
          }
          // dS as a row-major operand: for dK where not summed transposed, and for dQ (deterministic: dQ comes
          // from the row-owned pass below)
          const KV* ds_op = !done || !deterministic ? operand<T, KV>(ds, n * cols, dsk) : nullptr;
          if (!done) {
            const KV* p_op = operand<T, KV>(p, n * cols, pk);
            product<T, KV>(true, false, cols, d.Ev, n, T(1), p_op, cols, dop, ldo, T(1), dvp, d.Ev);
            product<T, KV>(true, false, cols, d.E, n, scale, ds_op, cols, qp, ldq, T(1), dkp, d.E);
          }
          if (!deterministic) add_dq(n, ds_op);
        };
        lone.clear();  // rows of runs shorter than LONE (a global token's row): gathered below
        for (const auto& run : seen_by[set][blk]) {
          if (run.second - run.first < LONE) {
            for (Index i = run.first; i < run.second; ++i) lone.push_back(i);
            continue;
          }
          for (Index i0 = run.first; i0 < run.second; i0 += q_chunk) {
            const Index n0 = std::min(q_chunk, run.second - i0);
            Index ldq = 0, ldo = 0;
            const KV* qp = rows_as<KV, S>(q, b, h, i0, n0, qg, ldq);
            const KV* dop = rows_as<KV, S>(dout, b, h, i0, n0, dog, ldo);
            rows_chunk(n0, i0, qp, ldq, dop, ldo, [i0](Index r) { return i0 + r; },
                       [&](Index n, const KV* ds_op) {
                         const Index base = (b * d.H + h) * groups, ga = i0 / LOCK_ROWS, ge = (i0 + n - 1) / LOCK_ROWS;
                         for (Index x = ga; x <= ge; ++x) locks[base + x].lock();  // ascending: no deadlock
                         product<T, KV>(false, false, n, d.E, cols, dq_scale<T, KV>(scale), ds_op, cols, kp, ldk,
                                        T(1), dq.data_ptr<T>() + (row0 + i0) * d.E, d.E);
                         for (Index x = ga; x <= ge; ++x) locks[base + x].unlock();
                       });
          }
        }
        for (std::size_t x0 = 0; x0 < lone.size(); x0 += q_chunk) {
          const Index n = std::min<Index>(q_chunk, static_cast<Index>(lone.size() - x0));
          const Index* rows = lone.data() + x0;
          for (Index r = 0; r < n; ++r) {
            load_row<KV, S>(q_rows_of(b, h, rows[r]), qg + r * d.E, d.E);
            load_row<KV, S>(dout_rows(b, h, rows[r]), dog + r * d.Ev, d.Ev);
          }
          rows_chunk(n, -1, qg, d.E, dog, d.Ev, [rows](Index r) { return rows[r]; }, [&](Index n, const KV* ds_op) {
            product<T, KV>(false, false, n, d.E, cols, dq_scale<T, KV>(scale), ds_op, cols, kp, ldk, T(0), dqg, d.E);
            for (Index r = 0; r < n; ++r) {
              auto& lock = locks[(b * d.H + h) * groups + rows[r] / LOCK_ROWS];
              T* dqr = dq.data_ptr<T>() + (row0 + rows[r]) * d.E;
              lock.lock();
              for (Index j = 0; j < d.E; ++j) dqr[j] += dqg[r * d.E + j];
              lock.unlock();
            }
          });
        }
      }
      if (summed_t) {  // the block's transposed sums into its rows of dK (scaled once) and dV
        for (Index c = 0; c < cols; ++c) {
          for (Index e = 0; e < d.E; ++e) dkp[c * d.E + e] += scale * dk_t[e * cp + c];
          for (Index e = 0; e < d.Ev; ++e) dvp[c * d.Ev + e] += dv_t[e * cp + c];
        }
      }
    }
  });
  if (any_wide) wide_key_pass<T, KV, S>(dout, q, k, v, stats, delta, dq, dk, dv, R, bias, dbias, scale, cap, kv_rows, q_chunk,
                                 deterministic, wide);
  if (!deterministic) return;
  // dQ by query blocks, as the forward walks them (key_chunks; the wide rows apart, in gathered
  // groups): each block sums its keys' shares in one fixed order.
  struct Scratch {  // a thread's buffers
    Tensor p_buf, ds_buf, dsk_buf, q_buf, do_buf, dq_buf;
    T *p, *ds;
    KV *dsk, *qg, *dog;
    T* dqg;
    std::vector<Index> rg;
    KeyScratch<T, KV> keys;
    Scratch(Index rows, Index chunk, const Shape& d, Index K)
        : p(scratch<T>(p_buf, rows * chunk)), ds(scratch<T>(ds_buf, rows * chunk)),
          dsk(scratch<KV>(dsk_buf, rounds ? rows * chunk : 1)), qg(scratch<KV>(q_buf, rows * d.E)),
          dog(scratch<KV>(do_buf, rows * d.Ev)), dqg(scratch<T>(dq_buf, rows * d.E)), rg(2 * K),
          keys(chunk, d.E, d.Ev) {}
  };
  // dQ of rows row(0..g-1) of (b, h) (a row(r) < 0 is left out), their queries and output gradients
  // at qp and dop (rows ldq, ldo apart), added to dqp (rows E apart).
  const auto dq_rows = [&](Index b, Index h, const KV* qp, Index ldq, const KV* dop, Index ldo, Index g,
                           const auto& row, T* dqp, Scratch& w) {
    const Index base = (b * d.H + h) * d.L;
    key_chunks<T, KV, S>(R, R.set(b, h), g, row, kv_rows, q_chunk, k, v, bias, b, h, h / G, w.keys,
                  [&](const KV* kp, Index ldk, const KV* vp, Index ldv, Index kc, const auto& visible,
                      const auto& bias_of, Index /*c0*/) {
      product<T, KV>(false, true, g, kc, d.E, T(1), qp, ldq, kp, ldk, T(0), w.p, kc);
      product<T, KV>(false, true, g, kc, d.Ev, T(1), dop, ldo, vp, ldv, T(0), w.ds, kc);
      for (Index r = 0; r < g; ++r) {
        const Index i = row(r);
        const Index count = i < 0 ? 0 : visible(i, w.rg);  // (none: zeros, and the statistics are not read)
        const T* br = biased && i >= 0 ? bias_of(i) : nullptr;
        const Index at = base + std::max<Index>(i, 0);
        probabilities<T, rounds>(w.p + r * kc, w.ds + r * kc, kc, w.rg.data(), count, scale, br, cap, m_all[at],
                                 ll_all[at], dl_all[at]);
      }
      product<T, KV>(false, false, g, d.E, kc, dq_scale<T, KV>(scale), operand<T, KV>(w.ds, g * kc, w.dsk), kc, kp, ldk,
                     T(1), dqp, d.E);
    });
  };
  const Index q_blocks = (d.L + kv_rows - 1) / kv_rows;
  bool any_wide_rows = false;
  const auto wide_r = wide_rows(R, kv_rows, any_wide_rows);
  each_item(d.B * d.H * q_blocks, false, [&](const auto& next) {
    Scratch w(kv_rows, q_chunk, d, R.K);
    for (Index it = 0; next(it);) {
      const Index blk = interleaved(it % q_blocks, q_blocks), h = (it / q_blocks) % d.H, b = it / (q_blocks * d.H);
      const Index i0 = blk * kv_rows, rows = std::min(kv_rows, d.L - i0);
      const auto& wide_set = wide_r[R.set(b, h)];
      const char* skip = wide_set.empty() ? nullptr : wide_set.data() + i0;
      Index ldq = 0, ldo = 0;
      const KV* qp = rows_as<KV, S>(q, b, h, i0, rows, w.qg, ldq);
      const KV* dop = rows_as<KV, S>(dout, b, h, i0, rows, w.dog, ldo);
      dq_rows(b, h, qp, ldq, dop, ldo, rows,
              [=](Index r) { return skip != nullptr && skip[r] ? Index(-1) : i0 + r; },
              dq.data_ptr<T>() + ((b * d.H + h) * d.L + i0) * d.E, w);
    }
  });
  if (!any_wide_rows) return;
  std::vector<std::vector<Index>> listed;
  const auto row_groups = wide_row_groups(R, d.B, d.H, wide_r, kv_rows, listed);
  each_item(static_cast<Index>(row_groups.size()), false, [&](const auto& next) {
    Scratch w(kv_rows, q_chunk, d, R.K);
    for (Index it = 0; next(it);) {
      const Index b = row_groups[it][0] / d.H, h = row_groups[it][0] % d.H, g = row_groups[it][2];
      const Index* rows = listed[R.set(b, h)].data() + row_groups[it][1];
      for (Index r = 0; r < g; ++r) {
        load_row<KV, S>(q_rows_of(b, h, rows[r]), w.qg + r * d.E, d.E);
        load_row<KV, S>(dout_rows(b, h, rows[r]), w.dog + r * d.Ev, d.Ev);
      }
      std::fill(w.dqg, w.dqg + g * d.E, T(0));
      dq_rows(b, h, w.qg, d.E, w.dog, d.Ev, g, [=](Index r) { return rows[r]; }, w.dqg, w);
      for (Index r = 0; r < g; ++r) {  // (these rows' blocks added zeros to them above: nothing lost)
        T* dqr = dq.data_ptr<T>() + ((b * d.H + h) * d.L + rows[r]) * d.E;
        for (Index j = 0; j < d.E; ++j) dqr[j] += w.dqg[r * d.E + j];
      }
    }
  });
}

bool has_blas() { return sgemm_ != nullptr && dgemm_ != nullptr; }

// What the entry points check: every argument, before any memory is read or written, as PyTorch's
// own operators do. A failed check is a RuntimeError naming the argument, what came and what was
// expected. Each check is O(1) (sizes, strides, dtypes, devices) except the intervals' bounds, one
// pass over starts and ends; q, k, v are never read for it.

// Block and chunk sizes: at least 1 (work is divided by them), at most this (a thread's scratch is
// rows x chunk, and a vector per block is sized by them).
constexpr Index MAX_BLOCK = Index(1) << 20;
// The BLAS takes sizes and row strides as int.
constexpr Index MAX_INT = std::numeric_limits<int>::max();

std::string dtype_name(at::ScalarType t) {
  return t == at::kFloat      ? "float32"
         : t == at::kDouble   ? "float64"
         : t == at::kLong     ? "int64"
         : t == at::kBFloat16 ? "bfloat16"
         : t == at::kHalf     ? "float16"
                              : c10::toString(t);
}

std::string described(const Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  return c10::str(dtype_name(t.scalar_type()), " ", t.sizes(), t.layout() == at::kStrided ? "" : " (not strided)",
                  " on ", t.device());
}

// `name` is a dense CPU tensor of `dtype` with `dims` dimensions (`shape` names them).
void check_tensor(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dims, const char* shape) {
  TORCH_CHECK(t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && t.scalar_type() == dtype &&
                  t.dim() == dims,
              "band kernel: ", name, " must be a dense ", dtype_name(dtype), " CPU tensor ", shape, ", got ",
              described(t));
}

// `name` ([..., rows, width]) has rows the BLAS reads in place: entries contiguous, rows at least a
// row apart (its leading dimension), that distance an int.
void check_blas_rows(const Tensor& t, const char* name) {
  TORCH_CHECK(t.stride(-1) == 1 && t.stride(-2) >= t.size(-1) && t.stride(-2) <= MAX_INT, "band kernel: ", name,
              " must have unit stride along its last dim and rows at least a row apart (as .contiguous() makes "
              "it), got strides ",
              t.strides(), " for sizes ", t.sizes());
}

bool is_half(const Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

// The type the kernel computes in for q's dtype: float32 for the half types.
at::ScalarType compute_type(const Tensor& q) { return is_half(q) ? at::kFloat : q.scalar_type(); }

// q [B, H, Lq, E], k [B, Hkv, Lk, E], v [B, Hkv, Lk, Ev]: float32 or float64 (half: also bfloat16 or float16,
// for the forward, which reads them as they are), one dtype, H a multiple of Hkv.
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, bool half = false) {
  TORCH_CHECK(q.defined() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble || (half && is_half(q))),
              "band kernel: q must be float32 or float64", half ? " (or bfloat16, float16)" : "", ", got ",
              described(q));
  const auto dtype = q.scalar_type();
  check_tensor(q, "q", dtype, 4, "[B, H, Lq, E]");
  check_tensor(k, "k", dtype, 4, "[B, Hkv, Lk, E] in q's dtype");
  check_tensor(v, "v", dtype, 4, "[B, Hkv, Lk, Ev] in q's dtype");
  const Index B = q.size(0), H = q.size(1), E = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == E, "band kernel: k must be [B, Hkv, Lk, E] with q's B = ", B,
              " and E = ", E, ", got ", k.sizes());
  TORCH_CHECK(Hkv > 0 ? H % Hkv == 0 : H == 0, "band kernel: q's heads (H = ", H,
              ") must be a multiple of k's heads (Hkv = ", Hkv, ")");
  TORCH_CHECK(v.size(0) == B && v.size(1) == Hkv && v.size(2) == S,
              "band kernel: v must be [B, Hkv, Lk, Ev] with q's B = ", B, " and k's Hkv = ", Hkv, " and Lk = ", S,
              ", got ", v.sizes());
  TORCH_CHECK(q.size(2) <= MAX_INT && S <= MAX_INT && E <= MAX_INT && v.size(3) <= MAX_INT,
              "band kernel: lengths and head sizes must be below 2^31 (the BLAS's int), got q ", q.sizes(), ", v ",
              v.sizes());
}

// starts, ends: contiguous int64 [P, Lq, K >= 1], P 1, B or B*H, each 0 <= start <= end <= Lk (their
// order within a row is the caller's: intervals out of order give wrong sums, never out-of-bounds reads).
void check_intervals(const Tensor& q, const Tensor& k, const Tensor& starts, const Tensor& ends) {
  const Index B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&starts, "starts"}, {&ends, "ends"}}) {
    check_tensor(*t, name, at::kLong, 3, "[P, L, K]");
    const Index P = t->size(0);
    TORCH_CHECK(t->is_contiguous() && (P == 1 || P == B || P == B * H) && t->size(1) == L && t->size(2) >= 1,
                "band kernel: ", name, " must be a contiguous [P, L, K], P 1, B or B*H (1, ", B, " or ", B * H,
                "), L q's length ", L, " and K >= 1, got ", t->sizes(), t->is_contiguous() ? "" : " (not contiguous)");
  }
  TORCH_CHECK(starts.sizes() == ends.sizes(), "band kernel: starts and ends must have one shape, got ",
              starts.sizes(), " and ", ends.sizes());
  const int64_t* s = starts.data_ptr<int64_t>();
  const int64_t* e = ends.data_ptr<int64_t>();
  const Index n = starts.numel(), K = starts.size(2);
  for (Index x = 0; x < n; ++x) {
    TORCH_CHECK(0 <= s[x] && s[x] <= e[x] && e[x] <= S, "band kernel: intervals must satisfy 0 <= start <= end <= S",
                " (k's length ", S, "), got (", s[x], ", ", e[x], ") at starts/ends[", x / (L * K), ", ", x / K % L,
                ", ", x % K, "]");
  }
}

// bias: [0, 0] for none, else contiguous [1 or H, Lq + Lk - 1], in q's dtype.
void check_bias(const Tensor& q, const Tensor& k, const Tensor& bias) {
  check_tensor(bias, "bias", compute_type(q), 2,
               "[1 or H, Lq + Lk - 1] in q's dtype, float32 for half types ([0, 0] for none)");
  const Index H = q.size(1), D = q.size(2) + k.size(2) - 1;
  const bool none = bias.size(0) == 0 && bias.size(1) == 0;
  TORCH_CHECK(none || ((bias.size(0) == 1 || bias.size(0) == H) && bias.size(1) == D && bias.is_contiguous()),
              "band kernel: bias must be contiguous [1 or H = ", H, ", Lq + Lk - 1 = ", D, "] ([0, 0] for none), got ",
              bias.sizes(), bias.is_contiguous() ? "" : " (not contiguous)");
}

// scale finite and softcap finite and >= 0 (0: off), both in q's dtype; block sizes in [1, MAX_BLOCK].
void check_numbers(const Tensor& q, double scale, double softcap, Index rows, const char* rows_name, Index chunk,
                   const char* chunk_name) {
  const auto finite = [&](double x) {
    return std::isfinite(x) && (compute_type(q) != at::kFloat || std::abs(x) <= std::numeric_limits<float>::max());
  };
  TORCH_CHECK(finite(scale), "band kernel: scale must be finite in q's dtype, got ", scale);
  TORCH_CHECK(finite(softcap) && softcap >= 0, "band kernel: softcap must be a finite float >= 0 (0: off), got ",
              softcap);
  for (const auto& [x, name] : {std::pair<Index, const char*>{rows, rows_name}, {chunk, chunk_name}}) {
    TORCH_CHECK(x >= 1 && x <= MAX_BLOCK, "band kernel: ", name, " must be between 1 and ", MAX_BLOCK, ", got ", x);
  }
}

void check_blas() {
  TORCH_CHECK(has_blas(), "band kernel: this torch does not export the BLAS functions (sgemm_/dgemm_) it calls");
}

// Whether a half forward without its products reads its keys and values a chunk at a time, widening each as
// it is read, rather than widening them once (to_float) first: where each key is read at most twice (a query
// head per key head, at most two blocks of query rows: a decode step, a short chunk of prefill), or where the
// keys a block of rows sees are few beside all of them, so that widening them for every query head and block
// (reads x (span + q_rows) keys, span the widest any row sees) costs less than widening every key once (a
// decode step of a grouped-query model with a window over a long cache). There the copy, a fresh tensor of
// every key and value, costs more than the attention; where blocks of rows read each key again and again, a
// float copy is the faster read (see load_row).
bool few_reads(const Tensor& q, const Tensor& k, Index q_rows, const Rows& R) {
  const Index reads = (q.size(1) / std::max<Index>(k.size(1), 1)) * ((q.size(2) + q_rows - 1) / q_rows);
  if (reads <= 2) return true;
  const Index most = k.size(2) / reads - q_rows;  // the widest span that still reads fewer keys than a copy
  if (most < 0) return false;
  for (Index p = 0; p < R.Bp; ++p) {
    for (Index i = 0; i < R.L; ++i) {
      const Index o = R.at(p, i);
      Index last = 0;  // the row's last interval that is not empty (they are sorted, empty ones last)
      while (last + 1 < R.K && R.s[o + last + 1] < R.e[o + last + 1]) ++last;
      if (R.s[o] < R.e[o] && R.e[o + last] - R.s[o] > most) return false;
    }
  }
  return true;
}

// The kernel's product of a half type on its own, for tests of the packing (transposes, odd sizes, alpha, beta).
Tensor half_product(const Tensor& a, const Tensor& b, const Tensor& c, bool ta, bool tb, double alpha, double beta) {
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}, std::pair{&c, "c"}}) {
    TORCH_CHECK(t->dim() == 2 && t->device().is_cpu() && t->layout() == at::kStrided, "half_product: ", name,
                " must be a 2-D dense CPU tensor, got ", described(*t));
    TORCH_CHECK(t->size(1) <= 1 || t->stride(1) == 1, "half_product: ", name, " must have unit stride along its rows");
    TORCH_CHECK(t->stride(0) >= std::max<Index>(t->size(1), 1), "half_product: ", name, "'s rows must not overlap");
  }
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && is_half(a), "half_product: a and b must both be bfloat16 or "
              "float16, got ", dtype_name(a.scalar_type()), " and ", dtype_name(b.scalar_type()));
  TORCH_CHECK(with_half_products(a), "half_product: ", dtype_name(a.scalar_type()), " products are off");
  const Index m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1), n = tb ? b.size(0) : b.size(1);
  TORCH_CHECK((tb ? b.size(1) : b.size(0)) == k, "half_product: op(a) is [", m, ", ", k, "] but op(b) is [",
              tb ? b.size(1) : b.size(0), ", ", n, "]");
  TORCH_CHECK(c.scalar_type() == at::kFloat && c.size(0) == m && c.size(1) == n, "half_product: c must be float32 [",
              m, ", ", n, "], got ", described(c));
  Tensor out = c.contiguous().clone();
  if (m == 0 || n == 0) return out;
  if (k == 0) return beta == 0.0 ? out.zero_() : out.mul_(beta);  // an empty sum; beta 0: C is not read
  const auto ld = [](const Tensor& t) { return std::max<Index>(t.stride(0), 1); };
  if (a.scalar_type() == at::kBFloat16) {
    gemm_half<c10::BFloat16>(ta, tb, m, n, k, float(alpha), a.data_ptr<c10::BFloat16>(), ld(a),
                             b.data_ptr<c10::BFloat16>(), ld(b), float(beta), out.data_ptr<float>(), n);
  } else {
    gemm_half<c10::Half>(ta, tb, m, n, k, float(alpha), a.data_ptr<c10::Half>(), ld(a), b.data_ptr<c10::Half>(),
                         ld(b), float(beta), out.data_ptr<float>(), n);
  }
  release_products();
  return out;
}

std::vector<Tensor> band_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& starts,
                                 const Tensor& ends, const Tensor& bias, double scale, double softcap, Index q_rows,
                                 Index kv_chunk) {
  check_qkv(q, k, v, true);
  check_intervals(q, k, starts, ends);
  check_bias(q, k, bias);
  check_numbers(q, scale, softcap, q_rows, "q_rows", kv_chunk, "kv_chunk");
  // [B, H, L, Ev] laid out as [B, L, H, Ev], as PyTorch's CPU flash kernel does: merging the heads
  // after attention (what every model does next) is then a view, not a copy
  Tensor out = at::empty({q.size(0), q.size(2), q.size(1), v.size(3)}, q.options()).transpose(1, 2);
  // row maximum, log of row sum, in the compute type
  Tensor stats = at::empty({2, q.size(0), q.size(1), q.size(2)}, q.options().dtype(compute_type(q)));
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) {  // nothing to compute; empty views may have any strides
    return {out.zero_(), stats.fill_(-std::numeric_limits<double>::infinity())};
  }
  check_blas_rows(q, "q");
  check_blas_rows(k, "k");
  check_blas_rows(v, "v");
  check_blas();
  const Rows R(starts, ends, q.size(0), q.size(1));
  if (is_half(q)) {  // keys and values in float once or a chunk at a time (few_reads); queries and outputs a row at a time
    // Fewer query rows than brgemm takes (a decode step) would send every bfloat16 tile to MKL's product, which
    // ran slower than widening to float32 on a CPU where brgemm runs: such a call takes float32 products.
    const bool products = with_half_products(q) && !(q.scalar_type() == at::kBFloat16 && q.size(2) < BRGEMM_ROWS &&
                                                     brgemm_bf16());
    const bool few = !products && few_reads(q, k, q_rows, R);  // once: it may look at every row's intervals
    if (products && q.scalar_type() == at::kBFloat16) {
      forward_impl<float, c10::BFloat16, c10::BFloat16>(q, k, v, out, stats, R, bias, static_cast<float>(scale),
                                                        static_cast<float>(softcap), q_rows, kv_chunk);
    } else if (products) {
      forward_impl<float, c10::Half, c10::Half>(q, k, v, out, stats, R, bias, static_cast<float>(scale),
                                                static_cast<float>(softcap), q_rows, kv_chunk);
    } else if (few && q.scalar_type() == at::kBFloat16) {
      forward_impl<float, c10::BFloat16, float, c10::BFloat16>(q, k, v, out, stats, R, bias, static_cast<float>(scale),
                                                               static_cast<float>(softcap), q_rows, kv_chunk);
    } else if (few) {
      forward_impl<float, c10::Half, float, c10::Half>(q, k, v, out, stats, R, bias, static_cast<float>(scale),
                                                       static_cast<float>(softcap), q_rows, kv_chunk);
    } else if (q.scalar_type() == at::kBFloat16) {
      forward_impl<float, c10::BFloat16>(q, to_float<c10::BFloat16>(k), to_float<c10::BFloat16>(v), out, stats, R,
                                         bias, static_cast<float>(scale), static_cast<float>(softcap), q_rows,
                                         kv_chunk);
    } else {
      forward_impl<float, c10::Half>(q, to_float<c10::Half>(k), to_float<c10::Half>(v), out, stats, R, bias,
                                     static_cast<float>(scale), static_cast<float>(softcap), q_rows, kv_chunk);
    }
  } else {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "band_forward", [&] {
      forward_impl<scalar_t>(q, k, v, out, stats, R, bias, static_cast<scalar_t>(scale),
                             static_cast<scalar_t>(softcap), q_rows, kv_chunk);
    });
  }
  return {out, stats};
}

std::vector<Tensor> band_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& stats, const Tensor& starts, const Tensor& ends,
                                  const Tensor& bias, double scale, double softcap, Index kv_rows, Index q_chunk,
                                  bool deterministic, bool bias_grad) {
  // a half type through its products, or widened here (see below)
  const bool halves = with_half_products(q);
  check_qkv(q, k, v, true);
  const Index B = q.size(0), H = q.size(1), L = q.size(2);
  // dout and out [B, H, Lq, Ev] in q's dtype, stats the forward's [2, B, H, Lq] in the compute type
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&dout, "dout"}, {&out, "out"}}) {
    check_tensor(*t, name, q.scalar_type(), 4, "[B, H, Lq, Ev] in q's dtype");
    TORCH_CHECK(t->sizes() == at::IntArrayRef({B, H, L, v.size(3)}), "band kernel: ", name,
                " must be [B, H, Lq, Ev] = ", at::IntArrayRef({B, H, L, v.size(3)}), " (q's B, H, Lq and v's Ev), got ",
                t->sizes());
  }
  check_tensor(stats, "stats", compute_type(q), 4, "[2, B, H, Lq] in q's dtype (float32 for the half types)");
  TORCH_CHECK(stats.sizes() == at::IntArrayRef({2, B, H, L}) && stats.is_contiguous(),
              "band kernel: stats must be the forward's contiguous [2, B, H, Lq] = ", at::IntArrayRef({2, B, H, L}),
              ", got ", stats.sizes(), stats.is_contiguous() ? "" : " (not contiguous)");
  check_intervals(q, k, starts, ends);
  check_bias(q, k, bias);
  check_numbers(q, scale, softcap, kv_rows, "kv_rows", q_chunk, "q_chunk");
  if (q.numel() == 0 || k.numel() == 0 || v.numel() == 0) {  // as in the forward
    return {at::zeros_like(q, at::MemoryFormat::Contiguous), at::zeros_like(k, at::MemoryFormat::Contiguous),
            at::zeros_like(v, at::MemoryFormat::Contiguous), at::zeros_like(bias, at::MemoryFormat::Contiguous)};
  }
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}, {&dout, "dout"},
                                {&out, "out"}}) {
    check_blas_rows(*t, name);
  }
  check_blas();
  // The bias gradient, per thread (no slots when none is wanted: a constant table, such as ALiBi's
  // fixed slopes, skips the pass over dS that sums it)
  // (gradients summed in the compute type; under half products stored in q's type at the end)
  const auto sums = q.options().dtype(compute_type(q));
  Tensor dbias = at::zeros({bias.numel() > 0 && bias_grad ? at::get_num_threads() : 0, bias.size(0), bias.size(1)},
                           sums);
  Tensor delta = at::empty({B, H, L}, sums);
  Tensor dq = at::zeros(q.sizes(), sums), dk = at::zeros(k.sizes(), sums), dv = at::zeros(v.sizes(), sums);
  const Rows R(starts, ends, B, H);
  if (halves && q.scalar_type() == at::kBFloat16) {
    row_dots<float, c10::BFloat16>(dout, out, delta);
    backward_impl<float, c10::BFloat16>(dout, q, k, v, stats, delta, dq, dk, dv, R, bias, dbias,
                                        static_cast<float>(scale), static_cast<float>(softcap), kv_rows, q_chunk,
                                        deterministic);
  } else if (halves) {
    row_dots<float, c10::Half>(dout, out, delta);
    backward_impl<float, c10::Half>(dout, q, k, v, stats, delta, dq, dk, dv, R, bias, dbias, static_cast<float>(scale),
                                    static_cast<float>(softcap), kv_rows, q_chunk, deterministic);
  } else if (q.scalar_type() == at::kBFloat16) {
    // Without its products a half type is computed in float32, its inputs read as they are stored and
    // widened a tile at a time (see backward_impl): no float32 copy of a whole tensor.
    row_dots<float, c10::BFloat16>(dout, out, delta);
    backward_impl<float, float, c10::BFloat16>(dout, q, k, v, stats, delta, dq, dk, dv, R, bias, dbias,
                                               static_cast<float>(scale), static_cast<float>(softcap), kv_rows,
                                               q_chunk, deterministic);
  } else if (q.scalar_type() == at::kHalf) {
    row_dots<float, c10::Half>(dout, out, delta);
    backward_impl<float, float, c10::Half>(dout, q, k, v, stats, delta, dq, dk, dv, R, bias, dbias,
                                           static_cast<float>(scale), static_cast<float>(softcap), kv_rows, q_chunk,
                                           deterministic);
  }
  if (is_half(q)) {
    dq = halves ? scaled_as(dq, static_cast<float>(scale), q.scalar_type()) : dq.to(q.scalar_type());  // dq_scale
    dk = dk.to(q.scalar_type());
    dv = dv.to(q.scalar_type());
  } else {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "band_backward", [&] {
      row_dots<scalar_t>(dout, out, delta);
      backward_impl<scalar_t>(dout, q, k, v, stats, delta, dq, dk, dv, R, bias, dbias, static_cast<scalar_t>(scale),
                              static_cast<scalar_t>(softcap), kv_rows, q_chunk, deterministic);
    });
  }
  return {dq, dk, dv, dbias.size(0) > 0 ? dbias.sum(0) : at::zeros_like(bias)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
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
  m.def("bf16_products", [] { return bf16_products.load(); }, "what set_bf16_products set (False at first)");
  m.def("f16_products", [] { return f16_products.load(); }, "what set_f16_products set (False at first)");
}
