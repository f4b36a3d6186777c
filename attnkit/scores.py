"""score_mod helpers: functions ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's form).

They close over tensors (slopes, tables), which may be ``nn.Parameter``s: backends propagate
gradients into what a score_mod captures. Positions: query ``i`` sits at ``i + offset``; pass
``offset = Lk - Lq`` for bottom-right alignment (decoding with a KV cache).

Helpers that add a bias depending only on the head and ``kv_idx - q_idx`` also carry
``attnkit_diagonal(heads, q_len, kv_len, dtype=None) -> [1 or H, q_len + kv_len - 1]`` (column
``kv_idx - q_idx + q_len - 1``, in ``dtype``; differentiable in the captured tensors), or None
where the arguments do not fit; the blockwise backend's banded kernel adds it along each row.

One dtype rule, on every backend: scores are computed in the inputs' compute dtype (float32 for
half types), and a score_mod's captured tensors are used in that dtype. The helpers here cast
what they capture to the score's dtype before any arithmetic (:func:`like_score`), and every
backend casts whatever a score_mod returns to the score's dtype (:func:`apply`). So float64
inputs with float32 ALiBi slopes compute in float64 (with the slopes' float32 values), float32
inputs with float64 slopes in float32, and gradients reach each captured tensor in its own dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .request import ScoreMod

__all__ = ["alibi_slopes", "alibi", "relative_position_bias", "softcap", "compose", "like_score", "apply"]


def like_score(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A captured tensor in the scores' dtype (differentiable: its gradient comes back in its own)."""
    return t if t.dtype == dtype else t.to(dtype)


def apply(score_mod: ScoreMod, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``score_mod(score, b, h, q_idx, kv_idx)`` in ``score``'s dtype, whatever dtype the mod computed in."""
    out = score_mod(score, b, h, q_idx, kv_idx)
    return like_score(out, score.dtype) if isinstance(out, Tensor) else out


def alibi_slopes(num_heads: int, *, device=None, dtype=torch.float32) -> Tensor:
    """ALiBi head slopes (Press et al. 2022): ``2^(-8/n), 2^(-16/n), ...`` for ``n`` heads.

    For a head count that is not a power of two, the paper takes the slopes of the nearest lower
    power of two ``m`` and fills up with every other slope of ``2m``.
    """
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")

    def pow2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    m = 2 ** math.floor(math.log2(num_heads))
    slopes = pow2(m) + pow2(2 * m)[0::2][: num_heads - m]
    return torch.tensor(slopes, device=device, dtype=dtype)


def alibi(slopes: Tensor, *, offset: int = 0) -> ScoreMod:
    """ALiBi: ``score - slopes[h] * |q_pos - kv_pos|``.

    With a causal mask this is the paper's ``-m * (i - j)``; without one it is the symmetric
    variant used for encoders.
    """

    def mod(score, b, h, q_idx, kv_idx):
        dist = (q_idx + offset - kv_idx).abs()
        return score - like_score(slopes, score.dtype)[h] * dist

    def diagonal(heads, q_len, kv_len, dtype=None):  # the mod reads slopes[h]: the first `heads` slopes
        if slopes.dim() != 1 or slopes.numel() < heads:
            return None
        own = like_score(slopes[:heads, None], dtype or slopes.dtype)
        return -own * (offset - _diagonals(q_len, kv_len, slopes.device)).abs()

    mod.attnkit_diagonal = diagonal
    return mod


def relative_position_bias(table: Tensor, max_distance: int, *, offset: int = 0) -> ScoreMod:
    """A learned bias per head and clipped relative distance (Shaw et al. 2018, as a bias).

    Args:
        table: ``[H, 2 * max_distance + 1]``; column ``max_distance + d`` is the bias for a key
            ``d`` positions after the query (``d`` clipped to ``[-max_distance, max_distance]``).
        max_distance: the clipping distance.
    """
    if table.dim() != 2 or table.shape[1] != 2 * max_distance + 1:
        raise ValueError(f"table must be [H, 2 * max_distance + 1] = [H, {2 * max_distance + 1}], "
                         f"got {tuple(table.shape)}")

    def mod(score, b, h, q_idx, kv_idx):
        d = (kv_idx - (q_idx + offset)).clamp(-max_distance, max_distance) + max_distance
        return score + like_score(table, score.dtype)[h, d]

    def diagonal(heads, q_len, kv_len, dtype=None):
        d = (_diagonals(q_len, kv_len, table.device) - offset).clamp(-max_distance, max_distance) + max_distance
        return like_score(table[:heads, d[0]], dtype or table.dtype) if table.shape[0] >= heads else None

    mod.attnkit_diagonal = diagonal
    return mod


def softcap(cap: float) -> ScoreMod:
    """Tanh soft-capping, ``cap * tanh(score / cap)`` (Gemma 2, Grok): bounds every logit."""
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}")

    def mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return mod


def compose(*mods: ScoreMod) -> ScoreMod:
    """Apply score_mods left to right."""

    def mod(score, b, h, q_idx, kv_idx):
        for m in mods:
            score = apply(m, score, b, h, q_idx, kv_idx)
        return score

    def diagonal(heads, q_len, kv_len, dtype=None):  # additive parts add up (in `dtype`, not each part's own)
        parts = [getattr(m, "attnkit_diagonal", lambda *_, **__: None)(heads, q_len, kv_len, dtype=dtype)
                 for m in mods]
        return None if not parts or any(p is None for p in parts) else sum(parts[1:], parts[0])

    mod.attnkit_diagonal = diagonal
    return mod


def _diagonals(q_len: int, kv_len: int, device) -> Tensor:
    """``kv_idx - q_idx`` of each diagonal of a ``[q_len, kv_len]`` grid, first column first."""
    return torch.arange(-(q_len - 1), kv_len, device=device).view(1, -1)
