"""The one table of numerical tolerances. Every comparison in the suite goes through ``close``.

Rows are keyed by the dtype the computation ran in. The float32 row is for results compared
against a float64 oracle after O(L * D) accumulation; half types round every output once.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-9},
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}

#: Module-level parity with a reference library (weights copied), float32 (issue: 1e-6 / 1e-5).
PARITY_FP32 = {"atol": 1e-6, "rtol": 1e-5}
MODEL_PARITY_FP32 = {"atol": 1e-5, "rtol": 1e-5}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **override) -> None:
    """Assert ``actual`` matches ``expected`` within the row for ``dtype`` (default: actual's)."""
    tol = dict(TOLERANCES[dtype or actual.dtype])
    tol.update(override)
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), **tol)
