"""Attention over one tile of keys, forward and backward, with its log-sum-exp.

These are the two primitives behind exact memory-efficient attention (Rabe & Staats 2021;
FlashAttention, Dao et al. 2022) and ring attention (Liu et al. 2023): attend a block of queries
to one block of keys, return the partial output normalised over that block together with the
row log-sum-exp, and merge partial results from different key blocks through their log-sum-exps.
The backward recomputes the probabilities of a tile from the saved log-sum-exp instead of
keeping them.

Shapes: ``q [..., Lq, E]``, ``k [..., Lk, E]``, ``v [..., Lk, Ev]``; ``allowed`` (bool) and
``bias`` (float) broadcast to ``[..., Lq, Lk]``; ``lse [..., Lq]``. Callers choose the compute
dtype (float32 for half inputs); a row with no allowed key has ``lse = -inf`` and output 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

_NEG_INF = float("-inf")


def _scores(q: Tensor, k: Tensor, scale: float, allowed: Tensor | None, bias: Tensor | None) -> Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # [..., Lq, Lk]
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, _NEG_INF)
    return s


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def tile_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` over this tile of keys.

    Returns:
        ``(out [..., Lq, Ev], lse [..., Lq])``: ``out`` is normalised over this tile alone;
        rows with no allowed key give ``out = 0`` and ``lse = -inf``.
    """
    s = _scores(q, k, scale, allowed, bias)
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows with nothing allowed
    p = torch.exp(s - _finite_or_zero(lse).unsqueeze(-1))
    return torch.matmul(p, v), lse


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial results over disjoint key sets into the result over their union.

    ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)`` with ``lse = logaddexp(lse_a,
    lse_b)``; a row empty on both sides stays ``(0, -inf)``.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    ref = _finite_or_zero(lse)
    wa = torch.exp(lse_a - ref).unsqueeze(-1)
    wb = torch.exp(lse_b - ref).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


def tile_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    lse: Tensor,
    delta: Tensor,
    *,
    scale: float,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """This tile's share of the gradients, given the *final* row ``lse`` and ``delta``.

    Args:
        dout: gradient of the final output ``[..., Lq, Ev]``.
        lse: final log-sum-exp over all keys ``[..., Lq]`` (from the forward pass).
        delta: ``(dout * out).sum(-1)`` with the final output, ``[..., Lq]``.

    Returns:
        ``(dq, dk, dv, ds)``: contributions to add up over tiles; ``ds [..., Lq, Lk]`` is the
        gradient of the (scaled, biased) scores, which is also the gradient of ``bias``.
    """
    s = _scores(q, k, scale, allowed, bias)
    p = torch.exp(s - _finite_or_zero(lse).unsqueeze(-1))  # probabilities under the full softmax
    dv = torch.matmul(p.transpose(-2, -1), dout)
    dp = torch.matmul(dout, v.transpose(-2, -1))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq, dk, dv, ds
