// The backward (FlashAttention-2): for each block of keys, the runs of query rows that see one of its keys,
// probabilities recomputed from the forward's statistics (kernel.h describes the whole kernel).
#include "checks.h"
#include "kernel.h"
#include "products.h"
#include "tiles.h"
#include "vec_math.h"

namespace attnkit::band {
namespace {

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
  // float32 products through brgemm (set_f32_brgemm) the same way, from float32 copies (transposed_f32). brgemm
  // reads B row-major, where sgemm reads k and v as they are stored for q k^T and dout v^T: a key block's k^T
  // and v^T are made once for the block, into the thread's buffers (its every chunk of rows and head of the
  // group reads them; a copy per call would be one more pass over k and v, which costs more than brgemm saves
  // where few rows read each key), and for dQ's own pass, which walks blocks of rows as the forward does, once
  // per call where many blocks read each key (packs_keys).
  constexpr bool f32 = std::is_same_v<T, float> && std::is_same_v<KV, float> && !widens;
  Tensor q_t, do_t, k_t, v_t;
  Index t_ld = 0, kv_ld = 0;
  if constexpr (std::is_same_v<KV, c10::BFloat16> && !widens) {
    if (brgemm_bf16() && q_chunk >= BRGEMM_ROWS) {
      q_t = transposed_rows(q, t_ld);
      do_t = transposed_rows(dout, t_ld);
    }
  } else if constexpr (f32) {
    if (f32_brgemm.load(std::memory_order_relaxed) && q_chunk >= BRGEMM_ROWS) {
      q_t = transposed_f32(q, t_ld);
      do_t = transposed_f32(dout, t_ld);
      if (deterministic && packs_keys(q, k, kv_rows, R)) {
        k_t = transposed_f32(k, kv_ld);
        v_t = transposed_f32(v, kv_ld);
      }
    }
  }
  // rows i0 .. i0 + n of (b, h) as columns of q^T (or dout^T), where the transposed sums take them (else nullptr;
  // bfloat16: pairs of rows interleaved, so from an even row, and a multiple of BRGEMM_Q rows)
  const auto transposed_at = [&](const Tensor& t, Index b, Index h, Index i0, Index n) -> const KV* {
    if (!t.defined() || i0 < 0 || (!f32 && (i0 % 2 != 0 || n % BRGEMM_Q != 0))) return nullptr;
    return static_cast<const KV*>(t.data_ptr()) + (b * d.H + h) * t.size(2) + i0;  // (t: [B, H, Ep * t_ld])
  };
  // S = q k^T and dP = dout v^T of m rows (qp, dop: rows ldq, ldo apart) against n keys (kp, vp: rows ldk, ldv
  // apart), into p and ds (rows n apart): through brgemm from the keys' k^T and v^T (kt, vt: rows ldt apart) where
  // they were made, else with the keys as they are stored.
  const auto scores = [&](Index m, Index n, const KV* qp, Index ldq, const KV* dop, Index ldo, const KV* kp,
                          Index ldk, const KV* vp, Index ldv, const T* kt, const T* vt, Index ldt, T* p, T* ds) {
    if constexpr (f32) {
      if (kt != nullptr) {
        gemm_f32_brgemm(m, n, d.E, 1.f, qp, ldq, kt, ldt, 0.f, p, n);
        gemm_f32_brgemm(m, n, d.Ev, 1.f, dop, ldo, vt, ldt, 0.f, ds, n);
        return;
      }
    }
    product<T, KV>(false, true, m, n, d.E, T(1), qp, ldq, kp, ldk, T(0), p, n);
    product<T, KV>(false, true, m, n, d.Ev, T(1), dop, ldo, vp, ldv, T(0), ds, n);
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
    std::vector<KV> pairs(q_t.defined() && !f32 ? (q_chunk + 1) / 2 * 2 * cp_max : 0);
    // a key block's k^T and v^T ([E x cp] and [Ev x cp]) for float32 products through brgemm
    std::vector<T> kt_blk(f32 && q_t.defined() ? d.E * cp_max : 0), vt_blk(f32 && q_t.defined() ? d.Ev * cp_max : 0);
    for (Index it = 0; next(it);) {
      const Index blk = interleaved(it % blocks, blocks), hk = (it / blocks) % d.Hkv, b = it / (blocks * d.Hkv);
      const Index j0 = blk * kv_rows, cols = std::min(kv_rows, d.S - j0), cp = (cols + 15) / 16 * 16;
      Index ldk = 0, ldv = 0;
      const KV* kp = rows_as<KV, S>(k, b, hk, j0, cols, kb, ldk);
      const KV* vp = rows_as<KV, S>(v, b, hk, j0, cols, vb, ldv);
      const T* kt = nullptr;
      const T* vt = nullptr;
      if constexpr (f32) {
        if (!kt_blk.empty()) {
          transpose_f32(kp, cols, d.E, ldk, kt_blk.data(), cp);
          transpose_f32(vp, cols, d.Ev, ldv, vt_blk.data(), cp);
          kt = kt_blk.data();
          vt = vt_blk.data();
        }
      }
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
          scores(n, cols, qp, ldq, dop, ldo, kp, ldk, vp, ldv, kt, vt, cp, p, ds);
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
          if constexpr ((std::is_same_v<KV, c10::BFloat16> && !widens) || f32) {
            const KV* dot = transposed_at(do_t, b, h, i0, n);
            const KV* qt = transposed_at(q_t, b, h, i0, n);
            if (dot != nullptr && qt != nullptr) {
              if (!summed_t) {
                std::fill(dk_t.begin(), dk_t.begin() + d.E * cp, 0.f);
                std::fill(dv_t.begin(), dv_t.begin() + d.Ev * cp, 0.f);
                summed_t = true;
              }
              if constexpr (f32) {  // P and dS row-major as they are: brgemm's B
                gemm_f32_brgemm(d.Ev, cols, n, 1.f, dot, t_ld, p, cols, 1.f, dv_t.data(), cp);
                gemm_f32_brgemm(d.E, cols, n, 1.f, qt, t_ld, ds, cols, 1.f, dk_t.data(), cp);
              } else {
                pack_row_pairs(p, cols, n, cols, cp, pairs.data());
                brgemm_into(d.Ev, cp, n, dot, t_ld, pairs.data(), cp, 1.f, 1.f, dv_t.data(), cp);
                pack_row_pairs(ds, cols, n, cols, cp, pairs.data());
                brgemm_into(d.E, cp, n, qt, t_ld, pairs.data(), cp, 1.f, 1.f, dk_t.data(), cp);
              }
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
                      const auto& bias_of, Index c0) {
      const T* kt = nullptr;
      const T* vt = nullptr;
      if (k_t.defined() && c0 >= 0) {  // columns c0.. of k^T and v^T, copied once for the call
        kt = static_cast<const T*>(k_t.data_ptr()) + (b * d.Hkv + h / G) * d.E * kv_ld + c0;
        vt = static_cast<const T*>(v_t.data_ptr()) + (b * d.Hkv + h / G) * d.Ev * kv_ld + c0;
      }
      scores(g, kc, qp, ldq, dop, ldo, kp, ldk, vp, ldv, kt, vt, kv_ld, w.p, w.ds);
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

}  // namespace

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

}  // namespace attnkit::band
