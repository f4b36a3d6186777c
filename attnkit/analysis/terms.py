"""A score taken apart: the per-dimension terms whose sum is ``q_i . k_j * scale``.

A score is a sum over the head's ``D`` dimensions, ``s[i, j] = sum_d q[i, d] * k[j, d] * scale``;
which dimensions make it large, and which pull it down, is what :func:`score_terms` shows.

Plain PyTorch, for a reader::

    terms = q[..., :, None, :] * k[..., None, :, :] * scale     # [..., Lq, Lk, D]
    assert torch.allclose(terms.sum(-1), q @ k.transpose(-2, -1) * scale)
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


def _check(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be [..., L, D] with at least 2 dimensions, got shape {tuple(t.shape)}")
    if q.dim() != k.dim():
        raise ValueError(f"q and k must have the same number of dimensions, got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head size D (last dimension), got q {tuple(q.shape)} "
                         f"and k {tuple(k.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must have the same dtype, got q {q.dtype} and k {k.dtype}")
    if q.dim() >= 3 and q.shape[-3] != k.shape[-3]:
        h, hkv = q.shape[-3], k.shape[-3]
        if hkv == 0 or h % hkv:
            raise ValueError(f"q has {h} heads and k {hkv} (dimension -3): the query heads must be a multiple "
                             f"of the key heads (grouped-query attention), got q {tuple(q.shape)} and k "
                             f"{tuple(k.shape)}")
        k = k.repeat_interleave(h // hkv, dim=-3)  # query head h reads key head h // (H / Hkv)
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the leading dimensions of q {tuple(q.shape)} and k {tuple(k.shape)} do not "
                         "broadcast") from None
    return q, k


def score_scale(scale, head_dim: int, name: str = "scale") -> float:
    """The factor on ``q . k``: ``scale`` checked (a finite real number), or ``1 / sqrt(head_dim)`` for None, as
    :func:`attnkit.attention` uses. ``name`` is how errors call it.

    Raises:
        TypeError: ``scale`` is not a real number or None.
        ValueError: ``scale`` is not finite.
    """
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{name} must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)


def score_terms(q: Tensor, k: Tensor, *, scale: float | None = None, query: int | None = None) -> Tensor:
    """The terms ``q[i, d] * k[j, d] * scale`` whose sum over ``d`` is the score of query ``i`` and key ``j``.

    Shape notation: ``...`` batch dims, ``H``/``Hkv`` query/key heads (``H % Hkv == 0``, as in
    :func:`attnkit.attention`), ``Lq``/``Lk`` lengths, ``D`` the head size.

    Args:
        q: ``[..., H, Lq, D]`` queries (or ``[Lq, D]`` for one head).
        k: ``[..., Hkv, Lk, D]`` keys, with as many dimensions as ``q``.
        scale: the factor on ``q . k`` (default ``1 / sqrt(D)``, what :func:`attnkit.attention` uses).
        query: one query position (negative counts from the end): only its terms are returned.

    Returns:
        ``[..., H, Lq, Lk, D]`` terms in ``q``'s dtype, or ``[..., H, Lk, D]`` for one ``query``.
        Summed over the last dimension they are the scores ``q @ k^T * scale`` up to rounding (the
        order of the sum differs from a matmul's). All ``Lq x Lk x D`` terms are made at once; for a
        long input pass ``query``.

    Raises:
        TypeError: ``q`` or ``k`` is not a floating-point tensor, their dtypes differ, or ``scale``
            or ``query`` is not a number.
        ValueError: shapes that disagree (head size, heads, batch), ``scale`` not finite, or
            ``query`` out of range.
    """
    q, k = _check(q, k)
    scale = score_scale(scale, q.shape[-1])
    if query is not None:
        if isinstance(query, bool) or not isinstance(query, numbers.Integral):
            raise TypeError(f"query must be an int or None, got {type(query).__name__}")
        lq = q.shape[-2]
        if not -lq <= query < lq:
            raise ValueError(f"query must be in [{-lq}, {lq}) for q with {lq} queries, got {query}")
        return q[..., query, None, :] * k * scale  # [..., Lk, D]
    return q[..., :, None, :] * k[..., None, :, :] * scale  # [..., Lq, Lk, D]
