"""A predicate's rows in closed form: each row's values as a few affine pieces along the keys.

The masks people write are mostly affine in the indices: ``q_idx - kv_idx <= 64``,
``kv_idx < 16``, ``doc_ids[q_idx] == doc_ids[kv_idx]`` (a table with few runs), and their
``and_masks``/``or_masks``. For such a predicate each query row's allowed keys follow from its
terms without evaluating a cell: here it is called once with, for every query row, each value as
pieces ``[cut_j, cut_j+1)`` of the key axis on which it is ``slope * kv_idx + intercept``
(integers; booleans are constant on each piece). An operation cuts pieces where its result
changes (a comparison where the difference crosses zero, a table where its entries change) and
the final boolean's true pieces are the row's runs. Exact, and O(rows x pieces) work: 1-1.5 ms
for a window at n = 8192, where tiles and cells (:mod:`attnkit._ranges`) take 4-6.

``//`` and ``%`` of a value that moves along the keys are kept whole until used. Compared, a
quotient is an interval (``kv_idx // 64 == q_idx // 64`` is ``64 * (q_idx // 64) <= kv_idx <=
64 * (q_idx // 64) + 63``) and a remainder holds every ``m`` keys (``(q_idx - kv_idx) % 2 == 0``:
a :class:`Periodic` boolean), which ``& | ^ ~`` with a boolean constant on each piece keep
periodic: a dilated or strided window is its window's pieces, one of them periodic, and becomes
one run per period only in the rows. Used otherwise, they are cut at every multiple.

Followed: ``+ - neg abs``, ``*`` when one side is constant along the keys, ``//`` and ``%`` by a
positive integer constant, comparisons, ``& | ^ ~`` and the ``logical_*`` forms,
``minimum``/``maximum``/``clamp``, ``where``, casts between bool and integer dtypes,
``new_ones``/``ones_like`` and friends, and indexing a captured 1-D integer or bool tensor
(``doc_ids[kv_idx]``) or a 2-D one at a row constant along the keys (a block layout's
``layout[q_idx // 64, kv_idx // 64]``). Anything else raises :class:`attnkit._ranges.Unsupported`
and the tiles take over: floats, a product of two key-dependent values, constants beyond 2^40, a
2-D table read at a row that changes along the keys, an index of slope other than 0 or 1 into a
table, an index outside the table, a value with more than
:data:`MOST_PIECES` pieces in a row, two periodic patterns combined beyond that, a row with more
runs than the caller keeps. Reading the head index where there are several heads raises
:class:`attnkit._ranges.ReadsHead`: the plan then works the predicate out again with the heads
folded into the batch, where the head is a value per row.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

from ._ranges import ReadsHead, Unsupported, _join, _state, rule_table, stands_in

#: Most pieces a value may have in a row; more (a pattern that changes every few keys) is left to tiles.
MOST_PIECES = 64
#: Beyond every index: the ends of a half-line of keys before it is cut to a piece.
_FAR = 1 << 62
#: Largest magnitude a constant or a product may reach here (sums of a few stay far from int64's
#: limits, so nothing wraps around where the predicate's own arithmetic would not).
_LARGE = 1 << 40


class _Keys(threading.local):
    """The key length of the derivation under way, per thread."""

    kv_len = 0


_keys = _Keys()


class Pieces:
    """One value for each row: ``cuts`` ``[R|1, P+1]`` (from 0 to ``kv_len``, non-decreasing; None for
    one piece, all keys), and on piece ``j`` the value ``slope[:, j] * kv_idx + icept[:, j]``
    (``slope`` None for booleans, ``icept`` ``[R|1, P]``)."""

    __slots__ = ("cuts", "slope", "icept")

    def __init__(self, cuts: Tensor | None, slope: Tensor | None, icept: Tensor):
        self.cuts, self.slope, self.icept = cuts, slope, icept

    @property
    def dtype(self) -> torch.dtype:
        return self.icept.dtype

    @property
    def device(self) -> torch.device:
        return self.icept.device

    @property
    def is_bool(self) -> bool:
        return self.slope is None


class _Deferred:
    """An integer ``(slope * kv_idx + icept)`` divided by ``m`` on each piece, kept whole: cut at
    every multiple of ``m`` (:meth:`plain`) only when something other than a comparison uses it."""

    __slots__ = ("cuts", "slope", "icept", "m")

    def __init__(self, cuts: Tensor | None, slope: Tensor, icept: Tensor, m: int):
        self.cuts, self.slope, self.icept, self.m = cuts, slope, icept, m

    dtype = torch.int64
    device = torch.device("cpu")

    def dividend(self) -> Pieces:
        return Pieces(self.cuts, self.slope, self.icept)


class Quotient(_Deferred):
    """``a // m`` where ``a`` moves along the keys (``kv_idx // 64``). Compared with an integer ``t``
    it is ``a`` compared with a multiple of ``m`` (``a // m <= t`` is ``a <= m * t + m - 1``): one
    interval, however many multiples the row passes."""

    def plain(self) -> Pieces:
        a = self.dividend()
        return _divided(a, self.m, _crossings(a, self.m))


class Wrapped(_Deferred):
    """``a % m`` where ``a`` moves along the keys (slope -1, 0 or 1): ``(q_idx - kv_idx) % 2``.
    Compared with a value constant along the keys it gives a :class:`Periodic` boolean."""

    def plain(self) -> Pieces:
        a = self.dividend()
        return _sub(a, _mul(_divided(a, self.m, _crossings(a, self.m)), self.m))


class Periodic:
    """A boolean that on piece ``j`` holds at the keys ``k`` with ``(k - phase) mod period < width``
    (``[R|1, P]`` each; ``period`` 1 for a piece where it is constant, ``width`` 1 or 0). Followed
    through ``& | ^ ~ == !=`` where one side is constant on each piece (a window and every other
    key), and into the rows: one run per period."""

    __slots__ = ("cuts", "phase", "period", "width")

    def __init__(self, cuts: Tensor | None, phase: Tensor, period: Tensor, width: Tensor):
        self.cuts, self.phase, self.period, self.width = cuts, phase, period, width

    dtype = torch.bool
    device = torch.device("cpu")

    @staticmethod
    def of(x) -> Periodic:
        if isinstance(x, Periodic):
            return x
        x = _lift(x)
        if not x.is_bool:
            raise Unsupported("a bitwise operation on integers")
        zero = torch.zeros_like(x.icept, dtype=torch.int64)
        return Periodic(x.cuts, zero, zero + 1, x.icept.long())

    def fields(self, at: Tensor | None) -> list[Tensor]:
        return [_take(t, at) for t in (self.phase, self.period, self.width)]

    def plain(self) -> Pieces:
        """As pieces: a true piece for each run (refused beyond :data:`MOST_PIECES` pieces)."""
        start, end = _bounds(self.cuts)
        rows = max(t.shape[0] for t in (start, self.phase, self.period, self.width))
        start, end, *fields = (t.expand(rows, -1) for t in (start, end, self.phase, self.period, self.width))
        from .plan import _pack  # the plan builds on this module

        row, first, last = _periodic_runs(start, end, *fields, MOST_PIECES // 2)
        at, last = _join(row, first, last, ordered=True)
        firsts, lasts = _pack(row[at], first[at], last, 1, rows, _keys.kv_len, most=None)  # [1, rows, k]
        runs = torch.stack([firsts[0], lasts[0]], -1).flatten(1)  # first, last, first, last, ...: the true pieces
        cuts = torch.cat([torch.zeros(rows, 1, dtype=torch.int64), runs,
                          torch.full((rows, 1), _keys.kv_len, dtype=torch.int64)], 1)
        return _make(cuts, None, (torch.arange(cuts.shape[1] - 1) % 2 == 1).view(1, -1))


def _periodic(cuts: Tensor | None, phase: Tensor, period: Tensor, width: Tensor) -> Pieces | Periodic:
    """A boolean from its periodic form: plain pieces where every piece is constant."""
    if not bool((period != 1).any()):
        return _make(cuts, None, width > 0)
    if cuts is not None and cuts.shape[1] - 1 > MOST_PIECES:
        raise Unsupported(f"a row with more than {MOST_PIECES} pieces")
    return Periodic(cuts, torch.remainder(phase, period), period, width)


class _Head:
    """The head index where there are several heads: any use raises :class:`ReadsHead`."""


def _lift(x) -> Pieces:
    """A value as pieces: pieces as they are, a bool, an int or a 0-d integer/bool tensor as a constant,
    a value kept whole (a quotient, a remainder, a periodic boolean) cut at every change."""
    if isinstance(x, Pieces):
        return x
    if isinstance(x, (Periodic, _Deferred)):
        return x.plain()
    if isinstance(x, _Head):
        raise ReadsHead()
    if isinstance(x, bool) or (isinstance(x, Tensor) and x.dim() == 0 and x.dtype == torch.bool):
        return Pieces(None, None, torch.as_tensor(x).view(1, 1))
    if isinstance(x, int) or (isinstance(x, Tensor) and x.dim() == 0 and not x.is_floating_point()
                              and not x.is_complex()):
        if abs(int(x)) > _LARGE:
            raise Unsupported(f"a constant as large as {int(x)}")
        t = torch.as_tensor(x, dtype=torch.int64).view(1, 1)
        return Pieces(None, torch.zeros_like(t), t)
    raise Unsupported(f"a {type(x).__name__} operand (floats and shaped tensors are left to tiles)")


def _integer(x) -> Pieces:
    x = _lift(x)
    return Pieces(x.cuts, torch.zeros_like(x.icept, dtype=torch.int64), x.icept.long()) if x.is_bool else x


def _bounds(cuts: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each piece's ``[start, end)``."""
    if cuts is None:
        return torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), _keys.kv_len, dtype=torch.int64)
    return cuts[:, :-1], cuts[:, 1:]


def _take(t: Tensor | None, at: Tensor) -> Tensor | None:
    """``t`` ``[R|1, P]`` read at pieces ``at`` ``[R', P']`` (None: as it is)."""
    if t is None or at is None or t.shape[1] == 1:
        return t
    rows = max(t.shape[0], at.shape[0])
    return torch.gather(t.expand(rows, -1), 1, at.expand(rows, -1))


def _index(old: Tensor | None, cuts: Tensor) -> Tensor | None:
    """For each piece of ``cuts``, a refinement of ``old``, the piece of ``old`` it lies in (None:
    the same pieces)."""
    if old is None or old is cuts:
        return None
    rows = max(old.shape[0], cuts.shape[0])
    at = torch.searchsorted(old.expand(rows, -1).contiguous(), cuts[:, :-1].expand(rows, -1).contiguous(),
                            right=True) - 1
    return at.clamp_(0, old.shape[1] - 2)


def _on(x: Pieces | _Deferred, cuts: Tensor) -> tuple[Tensor | None, Tensor]:
    """``x``'s slope and intercept on the pieces of ``cuts``, a refinement of ``x.cuts``."""
    at = _index(x.cuts, cuts)
    return (x.slope, x.icept) if at is None else (_take(x.slope, at), _take(x.icept, at))


def _common(*xs: Pieces, extra: Tensor | None = None) -> Tensor | None:
    """The cuts of every value in ``xs`` together (and ``extra`` cuts ``[R|1, M]``), sorted."""
    cuts = [x.cuts for x in xs if x.cuts is not None]
    if extra is None and (not cuts or all(c is cuts[0] for c in cuts)):
        return cuts[0] if cuts else None
    inner = [c[:, 1:-1] for c in cuts] + ([extra] if extra is not None else [])
    rows = max(t.shape[0] for t in inner)
    inner = torch.cat([t.expand(rows, -1) for t in inner], 1).sort(1).values
    return torch.cat([torch.zeros(rows, 1, dtype=torch.int64), inner,
                      torch.full((rows, 1), _keys.kv_len, dtype=torch.int64)], 1)


def _make(cuts: Tensor | None, slope: Tensor | None, icept: Tensor) -> Pieces:
    """A value, with its empty pieces dropped and equal neighbours merged once it has many."""
    if cuts is None or cuts.shape[1] <= 9:
        return Pieces(cuts, slope, icept)
    return _compact(cuts, slope, icept)


def _compact(cuts: Tensor, slope: Tensor | None, icept: Tensor) -> Pieces:
    """The same value with no empty piece, and a piece like the live one just before it merged into
    that one; rows padded with empty pieces at ``kv_len``."""
    rows = max(cuts.shape[0], icept.shape[0], 1 if slope is None else slope.shape[0])
    p = cuts.shape[1] - 1
    cuts = cuts.expand(rows, -1)
    start, end = cuts[:, :-1], cuts[:, 1:]
    icept = icept.expand(rows, p)
    slope = None if slope is None else slope.expand(rows, p)
    live = end > start
    alike = live[:, :-1] & (icept[:, 1:] == icept[:, :-1])
    if slope is not None:
        alike &= slope[:, 1:] == slope[:, :-1]
    keep = live.clone()
    keep[:, 1:] &= ~alike
    at = keep.cumsum(1) - 1  # each kept piece's place
    width = max(1, int(at[:, -1].max()) + 1)
    if width > MOST_PIECES:
        raise Unsupported(f"a row with more than {MOST_PIECES} pieces")
    at = torch.where(keep, at, width)  # the others go to a column dropped below

    def packed(t: Tensor, fill) -> Tensor:
        return torch.full((rows, width + 1), fill, dtype=t.dtype).scatter_(1, at, t)

    new_cuts = packed(start, _keys.kv_len)
    new_cuts[:, 0], new_cuts[:, width] = 0, _keys.kv_len
    new_slope = None if slope is None else packed(slope, 0)[:, :width]
    return Pieces(new_cuts, new_slope, packed(icept, False if icept.dtype == torch.bool else 0)[:, :width])


# ---- arithmetic -------------------------------------------------------------------------------


def _arithmetic(*xs) -> list[Pieces]:
    """Operands of ``+ - *``: two booleans are refused (torch's True + True is True)."""
    xs = [_lift(x) for x in xs]
    if all(x.is_bool for x in xs):
        raise Unsupported("arithmetic on booleans")
    return [_integer(x) for x in xs]


def _add(a, b, alpha=1, sign=1):
    a, b = _arithmetic(a, b)
    if isinstance(alpha, Tensor) or not isinstance(alpha, int) or isinstance(alpha, bool):
        raise Unsupported("add with a non-integer alpha")
    cuts = _common(a, b)
    (sa, ca), (sb, cb) = _on(a, cuts), _on(b, cuts)
    k = sign * alpha
    return _make(cuts, sa + k * sb, ca + k * cb)


def _sub(a, b, alpha=1):
    return _add(a, b, alpha, -1)


def _neg(a):
    a, = _arithmetic(a)
    return Pieces(a.cuts, -a.slope, -a.icept)


def _mul(a, b):
    a, b = _arithmetic(a, b)
    cuts = _common(a, b)
    (sa, ca), (sb, cb) = _on(a, cuts), _on(b, cuts)
    start, end = _bounds(cuts)
    if bool(((sa * sb != 0) & (end > start)).any()):
        raise Unsupported("a product of two values that both change along the keys")
    slope, icept = sa * cb + sb * ca, ca * cb
    if bool((slope.abs() * _keys.kv_len + icept.abs() > _LARGE).any()):
        raise Unsupported("a product too large to follow")
    return _make(cuts, slope, icept)


def _positive_constant(m) -> int:
    if isinstance(m, Tensor) and m.dim() == 0 and not m.is_floating_point() and m.dtype != torch.bool:
        m = int(m)
    if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
        raise Unsupported("// or % by other than a positive integer constant")
    return m


def _crossings(a: Pieces, m: int) -> tuple[Tensor, Tensor] | None:
    """Where ``a // m`` changes within each piece of ``a`` (of slope 0 or +-1): the first key after
    the piece's start, and how many times (every ``m`` keys); None where it changes nowhere."""
    start, end = _bounds(a.cuts)
    live = end > start
    moving = (a.slope != 0) & live
    if not bool(moving.any()):
        return None
    if bool(((a.slope.abs() > 1) & live).any()):
        raise Unsupported("// or % of a value whose slope along the keys is not 0 or +-1")
    # a(k) = +-k + c passes a multiple of m at k = -c (mod m) going up, and at k = c + 1 (mod m) going down
    residue = torch.where(a.slope > 0, -a.icept, a.icept + 1)
    first = start + torch.remainder(residue - start, m)
    first = torch.where(first == start, first + m, first)
    return first, torch.where(moving, (end - first + m - 1).clamp(min=0) // m, 0)


def _floor_divide(a, m):
    """``a // m``: where ``a`` moves along the keys, a :class:`Quotient` (cut, where it must be,
    between the keys where ``a`` passes a multiple of ``m``)."""
    a, m = _integer(a), _positive_constant(m)
    start, end = _bounds(a.cuts)
    quotient = Quotient(a.cuts, a.slope, a.icept, m)
    return quotient if bool(((a.slope != 0) & (end > start)).any()) else quotient.plain()


def _divided(a: Pieces, m: int, crossings: tuple[Tensor, Tensor] | None) -> Pieces:
    if crossings is None:
        return Pieces(a.cuts, torch.zeros_like(a.slope), torch.div(a.icept, m, rounding_mode="floor"))
    first, count = crossings
    return _cut_and_read(a, count, lambda j: first.unsqueeze(-1) + m * j,
                         lambda s, c, k: torch.div(s * k + c, m, rounding_mode="floor"))


def _remainder(a, m):
    """``a % m``: where ``a`` moves along the keys, a :class:`Wrapped` value (a comparison of it
    holds every ``m`` keys; anything else cuts it at every multiple of ``m``)."""
    a, m = _integer(a), _positive_constant(m)
    remainder = Wrapped(a.cuts, a.slope, a.icept, m)
    return remainder if _crossings(a, m) is not None else remainder.plain()


def _cut_and_read(a: Pieces, count: Tensor, cut_at, read) -> Pieces:
    """``a`` cut at ``count[r, j]`` keys within each piece (``cut_at(j)`` ``[R, P, M]`` gives the
    ``j``-th), and on every new piece the constant ``read(slope, icept, key)`` at its first key."""
    most = int(count.sum(1).max())
    if most > MOST_PIECES:
        raise Unsupported(f"a row with more than {MOST_PIECES} pieces")
    if most == 0:
        return Pieces(a.cuts, torch.zeros_like(a.icept), read(a.slope, a.icept, _bounds(a.cuts)[0]))
    width = max(1, int(count.max()))
    j = torch.arange(width)
    extra = torch.where(j < count.unsqueeze(-1), cut_at(j), _keys.kv_len)
    cuts = _common(a, extra=extra.reshape(extra.shape[0], -1))
    slope, icept = _on(a, cuts)
    return _make(cuts, torch.zeros_like(cuts[:, :-1]), read(slope, icept, cuts[:, :-1]))


def _where(cond, x, y):
    cond, x, y = _lift(cond), _lift(x), _lift(y)
    if not cond.is_bool:
        raise Unsupported("where with a condition that is not boolean")
    if x.is_bool != y.is_bool:
        x, y = _integer(x), _integer(y)
    cuts = _common(cond, x, y)
    (_, c), (sx, cx), (sy, cy) = _on(cond, cuts), _on(x, cuts), _on(y, cuts)
    return _make(cuts, None if sx is None else torch.where(c, sx, sy), torch.where(c, cx, cy))


def _abs(a):
    a = _integer(a)
    return _where(_lt(a, 0), _neg(a), a)


def _minimum(a, b):
    return _where(_le(a, b), a, b)


def _maximum(a, b):
    return _where(_ge(a, b), a, b)


def _clamp(a, min=None, max=None):  # noqa: A002 (torch's argument names)
    if min is not None:
        a = _maximum(a, min)
    return a if max is None else _minimum(a, max)


# ---- comparisons and logic --------------------------------------------------------------------


def _at_most_zero(slope: Tensor, icept: Tensor) -> tuple[Tensor, Tensor]:
    """The keys ``[lo, hi)`` where ``slope * k + icept <= 0`` (integers), unbounded as +-_FAR."""
    safe = torch.where(slope == 0, 1, slope)
    up = torch.div(-icept, safe, rounding_mode="floor") + 1  # slope > 0: k <= floor(-c / s)
    down = -torch.div(icept, safe, rounding_mode="floor")  # slope < 0: k >= ceil(c / -s) = -floor(c / s)
    flat_lo = torch.where(icept <= 0, -_FAR, _FAR)
    lo = torch.where(slope > 0, -_FAR, torch.where(slope < 0, down, flat_lo))
    hi = torch.where(slope > 0, up, torch.full_like(up, _FAR))
    return lo, hi


def _compare(a, b, kind: str) -> Pieces:
    """Where ``a - b`` is ``<= 0`` (``le``), ``< 0``, ``== 0``: per piece, an interval of keys."""
    if isinstance(a, Wrapped) or isinstance(b, Wrapped):
        return _compare_wrapped(a, b, kind)
    if isinstance(a, Quotient) or isinstance(b, Quotient):
        return _compare_quotient(a, b, kind)
    a, b = _integer(a), _integer(b)
    cuts = _common(a, b)
    (sa, ca), (sb, cb) = _on(a, cuts), _on(b, cuts)
    s, c = sa - sb, ca - cb
    if kind == "lt":
        c = c + 1
    if not bool(s.any()):  # constant on every piece: no piece is cut
        return Pieces(cuts, None, (c == 0) if kind == "eq" else (c <= 0))
    lo, hi = _at_most_zero(s, c)
    if kind == "eq":  # and also -(a - b) <= 0
        lo2, hi2 = _at_most_zero(-s, -c)
        lo, hi = torch.maximum(lo, lo2), torch.minimum(hi, hi2)
    start, end = _bounds(cuts)
    lo = torch.minimum(torch.maximum(lo, start), end)
    hi = torch.minimum(torch.maximum(hi, lo), end)
    rows = max(t.shape[0] for t in (start, lo, hi))
    p = lo.shape[1]
    new = torch.stack([start.expand(rows, p), lo.expand(rows, p), hi.expand(rows, p)], -1).reshape(rows, 3 * p)
    new = torch.cat([new, torch.full((rows, 1), _keys.kv_len, dtype=torch.int64)], 1)
    truth = torch.tensor([False, True, False]).repeat(p).view(1, -1)
    return _make(new, None, truth)


def _compare_quotient(a, b, kind: str) -> Pieces:
    """:func:`_compare` of a :class:`Quotient` ``a // m`` and an integer ``t``, as ``a`` against
    multiples of ``m``: ``a // m <= t`` is ``a <= m * t + m - 1``, ``a // m < t`` is ``a < m * t``,
    ``t <= a // m`` is ``m * t <= a``, ``t < a // m`` is ``m * t + m <= a``."""
    flip = not isinstance(a, Quotient)
    x, t = (b, _integer(a)) if flip else (a, _integer(b))
    lowest, m = _mul(t, x.m), x.m  # the least value of a with a // m == t
    if kind == "eq":
        return _logic(_compare(lowest, x.dividend(), "le"), _compare(x.dividend(), _add(lowest, m - 1), "le"),
                      torch.logical_and)
    if flip:
        return _compare(_add(lowest, m) if kind == "lt" else lowest, x.dividend(), "le")
    return _compare(x.dividend(), lowest, "lt") if kind == "lt" else _compare(x.dividend(), _add(lowest, m - 1), "le")


def _compare_wrapped(a, b, kind: str) -> Pieces | Periodic:
    """:func:`_compare` of a :class:`Wrapped` remainder ``x`` and a value ``t`` constant along the keys:
    the residues where it holds are ``[lo, hi]``, so on a piece where ``x`` moves it holds once every
    ``m`` keys, for ``hi - lo + 1`` keys."""
    flip = not isinstance(a, Wrapped)
    x, t = (b, _integer(a)) if flip else (a, _integer(b))
    cuts = _common(x, t)
    (s, c), (ts, tc) = _on(x, cuts), _on(t, cuts)
    start, end = _bounds(cuts)
    if bool(((ts != 0) & (end > start)).any()):  # against a value that moves: as pieces
        return _compare(t, x.plain(), kind) if flip else _compare(x.plain(), t, kind)
    m = x.m
    if kind == "eq":
        lo, hi = tc, tc
    elif flip:  # t <= x, t < x
        lo, hi = tc + int(kind == "lt"), torch.full_like(tc, m - 1)
    else:  # x <= t, x < t
        lo, hi = torch.zeros_like(tc), tc - int(kind == "lt")
    lo, hi = lo.clamp(min=0), hi.clamp(max=m - 1)
    width = (hi - lo + 1).clamp(min=0)
    # s = 1: k = r - c (mod m) for r in [lo, hi]; s = -1: k = c - r, from c - hi up
    phase = torch.where(s > 0, lo - c, c - hi)
    value = torch.remainder(c, m)  # where x does not move
    still = (s == 0) | (width == 0) | (width >= m)
    truth = torch.where(s == 0, (value >= lo) & (value <= hi), width >= m)
    return _periodic(cuts, torch.where(still, 0, phase), torch.where(still, 1, m),
                     torch.where(still, truth.long(), width))


def _le(a, b):
    return _compare(a, b, "le")


def _lt(a, b):
    return _compare(a, b, "lt")


def _ge(a, b):
    return _compare(b, a, "le")


def _gt(a, b):
    return _compare(b, a, "lt")


def _eq(a, b):
    if isinstance(a, _Deferred) or isinstance(b, _Deferred):
        return _compare(a, b, "eq")
    if isinstance(a, Periodic) or isinstance(b, Periodic):
        return _logic(a, b, torch.eq)
    a, b = _lift(a), _lift(b)
    if a.is_bool and b.is_bool:
        return _logic(a, b, torch.eq)
    return _compare(a, b, "eq")


def _ne(a, b):
    return _not(_eq(a, b))


def _logic(a, b, op) -> Pieces | Periodic:
    if isinstance(a, Periodic) or isinstance(b, Periodic):
        return _logic_periodic(Periodic.of(a), Periodic.of(b), op)
    a, b = _lift(a), _lift(b)
    if not (a.is_bool and b.is_bool):
        raise Unsupported("a bitwise operation on integers")
    cuts = _common(a, b)
    (_, ca), (_, cb) = _on(a, cuts), _on(b, cuts)
    return _make(cuts, None, op(ca, cb))


def _logic_periodic(a: Periodic, b: Periodic, op) -> Pieces | Periodic:
    """``op`` of two booleans, one of them constant on each live piece: with a constant, ``and``,
    ``or``, ``xor`` and ``eq`` give the other side, its negation, or a constant."""
    cuts = _common(a, b)
    fa, fb = a.fields(_index(a.cuts, cuts)), b.fields(_index(b.cuts, cuts))
    start, end = _bounds(cuts)
    fixed_a, fixed_b = fa[1] == 1, fb[1] == 1
    if bool((~fixed_a & ~fixed_b & (end > start)).any()):  # two patterns: as pieces, where they are few
        return _logic(a.plain(), b.plain(), op)
    constant = torch.where(fixed_a, fa[2], fb[2]) > 0  # the constant side's value
    other = [torch.where(fixed_a, y, x) for x, y in zip(fa, fb, strict=True)]
    inverse = [other[0] + other[2], other[1], other[1] - other[2]]
    true, false = [0, 1, 1], [0, 1, 0]
    # op(constant, other): (when the constant is true, when it is false)
    cases = {torch.logical_and: (other, false), torch.logical_or: (true, other),
             torch.logical_xor: (inverse, other), torch.eq: (other, inverse)}
    if op not in cases:
        raise Unsupported(f"{getattr(op, '__name__', op)} of a pattern every few keys")
    picked = [torch.where(constant, t, f) for t, f in zip(*cases[op], strict=True)]
    return _periodic(cuts, *picked)


def _not(a):
    if isinstance(a, Periodic):
        return _periodic(a.cuts, a.phase + a.width, a.period, a.period - a.width)
    a = _lift(a)
    if not a.is_bool:
        raise Unsupported("a bitwise operation on integers")
    return Pieces(a.cuts, None, ~a.icept)


# ---- dtypes, constants and tables -------------------------------------------------------------


def _cast(a, dtype: torch.dtype | None) -> Pieces:
    if isinstance(a, Periodic) and dtype in (None, torch.bool):
        return a
    if isinstance(a, _Deferred) and (dtype is None or not (dtype == torch.bool or dtype.is_floating_point
                                                           or dtype.is_complex)):
        return a
    if dtype is None:
        return _lift(a)
    if dtype == torch.bool:
        a = _lift(a)
        return a if a.is_bool else _ne(a, 0)
    if dtype.is_floating_point or dtype.is_complex:
        raise Unsupported("a cast to float (left to tiles)")
    return _integer(a)


def _constant(a, value, dtype) -> Pieces:
    dtype = dtype if dtype is not None else a.dtype
    if dtype.is_floating_point or dtype.is_complex:
        raise Unsupported("a float constant (left to tiles)")
    return _lift(bool(value) if dtype == torch.bool else int(value))


def _getitem(table, index):
    """``table[index]``: a captured 1-D integer or bool tensor read at an index, or a 2-D one at
    ``[row, column]`` with a row constant along the keys (``layout[q_idx // 64, kv_idx // 64]``).
    The index (column) has slope 0 or 1 along the keys, or is such a value's quotient by ``m``
    (read as the table with each entry repeated ``m`` times), and stays within the table; the
    value is cut where the entries change."""
    parts = index if isinstance(index, tuple) else (index,)
    if any(isinstance(i, _Head) for i in parts):
        raise ReadsHead()
    if (not isinstance(table, Tensor) or table.dim() not in (1, 2) or table.dim() != len(parts)
            or table.is_floating_point() or table.is_complex()
            or not any(isinstance(i, (Pieces, _Deferred)) for i in parts)):
        raise Unsupported("indexing other than a 1-D or 2-D integer or bool tensor by indices")
    entries = table.detach().view(-1 if table.dim() == 2 else 1, table.shape[-1])  # [table rows, N]
    rows_of, n = entries.shape
    row = None  # the table row each query row reads (a 2-D table)
    if table.dim() == 2:
        r = _integer(parts[0])
        if r.cuts is not None or bool((r.slope != 0).any()):
            raise Unsupported("a 2-D table read at a row that changes along the keys")
        row = r.icept[:, 0]
        if bool(((row < 0) | (row >= rows_of)).any()):
            raise Unsupported("an index outside the tensor")
    col = parts[-1]
    x, m = (col.dividend(), col.m) if isinstance(col, Quotient) else (_integer(col), 1)
    start, end = _bounds(x.cuts)
    live = end > start
    first, last = x.icept + x.slope * start, x.icept + x.slope * (end - 1)  # the index at each end
    if bool((live & ((x.slope < 0) | (x.slope > 1))).any()):
        raise Unsupported("a table read at an index whose slope along the keys is not 0 or 1")
    if bool((live & ((torch.minimum(first, last) < 0) | (torch.maximum(first, last) >= n * m))).any()):
        raise Unsupported("an index outside the tensor")  # cell by cell, this raises or wraps around
    # where each table row's runs of entries begin (the index into the stretched table), padded past its end
    changed = entries[:, 1:] != entries[:, :-1]
    most = int(changed.sum(1).max()) if n > 1 else 0
    changes = torch.where(changed, torch.arange(1, n), n).sort(1).values[:, :most] * m
    if row is not None:
        changes = changes.index_select(0, row)  # [R|1, C]: the changes of each query row's table row
        rows = max(changes.shape[0], first.shape[0])
        changes, first, last = (t.expand(rows, -1).contiguous() for t in (changes, first, last))
    else:
        changes = changes[0]
    moving = (x.slope == 1) & live
    lo = torch.searchsorted(changes, first, right=True)  # changes after the piece's first index
    count = torch.where(moving, torch.searchsorted(changes, last, right=True) - lo, 0)
    top = max(most - 1, 0)

    def cut_at(j: Tensor) -> Tensor:  # the key where the j-th change after a piece's first index falls
        if most == 0:
            return torch.zeros_like(j)
        at = (lo.unsqueeze(-1) + j).clamp(max=top)
        found = changes[at] if row is None else changes.gather(1, at.flatten(1)).view(at.shape)
        return found - x.icept.unsqueeze(-1)

    def read(s: Tensor, c: Tensor, k: Tensor) -> Tensor:
        at = torch.div(s * k + c, m, rounding_mode="floor").clamp(0, n - 1)
        return (entries[0, at] if row is None else entries[row.view(-1, 1), at]).long()

    out = _cut_and_read(x, count, cut_at, read)
    return _cast(out, torch.bool) if table.dtype == torch.bool else out


_RULES = rule_table({
    "add": _add, "sub": _sub, "mul": _mul, "neg": _neg, "abs": _abs, "floor_divide": _floor_divide,
    "remainder": _remainder, "minimum": _minimum, "maximum": _maximum, "clamp": _clamp,
    "lt": _lt, "le": _le, "gt": _gt, "ge": _ge, "eq": _eq, "ne": _ne,
    "and": lambda a, b: _logic(a, b, torch.logical_and), "or": lambda a, b: _logic(a, b, torch.logical_or),
    "xor": lambda a, b: _logic(a, b, torch.logical_xor), "not": _not, "where": _where, "getitem": _getitem,
}, _cast, _constant)

for _cls in (Pieces, Quotient, Wrapped, Periodic):
    stands_in(_cls, _RULES)


class _EveryRule(dict):
    """The head index's rules: whatever is done with it reads the head."""

    def get(self, name, default=None):
        return _reads_head

    def __contains__(self, name):
        return True


def _reads_head(*args, **kwargs):
    raise ReadsHead()


stands_in(_Head, _EveryRule())


def derive(mod, batch: int, heads: int, q_len: int, kv_len: int,
           most: int | None = None) -> tuple[Tensor, Tensor, Tensor, int]:
    """As :func:`attnkit._ranges.derive` (``(row, start, end, p)``, flat and sorted), from pieces.
    Raises :class:`Unsupported` for a predicate they cannot follow, and for a pattern every few
    keys that gives a row more than ``most`` runs."""
    if not (q_len and kv_len):
        raise Unsupported("an empty grid")
    _state.failed.clear()
    _keys.kv_len = kv_len
    rows = batch * q_len
    b = Pieces(None, torch.zeros(rows, 1, dtype=torch.int64), torch.arange(batch).repeat_interleave(q_len).view(-1, 1))
    q = Pieces(None, torch.zeros(rows, 1, dtype=torch.int64), torch.arange(q_len).repeat(batch).view(-1, 1))
    kv = Pieces(None, torch.ones(1, 1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64))
    h = _Head() if heads > 1 else _lift(0)
    out = mod(b, h, q, kv)
    if isinstance(out, Tensor) and out.dim() == 0 and out.dtype == torch.bool:
        out = _lift(out)
    if not (isinstance(out, Periodic) or (isinstance(out, Pieces) and out.is_bool)):
        raise Unsupported("the predicate did not return booleans")
    if _state.failed:
        raise Unsupported(_state.failed[0])
    cuts = (out.cuts if out.cuts is not None else torch.tensor([[0, kv_len]])).expand(rows, -1)
    fields = [out.icept] if isinstance(out, Pieces) else [out.phase, out.period, out.width]
    fields = [t.expand(rows, cuts.shape[1] - 1) for t in fields]
    p = batch
    if batch > 1 and all(bool((t.view(batch, q_len, -1) == t[:q_len]).all()) for t in (cuts, *fields)):
        p = 1  # the same pieces for every batch element
    rows = p * q_len
    start, end = cuts[:rows, :-1], cuts[:rows, 1:]
    if isinstance(out, Pieces):
        row, j = (fields[0][:rows] & (end > start)).nonzero(as_tuple=True)  # row-major: each row's true pieces in order
        first, last = start[row, j], end[row, j]
    else:
        row, first, last = _periodic_runs(start, end, *(t[:rows] for t in fields), most)
    at, last = _join(row, first, last, ordered=True)  # pieces that touch are one run
    if at.numel() == row.numel():  # none did
        return row, first, last, p
    return row.index_select(0, at), first.index_select(0, at), last, p


def _periodic_runs(start: Tensor, end: Tensor, phase: Tensor, period: Tensor, width: Tensor,
                   most: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """A :class:`Periodic` boolean's runs ``(row, first, last)``, each row's in order: one a piece
    where it is constant and true, one per period (within the piece) where it is periodic."""
    row, j = ((width > 0) & (end > start)).nonzero(as_tuple=True)
    s, e, phase, period, width = (t[row, j] for t in (start, end, phase, period, width))
    still = period == 1  # true throughout: one period the piece's length
    period, width = torch.where(still, e - s, period), torch.where(still, e - s, width)
    base = s - torch.remainder(s - torch.where(still, s, phase), period)  # where the period holding s begins
    skip = (s - base >= width).long()  # that period's run ends before the piece starts
    count = (e - base + period - 1) // period - skip
    if not count.numel():
        return row, s, e
    if most is not None and int(torch.bincount(row, count).max()) > most:
        raise Unsupported(f"more than {most} runs in a row")
    most_here = int(count.max())
    k = torch.arange(most_here).view(1, -1)  # [pieces, the most runs a piece has]: row-major is key order
    lo = base.view(-1, 1) + (skip.view(-1, 1) + k) * period.view(-1, 1)
    at = (k < count.view(-1, 1)).view(-1).nonzero().view(-1)
    first = torch.maximum(lo, s.view(-1, 1)).view(-1).index_select(0, at)
    last = torch.minimum(lo + width.view(-1, 1), e.view(-1, 1)).view(-1).index_select(0, at)
    return row.index_select(0, at // most_here), first, last
