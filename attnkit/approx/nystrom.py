"""Nystromformer (Xiong et al. 2021): softmax attention through ``m`` landmarks in O(n m).

With landmarks ``Q~``, ``K~`` (means of ``m`` consecutive segments of the queries and keys)::

    out = softmax(s Q K~^T) @ pinv(softmax(s Q~ K~^T)) @ softmax(s Q~ K^T) @ V
          [Lq, m]              [m, m]                  [m, Lk]

With one landmark per token (``m = n``) and the exact pseudo-inverse the middle factor inverts the
first and the result is softmax attention. The paper's depthwise convolution on ``V`` is a learned
addition, not part of the approximation, and is left out.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..functional import attention as exact


def segment_means(x: Tensor, m: int) -> Tensor:
    """``x [..., L, E]`` -> ``[..., m, E]``: the means of ``m`` consecutive, nearly equal segments.

    The paper needs ``m | L``; segments of ``floor`` or ``ceil(L / m)`` tokens lift that.
    """
    n = x.shape[-2]
    seg = torch.arange(n, device=x.device) * m // n  # token -> its segment, nondecreasing, all m used
    avg = torch.zeros(m, n, dtype=x.dtype, device=x.device)
    avg[seg, torch.arange(n, device=x.device)] = 1.0
    avg = avg / avg.sum(-1, keepdim=True)
    return avg @ x


def iterative_pinv(a: Tensor, iterations: int) -> Tensor:
    """The paper's Moore-Penrose iteration (their eq. 16), from ``Z0 = A^T / (|A|_1 |A|_inf)``."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm = a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1)  # ||A||_1 * ||A||_inf per matrix
    z = a.transpose(-2, -1) / norm[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, scale: float, num_landmarks: int,
                      exact_pinv: bool, pinv_iterations: int) -> Tensor:
    """``q [..., H, Lq, E]``, ``k``/``v`` with ``H`` heads; ``mask`` a key-padding mask ``[..., 1, Lk]`` or None.

    At most ``min(Lq, Lk)`` landmarks are used (then each is one token). The key-padding mask
    enters the last factor only, where keys appear one by one: that keeps ``m = n`` exact;
    with fewer landmarks padded keys still shift the segment means.
    """
    m = min(num_landmarks, q.shape[-2], k.shape[-2])
    if m == 0:
        return exact(q, k, v, mask=mask, scale=scale)
    q_l, k_l = segment_means(q, m), segment_means(k, m)  # [..., H, m, E]
    middle = torch.softmax(q_l @ k_l.transpose(-2, -1) * scale, dim=-1)  # [..., H, m, m]
    pinv = torch.linalg.pinv(middle) if exact_pinv else iterative_pinv(middle, pinv_iterations)
    right = exact(q_l, k, v, mask=mask, scale=scale)  # softmax(s Q~ K^T) V, masked: [..., H, m, Ev]
    return exact(q, k_l, pinv @ right, scale=scale)  # softmax(s Q K~^T) (pinv @ right)
