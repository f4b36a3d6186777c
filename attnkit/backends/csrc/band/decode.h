// The decode entry point (decode.cpp says what it computes): a few queries against a long cache.
#pragma once

#include "common.h"

namespace attnkit::band {

// The most queries per call: every query row of a key/value head is held in registers' reach at once.
constexpr Index MAX_DECODE_QUERIES = 8;

// q [B, H, Lq, E] float32/bfloat16/float16 with 1 <= Lq <= MAX_DECODE_QUERIES, k [B, Hkv, Lk, E] and
// v [B, Hkv, Lk, Ev] in its dtype (H a multiple of Hkv), each with unit stride along its last dim; mask bool
// [1 or B, 1 or H, 1 or Lq, Lk] with unit stride along its last dim, or [0, 0, 0, 0] for none; lo, hi contiguous
// int64 [1 or B, Lq], 0 <= lo <= hi <= Lk; scale finite in float32; softcap finite in float32 and >= 0 (scores
// capped to softcap * tanh(score / softcap) after the scale; 0 for none). Checked (RuntimeError naming the argument)
// before any memory is touched.
void check_decode(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const Tensor& lo,
                  const Tensor& hi, double scale, double softcap);
// -> [out [B, H, Lq, Ev] in q's dtype, finite bool [B, Hkv]: whether the query rows of (b, c) and every key and
// value the call read there were finite].
std::vector<Tensor> band_decode(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                                const Tensor& lo, const Tensor& hi, double scale, double softcap);

// The decode lane's call (attnkit.attention's plain step: one query, no mask, every key seen, no soft cap):
// q [B, H, 1, E], k [B, Hkv, Lk, E], v [B, Hkv, Lk, Ev] dense CPU float32/bfloat16/float16 tensors of one dtype
// (H a multiple of Hkv, Lk and Hkv >= 1), no gradient asked for; scale NaN for 1 / sqrt(E), else finite in float32.
// -> out [B, H, 1, Ev] where every query, key and value read was finite; an undefined tensor (None in Python) for
// any other call or input, whose caller then takes the whole path. Never raises for what it is given: what it
// does not take it leaves to the path that checks and says why.
Tensor band_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, double scale);

}  // namespace attnkit::band
