"""A predicate's rows in closed form: each row's values as a few affine pieces along the keys.

The masks people write are mostly affine in the indices: ``q_idx - kv_idx <= 64``,
``kv_idx < 16``, ``doc_ids[q_idx] == doc_ids[kv_idx]`` (a table with few runs), and their
``and_masks``/``or_masks``. For such a predicate each query row's allowed keys follow from its
terms without evaluating a cell: here it is called once with, for every query row, each value as
pieces ``[cut_j, cut_j+1)`` of the key axis on which it is ``slope * kv_idx + intercept``
(integers; booleans are constant on each piece). An operation cuts pieces where its result
changes (a comparison where the difference crosses zero, a table where its entries change) and
the final boolean's true pieces are the row's runs. Exact, and O(rows x pieces) work (two runs
combined on their ends, see :data:`ONE_RUN`), where tiles and cells (:mod:`.ranges`) cost
O(tiles) and O(cells); ``bench/results/mods.md`` (``attnkit bench mods``) has the figures.

Many rows (a long sequence, or a mask per head with the heads folded into the rows) are taken in
blocks of consecutive rows: the predicate runs on each block's first and last row, and every
choice made from a row's values (a comparison, a floor division, a sort, a search: the
``_at_most``, ``_fdiv``, ``_sorted``, ``_search`` below) is checked to come out the same at both.
A comparison of two values affine in the row that holds at both ends of a block holds across it;
so when every choice holds, every value is affine in the row within each block, and the rows
between follow from the two ends. Where a choice differs, the row where it changes is noted, the
blocks are cut there and the pass is run again: a window takes two passes, over one block and then
four, whatever the length.

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
``layout[q_idx // 64, kv_idx // 64]``). Anything else raises :class:`.stand_ins.CannotFollow`
and the tiles take over: floats, a product of two key-dependent values, constants beyond 2^40, a
2-D table read at a row that changes along the keys, an index of slope other than 0 or 1 into a
table, an index outside the table, a value with more than
:data:`MOST_PIECES` pieces in a row, two periodic patterns combined beyond that, a row with more
runs than the caller keeps. Reading the head index where there are several heads raises
:class:`.stand_ins.ReadsHead`: the plan then works the predicate out again with the heads
folded into the batch, where the head is a value per row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .rows import join, pack
from .stand_ins import CannotFollow, ReadsHead, call_on_stand_ins, current, deriving, rule_table, stands_in

#: Most pieces a value may have in a row; more (a pattern that changes every few keys) is left to tiles.
MOST_PIECES = 64
#: Most rows noted per entry and pass where a choice changes within a block of rows.
MOST_FLIPS = 256
#: Beyond every index: the ends of a half-line of keys before it is cut to a piece.
_FAR = 1 << 62
#: Largest magnitude a constant or a product may reach here (sums of a few stay far from int64's
#: limits, so nothing wraps around where the predicate's own arithmetic would not).
_LARGE = 1 << 40


class _NotBlocks(CannotFollow):
    """Block mode cannot follow the predicate: each row is worked out on its own."""

    def __init__(self, what: str):
        super().__init__(what)
        current().not_blocks = True


# ---- decisions --------------------------------------------------------------------------------
# Every choice made from a row value (a comparison, a floor division, a sort, a search) goes
# through these. Each row on its own, they are torch's. In block mode they also check that the
# choice is the same at a block's two ends: a comparison of two values affine in the row has one
# outcome across a block when it has one at both ends, so if every choice passes, every value is
# affine in the row within each block and its rows follow from its two ends. Where a choice
# differs, the row where it changes is noted and the blocks are cut there for another pass.


def _ends(t, block: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """A row value at its blocks' first and last rows; None when rows are on their own or ``t`` is
    one value for every row. ``block``: ``t`` is entries of the rows laid out flat, those at the
    first rows then the same ones at the last, and ``block`` the block of each of the first."""
    if current().span is None or not isinstance(t, Tensor) or t.dim() == 0 or (t.shape[0] == 1 and block is None):
        return None
    if block is not None and not block.numel():  # (the halves already differ: the pass is redone)
        return None
    r = current().span.shape[0] if block is None else block.shape[0]
    if t.shape[0] != 2 * r:
        raise _NotBlocks("a value that is not one per row")
    return t[:r], t[r:]


def _varies(t, block: Tensor | None = None) -> bool:
    ends = _ends(t, block)
    return ends is not None and not torch.equal(*ends)


def _note(d0: Tensor, d1: Tensor, where: Tensor, block: Tensor | None = None) -> None:
    """Note, for the entries ``where``, the first row after its block's first at which ``d >= 0``
    (affine in the row, ``d0`` and ``d1`` at the block's ends) stops being what it was there."""
    shape = (d0.shape[0],) + (1,) * (d0.dim() - 1)
    first, span = (t.view(-1) if block is None else t.view(-1)[block] for t in (current().first, current().span))
    first, span = first.view(shape), span.view(shape).clamp(min=1)
    step = torch.div(d1 - d0, span, rounding_mode="floor")
    step = torch.where(step == 0, torch.where(d1 >= d0, 1, -1), step)
    # rising (d0 < 0): the first row with d >= 0, ceil(-d0 / step); falling: with d <= -1, ceil((d0 + 1) / -step)
    offset = -torch.where(d0 < 0, torch.div(d0, step, rounding_mode="floor"),
                          torch.div(d0 + 1, step, rounding_mode="floor"))
    offset = torch.minimum(offset.clamp(min=1), span)
    current().flips.append((first + offset).expand_as(where)[where])


def _at_most(x, y, block: Tensor | None = None) -> Tensor:
    """``x <= y`` of integer row values (``block``: of entries laid out flat, see :func:`_ends`)."""
    out = x <= y
    ends = _ends(out, block)
    if ends is not None and not torch.equal(*ends):
        d = torch.as_tensor(y - x).expand(out.shape)
        _note(*_ends(d, block), ends[0] != ends[1], block)
    return out


def _below(x, y, block: Tensor | None = None) -> Tensor:
    """``x < y`` of integer row values."""
    return _at_most(x + 1, y, block)


def _same(x, y, block: Tensor | None = None) -> Tensor:
    """``x == y`` of integer row values."""
    return _at_most(x, y, block) & _at_most(y, x, block)


def _smaller(x, y, block: Tensor | None = None) -> Tensor:
    """``torch.minimum`` of integer row values (a choice of one: checked in blocks)."""
    if current().span is None:
        return torch.minimum(torch.as_tensor(x), torch.as_tensor(y))
    return torch.where(_at_most(x, y, block), x, y)


def _larger(x, y, block: Tensor | None = None) -> Tensor:
    """``torch.maximum`` of integer row values."""
    if current().span is None:
        return torch.maximum(torch.as_tensor(x), torch.as_tensor(y))
    return torch.where(_at_most(x, y, block), y, x)


def _fdiv(x: Tensor, m) -> Tensor:
    """``floor(x / m)`` of a row value by an integer or by a value the same across each block. In
    a block it is affine in the row when ``m`` divides ``x``'s step, or when it does not change."""
    if isinstance(m, int) and m in (1, -1):  # (exact: no choice)
        return x if m == 1 else -x
    out = torch.div(x, m, rounding_mode="floor")
    ends = _ends(out)
    if ends is None or torch.equal(*ends):
        return out
    if _varies(m):
        return _cannot("a divisor that changes with the row", out)
    x0, x1 = _ends(x.expand(out.shape))
    m = torch.as_tensor(m).expand(out.shape)[: x0.shape[0]]
    span = current().span.view((x0.shape[0],) + (1,) * (x0.dim() - 1))
    bad = torch.remainder(x1 - x0, m * span.clamp(min=1)) != 0
    if bool(bad.any()):  # it changes where x passes a multiple of m: note each (by |m|, on x's side of its sign)
        sign = torch.where(m < 0, -1, 1)
        x0, x1, m = x0 * sign, x1 * sign, m.abs()
        q0, q1 = torch.div(x0, m, rounding_mode="floor"), torch.div(x1, m, rounding_mode="floor")
        low, count = torch.minimum(q0, q1).unsqueeze(-1), (q1 - q0).abs().unsqueeze(-1)
        j = torch.arange(1, min(int(count.max()), MOST_FLIPS) + 1)
        level = m.unsqueeze(-1) * (low + j)  # x >= level changes between the ends, for each multiple passed
        _note(x0.unsqueeze(-1) - level, x1.unsqueeze(-1) - level, bad.unsqueeze(-1) & (j <= count))
    return out


def _cannot(what: str, out: Tensor) -> Tensor:
    """``out`` where a pass has already noted a change (it is redone, with values that may then
    hold); else blocks cannot follow ``what``."""
    if current().flips:
        return out
    raise _NotBlocks(what)


def _fmod(x: Tensor, m) -> Tensor:
    return x - m * _fdiv(x, m)


def _product(x, y, block: Tensor | None = None):
    """``x * y`` of row values: in block mode one of them must be the same along each block (else
    the product is not affine in the row)."""
    if _varies(x, block) and _varies(y, block):
        return _cannot("a product of two values that both change with the row", x * y)
    return x * y


def _search(seq: Tensor, v: Tensor, right: bool) -> Tensor:
    """``torch.searchsorted(seq, v, right=right)``, ``seq`` sorted along its last dimension
    (``[N]`` or ``[rows|1, N]``) and ``v`` ``[rows|1, M]``. In a block the count is one across
    it when it is one at both ends (``seq`` sorted throughout); where not, each entry ``v``
    passes between the ends is noted."""
    out = torch.searchsorted(seq, v, right=right)
    ends = _ends(out)
    if ends is None or torch.equal(*ends):
        return out
    (o0, o1), r = ends, ends[0].shape[0]
    low, high = torch.minimum(o0, o1), torch.maximum(o0, o1)
    v0, v1 = _ends(v.expand(out.shape))
    n = seq.shape[-1]
    if seq.dim() == 1:
        s0 = s1 = seq.view(1, -1).expand(r, -1)
    else:
        s0, s1 = _ends(seq) or (seq.expand(r, -1), seq.expand(r, -1))
    j = torch.arange(min(int((high - low).max()), MOST_FLIPS))
    at = (low.unsqueeze(-1) + j).clamp(max=n - 1)  # the entries v passes: v >= it (right) or v > it changes
    e0, e1 = (t.gather(1, at.flatten(1)).view(at.shape) for t in (s0, s1))
    d0, d1 = v0.unsqueeze(-1) - e0 - int(not right), v1.unsqueeze(-1) - e1 - int(not right)
    _note(d0, d1, low.unsqueeze(-1) + j < high.unsqueeze(-1))
    return out


def _sorted(t: Tensor) -> Tensor:
    """``t`` sorted along dimension 1. In a block, one order sorts both ends (ties at the first
    row broken by the last), or the pairs it leaves out of order at the last row are noted."""
    ends = _ends(t)
    if ends is None:
        return t.sort(1).values
    t0, t1 = ends
    order = t1.argsort(dim=1, stable=True)
    order = order.gather(1, t0.gather(1, order).argsort(dim=1, stable=True))
    s0, s1 = t0.gather(1, order), t1.gather(1, order)
    d0, d1 = s0[:, 1:] - s0[:, :-1], s1[:, 1:] - s1[:, :-1]
    wrong = d1 < 0
    if bool(wrong.any()):
        _note(d0, d1, wrong)
        return t.sort(1).values  # each end sorted on its own: true rows, and this pass is redone
    return torch.cat([s0, s1])


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


#: The truth of a boolean true on one run of keys in each row, cuts ``[0, lo, hi, Lk]`` (a comparison
#: of a value with one piece): known by identity, so ``&`` and ``|`` with it, and its rows, skip the
#: general merge of cuts (see :func:`_one_run`).
ONE_RUN = torch.tensor([[False, True, False]])
#: The truth of two runs in key order, cuts ``[0, lo1, hi1, lo2, hi2, Lk]`` (``|`` of two runs).
TWO_RUNS = torch.tensor([[False, True, False, True, False]])


class _Deferred:
    """An integer ``(slope * kv_idx + icept)`` under an operation (divided by ``m``, its remainder,
    its absolute value) kept whole: cut where the result changes form (:meth:`plain`) only when
    something other than a comparison uses it."""

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


class Absolute(_Deferred):
    """``|a|`` of a value with one piece (``(q_idx - kv_idx).abs()``). Compared as at most (or below)
    ``t`` it is ``a <= t`` and ``-a <= t``: one run, where as pieces it is two (each side of
    ``a = 0``) that touch."""

    def plain(self) -> Pieces:
        a = self.dividend()
        return _where(_lt(a, 0), _neg(a), a)


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
            raise CannotFollow("a bitwise operation on integers")
        zero = torch.zeros_like(x.icept, dtype=torch.int64)
        return Periodic(x.cuts, zero, zero + 1, x.icept.long())

    def fields(self, at: Tensor | None) -> list[Tensor]:
        return [_take(t, at) for t in (self.phase, self.period, self.width)]

    def plain(self) -> Pieces:
        """As pieces: a true piece for each run (refused beyond :data:`MOST_PIECES` pieces)."""
        rows = max(t.shape[0] for t in (*_bounds(self.cuts), self.phase, self.period, self.width))
        firsts, lasts = _runs(self, rows, MOST_PIECES // 2)
        runs = torch.stack([firsts, lasts], -1).flatten(1)  # first, last, first, last, ...: the true pieces
        cuts = _framed(runs)
        return _make(cuts, None, (torch.arange(cuts.shape[1] - 1) % 2 == 1).view(1, -1))


def _periodic(cuts: Tensor | None, phase: Tensor, period: Tensor, width: Tensor) -> Pieces | Periodic:
    """A boolean from its periodic form: plain pieces where every piece is constant."""
    if not bool((period != 1).any()):
        return _make(cuts, None, _below(0, width))
    if cuts is not None and cuts.shape[1] - 1 > MOST_PIECES:
        raise CannotFollow(f"a row with more than {MOST_PIECES} pieces")
    return Periodic(cuts, phase, period, width)


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
            raise CannotFollow(f"a constant as large as {int(x)}")
        t = torch.as_tensor(x, dtype=torch.int64).view(1, 1)
        return Pieces(None, torch.zeros_like(t), t)
    raise CannotFollow(f"a {type(x).__name__} operand (floats and shaped tensors are left to tiles)")


def _integer(x) -> Pieces:
    x = _lift(x)
    return Pieces(x.cuts, torch.zeros_like(x.icept, dtype=torch.int64), x.icept.long()) if x.is_bool else x


def _bounds(cuts: Tensor | None) -> tuple[Tensor, Tensor]:
    """Each piece's ``[start, end)``."""
    if cuts is None:
        return torch.zeros(1, 1, dtype=torch.int64), torch.full((1, 1), current().kv_len, dtype=torch.int64)
    return cuts[:, :-1], cuts[:, 1:]


def _framed(*inner: Tensor) -> Tensor:
    """Cuts from 0 through ``inner`` (``[R|1, m]`` each, in order) to ``kv_len``."""
    rows = max(t.shape[0] for t in inner)
    return torch.cat([torch.zeros(rows, 1, dtype=torch.int64), *(t.expand(rows, -1) for t in inner),
                      torch.full((rows, 1), current().kv_len, dtype=torch.int64)], 1)


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
    at = _search(old.expand(rows, -1).contiguous(), cuts[:, :-1].expand(rows, -1).contiguous(), right=True) - 1
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
    return _framed(_sorted(torch.cat([t.expand(rows, -1) for t in inner], 1)))


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
    live = _below(start, end)
    same = (icept[:, 1:] == icept[:, :-1]) if slope is None else _same(icept[:, 1:], icept[:, :-1])
    alike = live[:, :-1] & same
    if slope is not None:
        alike &= _same(slope[:, 1:], slope[:, :-1])
    keep = live.clone()
    keep[:, 1:] &= ~alike
    at = keep.cumsum(1) - 1  # each kept piece's place
    width = max(1, int(at[:, -1].max()) + 1)
    if width > MOST_PIECES:
        raise CannotFollow(f"a row with more than {MOST_PIECES} pieces")
    at = torch.where(keep, at, width)  # the others go to a column dropped below

    def packed(t: Tensor, fill) -> Tensor:
        return torch.full((rows, width + 1), fill, dtype=t.dtype).scatter_(1, at, t)

    new_cuts = packed(start, current().kv_len)
    new_cuts[:, 0], new_cuts[:, width] = 0, current().kv_len
    new_slope = None if slope is None else packed(slope, 0)[:, :width]
    return Pieces(new_cuts, new_slope, packed(icept, False if icept.dtype == torch.bool else 0)[:, :width])


# ---- arithmetic -------------------------------------------------------------------------------


def _arithmetic(*xs) -> list[Pieces]:
    """Operands of ``+ - *``: two booleans are refused (torch's True + True is True)."""
    xs = [_lift(x) for x in xs]
    if all(x.is_bool for x in xs):
        raise CannotFollow("arithmetic on booleans")
    return [_integer(x) for x in xs]


def _add(a, b, alpha=1, sign=1):
    a, b = _arithmetic(a, b)
    if isinstance(alpha, Tensor) or not isinstance(alpha, int) or isinstance(alpha, bool):
        raise CannotFollow("add with a non-integer alpha")
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
    if bool((~_same(sa, 0) & ~_same(sb, 0) & _below(start, end)).any()):
        raise CannotFollow("a product of two values that both change along the keys")
    slope, icept = _product(sa, cb) + _product(sb, ca), _product(ca, cb)
    if bool((slope.abs() * current().kv_len + icept.abs() > _LARGE).any()):
        raise CannotFollow("a product too large to follow")
    return _make(cuts, slope, icept)


def _positive_constant(m) -> int:
    if isinstance(m, Tensor) and m.dim() == 0 and not m.is_floating_point() and m.dtype != torch.bool:
        m = int(m)
    if not isinstance(m, int) or isinstance(m, bool) or m <= 0:
        raise CannotFollow("// or % by other than a positive integer constant")
    return m


def _moving(a: Pieces) -> Tensor:
    """The pieces where ``a`` moves along the keys (refused where by more than one a key)."""
    start, end = _bounds(a.cuts)
    live = _below(start, end)
    if bool(((_below(a.slope, -1) | _below(1, a.slope)) & live).any()):
        raise CannotFollow("// or % of a value whose slope along the keys is not 0 or +-1")
    return ~_same(a.slope, 0) & live


def _crossings(a: Pieces, m: int) -> tuple[Tensor, Tensor] | None:
    """Where ``a // m`` changes within each piece of ``a`` (of slope 0 or +-1): the first key after
    the piece's start, and how many times (every ``m`` keys); None where it changes nowhere."""
    moving = _moving(a)
    if not bool(moving.any()):
        return None
    start, end = _bounds(a.cuts)
    # a(k) = +-k + c passes a multiple of m at k = -c (mod m) going up, and at k = c + 1 (mod m) going down
    residue = torch.where(_below(0, a.slope), -a.icept, a.icept + 1)
    first = start + _fmod(torch.where(moving, residue - start, 0), m)  # (only where it moves: no needless choices)
    first = torch.where(_same(first, start), first + m, first)
    return first, torch.where(moving, _fdiv(_larger(torch.where(moving, end - first + m - 1, 0), 0), m), 0)


def _floor_divide(a, m):
    """``a // m``: where ``a`` moves along the keys, a :class:`Quotient` (cut, where it must be,
    between the keys where ``a`` passes a multiple of ``m``)."""
    a, m = _integer(a), _positive_constant(m)
    start, end = _bounds(a.cuts)
    quotient = Quotient(a.cuts, a.slope, a.icept, m)
    return quotient if bool((~_same(a.slope, 0) & _below(start, end)).any()) else quotient.plain()


def _divided(a: Pieces, m: int, crossings: tuple[Tensor, Tensor] | None) -> Pieces:
    if crossings is None:
        return Pieces(a.cuts, torch.zeros_like(a.slope), _fdiv(a.icept, m))
    first, count = crossings
    return _cut_and_read(a, count, lambda j: first.unsqueeze(-1) + m * j,
                         lambda s, c, k, live: _fdiv(torch.where(live, _product(s, k) + c, 0), m))


def _remainder(a, m):
    """``a % m``: where ``a`` moves along the keys, a :class:`Wrapped` value (a comparison of it
    holds every ``m`` keys; anything else cuts it at every multiple of ``m``)."""
    a, m = _integer(a), _positive_constant(m)
    remainder = Wrapped(a.cuts, a.slope, a.icept, m)
    return remainder if bool(_moving(a).any()) else remainder.plain()


def _cut_and_read(a: Pieces, count: Tensor, cut_at, read) -> Pieces:
    """``a`` cut at ``count[r, j]`` keys within each piece (``cut_at(j)`` ``[R, P, M]`` gives the
    ``j``-th), and on every new piece the constant ``read(slope, icept, key, live)`` at its first
    key (``live``: the pieces that are not empty; what an empty one reads is never used)."""
    most = int(count.sum(1).max())
    if most > MOST_PIECES:
        raise CannotFollow(f"a row with more than {MOST_PIECES} pieces")
    if most == 0:
        start, end = _bounds(a.cuts)
        return Pieces(a.cuts, torch.zeros_like(a.icept), read(a.slope, a.icept, start, _below(start, end)))
    width = max(1, int(count.max()))
    j = torch.arange(width)
    extra = torch.where(j < count.unsqueeze(-1), cut_at(j), current().kv_len)
    cuts = _common(a, extra=extra.reshape(extra.shape[0], -1))
    slope, icept = _on(a, cuts)
    start, end = _bounds(cuts)
    return _make(cuts, torch.zeros_like(start), read(slope, icept, start, _below(start, end)))


def _where(cond, x, y):
    cond, x, y = _lift(cond), _lift(x), _lift(y)
    if not cond.is_bool:
        raise CannotFollow("where with a condition that is not boolean")
    if x.is_bool != y.is_bool:
        x, y = _integer(x), _integer(y)
    cuts = _common(cond, x, y)
    (_, c), (sx, cx), (sy, cy) = _on(cond, cuts), _on(x, cuts), _on(y, cuts)
    return _make(cuts, None if sx is None else torch.where(c, sx, sy), torch.where(c, cx, cy))


def _abs(a):
    a = _integer(a)
    return Absolute(None, a.slope, a.icept, 1) if a.cuts is None else _where(_lt(a, 0), _neg(a), a)


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
    rising, falling = _below(0, slope), _below(slope, 0)
    safe = torch.where(rising | falling, slope, 1)
    up = _fdiv(-icept, safe) + 1  # slope > 0: k <= floor(-c / s)
    down = -_fdiv(icept, safe)  # slope < 0: k >= ceil(c / -s) = -floor(c / s)
    flat_lo = torch.where(_at_most(icept, 0), -_FAR, _FAR)
    lo = torch.where(rising, -_FAR, torch.where(falling, down, flat_lo))
    hi = torch.where(rising, up, torch.full_like(up, _FAR))
    return lo, hi


def _compare(a, b, kind: str) -> Pieces:
    """Where ``a - b`` is ``<= 0`` (``le``), ``< 0``, ``== 0``: per piece, an interval of keys."""
    if isinstance(a, Absolute) and kind != "eq":  # |x| <= t: x <= t and -x <= t
        x = a.dividend()
        return _logic(_compare(x, b, kind), _compare(_neg(x), b, kind), torch.logical_and)
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
        return Pieces(cuts, None, _same(c, 0) if kind == "eq" else _at_most(c, 0))
    start, end = _bounds(cuts)
    if kind != "eq" and s.numel() == 1:  # one slope on every row (q_idx - kv_idx <= 64): one side is the piece's
        slope = int(s)
        if slope > 0:  # k <= floor(-c / s)
            lo, hi = start, _smaller(_larger(_fdiv(-c, slope) + 1, start), end)
        else:  # k >= ceil(c / -s)
            lo, hi = _smaller(_larger(-_fdiv(c, slope), start), end), end
    else:
        lo, hi = _at_most_zero(s, c)
        if kind == "eq":  # and also -(a - b) <= 0
            lo2, hi2 = _at_most_zero(-s, -c)
            lo, hi = _larger(lo, lo2), _smaller(hi, hi2)
        lo = _smaller(_larger(lo, start), end)
        hi = _smaller(_larger(hi, lo), end)
    p = lo.shape[1]
    if p == 1:  # (one piece: it starts at 0)
        return Pieces(_framed(lo, hi), None, ONE_RUN)
    rows = max(t.shape[0] for t in (start, lo, hi))
    new = torch.stack([start.expand(rows, p), lo.expand(rows, p), hi.expand(rows, p)], -1).reshape(rows, 3 * p)
    new = torch.cat([new, torch.full((rows, 1), current().kv_len, dtype=torch.int64)], 1)
    return _make(new, None, torch.tensor([False, True, False]).repeat(p).view(1, -1))


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
    if bool((~_same(ts, 0) & _below(start, end)).any()):  # against a value that moves: as pieces
        return _compare(t, x.plain(), kind) if flip else _compare(x.plain(), t, kind)
    m = x.m
    if kind == "eq":
        lo, hi = tc, tc
    elif flip:  # t <= x, t < x
        lo, hi = tc + int(kind == "lt"), torch.full_like(tc, m - 1)
    else:  # x <= t, x < t
        lo, hi = torch.zeros_like(tc), tc - int(kind == "lt")
    lo, hi = _larger(lo, 0), _smaller(hi, m - 1)
    width = _larger(hi - lo + 1, 0)
    # s = 1: k = r - c (mod m) for r in [lo, hi]; s = -1: k = c - r, from c - hi up
    phase = torch.where(_below(0, s), lo - c, c - hi)
    flat = _same(s, 0)
    value = _fmod(torch.where(flat, c, 0), m)  # where x does not move
    still = flat | _same(width, 0) | _at_most(m, width)
    truth = torch.where(flat, _at_most(lo, value) & _at_most(value, hi), _at_most(m, width))
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
        raise CannotFollow("a bitwise operation on integers")
    if a.icept is ONE_RUN or b.icept is ONE_RUN:
        run = _one_run(a, b, op)
        if run is not None:
            return run
    cuts = _common(a, b)
    (_, ca), (_, cb) = _on(a, cuts), _on(b, cuts)
    return _make(cuts, None, op(ca, cb))


def _one_run(a: Pieces, b: Pieces, op) -> Pieces | None:
    """``a & b`` or ``a | b`` where one is a run of keys in each row (see :data:`ONE_RUN`), worked
    out on the run's ends (None: the general merge decides): of two runs, ``&`` is the run from the
    later start to the earlier end, ``|`` the two in key order (:func:`_either`); of a run and a
    value constant along the keys, ``&`` empties the run where the value is false, ``|`` makes it
    every key where it is true; of a run and any other boolean, ``&`` is that boolean with its cuts
    clipped to the run, false outside it."""
    if op not in (torch.logical_and, torch.logical_or):
        return None
    if a.icept is not ONE_RUN:
        a, b = b, a
    lo, hi = a.cuts[:, 1:2], a.cuts[:, 2:3]
    if b.icept is ONE_RUN:
        if op is torch.logical_or:
            return _either(lo, hi, b.cuts[:, 1:2], b.cuts[:, 2:3])
        lo = _larger(lo, b.cuts[:, 1:2])
        hi = _larger(_smaller(hi, b.cuts[:, 2:3]), lo)
    elif b.cuts is None and b.icept.shape[1] == 1:
        c = b.icept
        lo, hi = (lo, torch.where(c, hi, lo)) if op is torch.logical_and else \
            (torch.where(c, 0, lo), torch.where(c, current().kv_len, hi))
    elif op is torch.logical_and and b.cuts is not None:
        outside = torch.zeros(b.icept.shape[0], 1, dtype=torch.bool)
        return _make(_framed(lo, _smaller(_larger(b.cuts[:, 1:-1], lo), hi), hi), None,
                     torch.cat([outside, b.icept, outside], 1))
    else:
        return None
    return Pieces(_framed(lo, hi), None, ONE_RUN)


def _either(lo_a: Tensor, hi_a: Tensor, lo_b: Tensor, hi_b: Tensor) -> Pieces:
    """``|`` of two runs ``[lo, hi)`` of keys in each row: the two in key order, as one where they
    meet (the second's pieces then empty at the end of the first)."""
    a_first = _at_most(lo_a, lo_b)
    l1, h1 = torch.where(a_first, lo_a, lo_b), torch.where(a_first, hi_a, hi_b)
    l2, h2 = torch.where(a_first, lo_b, lo_a), torch.where(a_first, hi_b, hi_a)
    meet = _at_most(l2, h1)
    end = torch.where(meet, _larger(h1, h2), h1)
    l2, h2 = torch.where(meet, end, l2), torch.where(meet, end, h2)
    return Pieces(_framed(l1, end, l2, h2), None, TWO_RUNS)


def _logic_periodic(a: Periodic, b: Periodic, op) -> Pieces | Periodic:
    """``op`` of two booleans, one of them constant on each live piece: with a constant, ``and``,
    ``or``, ``xor`` and ``eq`` give the other side, its negation, or a constant."""
    cuts = _common(a, b)
    fa, fb = a.fields(_index(a.cuts, cuts)), b.fields(_index(b.cuts, cuts))
    start, end = _bounds(cuts)
    fixed_a, fixed_b = fa[1] == 1, fb[1] == 1
    if bool((~fixed_a & ~fixed_b & _below(start, end)).any()):  # two patterns: as pieces, where they are few
        return _logic(a.plain(), b.plain(), op)
    constant = _below(0, torch.where(fixed_a, fa[2], fb[2]))  # the constant side's value
    other = [torch.where(fixed_a, y, x) for x, y in zip(fa, fb, strict=True)]
    inverse = [other[0] + other[2], other[1], other[1] - other[2]]
    true, false = [0, 1, 1], [0, 1, 0]
    # op(constant, other): (when the constant is true, when it is false)
    cases = {torch.logical_and: (other, false), torch.logical_or: (true, other),
             torch.logical_xor: (inverse, other), torch.eq: (other, inverse)}
    if op not in cases:
        raise CannotFollow(f"{getattr(op, '__name__', op)} of a pattern every few keys")
    picked = [torch.where(constant, t, f) for t, f in zip(*cases[op], strict=True)]
    return _periodic(cuts, *picked)


def _not(a):
    if isinstance(a, Periodic):
        return _periodic(a.cuts, a.phase + a.width, a.period, a.period - a.width)
    a = _lift(a)
    if not a.is_bool:
        raise CannotFollow("a bitwise operation on integers")
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
        raise CannotFollow("a cast to float (left to tiles)")
    return _integer(a)


def _constant(a, value, dtype) -> Pieces:
    dtype = dtype if dtype is not None else a.dtype
    if dtype.is_floating_point or dtype.is_complex:
        raise CannotFollow("a float constant (left to tiles)")
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
        raise CannotFollow("indexing other than a 1-D or 2-D integer or bool tensor by indices")
    entries = table.detach().view(-1 if table.dim() == 2 else 1, table.shape[-1])  # [table rows, N]
    rows_of, n = entries.shape
    if table.dim() == 1 and isinstance(index, Pieces) and index.cuts is None and not bool(index.slope.any()) \
            and not _varies(index.icept):  # one entry per row (a table per head, a document id per row)
        if bool(((index.icept < 0) | (index.icept >= n)).any()):
            raise CannotFollow("an index outside the tensor")
        value = Pieces(None, torch.zeros(1, 1, dtype=torch.int64), entries[0, index.icept].long())
        return _cast(value, torch.bool) if table.dtype == torch.bool else value
    row = None  # the table row each query row reads (a 2-D table)
    if table.dim() == 2:
        r = _integer(parts[0])
        if r.cuts is not None or bool((r.slope != 0).any()):
            raise CannotFollow("a 2-D table read at a row that changes along the keys")
        row = r.icept[:, 0]
        if bool(((row < 0) | (row >= rows_of)).any()):
            raise CannotFollow("an index outside the tensor")
        if _varies(row):  # one table row across a block: no change of rows between its ends
            moved = (entries[1:] != entries[:-1]).any(1).nonzero().view(-1) + 1
            _search(moved, row.view(-1, 1), right=True)
    col = parts[-1]
    x, m = (col.dividend(), col.m) if isinstance(col, Quotient) else (_integer(col), 1)
    start, end = _bounds(x.cuts)
    live = _below(start, end)
    first, last = x.icept + _product(x.slope, start), x.icept + _product(x.slope, end - 1)  # the index at each end
    if bool((live & (_below(x.slope, 0) | _below(1, x.slope))).any()):
        raise CannotFollow("a table read at an index whose slope along the keys is not 0 or 1")
    if bool((live & ((torch.minimum(first, last) < 0) | (torch.maximum(first, last) >= n * m))).any()):
        raise CannotFollow("an index outside the tensor")  # cell by cell, this raises or wraps around
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
    moving = _same(x.slope, 1) & live
    first, last = torch.where(live, first, 0), torch.where(live, last, 0)  # (an empty piece reads nothing)
    lo = _search(changes, first, right=True)  # changes after the piece's first index
    count = torch.where(moving, _search(changes, last, right=True) - lo, 0)
    top = max(most - 1, 0)

    def cut_at(j: Tensor) -> Tensor:  # the key where the j-th change after a piece's first index falls
        if most == 0:
            return torch.zeros_like(j)
        at = (lo.unsqueeze(-1) + j).clamp(max=top)
        found = changes[at] if row is None else changes.gather(1, at.flatten(1)).view(at.shape)
        return found - x.icept.unsqueeze(-1)

    def read(s: Tensor, c: Tensor, k: Tensor, live: Tensor) -> Tensor:
        index = torch.where(live, _product(s, k) + c, 0)
        if current().span is not None:  # one entry across a block: no change of entries between its ends
            _search(changes, index.expand(changes.shape[0] if changes.dim() == 2 else index.shape[0], -1)
                    .contiguous(), right=True)
        at = torch.div(index, m, rounding_mode="floor").clamp(0, n - 1)
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

for _cls in (Pieces, Quotient, Wrapped, Absolute, Periodic):
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


#: Rows (batch x query rows) from which closed form works on blocks of rows; below, each row on its
#: own. A pass over blocks costs what one over a few thousand rows does, and it takes two to four.
#: Set by measuring rows on their own against blocks (windows, global tokens, a window per head) at
#: 8,192 to 32,768 rows: blocks win from about this many rows on. A pattern every few keys (a dilated
#: window) is cheaper on its own rows at every length, its rows' table being most of the work.
BLOCKS_FROM = 1 << 15
#: Passes over the blocks, and most blocks (one per this many rows, at least 64), before each row is
#: worked out on its own instead.
PASSES, ROWS_PER_BLOCK = 6, 16


def interval_tables(mod, batch: int, heads: int, q_len: int, kv_len: int, most: int | None = None,
                    blocks: bool | None = None, fold: int = 1) -> tuple[Tensor, Tensor]:
    """Each row's runs of allowed keys, ``(starts, ends)`` ``[p, Lq, K]`` (``p`` 1 when every batch
    element has the same rows, else ``batch``; empty slots ``(Lk, Lk)``). Raises
    :class:`CannotFollow` for a predicate the pieces cannot follow, and for a row with more than
    ``most`` runs.

    ``blocks`` (default: from :data:`BLOCKS_FROM` rows on): the predicate is run on blocks of
    consecutive rows, each at its first and last row, as long as every choice it makes comes out
    the same at both ends (so every value is affine in the row, and the rows between follow from
    the two ends); blocks are cut where a choice changes and the pass run again. A window takes
    two passes (one block, then four) whatever its length. Beyond :data:`PASSES` passes or too
    many blocks, or for what blocks cannot follow, each row is worked out on its own.

    ``fold``: the heads folded into ``batch`` (element ``b * fold + h``, ``heads`` 1), the predicate
    given ``b`` and ``h`` as each row's values.
    """
    if not (q_len and kv_len):
        raise CannotFollow("an empty grid")
    if blocks if blocks is not None else batch * q_len >= BLOCKS_FROM:
        cuts = torch.zeros(1, dtype=torch.int64)  # where blocks begin
        for _ in range(PASSES):
            try:
                found, flips = _evaluate(mod, batch, heads, q_len, kv_len, most, cuts, fold)
            except _NotBlocks:
                break
            if found is not None:
                return _from_ends(*found, cuts, batch, q_len)
            cuts = torch.cat([cuts, flips[flips < q_len]]).unique()
            if cuts.numel() > max(64, q_len // ROWS_PER_BLOCK):
                break
    found, _ = _evaluate(mod, batch, heads, q_len, kv_len, most, None, fold)
    return _batched(*found, batch, q_len)


def _evaluate(mod, batch: int, heads: int, q_len: int, kv_len: int, most: int | None,
              cuts: Tensor | None, fold: int = 1) -> tuple[tuple[Tensor, Tensor] | None, Tensor | None]:
    """One pass: the rows' runs ``[rows, K]`` and no flips, or (block mode, a choice that changed
    within a block) None and the rows where blocks must be cut. ``cuts``: where blocks begin
    (None: each row on its own, rows ``b * Lq + i``). ``fold``: see :func:`interval_tables`."""
    if cuts is None:
        b = torch.arange(batch).repeat_interleave(q_len)
        q = torch.arange(q_len).repeat(batch)
    else:
        span = torch.cat([cuts[1:], cuts.new_tensor([q_len])]) - 1 - cuts
        first, span = cuts.repeat(batch), span.repeat(batch)
        b = torch.arange(batch).repeat_interleave(cuts.numel()).repeat(2)
        q = torch.cat([first, first + span])
        first, span = first.view(-1, 1), span.view(-1, 1)
    with deriving(kv_len=kv_len, first=None if cuts is None else first,
                  span=None if cuts is None else span) as d:
        flat, element = torch.zeros(1, 1, dtype=torch.int64), b.view(-1, 1)
        bp = Pieces(None, flat, element // fold if fold > 1 else element)
        qp = Pieces(None, flat, q.view(-1, 1))
        kv = Pieces(None, torch.ones(1, 1, dtype=torch.int64), flat)
        h = Pieces(None, flat, element % fold) if fold > 1 else _Head() if heads > 1 else _lift(0)
        out = call_on_stand_ins(mod, bp, h, qp, kv)
        if isinstance(out, Tensor) and out.dim() == 0 and out.dtype == torch.bool:
            out = _lift(out)
        if d.not_blocks:
            raise _NotBlocks(d.failed[0])
        if not (isinstance(out, Periodic) or (isinstance(out, Pieces) and out.is_bool)):
            raise CannotFollow("the predicate did not return booleans")
        if d.failed:
            raise CannotFollow(d.failed[0])
        found = _runs(out, b.numel(), most)
        if d.not_blocks:
            raise _NotBlocks(d.failed[0])
        if d.flips:
            return None, torch.cat([f.reshape(-1) for f in d.flips])
        return found, None


def _between(first: Tensor, last: Tensor, cuts: Tensor, batch: int, q_len: int) -> tuple[Tensor, Tensor]:
    """Every row's runs from the runs at its block's two ends (rows ``[2R, K]``): the same runs,
    their ends moved by the same step each row (a running sum of the steps, set at each block's
    first row to what that row has)."""
    r = first.shape[0] // 2
    length = torch.diff(torch.cat([cuts, cuts.new_tensor([q_len])])).repeat(batch)
    begin = length.cumsum(0) - length  # each block's first row, rows b * Lq + i
    span = (length - 1).clamp(min=1).view(-1, 1)
    out = []
    for t in (first, last):
        at_first, at_last = t[:r], t[r:]
        step = torch.div(at_last - at_first, span, rounding_mode="floor")
        if bool((step * span != at_last - at_first).any()):  # cannot be, every choice having held: refuse, never guess
            raise CannotFollow("rows that do not follow from their block's ends")
        last_rows = at_first + step * (length - 1).view(-1, 1)  # each block's last row
        before = torch.cat([torch.zeros_like(t[:1]), last_rows[:-1]])  # (the first block's: none, 0)
        change = step - torch.cat([torch.zeros_like(step[:1]), step[:-1]])  # each row's step: a running sum
        rows = torch.zeros(batch * q_len, step.shape[1], dtype=torch.int64).index_copy_(0, begin, change).cumsum_(0)
        out.append(rows.index_copy_(0, begin, at_first - before).cumsum_(0))
    return out[0], out[1]


def _from_ends(first: Tensor, last: Tensor, cuts: Tensor, batch: int, q_len: int) -> tuple[Tensor, Tensor]:
    """``[p, Lq, K]`` from the runs at the blocks' ends (rows ``[2R, K]``, see :func:`_between`): one
    set when every batch element's ends agree (the rows between then agree too), made once."""
    c = cuts.numel()
    ends = [t.view(2, batch, c, -1) for t in (first, last)]
    if batch > 1 and all(bool((e == e[:, :1]).all()) for e in ends):
        first, last = (e[:, 0].reshape(2 * c, -1) for e in ends)
        batch = 1
    first, last = _between(first, last, cuts, batch, q_len)
    return first.view(batch, q_len, -1), last.view(batch, q_len, -1)


def _batched(first: Tensor, last: Tensor, batch: int, q_len: int) -> tuple[Tensor, Tensor]:
    """``[p, Lq, K]`` from rows ``b * Lq + i``: one set when every batch element has the same rows."""
    k = first.shape[1]
    first, last = first.view(batch, q_len, k), last.view(batch, q_len, k)
    if batch > 1 and bool((first == first[:1]).all()) and bool((last == last[:1]).all()):
        return first[:1], last[:1]
    return first, last


def _runs(out: Pieces | Periodic, rows: int, most: int | None) -> tuple[Tensor, Tensor]:
    """A boolean's runs of true keys in each row, those that touch joined: ``(first, last)``
    ``[rows, K]`` in key order, empty slots ``(kv_len, kv_len)``; refused beyond ``most`` runs."""
    if isinstance(out, Pieces) and out.icept is ONE_RUN:
        first, last = out.cuts[:, 1:2].expand(rows, 1), out.cuts[:, 2:3].expand(rows, 1)
        live = _below(first, last)
        return torch.where(live, first, current().kv_len), torch.where(live, last, current().kv_len)
    start, end = (t.expand(rows, -1) for t in _bounds(out.cuts))
    live = _below(start, end)
    if isinstance(out, Pieces):  # a run a true piece
        row, at = (out.icept.expand(rows, -1) & live).nonzero(as_tuple=True)  # row-major: each row's in key order
        first, last = start[row, at], end[row, at]
    else:
        row, first, last = _periodic_runs(start, end, live, *(t.expand(rows, start.shape[1])
                                                              for t in (out.phase, out.period, out.width)))
        if row is None:
            if most is not None and first.shape[1] > most:
                raise CannotFollow(f"more than {most} runs in a row")
            return first, last
    at, last = join(row, first, last, ordered=True, joins=_touching(row, first, last))  # runs that touch: one
    if at.numel() < row.numel():
        row, first = row.index_select(0, at), first.index_select(0, at)
    packed = pack(row, first, last, 1, rows, current().kv_len, most)
    if packed is None:
        raise CannotFollow(f"more than {most} runs in a row")
    return packed[0][0], packed[1][0]


def _touching(row: Tensor, first: Tensor, last: Tensor) -> Tensor | None:
    """In blocks, of runs laid out flat (``row``, each row's in order), those that begin where the
    one before them in their row ends: each half compared within itself, and the two checked alike.
    None (``_join`` compares them) for rows on their own."""
    block = _paired(row)
    if block is None or row.numel() < 2:
        return None
    h = row.numel() // 2
    pair = torch.cat([torch.arange(1, h), torch.arange(h + 1, 2 * h)])  # a run, and the one before it: within a half
    same_row = row.index_select(0, pair) == row.index_select(0, pair - 1)  # (runs of two rows: no choice made)
    meets = _same(torch.where(same_row, last.index_select(0, pair - 1), 0),
                  torch.where(same_row, first.index_select(0, pair), 0), block[1:])
    return torch.zeros_like(row, dtype=torch.bool).index_copy_(0, pair, same_row & meets)


def _paired(row: Tensor) -> Tensor | None:
    """In blocks, entries laid out flat whose first half (at the blocks' first rows) the second
    half repeats (at their last rows): the block of each entry of the first half. None for rows on
    their own, or where the two halves differ (a choice already failed: the pass is redone)."""
    r, h = current().span.shape[0] if current().span is not None else 0, row.numel() // 2
    if not r or row.numel() % 2 or not torch.equal(row[:h] + r, row[h:]):
        return None
    return row[:h]


def _one_piece_runs(count: Tensor, lo: Tensor, period: Tensor, width: Tensor, start: Tensor, end: Tensor,
                    most: int) -> tuple[Tensor, Tensor]:
    """Each row's runs ``[rows, most]`` where each row (on its own) has one piece with runs, ``count``
    of them, the ``k``-th from ``lo + k * period`` for ``width`` keys, within ``[start, end)``. Made in
    place on the whole table; only the rows with fewer runs than the most have slots to empty."""
    k = torch.arange(most).view(1, -1)
    first = torch.addcmul(lo.view(-1, 1), k, period.view(-1, 1))  # (two new tables, the rest in place)
    last = first + width.view(-1, 1)
    torch.maximum(first, start.view(-1, 1), out=first)
    torch.minimum(last, end.view(-1, 1), out=last)
    short = (count < most).nonzero().view(-1)
    if short.numel():
        past = k >= count.index_select(0, short).view(-1, 1)
        for t in (first, last):
            t.index_copy_(0, short, t.index_select(0, short).masked_fill_(past, current().kv_len))
    return first, last


def _periodic_runs(start: Tensor, end: Tensor, live: Tensor, phase: Tensor, period: Tensor,
                   width: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A :class:`Periodic` boolean's runs laid out flat, ``(row, first, last)``, each row's in key
    order: one a piece where it is constant and true, one per period (within the piece) where it
    is periodic. ``row`` None: ``first`` and ``last`` are each row's runs already, ``[rows, K]``
    (each row on its own, one piece with runs in each)."""
    live = live & _below(0, width)
    still = _same(period, 1)  # true throughout: one run, the piece
    moving = live & ~still
    base = start - _fmod(torch.where(moving, start - phase, 0), period)  # where the period holding start begins
    skip = _at_most(width, start - base).long()  # that period's run ends before the piece starts
    count = torch.where(moving, _fdiv(torch.where(moving, end - base + period - 1, 0), period) - skip, live.long())
    length = torch.where(live, end - start, 0)
    period, width = torch.where(still, length, period), torch.where(still, length, width)
    row, at = _below(0, count).nonzero(as_tuple=True)  # the pieces with runs, row-major
    count, base, skip, period, width, s, e = (t[row, at] for t in (count, base, skip, period, width, start, end))
    most = max(int(count.max()), 1) if count.numel() else 1
    if current().span is None and row.numel() == start.shape[0] and torch.equal(row, torch.arange(row.numel())):
        return None, *_one_piece_runs(count, base + skip * period, period, width, s, e, most)
    block = _paired(row)  # in blocks: the same pieces at the first rows, then at the last (see _ends)
    if block is None and current().span is not None:
        block = torch.zeros(0, dtype=torch.int64)  # the ends differ already: this pass is redone, nothing to check
    k = torch.arange(most).view(1, -1)
    valid = _below(k, count.view(-1, 1), block)  # (in blocks: as many runs in a piece at both ends)
    lo = base.view(-1, 1) + _product(skip.view(-1, 1) + k, period.view(-1, 1), block)
    s, e, lo_end = s.view(-1, 1), e.view(-1, 1), lo + width.view(-1, 1)
    if block is not None and block.numel():
        lo, lo_end = torch.where(valid, lo, s), torch.where(valid, lo_end, e)  # (past a piece's count: no choice)
    first, last = _larger(lo, s, block), _smaller(lo_end, e, block)
    at = valid.view(-1).nonzero().view(-1)
    return row.index_select(0, at // most), first.view(-1).index_select(0, at), last.view(-1).index_select(0, at)
