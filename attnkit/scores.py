"""score_mod helpers: functions ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's form).

They close over tensors (slopes, tables), which may be ``nn.Parameter``s: backends propagate
gradients into what a score_mod captures. Positions: query ``i`` sits at ``i + offset``; pass
``offset = Lk - Lq`` for bottom-right alignment (decoding with a KV cache).

A score_mod that adds a bias depending only on the head and ``kv_idx - q_idx`` (ALiBi, relative
position tables, T5 buckets; the library's helpers or a user's own) runs on the banded kernel as a
table ``[1 or H, q_len + kv_len - 1]`` (column ``kv_idx - q_idx + q_len - 1``), which
:func:`diagonal_bias` finds: the helpers here say theirs (``attnkit_diagonal``), and any other
score_mod is probed (see there for what is recognised and how it is checked).

One dtype rule, on every backend: scores are computed in the inputs' compute dtype (float32 for
half types), and a score_mod's captured tensors are used in that dtype. The helpers here cast
what they capture to the score's dtype before any arithmetic (:func:`like_score`), and every
backend casts whatever a score_mod returns to the score's dtype (:func:`apply`). So float64
inputs with float32 ALiBi slopes compute in float64 (with the slopes' float32 values), float32
inputs with float64 slopes in float32, and gradients reach each captured tensor in its own dtype.
"""

from __future__ import annotations

import collections
import functools
import math

import torch
from torch import Tensor

from .request import ScoreMod

__all__ = ["alibi_slopes", "alibi", "relative_position_bias", "softcap", "compose", "like_score", "apply",
           "diagonal_bias"]

#: Sampled tiles (``PROBE_TILE`` x ``PROBE_TILE`` cells, every head) on which a probed diagonal bias is
#: checked against the score_mod itself, besides the grid's four corners.
PROBE_TILES, PROBE_TILE = 12, 48


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


def diagonal_bias(score_mod: ScoreMod, *, batch: int, heads: int, q_len: int, kv_len: int, dtype: torch.dtype,
                  device="cpu") -> Tensor | None:
    """``score_mod`` as an additive bias per head and diagonal, ``[1 or H, Lq + Lk - 1]`` in ``dtype``
    (column ``kv_idx - q_idx + Lq - 1``; differentiable in what the mod captures), or None.

    The helpers of this module say theirs. Any other score_mod is probed: the bias is read from
    ``score_mod(0, ...)`` on the grid's first row and first column (together they cover every
    diagonal), then checked against the score_mod itself, on every head and a few batch elements, at
    the grid's corners and on :data:`PROBE_TILES` tiles drawn with a fixed seed, with a random score
    in place of 0 (so the mod must add its bias to the score, not scale or cap it): every value must
    agree to the last few ulps (compared in float64), and so must the grid's last row and last
    column. A mod that reads the batch index, keeps state (a counter), draws random numbers, scales
    or caps the score, or whose bias is not a function of ``(head, kv_idx - q_idx)`` fails the check
    and the call goes to the tiles, exact for any score_mod. What sampling cannot see: a bias that
    is diagonal everywhere except on a few cells no sample covers; write such an exception as a
    mask, or force ``backend="tiles"``.
    """
    diagonal = getattr(score_mod, "attnkit_diagonal", None)
    if diagonal is not None:
        table = diagonal(heads, q_len, kv_len, dtype=dtype)
    else:
        table = _probe(score_mod, batch, heads, q_len, kv_len, dtype, device)
    width = q_len + kv_len - 1
    ok = table is not None and table.dim() == 2 and table.shape[0] in (1, heads) and table.shape[1] == width
    return table if ok else None


def _probe(score_mod, batch, heads, q_len, kv_len, dtype, device) -> Tensor | None:
    if q_len == 0 or kv_len == 0:
        return None
    idx = functools.partial(torch.arange, device=device)
    h = idx(heads).view(-1, 1, 1)
    zero = torch.zeros((), dtype=torch.long, device=device)
    try:
        row = _call(score_mod, dtype, zero, h, zero.view(1, 1, 1), idx(kv_len).view(1, 1, -1), 0.0)  # kv - q >= 0
        col = _call(score_mod, dtype, zero, h, idx(q_len).view(1, -1, 1), zero.view(1, 1, 1), 0.0)  # kv - q <= 0
    except Exception:  # noqa: BLE001 - a mod that cannot be called this way is not a diagonal bias
        return None
    if row is None or col is None:
        return None
    row, col = (torch.broadcast_to(t, (heads,) + t.shape[1:]) for t in (row, col))
    table = torch.cat([col[:, 1:, 0].flip(-1), row[:, 0, :]], dim=-1)  # [H, Lq - 1 + Lk]
    if table.requires_grad and not _adds_the_score(score_mod, heads, dtype, device):
        return None
    key = _verified_key(score_mod, table, batch, heads, q_len, kv_len, dtype, device)
    if key is None or key not in _verified:
        with torch.no_grad():
            if not _agrees(score_mod, table.detach(), batch, heads, q_len, kv_len, dtype, device):
                return None
        if key is not None:
            _verified[key] = True
            while len(_verified) > 16:
                _verified.popitem(last=False)
    return table


#: Probes that passed, keyed on the mod (held), the sizes and the captured tensors' versions: a mod
#: whose tensors have not changed is not checked again (its table is still read on every call).
_verified: collections.OrderedDict = collections.OrderedDict()


def _verified_key(score_mod, table, *sizes) -> tuple | None:
    from .backends._captured import captured_tensors  # the backends build on this module

    try:
        hash(score_mod)
    except TypeError:
        return None
    found = captured_tensors(score_mod, requiring_grad=False)
    return (score_mod, tuple((id(t), t.data_ptr(), t._version) for t in found), table.detach().sum().item(), *sizes)


def _adds_the_score(score_mod, heads, dtype, device) -> bool:
    """Whether the mod's derivative in the score is a constant that nothing learned feeds: the
    gradients its captured tensors get through the table are then theirs (``score * w[h]`` with
    ``w`` all ones passes the value checks, but ``w``'s gradient depends on the score)."""
    score = torch.randn(1, heads, 2, 2, dtype=dtype, device=device, requires_grad=True)
    idx = torch.arange(2, device=device)
    with torch.enable_grad():
        out = score_mod(score, idx.new_zeros(()), torch.arange(heads, device=device).view(1, -1, 1, 1),
                        idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1))
        (slope,) = torch.autograd.grad(out.sum(), score, create_graph=True, allow_unused=True)
    return slope is not None and not slope.requires_grad


def _call(score_mod, dtype, b, h, q, kv, fill: float):
    """``score_mod`` at these indices on a score of ``fill``, or None when it returns something
    else than a tensor of the grid's shape."""
    shape = torch.broadcast_shapes(h.shape, q.shape, kv.shape)
    out = score_mod(torch.full(shape, fill, dtype=dtype, device=h.device), b, h, q, kv)
    if not isinstance(out, Tensor) or tuple(torch.broadcast_shapes(out.shape, shape)) != tuple(shape):
        return None
    return like_score(torch.broadcast_to(out, shape), dtype)


def _agrees(score_mod, table, batch, heads, q_len, kv_len, dtype, device) -> bool:
    """Whether ``score + table[h, kv - q + Lq - 1]`` is what the mod gives on sampled cells."""
    gen = torch.Generator().manual_seed(0)
    t = min(PROBE_TILE, q_len), min(PROBE_TILE, kv_len)
    corners = [(0, 0), (0, kv_len - t[1]), (q_len - t[0], 0), (q_len - t[0], kv_len - t[1])]
    drawn = [(int(torch.randint(0, q_len - t[0] + 1, (1,), generator=gen)),
              int(torch.randint(0, kv_len - t[1] + 1, (1,), generator=gen))) for _ in range(PROBE_TILES)]
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    last_row = (q_len - 1, 0, 1, kv_len)  # the last row and column see every diagonal once more
    last_col = (0, kv_len - 1, q_len, 1)
    tiles = [(q0, k0, *t) for q0, k0 in corners + drawn] + [last_row, last_col]
    for n, (q0, k0, nq, nk) in enumerate(tiles):
        b = torch.tensor([0, batch - 1, n % batch], device=device).view(-1, 1, 1, 1)
        q = torch.arange(q0, q0 + nq, device=device).view(1, 1, -1, 1)
        kv = torch.arange(k0, k0 + nk, device=device).view(1, 1, 1, -1)
        shape = (3, heads, nq, nk)
        score = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device) * 4
        out = score_mod(score, b, h, q, kv)
        if not isinstance(out, Tensor) or tuple(torch.broadcast_shapes(out.shape, shape)) != shape:
            return False
        want = score.double() + table.double()[:, (kv - q + q_len - 1)[0, 0]].unsqueeze(0)
        got = out.double()
        tol = 8 * torch.finfo(dtype).eps * (want.abs() + 1)
        if not bool(((got - want).abs() <= tol).all()):
            return False
    return True


def _diagonals(q_len: int, kv_len: int, device) -> Tensor:
    """``kv_idx - q_idx`` of each diagonal of a ``[q_len, kv_len]`` grid, first column first."""
    return torch.arange(-(q_len - 1), kv_len, device=device).view(1, -1)
