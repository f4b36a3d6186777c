// The forward: for each block of query rows, the keys its rows see in chunks merged by an online softmax
// (kernel.h describes the whole kernel).
#include "checks.h"
#include "kernel.h"
#include "products.h"
#include "tiles.h"
#include "vec_math.h"

namespace attnkit::band {
namespace {

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
  // float32 products through brgemm likewise: k^T copied once per call (transposed_f32), the B that brgemm reads
  // for q k^T (sgemm reads k as it is stored). Not scaled: the queries take the scale as they are copied.
  constexpr bool f32 = std::is_same_v<T, float> && std::is_same_v<KV, float> && std::is_same_v<KS, float>;
  Tensor keys_t;
  const float* keys_t_base = nullptr;
  Index keys_t_ld = 0;
  if constexpr (f32) {
    if (packs_keys(q, k, q_rows, R)) {
      keys_t = transposed_f32(k, keys_t_ld);
      keys_t_base = keys_t.data_ptr<float>();
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
      if constexpr (f32) {
        if (keys_t_base != nullptr && c0 >= 0) {  // columns c0.. of k^T, copied once for the call
          gemm_f32_brgemm(g, kc, d.E, unpacked_factor, qp, lda, keys_t_base + (b * d.Hkv + h / G) * d.E * keys_t_ld + c0,
                          keys_t_ld, 0.f, s, kc);
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

}  // namespace

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

}  // namespace attnkit::band
