// The kernel's products (see products.h): the BLAS's and MKL's symbols asked for, oneDNN's brgemm checked once
// and fed operands packed in its VNNI layout, each thread's packing buffers, and the product of a half type
// on its own for tests of the packing.
#include "products.h"

#include "checks.h"
#include "tiles.h"
#include "vec_math.h"

#include <chrono>

namespace attnkit::band {

// Half products (see "half products" at forward_impl): whether torch exports MKL's bfloat16 and float16 products,
// and whether the kernel uses them for inputs of that type (each set by the Python side once its self-check passed).
bool has_mkl_bf16_gemm() { return cblas_gemm_bf16bf16f32 != nullptr; }
bool has_f16_gemm() { return cblas_gemm_f16f16f32 != nullptr; }
std::atomic<bool> bf16_products{false};
std::atomic<bool> f16_products{false};


// (how brgemm is used: products.h)
#if defined(CPUBLAS_BRGEMM_BF16BF16F32) && defined(__x86_64__)
struct BrgemmBuffers {
  std::vector<BF16> a, b, t;
  std::vector<float> c;
  bool used = false;  // the thread set up a micro-kernel: brgemm_release() before the thread's work ends
};
// Each thread's packing buffers, touched only in this file.
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

// c[m x n] (rows ldc apart) = alpha * p + beta * c, for a product p (rows lp apart) that brgemm wrote into a buffer
// because it could not write c itself; beta 0: c is not read (it may hold anything), as in BLAS.
static void scale_into(Index m, Index n, float alpha, const float* p, Index lp, float beta, float* c, Index ldc) {
  for (Index i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    const float* pi = p + i * lp;
    if (beta == 0.f) {
      for (Index j = 0; j < n; ++j) ci[j] = alpha * pi[j];
    } else {
      for (Index j = 0; j < n; ++j) ci[j] = alpha * pi[j] + beta * ci[j];
    }
  }
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
  if (!direct) scale_into(m, n, alpha, C, lc, beta, c, ldc);
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

bool has_f32_brgemm() {
#if defined(CPUBLAS_BRGEMM_F32F32F32)
  static const bool works = [] {
    try {
      constexpr Index m = 9, n = 37, k = 35;
      std::vector<float> a(m * k), b(k * n), c(m * n);
      for (Index i = 0; i < m; ++i) for (Index p = 0; p < k; ++p) a[i * k + p] = float((i + 2 * p) % 5) - 2.f;
      for (Index p = 0; p < k; ++p) for (Index j = 0; j < n; ++j) b[p * n + j] = float((3 * p + j) % 7) - 3.f;
      at::native::cpublas::brgemm(m, n, k, k, n, n, false, a.data(), b.data(), c.data(), false);
      at::native::cpublas::brgemm_release(false);
      for (Index i = 0; i < m; ++i) {
        for (Index j = 0; j < n; ++j) {
          float want = 0.f;  // small integers: exact in any order
          for (Index p = 0; p < k; ++p) want += a[i * k + p] * b[p * n + j];
          if (c[i * n + j] != want) return false;
        }
      }
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works && at::globalContext().userEnabledMkldnn();
#else
  return false;
#endif
}

void gemm_f32_brgemm(Index m, Index n, Index k, float alpha, const float* a, Index lda, const float* b, Index ldb,
                     float beta, float* c, Index ldc) {
  BrgemmBuffers& w = brgemm_buffers;
  const bool direct = alpha == 1.f && (beta == 0.f || beta == 1.f);
  float* C = direct ? c : room(w.c, m * n);
  const Index lc = direct ? ldc : n;
  w.used = true;
  at::native::cpublas::brgemm(m, n, k, lda, ldb, lc, direct && beta == 1.f, a, b, C, false);
  if (!direct) scale_into(m, n, alpha, C, lc, beta, c, ldc);
}

// The end of a thread's share of a call: a micro-kernel's hardware state (AMX's tile configuration) let go.
void release_products() {
  if (brgemm_buffers.used) {
    brgemm_buffers.used = false;
    at::native::cpublas::brgemm_release(true);
  }
}
// out: t's heads ([B, H, L, E] of type X), each made into `size` values of X by pack(its first row, its part of
// out), side by side in one tensor [B, H, size]. In parallel over (b, h).
template <typename X, typename Pack>
Tensor packed_per_head(const Tensor& t, Index size, const Pack& pack) {
  const Index B = t.size(0), H = t.size(1);
  Tensor out = at::empty({B, H, size}, t.options().dtype(c10::CppTypeToScalarType<X>::value));
  X* base = out.data_ptr<X>();
  at::parallel_for(0, B * H, 1, [&](Index begin, Index end) {
    for (Index x = begin; x < end; ++x) pack(row_ptr<X>(t, x / H, x % H, 0), base + x * size);
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
  return packed_per_head<BF16>(k, pairs * ld * 2, [&](const BF16* rows, BF16* to) {
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
  return packed_per_head<BF16>(t, pairs * ld * 2, [&](const BF16* rows, BF16* to) {
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
  return packed_per_head<BF16>(t, round_up(E, BRGEMM_Q) * ld, [&](const BF16* rows, BF16* to) {
    transposed_into(E, L, ld, rows, t.stride(2), to);
  });
}

// a ([rows x cols] float32, rows la apart) transposed into to ([cols x rows], rows lt apart): blocks of 16 x 16
// floats as 32-bit words (transpose_16x16), the edges one by one.
void transpose_f32(const float* a, Index rows, Index cols, Index la, float* to, Index lt) {
  Index i0 = 0;
#if defined(__AVX512F__)
  for (; i0 + 16 <= rows; i0 += 16) {
    Index c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16) {
      transpose_16x16(reinterpret_cast<const BF16*>(a + i0 * la + c0), 2 * la,
                      reinterpret_cast<uint32_t*>(to + c0 * lt + i0), lt);
    }
    for (Index c = c0; c < cols; ++c) {
      for (Index i = i0; i < i0 + 16; ++i) to[c * lt + i] = a[i * la + c];
    }
  }
#endif
  for (Index c = 0; c < cols; ++c) {
    for (Index i = i0; i < rows; ++i) to[c * lt + i] = a[i * la + c];
  }
}

// Each (b, h)'s t ([B, H, L, E] float32) transposed, laid out as float [B, H, E * ld] (ld: L rounded up to 256,
// and BRGEMM_Q more: the leading dimension picks brgemm's micro-kernel, which torch builds and keeps per shape and
// thread, so calls of many lengths share few; and rows of the copy a power of two bytes apart would share the
// cache's sets), nothing past L. Columns c0 .. c0 + n of it are then B of q k^T over keys c0 .. c0 + n (t = k),
// or A of q^T dS over rows c0 .. c0 + n (t = q). In parallel over (b, h).
Tensor transposed_f32(const Tensor& t, Index& ld) {
  const Index L = t.size(2), E = t.size(3), lt = t.stride(2);
  ld = round_up(L, 256) + BRGEMM_Q;
  return packed_per_head<float>(t, E * ld, [&](const float* rows, float* to) { transpose_f32(rows, L, E, lt, to, ld); });
}
#else
bool brgemm_bf16() { return false; }
bool has_f32_brgemm() { return false; }
void gemm_f32_brgemm(Index, Index, Index, float, const float*, Index, const float*, Index, float, float*, Index) {
  TORCH_CHECK(false, "band kernel: no brgemm for float32 products");
}
void release_products() {}
Tensor pack_keys(const Tensor&, Index&, Index&, int) { TORCH_CHECK(false, "band kernel: no brgemm to pack keys for"); }
Tensor pack_rows(const Tensor&, Index&, Index&) { TORCH_CHECK(false, "band kernel: no brgemm to pack rows for"); }
Tensor transposed_rows(const Tensor&, Index&) { TORCH_CHECK(false, "band kernel: no brgemm to transpose rows for"); }
Tensor transposed_f32(const Tensor&, Index&) { TORCH_CHECK(false, "band kernel: no brgemm to transpose rows for"); }
void transpose_f32(const float*, Index, Index, Index, float*, Index) {
  TORCH_CHECK(false, "band kernel: no brgemm to transpose rows for");
}
#endif  // brgemm
std::atomic<bool> f32_brgemm{false};

// Seconds for `reps` of the float32 products of a forward's and a backward's tiles (p v over 320 and over 1024 keys,
// dS k, q k^T over 576 keys), best of three, through sgemm and through brgemm: {sgemm, brgemm}. sgemm reads the
// keys of q k^T as they are stored, brgemm a transposed copy (transposed_f32: made once per call, not timed). One
// thread.
std::vector<double> f32_product_times(Index reps) {
  TORCH_CHECK(reps >= 1 && reps <= 100000, "band kernel: reps must be between 1 and 100000, got ", reps);
  struct Case { Index m, n, k; };
  const Case cases[] = {{64, 64, 320}, {64, 64, 1024}, {64, 64, 64}};
  constexpr Index keys = 576, E = 64, ld = keys + 16;
  std::vector<float> a(64 * 1024), b(1024 * 64), c(64 * keys), kt(E * ld);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(i % 13) / 13.f - 0.5f, b[i] = float(i % 11) / 11.f - 0.5f;
  for (Index j = 0; j < keys; ++j) {
    for (Index e = 0; e < E; ++e) kt[e * ld + j] = b[j * E + e];
  }
  const bool was = f32_brgemm.load();
  std::vector<double> best(2, 1e30);
  for (int round = 0; round < 3; ++round) {
    for (int way = 0; way < 2; ++way) {
      f32_brgemm.store(way == 1);
      const auto start = std::chrono::steady_clock::now();
      for (Index r = 0; r < reps; ++r) {
        for (const Case& x : cases) gemm<float>(false, false, x.m, x.n, x.k, 1.f, a.data(), x.k, b.data(), x.n, 0.f,
                                                c.data(), x.n);
        if (way == 1) {
          gemm_f32_brgemm(64, keys, E, 1.f, a.data(), E, kt.data(), ld, 0.f, c.data(), keys);
        } else {
          gemm<float>(false, true, 64, keys, E, 1.f, a.data(), E, b.data(), E, 0.f, c.data(), keys);
        }
      }
      best[way] = std::min(best[way], std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  release_products();
  f32_brgemm.store(was);
  return best;
}

bool has_bf16_gemm() { return has_mkl_bf16_gemm() || brgemm_bf16(); }

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

}  // namespace attnkit::band
