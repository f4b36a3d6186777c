// A few queries against a long cache (a decode step): band_decode, for attnkit/backends/decode.py.
//
// For each batch element b and key/value head c, the G = H / Hkv query heads that share it and their Lq <= 8
// queries are R = G * Lq rows of one pass: the keys are streamed once, in blocks of BLOCK, scored against every
// row 16 keys at a time (16 accumulators summed across their lanes together, where AVX-512 is there), and folded
// into each row's running maximum, sum and accumulator (online softmax, float32). Float keys and values are read
// for four or two rows at a time where heads are grouped (dots4x4, dots2x8, add_values2; bfloat16 pairs likewise:
// dots4x4_pairs, add_value_pairs2), each vector loaded once for all of them. bfloat16 keys are scored as stored
// where the CPU multiplies bfloat16 pairs (AVX512-BF16), float16 ones widened to float32 in a small buffer.
// Each key and value is read from memory once for all the rows that share it, where PyTorch's CPU kernel (and the
// band kernel's tiles) are built for many queries and pay per-call packing and product set-ups that a single
// query cannot amortise. With a soft cap, each score (after the scale) becomes cap * tanh(score / cap).
//
// Row r (head c * G + r / Lq, query r % Lq) sees key j when lo[p, i] <= j < hi[p, i] (p = 0 or b) and, with a
// mask, mask[b', h', i', j] (each of b', h', i' 0 when that dimension of the mask is 1). A row that sees no key
// is 0 (a dead row). Keys outside every row's range are not read.
//
// In the same pass each (b, c) tells whether what it read was finite: its query rows summed as q * 0, the raw
// scores of row 0 against every key read (a key with a NaN or an infinity scores one: 0 * inf is NaN), and row 0's
// accumulator, to which every value read is added times its weight, 0 included. finite[b, c] is that sum's
// finiteness: False means a query, key or value read was not finite (or a score overflowed: a false alarm), and the
// caller (attnkit.nonfinite) takes its exact path; a masked key inside the range read counts too (a false alarm,
// which costs only that path). The output's other rows are then unspecified.
//
// Too few (b, c) for the threads: the key range is split into chunks, each chunk's (max, sum, accumulator) kept,
// and the chunks merged per row afterwards (the split softmax of FlashDecoding).
#include "decode.h"

#include <c10/core/GradMode.h>

#include "checks.h"
#include "vec_math.h"

namespace attnkit::band {

void check_decode(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const Tensor& lo,
                  const Tensor& hi, double scale, double softcap) {
  TORCH_CHECK(q.defined() && (q.scalar_type() == at::kFloat || is_half(q)),
              "band kernel: decode's q must be float32, bfloat16 or float16, got ", described(q));
  check_qkv(q, k, v, true);
  TORCH_CHECK(q.size(2) >= 1 && q.size(2) <= MAX_DECODE_QUERIES, "band kernel: decode's q must have between 1 and ",
              MAX_DECODE_QUERIES, " queries (Lq), got ", q.sizes());
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    TORCH_CHECK(t->stride(3) == 1 || t->size(3) <= 1, "band kernel: decode's ", name,
                " must have unit stride along its last dim, got strides ", t->strides(), " for sizes ", t->sizes());
  }
  const Index B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  check_tensor(mask, "mask", at::kBool, 4, "[1 or B, 1 or H, 1 or Lq, Lk] ([0, 0, 0, 0] for none)");
  const bool none = mask.numel() == 0 && mask.size(0) == 0 && mask.size(1) == 0 && mask.size(2) == 0 &&
                    mask.size(3) == 0;
  TORCH_CHECK(none || ((mask.size(0) == 1 || mask.size(0) == B) && (mask.size(1) == 1 || mask.size(1) == H) &&
                       (mask.size(2) == 1 || mask.size(2) == Lq) && mask.size(3) == Lk &&
                       (mask.stride(3) == 1 || Lk <= 1)),
              "band kernel: decode's mask must be [1 or B = ", B, ", 1 or H = ", H, ", 1 or Lq = ", Lq, ", Lk = ", Lk,
              "] with unit stride along its last dim ([0, 0, 0, 0] for none), got sizes ", mask.sizes(),
              " and strides ", mask.strides());
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&lo, "lo"}, {&hi, "hi"}}) {
    check_tensor(*t, name, at::kLong, 2, "[1 or B, Lq]");
    TORCH_CHECK(t->is_contiguous() && (t->size(0) == 1 || t->size(0) == B) && t->size(1) == Lq, "band kernel: ",
                "decode's ", name, " must be a contiguous [1 or B = ", B, ", Lq = ", Lq, "], got ", t->sizes(),
                t->is_contiguous() ? "" : " (not contiguous)");
  }
  TORCH_CHECK(lo.sizes() == hi.sizes(), "band kernel: decode's lo and hi must have one shape, got ", lo.sizes(),
              " and ", hi.sizes());
  const int64_t* s = lo.const_data_ptr<int64_t>();
  const int64_t* e = hi.const_data_ptr<int64_t>();
  for (Index x = 0; x < lo.numel(); ++x) {
    TORCH_CHECK(0 <= s[x] && s[x] <= e[x] && e[x] <= Lk, "band kernel: decode's key ranges must satisfy 0 <= lo <= ",
                "hi <= Lk (k's length ", Lk, "), got (", s[x], ", ", e[x], ") at [", x / Lq, ", ", x % Lq, "]");
  }
  TORCH_CHECK(std::isfinite(scale) && std::abs(scale) <= std::numeric_limits<float>::max(),
              "band kernel: decode's scale must be finite in float32, got ", scale);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0 && softcap <= std::numeric_limits<float>::max(),
              "band kernel: decode's softcap must be finite in float32 and >= 0 (0 for none), got ", softcap);
}

namespace {

// add_values inlined whatever the compiler's size heuristics say: called out of line, it spilled its accumulators to
// the stack and zeroed them there on every call, once per row and block (inlining the scoring helpers too cost the
// bfloat16 path more than it gave float32, in an A/B of the builds).
#define ALWAYS_INLINE inline __attribute__((always_inline))

using Vec = at::vec::Vectorized<float>;
constexpr Index BLOCK = 32;          // keys scored together before they are folded into the rows
constexpr Index MIN_SPLIT = 512;     // the fewest keys a chunk of a split range takes
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
static_assert(BLOCK % 32 == 0, "a block is whole vectors of scores, and of bfloat16 weights, on every ISA");

template <typename T>
inline void widen(const T* from, float* to, Index n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(to, from, n * sizeof(float));
  } else {
    Index d = 0;
    for (; d + Vec::size() <= n; d += Vec::size()) {
      Vec x;
      at::vec::load_to_float<T>(from + d, x);
      x.store(to + d);
    }
    for (; d < n; ++d) to[d] = static_cast<float>(from[d]);
  }
}

struct Shape {
  Index B, H, Hkv, G, Lq, Lk, D, Dv, R, Dp, Dvp;
  float scale, cap;  // cap > 0: scores capped to cap * tanh(score / cap)
  bool pairs;        // bfloat16 keys scored in place, two products per lane (dots16_pairs); q kept unscaled
  bool k_widened, v_widened;  // keys, values widened to float32 a block at a time (kbuf, vbuf), not read in place
  // grouped rows' keys and values read for several rows at once (dots4x4, add_values2 and the like): bfloat16 pairs
  // always; float keys where they fit the last-level cache (from memory, a row at a time kept more lines in flight
  // and was as fast or faster, prefetching or not; bfloat16 pairs, prefetched, came out ahead grouped; measured:
  // bench/decode_ab.py)
  bool grouped;
};

// The length of a pair of value rows interleaved (pair_values): 2 Dvp, rounded up to whole vectors of 32.
inline Index pair_row(const Shape& z) { return (2 * z.Dvp + 31) / 32 * 32; }

// The per-thread state of one chunk: each row's maximum, sum and accumulator [R, Dvp], its query (scaled
// float32, or as stored for `pairs`), the block's scores [R, BLOCK] and the widened keys and values.
struct Rows {
  std::vector<float> q, m, l, acc, s, kbuf, vbuf;
  std::vector<c10::BFloat16> qh, vpairs;  // vpairs: the block's values two keys to a lane (pair_values)
  // once per call and thread (the vectors keep their capacity: see decode_impl): the padding of q, the keys and the
  // values past D is zero, and no write reaches it
  void allocate(const Shape& z) {
    q.assign(z.R * z.Dp, 0.f);
    qh.assign(z.pairs ? z.R * z.Dp * 2 : 0, c10::BFloat16(0.f));
    m.resize(z.R);
    l.resize(z.R);
    acc.resize(z.R * z.Dvp);
    s.assign(z.R * BLOCK, NEG_INF);
    kbuf.assign(z.k_widened ? BLOCK * z.Dp : 0, 0.f);
    vbuf.assign(z.v_widened ? BLOCK * z.Dvp : 0, 0.f);
    vpairs.assign(z.pairs ? BLOCK / 2 * pair_row(z) : 0, c10::BFloat16(0.f));
  }
  // once per (b, c) and chunk of keys
  void reset() {
    std::fill(m.begin(), m.end(), NEG_INF);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
  }
};

// f(std::integral_constant<int, nv>{}) for nv in [1, 8]: loops over a row's vectors unrolled, held in registers.
template <typename F>
inline void with_vecs(Index nv, const F& f) {
  switch (nv) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// s[jj] = q . k_jj for keys jj in [0, n) (rows ks apart, Dp floats each, zero past D like q): one horizontal sum
// a key. The tail of a block, and every key where the ISA has no lane_sums.
inline void dots_one_by_one(const float* q, const float* k, Index ks, Index Dp, Index n, float* s) {
  for (Index jj = 0; jj < n; ++jj) {
    const float* kr = k + jj * ks;
    Vec a(0.f), b(0.f);
    Index d = 0;
    for (; d + 2 * Vec::size() <= Dp; d += 2 * Vec::size()) {
      a = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(kr + d), a);
      b = at::vec::fmadd(Vec::loadu(q + d + Vec::size()), Vec::loadu(kr + d + Vec::size()), b);
    }
    if (d < Dp) a = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(kr + d), a);
    s[jj] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, a + b);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The key accumulator t of a group of 16 takes, so that lane_sums leaves key L in lane L: its shuffles gather
// accumulator KEY_OF[L] into lane L, and KEY_OF is its own inverse.
constexpr int KEY_OF[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};

// The 16 lane sums of a[0..15] in one vector (lane L: the sum of a[KEY_OF[L]]'s lanes): halves, quarters,
// pairs and single lanes of two accumulators shuffled side by side and added, 15 shuffle pairs in all, where a
// horizontal sum per key takes four shuffles and four adds of its own.
inline __m512 lane_sums(const __m512 (&a)[16]) {
  __m512 b[8], c[4], d[2];
  for (int t = 0; t < 8; ++t) {
    b[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[t], a[t + 8], 0x44), _mm512_shuffle_f32x4(a[t], a[t + 8], 0xEE));
  }
  for (int t = 0; t < 4; ++t) {
    c[t] = _mm512_add_ps(_mm512_shuffle_f32x4(b[t], b[t + 4], 0x88), _mm512_shuffle_f32x4(b[t], b[t + 4], 0xDD));
  }
  for (int t = 0; t < 2; ++t) {
    d[t] = _mm512_add_ps(_mm512_shuffle_ps(c[t], c[t + 2], 0x44), _mm512_shuffle_ps(c[t], c[t + 2], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// s[0:16) = q . k_jj for 16 float keys (rows ks apart, Dp floats each): 16 accumulators side by side, summed
// across their lanes together.
inline void dots16(const float* q, const float* k, Index ks, Index Dp, float* s) {
  __m512 a[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
  for (Index d = 0; d < Dp; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
    for (int t = 0; t < 16; ++t) a[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + KEY_OF[t] * ks + d), a[t]);
  }
  _mm512_storeu_ps(s, lane_sums(a));
}

// Grouped heads: several rows against the same keys, each key vector loaded once for all of them (dots16 loads it
// once a row). The 16 accumulators are (row, key) pairs, summed across their lanes together as in dots16, row r's
// key t landing in lane r * keys + t.

// s[r * ss + t] = q_r . k_t for 4 rows (qs apart) and 4 keys (ks apart).
inline void dots4x4(const float* q, Index qs, const float* k, Index ks, Index Dp, float* s, Index ss) {
  __m512 a[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
  for (Index d = 0; d < Dp; d += 16) {
    __m512 x[4];
    for (int r = 0; r < 4; ++r) x[r] = _mm512_loadu_ps(q + r * qs + d);
    for (int t = 0; t < 4; ++t) {
      const __m512 kv = _mm512_loadu_ps(k + t * ks + d);
      for (int r = 0; r < 4; ++r) a[KEY_OF[r * 4 + t]] = _mm512_fmadd_ps(x[r], kv, a[KEY_OF[r * 4 + t]]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, lane_sums(a));
  for (int r = 0; r < 4; ++r) _mm_storeu_ps(s + r * ss, _mm_load_ps(sums + 4 * r));
}

// s[r * ss + t] = q_r . k_t for 2 rows (qs apart) and 8 keys (ks apart).
inline void dots2x8(const float* q, Index qs, const float* k, Index ks, Index Dp, float* s, Index ss) {
  __m512 a[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
  for (Index d = 0; d < Dp; d += 16) {
    const __m512 x0 = _mm512_loadu_ps(q + d), x1 = _mm512_loadu_ps(q + qs + d);
    for (int t = 0; t < 8; ++t) {
      const __m512 kv = _mm512_loadu_ps(k + t * ks + d);
      a[KEY_OF[t]] = _mm512_fmadd_ps(x0, kv, a[KEY_OF[t]]);
      a[KEY_OF[8 + t]] = _mm512_fmadd_ps(x1, kv, a[KEY_OF[8 + t]]);
    }
  }
  const __m512 sums = lane_sums(a);
  _mm256_storeu_ps(s, _mm512_castps512_ps256(sums));
  _mm256_storeu_ps(s + ss, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)));
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// The first n of 32 lanes (all for n >= 32, none for n <= 0): the masked loads of a row's last, partial vector.
inline __mmask32 first_lanes(Index n) {
  return n >= 32 ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : static_cast<__mmask32>((1ull << n) - 1);
}

// s[0:16) = q . k_jj for 16 bfloat16 keys read as stored (rows ks apart, D values each; q as stored, zero from D
// to a multiple of 32): AVX512-BF16's dot product multiplies two pairs of bfloat16 per float lane, exactly (a
// product of two bfloat16 fits a float), and adds them in float32, so the keys are not widened first. It reads
// subnormal bfloat16 (below 1.2e-38) as zero.
inline void dots16_pairs(const c10::BFloat16* q, const c10::BFloat16* k, Index ks, Index D, float* s) {
  __m512 a[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
  for (Index d = 0; d < D; d += 32) {
    const __mmask32 m = first_lanes(D - d);
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
    for (int t = 0; t < 16; ++t) {
      a[t] = _mm512_dpbf16_ps(a[t], qv, (__m512bh)_mm512_maskz_loadu_epi16(m, k + KEY_OF[t] * ks + d));
    }
  }
  _mm512_storeu_ps(s, lane_sums(a));
}

// The tail of a block in the same arithmetic: one key at a time.
inline void dots_pairs_one_by_one(const c10::BFloat16* q, const c10::BFloat16* k, Index ks, Index D, Index n,
                                  float* s) {
  for (Index jj = 0; jj < n; ++jj) {
    __m512 a = _mm512_setzero_ps();
    for (Index d = 0; d < D; d += 32) {
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + d),
                           (__m512bh)_mm512_maskz_loadu_epi16(first_lanes(D - d), k + jj * ks + d));
    }
    s[jj] = _mm512_reduce_add_ps(a);
  }
}

// dots4x4 in the same arithmetic: s[r * ss + t] = q_r . k_t for 4 rows (qs apart) and 4 bfloat16 keys (ks apart),
// read as stored.
inline void dots4x4_pairs(const c10::BFloat16* q, Index qs, const c10::BFloat16* k, Index ks, Index D, float* s,
                          Index ss) {
  __m512 a[16];
  for (int t = 0; t < 16; ++t) a[t] = _mm512_setzero_ps();
  for (Index d = 0; d < D; d += 32) {
    const __mmask32 m = first_lanes(D - d);
    __m512bh x[4];
    for (int r = 0; r < 4; ++r) x[r] = (__m512bh)_mm512_loadu_si512(q + r * qs + d);
    for (int t = 0; t < 4; ++t) {
      const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(m, k + t * ks + d);
      for (int r = 0; r < 4; ++r) a[KEY_OF[r * 4 + t]] = _mm512_dpbf16_ps(a[KEY_OF[r * 4 + t]], x[r], kv);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, lane_sums(a));
  for (int r = 0; r < 4; ++r) _mm_storeu_ps(s + r * ss, _mm_load_ps(sums + 4 * r));
}

// Value rows jj and jj + 1 of a block (Dv values each) interleaved into `to` (pair_row values): element 2i from
// row jj and 2i + 1 from row jj + 1, zero past Dv, so that one pair product adds both keys' values into lane i.
// An odd last row is paired with zeros.
inline void pair_values(const c10::BFloat16* v0, const c10::BFloat16* v1, Index Dv, Index len, c10::BFloat16* to) {
  alignas(64) static constexpr uint16_t LOW[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t HIGH[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(LOW), hi = _mm512_load_si512(HIGH);
  for (Index d = 0; 2 * d < len; d += 32) {
    const __mmask32 m = first_lanes(Dv - d);
    const __m512i a = _mm512_maskz_loadu_epi16(m, v0 + d);
    const __m512i b = v1 == nullptr ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi16(m, v1 + d);
    _mm512_storeu_si512(to + 2 * d, _mm512_permutex2var_epi16(a, lo, b));
    if (2 * d + 32 < len) _mm512_storeu_si512(to + 2 * d + 32, _mm512_permutex2var_epi16(a, hi, b));
  }
}

// acc[0 : NV vectors) += the block's values times their weights, two keys per pair product: w2[t] holds the
// weights of keys 2t and 2t + 1 rounded to bfloat16 (the products then take half the instructions of widened
// values; the band kernel's bfloat16 products round their weights so too), vpairs their values (pair_values).
// A weight of 0 is multiplied in, as in add_values.
template <int NV>
inline void add_value_pairs(float* acc, const uint32_t* w2, const c10::BFloat16* vpairs, Index len, Index pairs,
                            Index d) {
  __m512 a[NV], b[NV];
  for (int u = 0; u < NV; ++u) a[u] = _mm512_loadu_ps(acc + u * 16), b[u] = _mm512_setzero_ps();
  Index t = 0;
  for (; t + 2 <= pairs; t += 2) {
    const __m512bh p0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w2[t]));
    const __m512bh p1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w2[t + 1]));
    const c10::BFloat16* r0 = vpairs + t * len + 2 * d;
    const c10::BFloat16* r1 = r0 + len;
    for (int u = 0; u < NV; ++u) {
      a[u] = _mm512_dpbf16_ps(a[u], p0, (__m512bh)_mm512_loadu_si512(r0 + 32 * u));
      b[u] = _mm512_dpbf16_ps(b[u], p1, (__m512bh)_mm512_loadu_si512(r1 + 32 * u));
    }
  }
  if (t < pairs) {
    const __m512bh p0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w2[t]));
    const c10::BFloat16* r0 = vpairs + t * len + 2 * d;
    for (int u = 0; u < NV; ++u) a[u] = _mm512_dpbf16_ps(a[u], p0, (__m512bh)_mm512_loadu_si512(r0 + 32 * u));
  }
  for (int u = 0; u < NV; ++u) _mm512_storeu_ps(acc + u * 16, _mm512_add_ps(a[u], b[u]));
}

// add_value_pairs for two rows (grouped heads), weights w0 and w1: each pair vector loaded once for both rows.
template <int NV>
inline void add_value_pairs2(float* acc0, float* acc1, const uint32_t* w0, const uint32_t* w1,
                             const c10::BFloat16* vpairs, Index len, Index pairs, Index d) {
  __m512 a[NV], b[NV];
  for (int u = 0; u < NV; ++u) a[u] = _mm512_loadu_ps(acc0 + u * 16), b[u] = _mm512_loadu_ps(acc1 + u * 16);
  for (Index t = 0; t < pairs; ++t) {
    const __m512bh p0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w0[t]));
    const __m512bh p1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(w1[t]));
    const c10::BFloat16* r0 = vpairs + t * len + 2 * d;
    for (int u = 0; u < NV; ++u) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(r0 + 32 * u);
      a[u] = _mm512_dpbf16_ps(a[u], p0, x);
      b[u] = _mm512_dpbf16_ps(b[u], p1, x);
    }
  }
  for (int u = 0; u < NV; ++u) _mm512_storeu_ps(acc0 + u * 16, a[u]), _mm512_storeu_ps(acc1 + u * 16, b[u]);
}

// A row's block of weights s[0:BLOCK) as bfloat16 pairs w2[BLOCK / 2] (keys 2t and 2t + 1 in w2[t]).
inline void weight_pairs(const float* s, uint32_t* w2) {
  for (Index jj = 0; jj < BLOCK; jj += 32) {
    const __m512bh pairs = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + jj + 16), _mm512_loadu_ps(s + jj));
    _mm512_storeu_si512(w2 + jj / 2, (__m512i)pairs);
  }
}
#endif

// Raw scores s[0:n) of one row against the block's n keys: every key is scored, masked or not, so that the scores
// of row 0 tell whether the keys are finite (see run_chunk).
template <typename T>
inline void raw_scores(const Shape& z, const Rows& w, Index r, const T* kblock, Index ks, const float* kf, Index n,
                       float* s) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (z.pairs) {
      const c10::BFloat16* qh = w.qh.data() + r * z.Dp * 2;
      Index jj = 0;
      for (; jj + 16 <= n; jj += 16) dots16_pairs(qh, kblock + jj * ks, ks, z.D, s + jj);
      dots_pairs_one_by_one(qh, kblock + jj * ks, ks, z.D, n - jj, s + jj);
      return;
    }
  }
#endif
  const float* q = w.q.data() + r * z.Dp;
  const Index fs = z.k_widened ? z.Dp : ks;  // the float keys' row stride: the buffer's or the cache's
  Index jj = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; jj + 16 <= n; jj += 16) dots16(q, kf + jj * fs, fs, z.Dp, s + jj);
#endif
  dots_one_by_one(q, kf + jj * fs, fs, z.Dp, n - jj, s + jj);
}

// Whether T's keys and values are only ever read in pairs (bfloat16 where the CPU multiplies pairs): then run_chunk's
// float32 paths are left out of its code for T, not just skipped (compiled in, they cost the bfloat16 loops
// registers and placement).
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
template <typename T>
constexpr bool pairs_only = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool pairs_only = false;
#endif

// The most accumulator vectors a row keeps in registers while a block of values is added in.
constexpr Index ACC_VECS = 8;

// acc[0 : NV vectors) += sum over the block's keys jj of p[jj] * v_jj[d : d + NV vectors), in registers. A weight
// of 0 is multiplied in too: 0 * inf is NaN, so the accumulator tells whether the values were finite.
template <int NV>
ALWAYS_INLINE void add_values(float* acc, const float* p, const float* const* vrows, Index n, Index d) {
  // two keys at a time into two sets of accumulators, where the registers hold both: with one set, a row of
  // four vectors waits on each multiply-add's latency before the next key's
  constexpr bool two = Vec::size() == 16 || NV <= 4;
  Vec a[NV], b[NV];
  for (int u = 0; u < NV; ++u) a[u] = Vec::loadu(acc + u * Vec::size()), b[u] = Vec(0.f);
  Index jj = 0;
  if constexpr (two) {
    for (; jj + 2 <= n; jj += 2) {
      const Vec p0(p[jj]), p1(p[jj + 1]);
      const float* v0 = vrows[jj] + d;
      const float* v1 = vrows[jj + 1] + d;
      for (int u = 0; u < NV; ++u) {
        a[u] = at::vec::fmadd(p0, Vec::loadu(v0 + u * Vec::size()), a[u]);
        b[u] = at::vec::fmadd(p1, Vec::loadu(v1 + u * Vec::size()), b[u]);
      }
    }
  }
  for (; jj < n; ++jj) {
    const Vec pv(p[jj]);
    const float* vr = vrows[jj] + d;
    for (int u = 0; u < NV; ++u) a[u] = at::vec::fmadd(pv, Vec::loadu(vr + u * Vec::size()), a[u]);
  }
  for (int u = 0; u < NV; ++u) (a[u] + b[u]).store(acc + u * Vec::size());
}

// add_values for two rows (grouped heads): each value vector is loaded once for both rows' accumulators, two
// independent chains that hide the multiply-add's latency as add_values' second set does. AVX-512 only: the 2 NV
// accumulators need its 32 registers.
template <int NV>
ALWAYS_INLINE void add_values2(float* acc0, float* acc1, const float* p0, const float* p1, const float* const* vrows,
                               Index n, Index d) {
  Vec a[NV], b[NV];
  for (int u = 0; u < NV; ++u) a[u] = Vec::loadu(acc0 + u * Vec::size()), b[u] = Vec::loadu(acc1 + u * Vec::size());
  for (Index jj = 0; jj < n; ++jj) {
    const Vec w0(p0[jj]), w1(p1[jj]);
    const float* vr = vrows[jj] + d;
    for (int u = 0; u < NV; ++u) {
      const Vec x = Vec::loadu(vr + u * Vec::size());
      a[u] = at::vec::fmadd(w0, x, a[u]);
      b[u] = at::vec::fmadd(w1, x, b[u]);
    }
  }
  for (int u = 0; u < NV; ++u) a[u].store(acc0 + u * Vec::size()), b[u].store(acc1 + u * Vec::size());
}

// Row r's scores s[0:BLOCK) (-inf past the block's n keys and where the row does not see a key) folded into its
// running maximum and sum and its accumulator rescaled; s becomes the block's weights.
inline void online_softmax(const Shape& z, Rows& w, Index r) {
  float* sr = w.s.data() + r * BLOCK;
  Vec mx(NEG_INF);
  for (Index jj = 0; jj < BLOCK; jj += Vec::size()) mx = at::vec::maximum(mx, Vec::loadu(sr + jj));  // keeps NaN
  const float bm = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, mx);
  const bool nan = std::isnan(w.m[r]) || std::isnan(bm);
  if (nan || bm == NEG_INF) {  // NaN in: the row stays NaN (its output too); nothing seen: weights 0
    if (nan) w.m[r] = std::numeric_limits<float>::quiet_NaN();
    std::fill(sr, sr + BLOCK, nan ? w.m[r] : 0.f);
    return;
  }
  const float m_new = std::max(w.m[r], bm);
  if (m_new > w.m[r] && w.m[r] != NEG_INF) {
    const float c = std::exp(w.m[r] - m_new);
    w.l[r] *= c;
    float* ar = w.acc.data() + r * z.Dvp;
    for (Index d = 0; d < z.Dvp; d += Vec::size()) (Vec::loadu(ar + d) * Vec(c)).store(ar + d);
  }
  w.m[r] = m_new;
  Vec sum(0.f);
  for (Index jj = 0; jj < BLOCK; jj += Vec::size()) {
    const Vec p = vexp<float, false>(Vec::loadu(sr + jj) - Vec(m_new));
    p.store(sr + jj);
    sum = sum + p;
  }
  w.l[r] += at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, sum);
}

// Rows [j, j + n) of a cache (rows `stride` elements apart, `len` elements each) asked for ahead of their use, into
// the core's L2 (locality 2, T1): into L1 (locality 3) they crowded out the block being read, and a non-temporal
// hint (0) fetched too little to help (measured: bench/decode_ab.py's cells from memory).
template <typename T>
inline void prefetch_rows(const T* base, Index stride, Index j, Index n, Index len) {
  constexpr Index LINE = 64;
  for (Index jj = j; jj < j + n; ++jj) {
    const char* row = reinterpret_cast<const char*>(base + jj * stride);
    for (Index b = 0; b < len * Index(sizeof(T)); b += LINE) __builtin_prefetch(row + b, 0, 2);
  }
}

// How many blocks ahead a prefetching call asks for its keys and values: 2 to 8 measured within a few percent of
// each other; one block ahead, into L1, gained a third as much.
constexpr Index PREFETCH_BLOCKS = 3;

// Whether a call reads so much that its keys and values come from memory, not the last-level cache, even on a
// server of its own: more than a CCD's L3 (a fixed 32 MiB: sysconf's L3 size is the whole socket's on some CPUs).
constexpr bool from_memory(Index bytes) { return bytes >= (Index(32) << 20); }

// Whether a cache tensor is a view into a larger buffer: a cache preallocated and written in place (attnkit's
// KVCache, transformers' StaticCache), whose rows were written steps ago and have left the caches since (a step
// runs the whole model between two calls of one layer). A cache grown by concatenation (transformers'
// DynamicCache) is a new tensor each step, just written, and warm when it fits. (Any other view of a larger tensor,
// one part of a fused projection say, is taken for such a cache too: prefetched, at the cost measured warm.)
inline bool written_in_place(const Tensor& t) {
  return t.storage().nbytes() > static_cast<size_t>(t.numel() * t.element_size());
}

// Whether each block asks for the keys and values PREFETCH_BLOCKS ahead as it starts (and each (b, c) for the
// next one's first blocks): where the lines come from DRAM, it gains 25-35% (float32 and bfloat16 alike); where
// they are in L2 or L3 the hardware's own prefetch keeps up and the extra instructions cost 10-25%. From DRAM:
// a cache written in place (cold whatever its size), or one that reads over 12 MiB (on a server shared with other
// tenants, a core keeps its share of L3, well below its size). Measured: bench/decode_ab.py, warm and cold.
inline bool prefetch_pays(Index bytes, bool cold) { return cold || bytes > (Index(12) << 20); }

// Keys [from, to) of (b, c) folded into `w` (whose q rows are loaded); returns a sum that is finite when every key
// and value read was (and no score overflowed: a false alarm, which costs the caller only its exact path). Row
// 0's raw scores are each q . k over every key read, NaN or infinite when a key is not finite (0 * inf is NaN, so a
// zero in q hides nothing), and its accumulator has every value read times a weight added in (add_values).
template <typename T>
float run_chunk(const Shape& z, Rows& w, const T* kp, const T* vp, Index ks, Index vs, const int64_t* lo,
                const int64_t* hi, const bool* const* mrow, Index from, Index to, bool prefetch) {
  const Index R = z.R, Dvp = z.Dvp;
  // keys every row sees, with no mask: a block inside them needs no per-key test
  Index all_lo = 0, all_hi = z.Lk;
  for (Index i = 0; i < z.Lq; ++i) all_lo = std::max<Index>(all_lo, lo[i]), all_hi = std::min<Index>(all_hi, hi[i]);
  Vec seen(0.f);
  const Vec zero(0.f);
  for (Index j0 = from; j0 < to; j0 += BLOCK) {
    const Index n = std::min(BLOCK, to - j0);
    if (prefetch) {  // the keys and values PREFETCH_BLOCKS blocks ahead
      const Index ahead = j0 + PREFETCH_BLOCKS * BLOCK;
      if (ahead < to) {
        prefetch_rows(kp, ks, ahead, std::min(BLOCK, to - ahead), z.D);
        prefetch_rows(vp, vs, ahead, std::min(BLOCK, to - ahead), z.Dv);
      }
    }
    const float* kf = w.kbuf.data();
    if (z.k_widened) {
      for (Index jj = 0; jj < n; ++jj) widen(kp + (j0 + jj) * ks, w.kbuf.data() + jj * z.Dp, z.D);
    } else if constexpr (std::is_same_v<T, float>) {
      kf = kp + j0 * ks;
    }
    const bool every_key = mrow == nullptr && j0 >= all_lo && j0 + n <= all_hi;
    Index grouped = 0;  // rows [0, grouped) scored together, four or two at a time, over a whole block of keys
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    if constexpr (pairs_only<T>) {
      if (n == BLOCK && z.grouped) {
        for (; grouped + 4 <= R; grouped += 4) {
          const c10::BFloat16* q0 = w.qh.data() + grouped * z.Dp * 2;
          float* s0 = w.s.data() + grouped * BLOCK;
          for (Index jj = 0; jj < BLOCK; jj += 4) {
            dots4x4_pairs(q0, z.Dp * 2, kp + (j0 + jj) * ks, ks, z.D, s0 + jj, BLOCK);
          }
        }
      }
    }
#endif
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (!pairs_only<T>) {
      if (n == BLOCK && z.grouped) {
        const Index fs = z.k_widened ? z.Dp : ks;
        for (; grouped + 4 <= R; grouped += 4) {
          const float* q0 = w.q.data() + grouped * z.Dp;
          float* s0 = w.s.data() + grouped * BLOCK;
          for (Index jj = 0; jj < BLOCK; jj += 4) dots4x4(q0, z.Dp, kf + jj * fs, fs, z.Dp, s0 + jj, BLOCK);
        }
        for (; grouped + 2 <= R; grouped += 2) {
          const float* q0 = w.q.data() + grouped * z.Dp;
          float* s0 = w.s.data() + grouped * BLOCK;
          for (Index jj = 0; jj < BLOCK; jj += 8) dots2x8(q0, z.Dp, kf + jj * fs, fs, z.Dp, s0 + jj, BLOCK);
        }
      }
    }
#endif
    for (Index r = 0; r < R; ++r) {
      float* sr = w.s.data() + r * BLOCK;
      if (r >= grouped) raw_scores<T>(z, w, r, kp + j0 * ks, ks, kf, n, sr);
      if (r == 0) {
        Index jj = 0;
        for (; jj + Vec::size() <= n; jj += Vec::size()) seen = at::vec::fmadd(Vec::loadu(sr + jj), zero, seen);
        for (; jj < n; ++jj) seen = seen + Vec(sr[jj] * 0.f);
      }
      if (z.pairs) {
        for (Index jj = 0; jj < n; jj += Vec::size()) (Vec::loadu(sr + jj) * Vec(z.scale)).store(sr + jj);
      }
      if (z.cap > 0.f) cap_row<float>(sr, n, z.cap);
      if (!every_key) {
        const Index i = r % z.Lq;
        for (Index jj = 0; jj < n; ++jj) {
          const Index j = j0 + jj;
          if (!(j >= lo[i] && j < hi[i] && (mrow == nullptr || mrow[r][j]))) sr[jj] = NEG_INF;
        }
      }
      std::fill(sr + n, sr + BLOCK, NEG_INF);
    }
    for (Index r = 0; r < R; ++r) online_softmax(z, w, r);
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    if constexpr (pairs_only<T>) {  // the values two keys to a lane, each pair read once for every row's weights
      const Index len = pair_row(z), pairs = (n + 1) / 2;
      for (Index t = 0; t < pairs; ++t) {
        const T* v0 = vp + (j0 + 2 * t) * vs;
        pair_values(v0, 2 * t + 1 < n ? v0 + vs : nullptr, z.Dv, len, w.vpairs.data() + t * len);
      }
      Index r = 0;
      for (; z.grouped && r + 2 <= R; r += 2) {
        uint32_t w2a[BLOCK / 2], w2b[BLOCK / 2];
        weight_pairs(w.s.data() + r * BLOCK, w2a);
        weight_pairs(w.s.data() + (r + 1) * BLOCK, w2b);
        float* ar = w.acc.data() + r * Dvp;
        for (Index d = 0; d < Dvp; d += ACC_VECS * 16) {
          const Index nv = std::min<Index>(ACC_VECS, (Dvp - d) / 16);
          with_vecs(nv, [&](auto NV) {
            add_value_pairs2<NV.value>(ar + d, ar + Dvp + d, w2a, w2b, w.vpairs.data(), len, pairs, d);
          });
        }
      }
      for (; r < R; ++r) {
        uint32_t w2[BLOCK / 2];
        weight_pairs(w.s.data() + r * BLOCK, w2);
        float* ar = w.acc.data() + r * Dvp;
        for (Index d = 0; d < Dvp; d += ACC_VECS * 16) {
          const Index nv = std::min<Index>(ACC_VECS, (Dvp - d) / 16);
          with_vecs(nv, [&](auto NV) { add_value_pairs<NV.value>(ar + d, w2, w.vpairs.data(), len, pairs, d); });
        }
      }
    }
#endif
    if constexpr (!pairs_only<T>) {  // float32 values, or half ones widened
      // the values, each read once (from memory) for every row; then each row's accumulator, held in registers
      // NV vectors at a time, takes the block's values from the cache
      const float* vrows[BLOCK];
      for (Index jj = 0; jj < n; ++jj) {
        if (z.v_widened) {
          widen(vp + (j0 + jj) * vs, w.vbuf.data() + jj * Dvp, z.Dv);
          vrows[jj] = w.vbuf.data() + jj * Dvp;
        } else {
          vrows[jj] = reinterpret_cast<const float*>(vp + (j0 + jj) * vs);
        }
      }
      Index r = 0;
      if constexpr (Vec::size() == 16) {
        for (; z.grouped && r + 2 <= R; r += 2) {
          const float* pr = w.s.data() + r * BLOCK;
          float* ar = w.acc.data() + r * Dvp;
          for (Index d = 0; d < Dvp; d += ACC_VECS * Vec::size()) {
            const Index nv = std::min<Index>(ACC_VECS, (Dvp - d) / Vec::size());
            with_vecs(nv, [&](auto NV) { add_values2<NV.value>(ar + d, ar + Dvp + d, pr, pr + BLOCK, vrows, n, d); });
          }
        }
      }
      for (; r < R; ++r) {
        const float* pr = w.s.data() + r * BLOCK;
        float* ar = w.acc.data() + r * Dvp;
        for (Index d = 0; d < Dvp; d += ACC_VECS * Vec::size()) {
          const Index nv = std::min<Index>(ACC_VECS, (Dvp - d) / Vec::size());
          with_vecs(nv, [&](auto NV) { add_values<NV.value>(ar + d, pr, vrows, n, d); });
        }
      }
    }
  }
  for (Index d = 0; d < Dvp; d += Vec::size()) seen = at::vec::fmadd(Vec::loadu(w.acc.data() + d), zero, seen);
  return at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, seen);
}

// lod, hid: the key ranges, lo_rows rows of Lq (1: shared by the batch, else B); fd: B * Hkv finiteness flags.
template <typename T>
void decode_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const int64_t* lod,
                 const int64_t* hid, Index lo_rows, double scale, double cap, Tensor& out, bool* fd) {
  Shape z;
  z.scale = static_cast<float>(scale), z.cap = static_cast<float>(cap);
  z.pairs = pairs_only<T>;
  z.B = q.size(0), z.H = q.size(1), z.Lq = q.size(2), z.D = q.size(3), z.Hkv = k.size(1), z.Lk = k.size(2);
  z.Dv = v.size(3), z.G = z.H / z.Hkv, z.R = z.G * z.Lq;
  const auto up = [](Index x) { return (x + Vec::size() - 1) / Vec::size() * Vec::size(); };
  z.Dp = std::max<Index>(up(z.D), Vec::size()), z.Dvp = std::max<Index>(up(z.Dv), Vec::size());
  z.k_widened = !z.pairs && !(std::is_same_v<T, float> && z.D == z.Dp);
  z.v_widened = !z.pairs && !(std::is_same_v<T, float> && z.Dv == z.Dvp);
  const Index items = z.B * z.Hkv;
  const T* qd = q.const_data_ptr<T>();
  const T* kd = k.const_data_ptr<T>();
  const T* vd = v.const_data_ptr<T>();
  T* od = out.data_ptr<T>();
  const bool has_mask = mask.numel() > 0;
  const bool* md = has_mask ? mask.const_data_ptr<bool>() : nullptr;
  const Index lo_step = lo_rows == 1 ? 0 : z.Lq;
  // each (b, c)'s key range: the union of its rows' ranges
  std::vector<Index> first(items), last(items);
  for (Index b = 0; b < z.B; ++b) {
    Index f = z.Lk, e = 0;
    for (Index i = 0; i < z.Lq; ++i) {
      const Index s = lod[b * lo_step + i], t = hid[b * lo_step + i];
      if (s < t) f = std::min(f, s), e = std::max(e, t);
    }
    for (Index c = 0; c < z.Hkv; ++c) first[b * z.Hkv + c] = f, last[b * z.Hkv + c] = std::max(f, e);
  }
  Index longest = 0;
  for (Index x = 0; x < items; ++x) longest = std::max(longest, last[x] - first[x]);
  Index read = 0;  // bytes of keys and values the call reads
  for (Index x = 0; x < items; ++x) read += (last[x] - first[x]) * (z.D + z.Dv) * Index(sizeof(T));
  const bool prefetch = prefetch_pays(read, written_in_place(k) || written_in_place(v));
  z.grouped = pairs_only<T> || !from_memory(read);
  const Index threads = at::get_num_threads();
  const Index splits = items >= threads ? 1
                                        : std::max<Index>(1, std::min((threads + items - 1) / items,
                                                                      longest / MIN_SPLIT));
  // a split call's partial rows: [items, splits, R] maxima and sums, [items, splits, R, Dvp] accumulators
  std::vector<float> pm, pl, pacc, pseen(items * splits, 0.f);
  if (splits > 1) {
    pm.assign(items * splits * z.R, NEG_INF);
    pl.assign(items * splits * z.R, 0.f);
    pacc.assign(items * splits * z.R * z.Dvp, 0.f);
  }
  const Index mb = has_mask ? mask.stride(0) : 0, mh = has_mask ? mask.stride(1) : 0;
  const Index mq = has_mask ? mask.stride(2) : 0;
  at::parallel_for(0, items * splits, 1, [&](Index begin, Index end) {
    // this thread's buffers, kept from call to call: allocated per call, they were fresh pages from the heap's top
    // whenever the allocator had given memory back, and a decode step paid their page faults
    static thread_local Rows kept;
    Rows& w = kept;
    w.allocate(z);
    std::vector<const bool*> mrows(has_mask ? z.R : 0);
    for (Index it = begin; it < end; ++it) {
      const Index x = it / splits, b = x / z.Hkv, c = x % z.Hkv;
      w.reset();
      Vec q_seen(0.f);
      for (Index r = 0; r < z.R; ++r) {
        const Index h = c * z.G + r / z.Lq, i = r % z.Lq;
        const T* qr = qd + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        float* wq = w.q.data() + r * z.Dp;
        widen(qr, wq, z.D);
        for (Index d = 0; d < z.Dp; d += Vec::size()) {
          const Vec x = Vec::loadu(wq + d);
          q_seen = at::vec::fmadd(x, Vec(0.f), q_seen);
          (x * Vec(z.scale)).store(wq + d);
        }
        if (z.pairs) std::copy(qr, qr + z.D, reinterpret_cast<T*>(w.qh.data()) + r * z.Dp * 2);
        if (has_mask) mrows[r] = md + (mask.size(0) == 1 ? 0 : b * mb) + (mask.size(1) == 1 ? 0 : h * mh) +
                                 (mask.size(2) == 1 ? 0 : i * mq);
      }
      const auto range = [&](Index i) {  // item i's keys [from, to): its (b, c)'s range, or its chunk of it
        const Index y = i / splits, per = (last[y] - first[y] + splits - 1) / splits;
        const Index f = std::min(last[y], first[y] + (i % splits) * per);
        return std::pair<Index, Index>{f, std::min(last[y], f + per)};
      };
      const auto [from, to] = range(it);
      if (prefetch && it + 1 < end) {  // the next item's first blocks, which its own pass starts without
        const Index y = (it + 1) / splits, b1 = y / z.Hkv, c1 = y % z.Hkv;
        const auto [f1, t1] = range(it + 1);
        const Index n1 = std::min(PREFETCH_BLOCKS * BLOCK, t1 - f1);
        prefetch_rows(kd + b1 * k.stride(0) + c1 * k.stride(1), k.stride(2), f1, n1, z.D);
        prefetch_rows(vd + b1 * v.stride(0) + c1 * v.stride(1), v.stride(2), f1, n1, z.Dv);
      }
      pseen[it] = run_chunk<T>(z, w, kd + b * k.stride(0) + c * k.stride(1), vd + b * v.stride(0) + c * v.stride(1),
                               k.stride(2), v.stride(2), lod + b * lo_step, hid + b * lo_step,
                               has_mask ? mrows.data() : nullptr, from, to, prefetch) +
                  at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, q_seen);
      if (splits > 1) {
        std::copy(w.m.begin(), w.m.end(), pm.begin() + it * z.R);
        std::copy(w.l.begin(), w.l.end(), pl.begin() + it * z.R);
        std::copy(w.acc.begin(), w.acc.end(), pacc.begin() + it * z.R * z.Dvp);
        continue;
      }
      for (Index r = 0; r < z.R; ++r) {
        const Index h = c * z.G + r / z.Lq, i = r % z.Lq;
        T* orow = od + ((b * z.H + h) * z.Lq + i) * z.Dv;
        float* ar = w.acc.data() + r * z.Dvp;
        if (w.l[r] > 0.f) {
          const Vec inv(1.f / w.l[r]);
          for (Index d = 0; d < z.Dvp; d += Vec::size()) (Vec::loadu(ar + d) * inv).store(ar + d);
        } else {  // a dead row: 0, or NaN where a NaN reached it
          std::fill(ar, ar + z.Dv, std::isnan(w.m[r]) ? std::numeric_limits<float>::quiet_NaN() : 0.f);
        }
        at::vec::convert(ar, orow, z.Dv);
      }
    }
  });
  if (splits > 1) {
    at::parallel_for(0, items, 1, [&](Index begin, Index end) {
      std::vector<float> acc(z.Dvp);
      for (Index x = begin; x < end; ++x) {
        const Index b = x / z.Hkv, c = x % z.Hkv;
        for (Index r = 0; r < z.R; ++r) {
          float m = NEG_INF;
          bool nan = false;
          for (Index s = 0; s < splits; ++s) {
            const float ms = pm[(x * splits + s) * z.R + r];
            nan = nan || std::isnan(ms);
            m = std::max(m, ms);
          }
          float l = 0.f;
          std::fill(acc.begin(), acc.end(), 0.f);
          for (Index s = 0; s < splits && m != NEG_INF; ++s) {
            const Index at_ = (x * splits + s) * z.R + r;
            if (pm[at_] == NEG_INF) continue;
            const float f = std::exp(pm[at_] - m);
            l += pl[at_] * f;
            const float* a = pacc.data() + at_ * z.Dvp;
            for (Index d = 0; d < z.Dv; ++d) acc[d] += a[d] * f;
          }
          const Index h = c * z.G + r / z.Lq, i = r % z.Lq;
          T* orow = od + ((b * z.H + h) * z.Lq + i) * z.Dv;
          const float inv = l > 0.f ? 1.f / l : 0.f;
          const float dead = nan ? std::numeric_limits<float>::quiet_NaN() : 0.f;
          for (Index d = 0; d < z.Dv; ++d) orow[d] = static_cast<T>(l > 0.f && !nan ? acc[d] * inv : dead);
        }
      }
    });
  }
  for (Index x = 0; x < items; ++x) {
    float s = 0.f;
    for (Index p = 0; p < splits; ++p) s += pseen[x * splits + p];
    fd[x] = std::isfinite(s);
  }
}

void dispatch(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const int64_t* lod,
              const int64_t* hid, Index lo_rows, double scale, double cap, Tensor& out, bool* fd) {
  switch (q.scalar_type()) {
    case at::kFloat: decode_impl<float>(q, k, v, mask, lod, hid, lo_rows, scale, cap, out, fd); break;
    case at::kBFloat16: decode_impl<c10::BFloat16>(q, k, v, mask, lod, hid, lo_rows, scale, cap, out, fd); break;
    default: decode_impl<c10::Half>(q, k, v, mask, lod, hid, lo_rows, scale, cap, out, fd); break;
  }
}

}  // namespace

std::vector<Tensor> band_decode(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                const Tensor& lo, const Tensor& hi, double scale, double softcap) {
  check_decode(q, k, v, mask, lo, hi, scale, softcap);
  const Index B = q.size(0), H = q.size(1), Lq = q.size(2), Hkv = k.size(1);
  Tensor out = at::empty({B, H, Lq, v.size(3)}, q.options().memory_format(at::MemoryFormat::Contiguous));
  Tensor finite = at::empty({B, Hkv}, q.options().dtype(at::kBool));
  if (out.numel() == 0 && finite.numel() == 0) return {out, finite};
  if (k.size(2) == 0 || out.numel() == 0) {
    out.zero_();
    finite.fill_(true);
    return {out, finite};
  }
  dispatch(q, k, v, mask, lo.const_data_ptr<int64_t>(), hi.const_data_ptr<int64_t>(), lo.size(0), scale, softcap, out,
           finite.data_ptr<bool>());
  return {out, finite};
}

Tensor band_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  const Tensor none;
  if (!q.defined() || !k.defined() || !v.defined()) return none;
  const auto dtype = q.scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) return none;
  for (const Tensor* t : {&q, &k, &v}) {
    if (t->layout() != at::kStrided || !t->device().is_cpu() || t->scalar_type() != dtype || t->dim() != 4) {
      return none;
    }
  }
  const Index B = q.size(0), H = q.size(1), E = q.size(3), Hkv = k.size(1), Lk = k.size(2);
  if (q.size(2) != 1 || k.size(0) != B || v.size(0) != B || k.size(3) != E || v.size(1) != Hkv || v.size(2) != Lk ||
      Hkv == 0 || Lk == 0 || H % Hkv != 0 || Lk > MAX_INT || E > MAX_INT || v.size(3) > MAX_INT) {
    return none;
  }
  if (c10::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() || v.requires_grad())) return none;
  if (std::isnan(scale)) scale = E > 0 ? 1.0 / std::sqrt(static_cast<double>(E)) : 1.0;
  if (!std::isfinite(scale) || std::abs(scale) > std::numeric_limits<float>::max()) return none;
  const auto unit_last = [](const Tensor& t) { return t.stride(3) == 1 || t.size(3) <= 1 ? t : t.contiguous(); };
  const Tensor qc = unit_last(q), kc = unit_last(k), vc = unit_last(v);
  static const Tensor no_mask = at::empty({0, 0, 0, 0}, at::TensorOptions().dtype(at::kBool));
  const int64_t lo = 0, hi = Lk;  // one query sees every key, causal or not
  Tensor out = at::empty({B, H, 1, v.size(3)}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out.zero_();
  std::vector<char> finite(B * Hkv);
  dispatch(qc, kc, vc, no_mask, &lo, &hi, 1, scale, 0.0, out, reinterpret_cast<bool*>(finite.data()));
  for (const char f : finite) {
    if (!f) return none;
  }
  return out;
}

}  // namespace attnkit::band
