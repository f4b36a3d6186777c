// A few queries against a long cache (a decode step): band_decode, for attnkit/backends/decode.py.
//
// For each batch element b and key/value head c, the G = H / Hkv query heads that share it and their Lq <= 8
// queries are R = G * Lq rows of one pass: the keys are streamed once, in blocks of BLOCK, each block widened to
// float32 in registers (or a small buffer for half types and head sizes that are not a multiple of the vector),
// scored against every row, and folded into each row's running maximum, sum and accumulator (online softmax,
// float32). Each key and value is read from memory once for all the rows that share it, where PyTorch's CPU
// kernel (and the band kernel's tiles) are built for many queries and pay per-call packing and product set-ups
// that a single query cannot amortise.
//
// Row r (head c * G + r / Lq, query r % Lq) sees key j when lo[p, i] <= j < hi[p, i] (p = 0 or b) and, with a
// mask, mask[b', h', i', j] (each of b', h', i' 0 when that dimension of the mask is 1). A row that sees no key
// is 0 (a dead row). Keys outside every row's range are not read.
//
// In the same pass each (b, c) adds up q * 0, k * 0 and v * 0 over its query rows and every key and value it reads:
// 0 for finite ones, NaN for a NaN or an infinity (0 * inf is NaN). finite[b, c] is that sum's finiteness: False
// means a query, key or value read was not finite, and the caller (attnkit.nonfinite) takes its exact path; a masked key inside the
// range read counts too (a false alarm, which costs only that path). The output's other rows are then unspecified.
//
// Too few (b, c) for the threads: the key range is split into chunks, each chunk's (max, sum, accumulator) kept,
// and the chunks merged per row afterwards (the split softmax of FlashDecoding).
#include "decode.h"

#include "checks.h"
#include "vec_math.h"

namespace attnkit::band {

void check_decode(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const Tensor& lo,
                  const Tensor& hi, double scale) {
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
}

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr Index BLOCK = 32;          // keys scored together before they are folded into the rows
constexpr Index MIN_SPLIT = 512;     // the fewest keys a chunk of a split range takes
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

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
};

// The per-thread state of one chunk: each row's maximum, sum and accumulator [R, Dvp].
struct Rows {
  std::vector<float> q, m, l, acc, s, kbuf, vbuf;
  void size_for(const Shape& z) {
    q.assign(z.R * z.Dp, 0.f);
    m.assign(z.R, NEG_INF);
    l.assign(z.R, 0.f);
    acc.assign(z.R * z.Dvp, 0.f);
    s.assign(z.R * BLOCK, 0.f);
    kbuf.assign(BLOCK * z.Dp, 0.f);
    vbuf.assign(BLOCK * z.Dvp, 0.f);
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

// s[jj] = q . k_jj over the block's keys that row sees (allowed[jj]), -inf elsewhere; q in registers (NV vectors).
template <int NV>
inline void score_row(const float* q, const float* const* krows, const bool* allowed, Index n, float* s) {
  Vec qv[NV];
  for (int u = 0; u < NV; ++u) qv[u] = Vec::loadu(q + u * Vec::size());
  for (Index jj = 0; jj < n; ++jj) {
    if (!allowed[jj]) {
      s[jj] = NEG_INF;
      continue;
    }
    Vec a = qv[0] * Vec::loadu(krows[jj]);
    for (int u = 1; u < NV; ++u) a = at::vec::fmadd(qv[u], Vec::loadu(krows[jj] + u * Vec::size()), a);
    s[jj] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, a);
  }
}

// The most accumulator vectors a row keeps in registers while a block of values is added in.
constexpr Index ACC_VECS = 8;

// acc[0 : NV vectors) += sum over the block's keys jj of p[jj] * v_jj[d : d + NV vectors), in registers.
template <int NV>
inline void add_values(float* acc, const float* p, const float* const* vrows, Index n, Index d) {
  Vec a[NV];
  for (int u = 0; u < NV; ++u) a[u] = Vec::loadu(acc + u * Vec::size());
  for (Index jj = 0; jj < n; ++jj) {
    if (p[jj] == 0.f) continue;  // a masked key (a NaN weight still reaches the row)
    const Vec pv(p[jj]);
    const float* vr = vrows[jj] + d;
    for (int u = 0; u < NV; ++u) a[u] = at::vec::fmadd(pv, Vec::loadu(vr + u * Vec::size()), a[u]);
  }
  for (int u = 0; u < NV; ++u) a[u].store(acc + u * Vec::size());
}

// Keys [from, to) of (b, c) folded into `w` (whose q rows are loaded and scaled); returns the k * 0 + v * 0 sum.
template <typename T>
float run_chunk(const Shape& z, Rows& w, const T* kp, const T* vp, Index ks, Index vs, const int64_t* lo,
                const int64_t* hi, const bool* const* mrow, Index from, Index to) {
  const Index R = z.R, Dp = z.Dp, Dvp = z.Dvp;
  const bool k_inplace = std::is_same_v<T, float> && z.D == Dp;
  const bool v_inplace = std::is_same_v<T, float> && z.Dv == Dvp;
  Vec seen(0.f);
  const Vec zero(0.f);
  for (Index j0 = from; j0 < to; j0 += BLOCK) {
    const Index n = std::min(BLOCK, to - j0);
    // the block's keys, each read once (from memory) for every row, and their scores s[r, jj] (-inf where row r
    // does not see the key)
    const float* krows[BLOCK];
    for (Index jj = 0; jj < n; ++jj) {
      if (k_inplace) {
        krows[jj] = reinterpret_cast<const float*>(kp + (j0 + jj) * ks);
      } else {
        widen(kp + (j0 + jj) * ks, w.kbuf.data() + jj * Dp, z.D);
        krows[jj] = w.kbuf.data() + jj * Dp;
      }
      for (Index d = 0; d < Dp; d += Vec::size()) seen = at::vec::fmadd(Vec::loadu(krows[jj] + d), zero, seen);
    }
    bool allowed[BLOCK];
    for (Index r = 0; r < R; ++r) {
      const Index i = r % z.Lq;
      for (Index jj = 0; jj < n; ++jj) {
        const Index j = j0 + jj;
        allowed[jj] = j >= lo[i] && j < hi[i] && (mrow == nullptr || mrow[r][j]);
      }
      float* sr = w.s.data() + r * BLOCK;
      const float* qr = w.q.data() + r * Dp;
      if (Dp <= ACC_VECS * Vec::size()) {
        with_vecs(Dp / Vec::size(), [&](auto NV) { score_row<NV.value>(qr, krows, allowed, n, sr); });
        continue;
      }
      for (Index jj = 0; jj < n; ++jj) {
        if (!allowed[jj]) {
          sr[jj] = NEG_INF;
          continue;
        }
        Vec a(0.f), b(0.f);
        Index d = 0;
        for (; d + 2 * Vec::size() <= Dp; d += 2 * Vec::size()) {
          a = at::vec::fmadd(Vec::loadu(qr + d), Vec::loadu(krows[jj] + d), a);
          b = at::vec::fmadd(Vec::loadu(qr + d + Vec::size()), Vec::loadu(krows[jj] + d + Vec::size()), b);
        }
        if (d < Dp) a = at::vec::fmadd(Vec::loadu(qr + d), Vec::loadu(krows[jj] + d), a);
        sr[jj] = at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, a + b);
      }
    }
    // the online softmax: each row's new maximum, its old sum and accumulator rescaled, the block's weights
    for (Index r = 0; r < R; ++r) {
      float* sr = w.s.data() + r * BLOCK;
      float bm = NEG_INF;
      bool nan = std::isnan(w.m[r]);
      for (Index jj = 0; jj < n; ++jj) bm = std::max(bm, sr[jj]), nan = nan || std::isnan(sr[jj]);
      if (nan || bm == NEG_INF) {  // NaN in: the row stays NaN (its output too); nothing seen: weights 0
        if (nan) w.m[r] = std::numeric_limits<float>::quiet_NaN();
        for (Index jj = 0; jj < n; ++jj) sr[jj] = nan ? w.m[r] : 0.f;
        continue;
      }
      const float m_new = std::max(w.m[r], bm);
      if (m_new > w.m[r] && w.m[r] != NEG_INF) {
        const float c = std::exp(w.m[r] - m_new);
        w.l[r] *= c;
        float* ar = w.acc.data() + r * Dvp;
        for (Index d = 0; d < Dvp; d += Vec::size()) (Vec::loadu(ar + d) * Vec(c)).store(ar + d);
      }
      w.m[r] = m_new;
      Index jj = 0;
      float sum = 0.f;
      for (; jj + Vec::size() <= n; jj += Vec::size()) {
        const Vec p = vexp<float, false>(Vec::loadu(sr + jj) - Vec(m_new));
        p.store(sr + jj);
        sum += at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, p);
      }
      for (; jj < n; ++jj) {
        sr[jj] = std::exp(sr[jj] - m_new);
        sum += sr[jj];
      }
      w.l[r] += sum;
    }
    // the values, each read once (from memory) for every row; then each row's accumulator, held in registers
    // NV vectors at a time, takes the block's values from the cache
    const float* vrows[BLOCK];
    for (Index jj = 0; jj < n; ++jj) {
      if (v_inplace) {
        vrows[jj] = reinterpret_cast<const float*>(vp + (j0 + jj) * vs);
      } else {
        widen(vp + (j0 + jj) * vs, w.vbuf.data() + jj * Dvp, z.Dv);
        vrows[jj] = w.vbuf.data() + jj * Dvp;
      }
      for (Index d = 0; d < Dvp; d += Vec::size()) seen = at::vec::fmadd(Vec::loadu(vrows[jj] + d), zero, seen);
    }
    for (Index r = 0; r < R; ++r) {
      const float* pr = w.s.data() + r * BLOCK;
      float* ar = w.acc.data() + r * Dvp;
      for (Index d = 0; d < Dvp; d += ACC_VECS * Vec::size()) {
        const Index nv = std::min<Index>(ACC_VECS, (Dvp - d) / Vec::size());
        with_vecs(nv, [&](auto NV) { add_values<NV.value>(ar + d, pr, vrows, n, d); });
      }
    }
  }
  return at::vec::vec_reduce_all<float>([](Vec x, Vec y) { return x + y; }, seen);
}

template <typename T>
void decode_impl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const Tensor& lo,
                 const Tensor& hi, double scale, Tensor& out, Tensor& finite) {
  Shape z;
  z.B = q.size(0), z.H = q.size(1), z.Lq = q.size(2), z.D = q.size(3), z.Hkv = k.size(1), z.Lk = k.size(2);
  z.Dv = v.size(3), z.G = z.H / z.Hkv, z.R = z.G * z.Lq;
  const auto up = [](Index x) { return (x + Vec::size() - 1) / Vec::size() * Vec::size(); };
  z.Dp = std::max<Index>(up(z.D), Vec::size()), z.Dvp = std::max<Index>(up(z.Dv), Vec::size());
  const Index items = z.B * z.Hkv;
  const T* qd = q.const_data_ptr<T>();
  const T* kd = k.const_data_ptr<T>();
  const T* vd = v.const_data_ptr<T>();
  T* od = out.data_ptr<T>();
  bool* fd = finite.data_ptr<bool>();
  const int64_t* lod = lo.const_data_ptr<int64_t>();
  const int64_t* hid = hi.const_data_ptr<int64_t>();
  const bool has_mask = mask.numel() > 0;
  const bool* md = has_mask ? mask.const_data_ptr<bool>() : nullptr;
  const Index lo_step = lo.size(0) == 1 ? 0 : z.Lq;
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
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, items * splits, 1, [&](Index begin, Index end) {
    Rows w;
    std::vector<const bool*> mrows(has_mask ? z.R : 0);
    for (Index it = begin; it < end; ++it) {
      const Index x = it / splits, part = it % splits, b = x / z.Hkv, c = x % z.Hkv;
      w.size_for(z);
      Vec q_seen(0.f);
      for (Index r = 0; r < z.R; ++r) {
        const Index h = c * z.G + r / z.Lq, i = r % z.Lq;
        const T* qr = qd + b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        float* wq = w.q.data() + r * z.Dp;
        widen(qr, wq, z.D);
        for (Index d = 0; d < z.Dp; d += Vec::size()) {
          const Vec x = Vec::loadu(wq + d);
          q_seen = at::vec::fmadd(x, Vec(0.f), q_seen);
          (x * Vec(sc)).store(wq + d);
        }
        if (has_mask) mrows[r] = md + (mask.size(0) == 1 ? 0 : b * mb) + (mask.size(1) == 1 ? 0 : h * mh) +
                                 (mask.size(2) == 1 ? 0 : i * mq);
      }
      const Index span = last[x] - first[x], per = (span + splits - 1) / splits;
      const Index from = std::min(last[x], first[x] + part * per), to = std::min(last[x], from + per);
      pseen[it] = run_chunk<T>(z, w, kd + b * k.stride(0) + c * k.stride(1), vd + b * v.stride(0) + c * v.stride(1),
                               k.stride(2), v.stride(2), lod + b * lo_step, hid + b * lo_step,
                               has_mask ? mrows.data() : nullptr, from, to) +
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
        const float l = w.l[r], inv = l > 0.f ? 1.f / l : 0.f;
        const float dead = std::isnan(w.m[r]) ? std::numeric_limits<float>::quiet_NaN() : 0.f;
        for (Index d = 0; d < z.Dv; ++d) orow[d] = static_cast<T>(l > 0.f ? w.acc[r * z.Dvp + d] * inv : dead);
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

}  // namespace

std::vector<Tensor> band_decode(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                const Tensor& lo, const Tensor& hi, double scale) {
  check_decode(q, k, v, mask, lo, hi, scale);
  const Index B = q.size(0), H = q.size(1), Lq = q.size(2), Hkv = k.size(1);
  Tensor out = at::empty({B, H, Lq, v.size(3)}, q.options().memory_format(at::MemoryFormat::Contiguous));
  Tensor finite = at::empty({B, Hkv}, q.options().dtype(at::kBool));
  if (out.numel() == 0 && finite.numel() == 0) return {out, finite};
  if (k.size(2) == 0 || out.numel() == 0) {
    out.zero_();
    finite.fill_(true);
    return {out, finite};
  }
  switch (q.scalar_type()) {
    case at::kFloat: decode_impl<float>(q, k, v, mask, lo, hi, scale, out, finite); break;
    case at::kBFloat16: decode_impl<c10::BFloat16>(q, k, v, mask, lo, hi, scale, out, finite); break;
    default: decode_impl<c10::Half>(q, k, v, mask, lo, hi, scale, out, finite); break;
  }
  return {out, finite};
}

}  // namespace attnkit::band
