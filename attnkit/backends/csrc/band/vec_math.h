// The kernel's vector maths on at::vec: rounding pairs of float vectors to a half type, exp (a shorter
// polynomial than Sleef's on AVX-512), tanh soft-capping, a score row's scale, bias and cap, maxima that keep
// a NaN, and sums that tell a non-finite input. All inline or templates: they run inside the hot loops.
#pragma once

#include "common.h"

namespace attnkit::band {

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

#if defined(CPU_CAPABILITY_AVX512)
// exp of 16 floats: x = n ln 2 + r (|r| <= ln 2 / 2, ln 2 in two parts), e^r by a degree-5 polynomial with
// constant term 1 fitted for least maximum relative error on that interval (over every float, within the
// error of a degree-6 Taylor polynomial, with one multiply-add fewer), times 2^n by one scalef. As exp_u20:
// 0 below ln(FLT_MIN) (the mask also catches -inf, whose r is NaN), and a NaN clamped to ln(FLT_MAX), whose
// exp overflows to +inf (so a NaN score's row sums to inf and its output comes out NaN: see "Non-finite
// inputs" in kernel.h). About three fifths of exp_u20's instructions.
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
// the caller only its exact path). See "Non-finite inputs" in kernel.h.
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

}  // namespace attnkit::band
