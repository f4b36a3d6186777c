"""score_mod helpers: functions ``fn(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's form).

They close over tensors (slopes, tables), which may be ``nn.Parameter``s: backends propagate
gradients into what a score_mod captures. Positions: query ``i`` sits at ``i + offset``; pass
``offset = Lk - Lq`` for bottom-right alignment (decoding with a KV cache).

A score_mod that adds a bias depending only on the head and ``kv_idx - q_idx`` (ALiBi, relative
position tables, T5 buckets; the library's helpers or a user's own) runs on the banded kernel as a
table ``[1 or H, q_len + kv_len - 1]`` (column ``kv_idx - q_idx + q_len - 1``), which
:func:`diagonal_bias` finds: the helpers here are typed (:class:`DiagonalBias`, whose
:meth:`DiagonalBias.diagonal` is the table), and any other score_mod is probed (see there for what is
recognised and how it is checked). :func:`softcap` is typed too (:class:`SoftCap`), and
:func:`parts` reads a composed "bias, then cap" as ``(bias, cap)`` for kernels that do both.

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
import threading
import weakref

import torch
from torch import Tensor

from . import per_element
from .call import ScoreMod
from .closures import captured_state, captured_tensors

__all__ = ["alibi_slopes", "alibi", "relative_position_bias", "softcap", "compose", "like_score", "apply",
           "diagonal_bias", "parts", "DiagonalBias", "SoftCap", "Composed"]

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


class DiagonalBias:
    """A score_mod that adds a bias depending only on the head and the diagonal ``kv_idx - q_idx``
    (ALiBi, relative position tables): ``score + bias[h, kv_idx - q_idx + Lq - 1]``.

    It is a sum of terms, each a pair of functions: ``bias(dtype, b, h, q_idx, kv_idx)``, the term on
    broadcasting index tensors in the scores' dtype (what the mod adds, cell by cell), and
    ``table(heads, q_len, kv_len, dtype)``, the same term as ``[1 or H, Lq + Lk - 1]`` or None when it
    has no table for those sizes. :meth:`diagonal` is what the banded kernel adds instead of calling
    the mod; :func:`compose` of diagonal biases is one (the terms side by side).
    """

    broadcasts = True  # written to broadcast (attnkit.per_element.broadcasts)

    def __init__(self, *terms: tuple):
        self.terms = terms

    def __call__(self, score, b, h, q_idx, kv_idx):
        for bias, _ in self.terms:
            score = score + like_score(bias(score.dtype, b, h, q_idx, kv_idx), score.dtype)
        return score

    def diagonal(self, heads: int, q_len: int, kv_len: int, dtype=None) -> Tensor | None:
        """The bias as ``[1 or heads, q_len + kv_len - 1]`` (column ``kv_idx - q_idx + q_len - 1``) in
        ``dtype`` (default: the captured tensors' own), differentiable in what it captures; None
        when a term has no table for these sizes."""
        tables = [table(heads, q_len, kv_len, dtype) for _, table in self.terms]
        if not tables or any(t is None for t in tables):
            return None
        return sum(tables[1:], tables[0])

    def __repr__(self) -> str:
        return f"DiagonalBias({len(self.terms)} term(s))"

    def parts(self) -> tuple[DiagonalBias | None, float | None]:
        """``(self, None)``: a bias and no cap (see :func:`parts`)."""
        return self, None


class SoftCap:
    """Tanh soft-capping, ``cap * tanh(score / cap)``, with its ``cap`` readable (so a kernel can cap
    the scores itself instead of calling the mod)."""

    broadcasts = True
    #: A function of the score alone, with nothing captured: validate_call has nothing to probe (it would cost a
    #: decode step, which calls it once per layer, more than the step's own attention over a short cache).
    score_only = True

    def __init__(self, cap: float):
        self.cap = cap

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)

    def parts(self) -> tuple[DiagonalBias | None, float | None]:
        """``(None, cap)``: no bias, then the cap (see :func:`parts`)."""
        return None, self.cap

    def __repr__(self) -> str:
        return f"SoftCap({self.cap!r})"


class Composed:
    """Score_mods applied left to right (what :func:`compose` returns unless every part is a diagonal
    bias)."""

    def __init__(self, *mods: ScoreMod):
        self.mods = mods

    @property
    def broadcasts(self) -> bool:
        return per_element.broadcasts(*self.mods)

    def __call__(self, score, b, h, q_idx, kv_idx):
        for m in self.mods:
            score = apply(m, score, b, h, q_idx, kv_idx)
        return score

    def __repr__(self) -> str:
        return f"Composed{self.mods!r}"

    def parts(self) -> tuple[DiagonalBias | None, float | None] | None:
        """``(bias, cap)`` when the parts are diagonal biases followed by at most one soft cap (bias
        or cap None where absent), else None (see :func:`parts`)."""
        mods = list(self.mods)
        cap = mods.pop().cap if mods and isinstance(mods[-1], SoftCap) else None
        if not all(isinstance(m, DiagonalBias) for m in mods):
            return None
        return (compose(*mods) if mods else None), cap


def _builder_args(fn: str, tensor: tuple[str, object, int, str], **ints: tuple[object, int]) -> None:
    """The one check of a bias builder's arguments: ``tensor`` (name, value, dimensions, what it
    holds) a floating-point tensor of that many dimensions, each of ``ints`` (value, least) an int
    at least that large."""
    name, value, dim, holds = tensor
    if not isinstance(value, Tensor) or not value.is_floating_point():
        got = value.dtype if isinstance(value, Tensor) else type(value).__name__
        raise TypeError(f"scores.{fn}: {name} must be a floating-point tensor ({holds}), got {got}")
    if value.dim() != dim:
        raise ValueError(f"scores.{fn}: {name} must have {dim} dimension{'s' * (dim > 1)} ({holds}), "
                         f"got shape {tuple(value.shape)}")
    for key, (number, least) in ints.items():
        if isinstance(number, bool) or not isinstance(number, int):
            raise TypeError(f"scores.{fn}: {key} must be an int, got {type(number).__name__}")
        if number < least:
            raise ValueError(f"scores.{fn}: {key} must be >= {least}, got {number}")


def alibi(slopes: Tensor, *, offset: int = 0) -> DiagonalBias:
    """ALiBi: ``score - slopes[h] * |q_pos - kv_pos|``.

    With a causal mask this is the paper's ``-m * (i - j)``; without one it is the symmetric
    variant used for encoders. ``slopes``: one per head (:func:`alibi_slopes` gives the paper's).
    """
    _builder_args("alibi", ("slopes", slopes, 1, "one slope per head; alibi_slopes(num_heads) gives the paper's"),
                  offset=(offset, -(1 << 62)))

    def bias(dtype, b, h, q_idx, kv_idx):
        return -like_score(slopes, dtype)[h] * (q_idx + offset - kv_idx).abs()

    def table(heads, q_len, kv_len, dtype=None):  # the mod reads slopes[h]: the first `heads` slopes
        if slopes.dim() != 1 or slopes.numel() < heads:
            return None
        own = like_score(slopes[:heads, None], dtype or slopes.dtype)
        return -own * (offset - _diagonals(q_len, kv_len, slopes.device)).abs()

    return DiagonalBias((bias, table))


def relative_position_bias(table: Tensor, max_distance: int, *, offset: int = 0) -> DiagonalBias:
    """A learned bias per head and clipped relative distance (Shaw et al. 2018, as a bias).

    Args:
        table: ``[H, 2 * max_distance + 1]``; column ``max_distance + d`` is the bias for a key
            ``d`` positions after the query (``d`` clipped to ``[-max_distance, max_distance]``).
        max_distance: the clipping distance.
    """
    _builder_args("relative_position_bias", ("table", table, 2, "[H, 2 * max_distance + 1]"),
                  max_distance=(max_distance, 0), offset=(offset, -(1 << 62)))
    if table.shape[1] != 2 * max_distance + 1:
        raise ValueError(f"table must be [H, 2 * max_distance + 1] = [H, {2 * max_distance + 1}], "
                         f"got {tuple(table.shape)}")

    def bias(dtype, b, h, q_idx, kv_idx):
        d = (kv_idx - (q_idx + offset)).clamp(-max_distance, max_distance) + max_distance
        return like_score(table, dtype)[h, d]

    def diagonal(heads, q_len, kv_len, dtype=None):
        d = (_diagonals(q_len, kv_len, table.device) - offset).clamp(-max_distance, max_distance) + max_distance
        return like_score(table[:heads, d[0]], dtype or table.dtype) if table.shape[0] >= heads else None

    return DiagonalBias((bias, diagonal))


def softcap(cap: float) -> SoftCap:
    """Tanh soft-capping, ``cap * tanh(score / cap)`` (Gemma 2, Grok): bounds every logit."""
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap!r}; expected a positive number")
    return SoftCap(cap)


def compose(*mods: ScoreMod) -> ScoreMod:
    """Apply score_mods left to right. Diagonal biases compose to a :class:`DiagonalBias` (their
    terms added); anything else gives a :class:`Composed`, whose :meth:`Composed.parts` still
    recognises "diagonal biases, then one soft cap" as ``(bias, cap)``."""
    flat = [m for mod in mods for m in (mod.mods if isinstance(mod, Composed) else (mod,))]
    if flat and all(isinstance(m, DiagonalBias) for m in flat):
        return DiagonalBias(*(t for m in flat for t in m.terms))
    return Composed(*flat)


def parts(score_mod: ScoreMod | None) -> tuple[DiagonalBias | None, float | None] | None:
    """``score_mod`` as ``(bias, cap)``: an additive diagonal bias (or None) followed by tanh soft
    capping at ``cap`` (or None), the two things a kernel can do without calling the mod; None
    when the mod is anything else (a plain function, a cap before a bias, two caps). ``None``
    itself is ``(None, None)``."""
    if score_mod is None:
        return None, None
    return score_mod.parts() if isinstance(score_mod, DiagonalBias | SoftCap | Composed) else None


#: Why :func:`kernel_terms` found nothing, for the backends' messages.
NOT_KERNEL_TERMS = ("the score_mod is not an additive bias per head and diagonal (ALiBi, relative positions and the "
                    "like, written by hand or with attnkit.scores), nor tanh soft-capping c * tanh(score / c) "
                    "(alone, or after such a bias with attnkit.scores)")


def kernel_terms(score_mod: ScoreMod, *, batch: int, heads: int, q_len: int, kv_len: int, dtype: torch.dtype,
                 device="cpu") -> tuple[Tensor | None, float] | None:
    """``score_mod`` as what the banded kernel applies itself: ``(diagonal bias [1 or H, Lq + Lk - 1] or
    None, soft cap or 0.0)``, or None when it is neither.

    This module's own forms say theirs (:func:`parts`); any other mod is probed, first as a bias per
    head and diagonal (:func:`diagonal_bias`), then as a soft cap (:func:`soft_cap`), except under
    ``torch.compile`` (None: the backends that call the mod serve it there).
    """
    typed = parts(score_mod)
    if typed is not None:
        bias_mod, cap = typed
        bias = None if bias_mod is None else bias_mod.diagonal(heads, q_len, kv_len, dtype=dtype)
        return None if bias_mod is not None and bias is None else (bias, cap or 0.0)
    if torch.compiler.is_compiling():  # probing decides on values, which a traced graph cannot: not a kernel term
        return None
    sizes = dict(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, dtype=dtype, device=device)
    bias = diagonal_bias(score_mod, **sizes)
    if bias is not None:
        return bias, 0.0
    cap = soft_cap(score_mod, **sizes)
    return None if cap is None else (None, cap)


def diagonal_bias(score_mod: ScoreMod, *, batch: int, heads: int, q_len: int, kv_len: int, dtype: torch.dtype,
                  device="cpu") -> Tensor | None:
    """``score_mod`` as an additive bias per head and diagonal, ``[1 or H, Lq + Lk - 1]`` in ``dtype``
    (column ``kv_idx - q_idx + Lq - 1``; differentiable in what the mod captures), or None.

    A :class:`DiagonalBias` (the helpers of this module, and :func:`compose` of them) says its own;
    a soft cap, alone or after a bias, is none. Any other score_mod is probed: the bias is read from
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
    if isinstance(score_mod, DiagonalBias):
        table = score_mod.diagonal(heads, q_len, kv_len, dtype=dtype)
    elif isinstance(score_mod, SoftCap) or (isinstance(score_mod, Composed) and parts(score_mod) is not None
                                            and parts(score_mod)[1] is not None):
        return None  # a capped score is not the score plus a bias
    else:
        table = _probe(score_mod, batch, heads, q_len, kv_len, dtype, device)
    width = q_len + kv_len - 1
    ok = table is not None and table.dim() == 2 and table.shape[0] in (1, heads) and table.shape[1] == width
    return table if ok else None


def soft_cap(score_mod: ScoreMod, *, batch: int, heads: int, q_len: int, kv_len: int, dtype: torch.dtype,
             device="cpu") -> float | None:
    """The cap ``c`` when ``score_mod`` is tanh soft-capping, ``c * tanh(score / c)`` (Gemma 2's
    ``attn_logit_softcapping``), however it is written; None otherwise.

    :class:`SoftCap` says its own. Any other mod that captures nothing learned is probed: ``c`` is
    read as the mod's value on a score of ``1e20`` (where ``tanh`` is 1), then the mod must give
    ``c * tanh(score / c)`` to the last few ulps on the cells :func:`diagonal_bias` checks, with
    scores spread over the cap's whole range (saturated ones included); anything else (a bias, a
    scale, an index or a counter read, a cap learned) fails and the call goes to the tiles.
    """
    if isinstance(score_mod, SoftCap):
        return score_mod.cap
    if isinstance(score_mod, DiagonalBias | Composed) or q_len == 0 or kv_len == 0:
        return None
    if captured_tensors(score_mod):  # something that requires grad feeds it: not a constant cap
        return None
    zero = torch.zeros((), dtype=torch.long, device=device)
    one = zero.view(1, 1, 1)
    try:
        top = _call(score_mod, dtype, zero, one, one, one, 1e20)
    except Exception:  # noqa: BLE001 - a mod that cannot be called this way is not read as a cap
        return None
    cap = None if top is None or top.requires_grad else float(top.reshape(-1)[0])
    if cap is None or not math.isfinite(cap) or cap <= 0:
        return None
    owner = getattr(score_mod, "__wrapped__", score_mod)
    key = _verified_key(owner, torch.tensor(cap), "soft cap", batch, heads, q_len, kv_len, dtype, device)
    ok = _check_once(owner, key, lambda: _agrees(score_mod, lambda score, q, kv: cap * torch.tanh(score / cap),
                                                 batch, heads, q_len, kv_len, dtype, device, spread=2 * cap))
    return cap if ok else None


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
    if table.requires_grad and not _adds_the_score(score_mod, heads, q_len, kv_len, dtype, device):
        return None
    owner = getattr(score_mod, "__wrapped__", score_mod)  # a per-element wrapper, made per call: its mod
    key = _verified_key(owner, table, batch, heads, q_len, kv_len, dtype, device)
    diagonal = table.detach().double()

    def expect(score, q, kv):
        return score + diagonal[:, (kv - q + q_len - 1)[0, 0]].unsqueeze(0)

    if not _check_once(owner, key, lambda: _agrees(score_mod, expect, batch, heads, q_len, kv_len, dtype, device)):
        return None
    return table


#: Probes that passed, per mod (weakly: nothing is kept alive), keyed on the sizes, the captured
#: tensors' versions, the plain values the mod reaches and the table's sum: a mod whose state has not
#: changed is not checked again (its table is still read on every call). Written under _verified_lock.
_verified: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_verified_lock = threading.Lock()


def _check_once(owner, key, check) -> bool:
    """``check()`` under no_grad, unless a check of ``owner`` with ``key`` passed before; remembered
    when it passes (the last 8 keys per mod)."""
    if key is not None and key in _verified.get(owner, ()):
        return True
    with torch.no_grad():
        if not check():
            return False
    if key is not None:
        with _verified_lock:  # an eviction may free tensors, and a thread switch there must not see half of it
            passed = _verified.setdefault(owner, collections.OrderedDict())
            passed[key] = True
            while len(passed) > 8:
                passed.popitem(last=False)
    return True


def _verified_key(score_mod, table, *sizes) -> tuple | None:
    try:
        weakref.ref(score_mod)
        hash(score_mod)
    except TypeError:
        return None
    found, values = captured_state(score_mod)
    if any(t.is_inference() for t in found):  # no version counter (torch.inference_mode): check every call
        return None
    return (tuple((t.data_ptr(), t._version) for t in found), tuple((type(v), v) for v in values),
            table.detach().sum().item(), *sizes)


def _adds_the_score(score_mod, heads, q_len, kv_len, dtype, device) -> bool:
    """Whether the mod's derivative in the score is a constant that nothing learned feeds: the
    gradients its captured tensors get through the table are then theirs (``score * w[h]`` with
    ``w`` all ones passes the value checks, but ``w``'s gradient depends on the score)."""
    nq, nk = min(2, q_len), min(2, kv_len)
    score = torch.randn(1, heads, nq, nk, dtype=dtype, device=device, requires_grad=True)
    try:
        with torch.enable_grad():
            out = score_mod(score, torch.zeros((), dtype=torch.long, device=device),
                            torch.arange(heads, device=device).view(1, -1, 1, 1),
                            torch.arange(nq, device=device).view(1, 1, -1, 1),
                            torch.arange(nk, device=device).view(1, 1, 1, -1))
            (slope,) = torch.autograd.grad(out.sum(), score, create_graph=True, allow_unused=True)
    except Exception:  # noqa: BLE001 - a mod that cannot be called this way is not read as a diagonal bias
        return False
    return slope is not None and not slope.requires_grad


def _call(score_mod, dtype, b, h, q, kv, fill: float):
    """``score_mod`` at these indices on a score of ``fill``, or None when it returns something
    else than a tensor of the grid's shape."""
    shape = torch.broadcast_shapes(h.shape, q.shape, kv.shape)
    out = score_mod(torch.full(shape, fill, dtype=dtype, device=h.device), b, h, q, kv)
    if not isinstance(out, Tensor) or tuple(torch.broadcast_shapes(out.shape, shape)) != tuple(shape):
        return None
    return like_score(torch.broadcast_to(out, shape), dtype)


_POOL = 10007  # random scores drawn per check, reused along the tiles


def _agrees(score_mod, expect, batch, heads, q_len, kv_len, dtype, device, spread: float = 4.0) -> bool:
    """Whether the mod gives ``expect(score, q, kv)`` (float64) on sampled cells: the grid's corners,
    :data:`PROBE_TILES` tiles drawn with a fixed seed, its last row and last column, every head and a
    few batch elements, random scores from ``spread / 100`` to ``10^4 spread`` in size; to the last
    few ulps."""
    gen = torch.Generator().manual_seed(0)
    t = min(PROBE_TILE, q_len), min(PROBE_TILE, kv_len)
    corners = [(0, 0), (0, kv_len - t[1]), (q_len - t[0], 0), (q_len - t[0], kv_len - t[1])]
    drawn = [(int(torch.randint(0, q_len - t[0] + 1, (1,), generator=gen)),
              int(torch.randint(0, kv_len - t[1] + 1, (1,), generator=gen))) for _ in range(PROBE_TILES)]
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    # magnitudes over six decades around spread: a clamp or cap far above typical scores shows too.
    # Drawn once and laid along each tile (a prime count, so its period does not line up with rows):
    # drawing afresh for every tile would cost more than the probe's tiles themselves at long lengths.
    size = spread * 10.0 ** (6 * torch.rand(_POOL, generator=gen, dtype=torch.float64) - 2)
    pool = torch.randn(_POOL, generator=gen, dtype=torch.float64) * size
    last_row = (q_len - 1, 0, 1, kv_len)  # the last row and column see every diagonal once more
    last_col = (0, kv_len - 1, q_len, 1)
    tiles = [(q0, k0, *t) for q0, k0 in corners + drawn] + [last_row, last_col]
    for n, (q0, k0, nq, nk) in enumerate(tiles):
        b = torch.tensor([0, batch - 1, n % batch], device=device).view(-1, 1, 1, 1)
        q = torch.arange(q0, q0 + nq, device=device).view(1, 1, -1, 1)
        kv = torch.arange(k0, k0 + nk, device=device).view(1, 1, 1, -1)
        shape = (3, heads, nq, nk)
        cells = math.prod(shape)
        start = (n * 7919) % _POOL
        score = pool.roll(-start).repeat(-(-cells // _POOL))[:cells].view(shape).to(dtype=dtype, device=device)
        out = score_mod(score, b, h, q, kv)
        if not isinstance(out, Tensor) or tuple(torch.broadcast_shapes(out.shape, shape)) != shape:
            return False
        want = expect(score.double(), q, kv)
        got = out.double()
        tol = 8 * torch.finfo(dtype).eps * (want.abs() + 1)
        if not bool(((got - want).abs() <= tol).all()):
            return False
    return True


def _diagonals(q_len: int, kv_len: int, device) -> Tensor:
    """``kv_idx - q_idx`` of each diagonal of a ``[q_len, kv_len]`` grid, first column first."""
    return torch.arange(-(q_len - 1), kv_len, device=device).view(1, -1)
