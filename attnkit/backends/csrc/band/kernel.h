// Banded attention on CPU: the entry points of the module that attnkit/backends/_band.py loads (built at
// install by setup.py, else on first use), one translation unit per role:
//   checks.cpp    the arguments of every entry point, checked before any memory is touched (checks.h)
//   products.cpp  the matrix products: BLAS, MKL's half products, oneDNN's brgemm and its packing (products.h)
//   vec_math.h    exp, tanh capping, maxima and sums on at::vec (inline: the hot loops call them)
//   tiles.h       rows, intervals, key segments and the online softmax of a row, shared by both passes
//   forward.cpp   the forward (band_forward)
//   backward.cpp  the backward (band_backward)
//   bindings.cpp  the Python module
//
//
// Query row i of batch element b, head h attends the keys in a few intervals, starts[p, i, k] <= j
// < ends[p, i, k] with p = 0, b or b * H + h (the intervals shared, per batch element, or per head
// too; each row's sorted and disjoint, empty ones last; rows in any order: a window, causal,
// padding, packed documents, a window plus global tokens, dilated or strided patterns, a block
// layout), with an optional bias per head and diagonal, bias[h, j - i + L - 1] (ALiBi,
// relative positions), and optional tanh soft-capping of the scores, t <- c * tanh(t / c) after the
// scale and bias (Gemma 2, Grok): the backward multiplies dS by 1 - (t / c)^2 before dQ, dK and
// the bias gradient take it (the bias is inside the tanh). Forward: for each block of query rows,
// the union of the rows' intervals as a few segments of keys (gaps shorter than the block closed,
// so a sliding window is one segment, exactly its first row's start to its last row's end), in
// chunks merged by an online softmax; only the columns a row may see are exponentiated, the rest
// are zero. Backward (FlashAttention-2): for each block of keys, the runs of query rows that see
// one of its keys (found once per call from the intervals); probabilities are recomputed from the
// saved row maximum and log-sum, dK and dV belong to the block, dQ rows are shared with neighbouring blocks
// and added under a lock per LOCK_ROWS rows, in whatever order the threads arrive, so dQ (and a
// bias gradient, summed per thread) may change from run to run. Under
// torch.use_deterministic_algorithms(True) dQ comes from a second pass over query blocks instead
// (like the forward), each block owning its rows, and with a learned bias threads take fixed shares
// of the key blocks: every result is then bitwise repeatable run to run at a given thread count,
// for one more recomputation of the probabilities. Across thread counts results may differ in the
// last bits in either mode: torch's BLAS rounds differently with the thread count, and the bias
// gradient is summed per thread.
//
// Global tokens (a row that sees every key, a key that every row sees, beside a window): such a row
// would make its whole block of rows compute every key, such a key its whole block of keys every
// row, and a lone key or row far from the window would be a product of its own. So the forward
// computes rows far wider than the rest of their block (mark_wide) apart, gathered in groups, and
// gathers each block's short key segments into one chunk (key_chunks; the deterministic dQ pass,
// which walks query blocks, too); the backward does the same with keys far wider than the rest of
// their block, and gathers each key block's lone rows.
//
// Large scores: a score is scaled (biased, capped) once, stored, and every later step works on that
// stored value: exp(t - m) with m the maximum of the same stored t. Computing s * scale - m in one
// expression lets the compiler fuse it into an FMA whose unrounded product differs from the rounded
// one m came from, by up to half an ulp of the score (256 at 7e9): exp of that is 0 or inf. The
// backward subtracts m and log(l) separately for the same reason (m + log(l) rounds to m there).
//
// Non-finite inputs: the forward gives every row of a block NaN statistics when a key or value it read
// for the block is not finite, and a row NaN statistics when its visible scores' maximum is not finite.
// A NaN or infinite key makes its raw score with any finite query NaN or infinite, visible or not, so
// one row of raw scores per chunk tells for the chunk's keys; a value that is not finite reaches every
// row of the accumulator (p * inf, 0 * inf), so one accumulator row tells for the block's values; a
// query that is not finite makes its row's scores NaN or infinite, whose maximum then is (capped scores
// are finite, so capped rows add up their raw scores instead). So statistics free of NaN mean that every
// row of q, k and v the forward read was finite (a false alarm when a finite score overflows), and the
// output is the finite formula's. The caller (attnkit.nonfinite) uses that in place of reading q, k and
// v once more before the call.
//
// Matrix products go to the BLAS that torch itself links (sgemm_/dgemm_, looked up weakly so that
// a torch without them still loads this module: has_blas() then says no and nothing here is used), or
// float32 ones to oneDNN's brgemm where the Python side chose it (set_f32_brgemm; products.h).
// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: gemm() swaps the operands.
#pragma once

#include "common.h"

namespace attnkit::band {

// The module's functions (bindings.cpp says what each takes and returns).
std::vector<Tensor> band_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& starts,
                                 const Tensor& ends, const Tensor& bias, double scale, double softcap, Index q_rows,
                                 Index kv_chunk);
std::vector<Tensor> band_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& stats, const Tensor& starts, const Tensor& ends,
                                  const Tensor& bias, double scale, double softcap, Index kv_rows, Index q_chunk,
                                  bool deterministic, bool bias_grad);
Tensor half_product(const Tensor& a, const Tensor& b, const Tensor& c, bool ta, bool tb, double alpha, double beta);
std::vector<double> f32_product_times(Index reps);

}  // namespace attnkit::band
