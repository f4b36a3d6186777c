"""Per-head summaries of attention maps: how spread out and how far each head looks."""

from __future__ import annotations

import torch
from torch import Tensor


def _check(attn: Tensor) -> None:
    if attn.dim() < 2:
        raise ValueError(f"attn must be [..., Lq, Lk], got shape {tuple(attn.shape)}")


def entropy(attn: Tensor) -> Tensor:
    """Mean entropy, in bits, of the query rows of attention maps.

    A head that looks at one token scores 0; one that spreads evenly over ``n`` keys scores
    ``log2(n)``. Rows that carry no weight (fully masked queries) are left out of the mean.

    Args:
        attn: ``[..., Lq, Lk]`` weights, rows summing to 1 (or 0 where fully masked).

    Returns:
        ``[...]``: one value per map (e.g. ``[B, H]`` for one layer), float32 or float64.
    """
    _check(attn)
    p = attn.double() if attn.dtype == torch.float64 else attn.float()
    h = -(torch.where(p > 0, p * torch.log2(p.clamp_min(torch.finfo(p.dtype).tiny)), 0.0)).sum(-1)
    live = p.sum(-1) > 0
    return (h * live).sum(-1) / live.sum(-1).clamp_min(1)


def mean_distance(attn: Tensor) -> Tensor:
    """Mean distance, in tokens, between a query and the keys it attends to.

    ``sum_j p[i, j] * |i - j|`` averaged over the rows that carry weight. When ``Lq != Lk`` queries
    are aligned bottom-right (query ``i`` sits at key position ``i + Lk - Lq``), as with a KV cache.

    Args:
        attn: ``[..., Lq, Lk]`` weights.

    Returns:
        ``[...]``: one value per map.
    """
    _check(attn)
    p = attn.double() if attn.dtype == torch.float64 else attn.float()
    lq, lk = p.shape[-2:]
    qpos = torch.arange(lq, device=p.device, dtype=p.dtype)[:, None] + (lk - lq)
    kpos = torch.arange(lk, device=p.device, dtype=p.dtype)[None, :]
    d = (p * (qpos - kpos).abs()).sum(-1)
    live = p.sum(-1) > 0
    return (d * live).sum(-1) / live.sum(-1).clamp_min(1)
