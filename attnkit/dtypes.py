"""The dtype rule every kernel shares: what a call computes in.

Half-precision inputs (``float16``, ``bfloat16``) are computed in float32 by the CPU kernels
(scores, softmax and the weighted sum), and the result is cast back to the input's dtype; float32
and float64 compute in their own dtype. One rule, here, so that the reference, band, tiles and ring
paths round the same way and can be compared with one tolerance table. The one exception is the
banded kernel's forward and backward where it uses products of the half type (bfloat16 or float16, on a
CPU that multiplies that type natively, or asked for): every product takes operands of that type (exact
products, float32 sums; the weights, and in the backward dS, rounded to that type for the products that
take them), while the softmax, its statistics and every sum of the output and the gradients stay float32
(the exponential of weights rounded next a shorter one, within 3.2e-6 relative); see
:mod:`attnkit.backends._band`.
"""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)
#: Every dtype a call may come in: the half types and the two full ones (not float8 and the like, which
#: PyTorch itself does not multiply or sum on every device).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU kernels compute in: half types go through float32, others stay."""
    return torch.float32 if dtype in HALF else dtype
