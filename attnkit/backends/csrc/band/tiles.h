// What the forward and the backward share between the products and the exponentials: a call's shapes, reading
// rows of q, k and v (as stored, or widened from a half type), the intervals of each row (Rows), the keys a block
// of rows sees as segments gathered into chunks, the softmax of one row over its visible ranges (online, with the
// row's running maximum and sum), and the rows or keys far wider than the rest of their block.
#pragma once

#include "products.h"
#include "vec_math.h"

namespace attnkit::band {

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

// Whether a half forward without its products reads its keys and values a chunk at a time, widening each as
// it is read, rather than widening them once (to_float) first: where each key is read at most twice (a query
// head per key head, at most two blocks of query rows: a decode step, a short chunk of prefill), or where the
// keys a block of rows sees are few beside all of them, so that widening them for every query head and block
// (reads x (span + q_rows) keys, span the widest any row sees) costs less than widening every key once (a
// decode step of a grouped-query model with a window over a long cache). There the copy, a fresh tensor of
// every key and value, costs more than the attention; where blocks of rows read each key again and again, a
// float copy is the faster read (see load_row). packs_keys asks the same of a copy of k^T for brgemm.
inline bool few_reads(const Tensor& q, const Tensor& k, Index q_rows, const Rows& R) {
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

// Whether a pass over blocks of q_rows query rows (the forward; dQ's own pass in the backward) packs k^T once for
// the call: products through brgemm (bfloat16, or float32 where set_f32_brgemm chose it), where many blocks of
// rows read each key (not few_reads).
inline bool packs_keys(const Tensor& q, const Tensor& k, Index q_rows, const Rows& R) {
  const bool brgemm = k.scalar_type() == at::kFloat ? f32_brgemm.load(std::memory_order_relaxed) : brgemm_bf16();
  return brgemm && q_rows >= BRGEMM_ROWS && !few_reads(q, k, q_rows, R);
}

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
inline std::vector<std::vector<std::vector<std::pair<Index, Index>>>> key_block_rows(
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
// of its keys is not finite (see "Non-finite inputs" in kernel.h).
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
inline bool mark_wide(const std::vector<Index>& seen, Index block, std::vector<char>& wide) {
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
inline std::vector<std::vector<char>> wide_rows(const Rows& R, Index q_rows, bool& any) {
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
inline std::vector<std::vector<char>> wide_keys(const Rows& R, Index S, Index kv_rows, bool& any) {
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
inline std::vector<std::array<Index, 3>> wide_row_groups(const Rows& R, Index B, Index H,
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

}  // namespace attnkit::band
