// What the entry points check: every argument, before any memory is read or written, as PyTorch's
// own operators do. A failed check is a RuntimeError naming the argument, what came and what was
// expected. Each check is O(1) (sizes, strides, dtypes, devices) except the intervals' bounds, one
// pass over starts and ends; q, k, v are never read for it. The bodies are in checks.cpp.
#pragma once

#include "common.h"

namespace attnkit::band {

// Block and chunk sizes: at least 1 (work is divided by them), at most this (a thread's scratch is
// rows x chunk, and a vector per block is sized by them).
constexpr Index MAX_BLOCK = Index(1) << 20;
// The BLAS takes sizes and row strides as int.
constexpr Index MAX_INT = std::numeric_limits<int>::max();

inline bool is_half(const Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf; }

// The type the kernel computes in for q's dtype: float32 for the half types.
inline at::ScalarType compute_type(const Tensor& q) { return is_half(q) ? at::kFloat : q.scalar_type(); }

// "float32", "bfloat16", ... (torch's own names for the kernel's types)
std::string dtype_name(at::ScalarType t);
// A tensor's dtype, sizes, layout and device, for a message.
std::string described(const Tensor& t);

// `name` is a dense CPU tensor of `dtype` with `dims` dimensions (`shape` names them).
void check_tensor(const Tensor& t, const char* name, at::ScalarType dtype, int64_t dims, const char* shape);
// `name` ([..., rows, width]) has rows the BLAS reads in place: entries contiguous, rows at least a
// row apart (its leading dimension), that distance an int.
void check_blas_rows(const Tensor& t, const char* name);
// q [B, H, Lq, E], k [B, Hkv, Lk, E], v [B, Hkv, Lk, Ev]: float32 or float64 (half: also bfloat16 or float16,
// for the forward, which reads them as they are), one dtype, H a multiple of Hkv.
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, bool half = false);
// starts, ends: contiguous int64 [P, Lq, K >= 1], P 1, B or B*H, each 0 <= start <= end <= Lk (their
// order within a row is the caller's: intervals out of order give wrong sums, never out-of-bounds reads).
void check_intervals(const Tensor& q, const Tensor& k, const Tensor& starts, const Tensor& ends);
// bias: [0, 0] for none, else contiguous [1 or H, Lq + Lk - 1], in q's dtype.
void check_bias(const Tensor& q, const Tensor& k, const Tensor& bias);
// scale finite and softcap finite and >= 0 (0: off), both in q's dtype; block sizes in [1, MAX_BLOCK].
void check_numbers(const Tensor& q, double scale, double softcap, Index rows, const char* rows_name, Index chunk,
                   const char* chunk_name);
// Whether torch exposes the BLAS (sgemm_, dgemm_) the kernel calls; check_blas() raises if not.
bool has_blas();
void check_blas();

}  // namespace attnkit::band
