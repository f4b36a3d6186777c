// What every translation unit of the banded attention kernel shares: torch's headers, the BLAS symbols
// torch links (looked up weakly), the index type and the one way work is handed to the threads.
// The kernel itself is described in forward.cpp (the maths and its numerics) and backward.cpp.
//
// Everything lives in namespace attnkit::band, compiled with hidden visibility (-fvisibility=hidden):
// only the Python module's entry point is exported. Helpers that a hot loop calls are inline or
// templates here and in the other headers, so each loop compiles as it did in one translation unit.
#pragma once

#include <ATen/ATen.h>
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

namespace attnkit::band {

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
// Each thread ends its share with release_products() (products.cpp).
void release_products();

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

}  // namespace attnkit::band
