"""The one table of numerical tolerances. Every comparison in the suite goes through ``close``.

Rows are keyed by the dtype the computation ran in. The float32 row is for results compared
against a float64 oracle after O(L * D) accumulation; half types round every output once.

Parity with another implementation (transformers, torch.nn, sentence-transformers, or our own
cached decoding against a full pass) is checked in float64 wherever the reference runs in float64:
both sides then round at ~1e-16, and the float64 row holds on any CPU. In float32 the two sides
differ by their operation orders, and those depend on the CPU (AVX512 / AVX2 / scalar kernels), the
BLAS blocking and the thread count: a fixed 1e-5 passed on one machine and failed on another
(GPT-2 logits of size ~10 differed by 1.3e-5). The float32 parity rows are therefore measured:

* ``python -m tests.support.measure_tolerances`` runs every kind of float32 parity comparison over 8 seeds
  and the test configurations, with 1 and 2 threads, and reports per family the worst
  ``rel = (|ours32 - truth64| + |theirs32 - truth64|) / max|truth64|``: the most the two float32
  results may differ where their rounding errors do not cancel, relative to the size of the result
  (rounding error grows with the whole computation, not with each element, hence ``scaled_atol``).
* Re-measure under each dispatch level torch offers and take the worst:
  ``for cap in "" avx2 default; do ATEN_CPU_CAPABILITY=$cap python -m tests.support.measure_tolerances; done``.
* Measured (torch 2.13, an AVX512 Xeon, worst of its AVX512, AVX2 and scalar kernels, 1 and 2 threads):

  ==========================================================  ==========  ================
  family                                                      worst rel   worst |a-b| here
  ==========================================================  ==========  ================
  models: GPT-2 logits / BERT states vs transformers          1.60e-5     3.6e-5
  models: cached decoding vs full pass (GPT-2 logits)         3.98e-6     1.2e-5
  models: sentence embeddings vs sentence-transformers        1.51e-6     1.4e-7
  modules: torch.nn.MultiheadAttention / Transformer* layers  7.27e-7     2.4e-7
  kernels: blockwise vs SDPA (L up to 1024)                   1.79e-6     6.0e-7
  ==========================================================  ==========  ================

* Rows: 10x the worst measured ``rel``, rounded up: other vector widths and BLAS blockings give
  errors of the same order (the three dispatch levels here differ by at most 1.6x, the scalar
  kernels mostly the worst). Models: ``1.60e-5 -> 2e-4``; modules: ``7.27e-7 -> 8e-6``. The kernel
  comparisons (values of order 1) stay on the plain float32 row: its ``atol 2e-5`` is 7x their worst
  bound (2.79e-6, scalar kernels) and 33x the worst difference seen (6.0e-7).
* The old fixed 1e-5 was below GPT-2's measured float32 gap (3.6e-5 on logits of size 14),
  which is why it failed on some machines.

Half types: both rows bound outputs of order 1 rounded once, plus the float32 work before. SDPA's own
half-precision CPU path, against the float64 oracle on the same rounded inputs (B=2, H=4, E=64; window
+-40 at n = 257, causal at n = 300, no mask at n = 128; torch 2.13, AVX2), measured 2.7e-3, 7.2e-3
and 3.6e-3 in bfloat16 and 5.7e-4, 1.1e-3 and 4.2e-4 in float16. attnkit's banded kernel measured 0.80
to 1.00 of SDPA's on each when it widens half types to float32. With products of the half type (where torch
exports MKL's), whose weights are rounded to that type before the second product as FlashAttention does, its
output measured up to 1.23x SDPA's error in bfloat16 and 1.16x in float16 (window, causal with GQA,
documents; 10 seeds each), and its backward, which rounds dS too, up to 1.52x SDPA's bfloat16 backward's
error and 1.46x its float16 one on each gradient (SDPA's CPU backward computes in float32 and rounds once;
window, causal with GQA, documents, global tokens; 5 seeds, dQ both ways). ``tests/backends/test_band_half.py``
holds the widened paths to SDPA's error, the products to 1.5x (output) and 2x (gradients) of it, and all to
these rows. The rows keep about 3x SDPA's worst: bfloat16 ``2e-2``, float16 ``3e-3``.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-9},
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}

#: float32 parity of a module (attention, a Transformer layer) with torch.nn, weights copied.
PARITY_FP32 = {"scaled_atol": 8e-6, "rtol": 0.0}
#: float32 parity of a whole model (GPT-2, BERT, sentence embeddings) with its reference, or of
#: cached decoding with a full pass.
MODEL_PARITY_FP32 = {"scaled_atol": 2e-4, "rtol": 0.0}
#: A float32 kernel's softmax weights on scores exact in float32, each over its row's largest: relative error
#: against float64's exp. Measured at 1.96e-7 (the banded kernel's AVX-512 exponential) and 3.7e-7 (ATen's
#: exp_u20, its AVX2 one); a float32 rounding is 6e-8.
EXP_WEIGHTS_FP32 = 6e-7
#: The log of a row's softmax sum (the banded kernel's statistic, with the row's largest score taken out) for
#: bfloat16 and float16 inputs whose scores are exact, against float64. Under half products the weights are
#: rounded to the half type for p v, and their exponential is a shorter one, at most 3.2e-6 off relative
#: (every float checked); the sum takes that error. Measured at 1.7e-6 (float32 products: 3.1e-7).
LOG_ROW_SUM_HALF = 4e-6
#: Parity rows by the dtype both sides ran in; float64 is the plain float64 row.
PARITY = {torch.float64: {}, torch.float32: PARITY_FP32}
MODEL_PARITY = {torch.float64: {}, torch.float32: MODEL_PARITY_FP32}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *,
          scaled_atol: float | None = None, **override) -> None:
    """Assert ``actual`` matches ``expected`` within the row for ``dtype`` (default: actual's).

    ``scaled_atol`` gives the absolute tolerance in units of ``max|expected|`` (the float32 parity rows).
    """
    tol = dict(TOLERANCES[dtype or actual.dtype])
    if scaled_atol is not None:
        finite = expected.detach()[expected.isfinite()]  # an inf would make the tolerance infinite
        tol["atol"] = scaled_atol * finite.abs().max().item() if finite.numel() else 0.0
    tol.update(override)
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), **tol)
