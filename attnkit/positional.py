"""Positional encodings, in the three roles they play in a Transformer.

* **Added to the token embeddings** (absolute): :func:`sinusoidal_table`,
  :class:`SinusoidalPositionalEncoding` (Vaswani et al. 2017), :class:`LearnedPositionalEmbedding`
  (BERT, GPT-2). Their ``forward(x, start)`` takes the absolute position of ``x[:, 0]``, so a
  decoder fed one token at a time passes ``start = cache.seq_len``.
* **A q/k transform** (``MultiHeadAttention(rotary=...)``): :class:`RotaryEmbedding` (RoPE,
  Su et al. 2021), interleaved or half-rotation layout.
* **A score_mod** (``MultiHeadAttention(position_bias=...)``): :class:`ALiBi` (Press et al. 2022),
  :class:`T5RelativeBias` (Raffel et al. 2020), :class:`RelativeKeyEmbedding` (Shaw et al. 2018,
  Hugging Face BERT's ``relative_key``). Each has ``score_mod(q, k, *, offset)``: query ``i`` sits
  at absolute position ``i + offset`` and key ``j`` at ``j`` (``offset = Lk - Lq``, bottom-right,
  which is what a KV cache needs), and ``bias(q_len, kv_len)`` for the dense ``[H, Lq, Lk]`` term.

Shape notation: ``B`` batch, ``H`` heads, ``L`` length, ``D`` head size, ``E`` model size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import scores
from ._text import describe
from .call import ScoreMod

__all__ = [
    "sinusoidal_table",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "apply_rotary",
    "ALiBi",
    "t5_relative_position_bucket",
    "T5RelativeBias",
    "RelativeKeyEmbedding",
]


def _check_pos_int(name: str, val) -> None:
    if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
        raise ValueError(f"{name} must be a positive int, got {val!r}")


def _check_start(start) -> None:
    """A non-negative int, or a 0-d integer tensor (a compiled decode step's position: not read here)."""
    if isinstance(start, Tensor) and start.dim() == 0 and not start.is_floating_point() and start.dtype != torch.bool:
        return
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise ValueError(f"start must be a non-negative int (absolute position of x[:, 0]), got {start!r}")


def _grid_bias(mod: ScoreMod, heads: int, q_len: int, kv_len: int, device) -> Tensor:
    """Evaluate a positional score_mod on zeros: its additive term ``[H, Lq, Lk]``."""
    h = torch.arange(heads, device=device).view(-1, 1, 1)
    q = torch.arange(q_len, device=device).view(1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, -1)
    zero = torch.zeros((), device=device)
    return mod(zero, torch.zeros((), dtype=torch.long, device=device), h, q, kv).expand(heads, q_len, kv_len)


# --------------------------------------------------------------------------------------------
# Absolute: added to the embeddings
# --------------------------------------------------------------------------------------------


def sinusoidal_table(num_positions: int, dim: int, *, start: int = 0, base: float = 10000.0,
                     dtype=torch.float32, device=None) -> Tensor:
    """The fixed encodings of "Attention Is All You Need", ``[num_positions, dim]``.

    ``PE[pos, 2i] = sin(pos / base^(2i/dim))`` and ``PE[pos, 2i+1] = cos(pos / base^(2i/dim))``
    for ``pos = start ... start + num_positions - 1``; with an odd ``dim`` the last column is a
    sine. Computed in float64 and rounded once.
    """
    if not isinstance(num_positions, int) or num_positions < 0:
        raise ValueError(f"num_positions must be a non-negative int, got {num_positions!r}")
    _check_pos_int("dim", dim)
    _check_start(start)
    pos = (torch.arange(num_positions, dtype=torch.float64, device=device) + start)[:, None]
    two_i = torch.arange(0, dim, 2, dtype=torch.float64, device=device)  # 2i
    angle = pos / base ** (two_i / dim)  # (L, ceil(dim/2))
    pe = torch.empty(num_positions, dim, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return pe.to(dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """``dropout(x + PE[start : start + L])`` with :func:`sinusoidal_table`; no parameters.

    Args:
        dim: ``E``.
        dropout: on the sum, while training (the paper uses 0.1).
        base: the wavelength base, 10000 in the paper.
    """

    def __init__(self, dim: int, *, dropout: float = 0.0, base: float = 10000.0) -> None:
        super().__init__()
        _check_pos_int("dim", dim)
        self.dim, self.base = dim, base
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """``x [B, L, E]`` -> ``[B, L, E]``; ``start`` is the absolute position of ``x[:, 0]``."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [B, L, {self.dim}], got {describe(x)}")
        pe = sinusoidal_table(x.shape[1], self.dim, start=start, base=self.base, dtype=x.dtype, device=x.device)
        return self.dropout(x + pe)


class LearnedPositionalEmbedding(nn.Module):
    """A trained vector per absolute position (BERT, GPT-2): ``dropout(x + W[start : start + L])``.

    Args:
        max_len: positions the table holds.
        dim: ``E``.
        dropout: on the sum, while training.
    """

    def __init__(self, max_len: int, dim: int, *, dropout: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        _check_pos_int("max_len", max_len)
        _check_pos_int("dim", dim)
        self.max_len, self.dim = max_len, dim
        self.embedding = nn.Embedding(max_len, dim, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """``x [B, L, E]`` -> ``[B, L, E]``; positions ``start ... start + L - 1`` must be < ``max_len``."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be [B, L, {self.dim}], got {describe(x)}")
        _check_start(start)
        if start + x.shape[1] > self.max_len:
            raise ValueError(f"positions {start}..{start + x.shape[1] - 1} exceed max_len {self.max_len}")
        return self.dropout(x + self.embedding.weight[start:start + x.shape[1]])


# --------------------------------------------------------------------------------------------
# Rotary: a q/k transform
# --------------------------------------------------------------------------------------------


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate pairs of features of ``x [..., L, D]`` by the angles whose ``cos``/``sin`` are given.

    ``cos``, ``sin``: ``[L, R/2]`` for the first ``R <= D`` features (the rest pass through).
    Half-rotation layout (GPT-NeoX, Llama, HF ``rotate_half``) pairs feature ``i`` with
    ``i + R/2``; the interleaved layout (RoFormer, GPT-J) pairs ``2i`` with ``2i + 1``. Either
    way a pair ``(a, b)`` becomes ``(a cos - b sin, a sin + b cos)``: the complex product
    ``(a + ib) e^{i theta}``.
    """
    r = 2 * cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]  # (..., L, R/2)
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2:]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE, Su et al. 2021) as a q/k transform.

    Feature pair ``i`` of a token at position ``p`` is rotated by ``p * base^(-2i/R)``; since
    rotations compose, ``<rot(q, m), rot(k, n)>`` depends only on ``m - n``. Plug into
    ``MultiHeadAttention(rotary=RotaryEmbedding(head_dim))``.

    Args:
        head_dim: ``D``.
        base: frequency base (10000 in the paper and Llama 2).
        interleaved: pairs ``(2i, 2i+1)`` (RoFormer, GPT-J) instead of ``(i, i + R/2)``
            (GPT-NeoX, Llama, Hugging Face's ``rotate_half``).
        rotary_dim: rotate only the first ``R`` features (GPT-NeoX's partial rotary); default ``D``.
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, interleaved: bool = False,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        _check_pos_int("head_dim", head_dim)
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        _check_pos_int("rotary_dim", rotary_dim)
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be even and <= head_dim ({head_dim})")
        if not base > 0:
            raise ValueError(f"base must be > 0, got {base!r}")
        self.head_dim, self.rotary_dim, self.base, self.interleaved = head_dim, rotary_dim, base, interleaved
        # Computed the way Llama/GPT-NeoX do (integer arange, float32), so the angles agree bitwise.
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, length: int, start: int = 0, *, dtype=torch.float32, device=None) -> tuple[Tensor, Tensor]:
        """``cos``, ``sin`` ``[length, R/2]`` for positions ``start ... start + length - 1``."""
        _check_start(start)
        if dtype == torch.float64:  # exact angles for float64 work (gradcheck, oracles)
            two_i = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device=device)
            inv_freq = 1.0 / self.base ** (two_i / self.rotary_dim)
        else:
            inv_freq = self.inv_freq.to(device=device)
        pos = (torch.arange(length, device=device) + start).to(inv_freq.dtype)  # exact: whole numbers below 2^24
        angle = pos[:, None] * inv_freq[None, :]  # (L, R/2)
        return angle.cos().to(dtype), angle.sin().to(dtype)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """Rotate ``x [..., L, D]`` whose row ``l`` sits at position ``start + l``."""
        if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-1] != self.head_dim:
            raise ValueError(f"x must be [..., L, {self.head_dim}], got {describe(x)}")
        cos, sin = self.cos_sin(x.shape[-2], start, dtype=x.dtype, device=x.device)
        return apply_rotary(x, cos, sin, interleaved=self.interleaved)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
                f"interleaved={self.interleaved}")


# --------------------------------------------------------------------------------------------
# Score terms: score_mods
# --------------------------------------------------------------------------------------------


class ALiBi(nn.Module):
    """Attention with Linear Biases (Press et al. 2022): ``score - m_h * |q_pos - kv_pos|``.

    Slopes come from :func:`attnkit.scores.alibi_slopes` (the paper's rule, also for head counts
    that are not powers of two). Use with ``is_causal=True`` for the paper's decoder; without a
    mask it is the symmetric encoder variant.
    """

    def __init__(self, num_heads: int, *, device=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.register_buffer("slopes", scores.alibi_slopes(num_heads, device=device), persistent=False)

    def score_mod(self, q: Tensor, k: Tensor, *, offset: int) -> ScoreMod:
        return scores.alibi(self.slopes, offset=offset)

    def bias(self, q_len: int, kv_len: int, *, offset: int | None = None) -> Tensor:
        """The dense term ``[H, Lq, Lk]`` (offset defaults to ``Lk - Lq``)."""
        offset = kv_len - q_len if offset is None else offset
        return _grid_bias(scores.alibi(self.slopes, offset=offset), self.num_heads, q_len, kv_len,
                          self.slopes.device)


def t5_relative_position_bucket(relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32,
                                max_distance: int = 128) -> Tensor:
    """T5's bucket of each relative position ``key_pos - query_pos`` (Raffel et al. 2020).

    Half of the buckets (all of them when not bidirectional) hold exact distances ``0 ...
    max_exact - 1`` with ``max_exact = buckets / 2``; the rest cover ``max_exact ... max_distance``
    logarithmically, and every larger distance shares the last bucket. Bidirectional: keys after
    the query get the upper half of the buckets. Causal (``bidirectional=False``): keys after the
    query all fall in bucket 0. Float32 arithmetic, so the buckets equal Hugging Face T5's.

    Returns:
        long tensor of the same shape, values in ``[0, num_buckets)``.
    """
    _check_pos_int("num_buckets", num_buckets)
    _check_pos_int("max_distance", max_distance)
    rp = relative_position.long()
    out = torch.zeros_like(rp)
    n = num_buckets
    if bidirectional:
        n //= 2
        out = out + (rp > 0).long() * n
        dist = rp.abs()
    else:
        dist = (-rp).clamp(min=0)  # only keys before the query are told apart
    max_exact = n // 2
    if max_exact < 1 or max_distance <= max_exact:
        raise ValueError(f"T5 buckets need num_buckets >= {4 if bidirectional else 2} and max_distance > "
                         f"{max(max_exact, 1)} (the exact range), got num_buckets={num_buckets}, "
                         f"max_distance={max_distance}, bidirectional={bidirectional}")
    # log-spaced buckets above max_exact; clamp first so log never sees 0 (those cells take `dist`).
    far = dist.clamp(min=max(max_exact, 1)).float()
    log_bucket = max_exact + (torch.log(far / max_exact) / math.log(max_distance / max_exact)
                              * (n - max_exact)).long()
    log_bucket = log_bucket.clamp(max=n - 1)
    return out + torch.where(dist < max_exact, dist, log_bucket)


class T5RelativeBias(nn.Module):
    """T5's learned bias per head and log-bucketed relative position (a score_mod).

    ``relative_attention_bias`` is ``nn.Embedding(num_buckets, num_heads)``, Hugging Face's name
    and layout, so a T5 checkpoint's table loads as is. T5 does not scale its scores: build the
    attention with ``scale=1.0`` for T5 parity.

    Args:
        num_heads: ``H``.
        num_buckets, max_distance: see :func:`t5_relative_position_bucket` (T5: 32, 128).
        bidirectional: ``True`` for the encoder, ``False`` for causal decoder self-attention.
    """

    def __init__(self, num_heads: int, *, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        _check_pos_int("num_heads", num_heads)
        _check_pos_int("num_buckets", num_buckets)
        _check_pos_int("max_distance", max_distance)
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional = bidirectional
        t5_relative_position_bucket(torch.zeros(1), bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance)  # validates the sizes now, not at first use
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads, device=device, dtype=dtype)

    def _mod(self, offset: int) -> ScoreMod:
        table = self.relative_attention_bias.weight  # (buckets, H)

        def mod(score, b, h, q_idx, kv_idx):
            bucket = t5_relative_position_bucket(kv_idx - (q_idx + offset), bidirectional=self.bidirectional,
                                                 num_buckets=self.num_buckets, max_distance=self.max_distance)
            return score + scores.like_score(table, score.dtype)[bucket, h]

        return mod

    def score_mod(self, q: Tensor, k: Tensor, *, offset: int) -> ScoreMod:
        return self._mod(offset)

    def bias(self, q_len: int, kv_len: int, *, offset: int | None = None) -> Tensor:
        """The dense term ``[H, Lq, Lk]`` (offset defaults to ``Lk - Lq``)."""
        offset = kv_len - q_len if offset is None else offset
        return _grid_bias(self._mod(offset), self.num_heads, q_len, kv_len,
                          self.relative_attention_bias.weight.device)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")


class RelativeKeyEmbedding(nn.Module):
    """Shaw et al. (2018) relative key embeddings: ``score += scale * q_i . r[clip(i - j)]``.

    This is Hugging Face BERT's ``position_embedding_type="relative_key"`` (the term is added
    before scaling there, so after scaling it carries the same ``scale``), with Shaw's clipping at
    ``max_distance``. ``distance_embedding`` has ``2 * max_distance + 1`` rows; row
    ``(i - j) + max_distance`` serves query position ``i`` and key position ``j``, BERT's layout
    with ``max_position_embeddings = max_distance + 1``, so a BERT table loads as is.

    Args:
        max_distance: the clipping distance ``k`` of the paper.
        head_dim: ``D``.
        scale: the attention's score scale; default ``1 / sqrt(head_dim)``, the module default.
    """

    def __init__(self, max_distance: int, head_dim: int, *, scale: float | None = None,
                 device=None, dtype=None) -> None:
        super().__init__()
        _check_pos_int("max_distance", max_distance)
        _check_pos_int("head_dim", head_dim)
        self.max_distance, self.head_dim = max_distance, head_dim
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.distance_embedding = nn.Embedding(2 * max_distance + 1, head_dim, device=device, dtype=dtype)

    def score_mod(self, q: Tensor, k: Tensor, *, offset: int) -> ScoreMod:
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"q head size {q.shape[-1]} does not match head_dim {self.head_dim}")
        m = self.max_distance
        # q . r for every clipped distance once, (B, H, Lq, 2m+1); the score_mod only gathers.
        qr = torch.matmul(q, self.distance_embedding.weight.to(q.dtype).t()) * self.scale

        def mod(score, b, h, q_idx, kv_idx):
            d = (q_idx + offset - kv_idx).clamp(-m, m) + m
            return score + qr[b, h, q_idx, d]

        return mod

    def extra_repr(self) -> str:
        return f"max_distance={self.max_distance}, head_dim={self.head_dim}, scale={self.scale}"

