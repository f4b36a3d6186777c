"""A predicate's rows of allowed keys without evaluating every cell: run it on ranges of indices.

The second way of :func:`attnkit.maskplan.row_intervals` (``derived_by == "ranges"``): each query row's runs
of allowed keys for a user's ``mask_mod``, without the O(Lq * Lk) of evaluating every cell, which
costs more than the attention itself for a narrow mask. (Predicates affine in the indices are first
worked out in closed form by :mod:`.closed_form`; this module takes what that cannot follow.) Here the predicate is
called once with *ranges* in place of its index tensors: a tile of queries ``[q0, q1]`` and keys
``[k0, k1]`` is a :class:`Range`, and every operation on ranges returns bounds that hold for every
cell of the tile (interval arithmetic). A boolean result whose lower bound is True is a tile that
is all allowed; one whose upper bound is False is all masked; the rest are mixed. Mixed tiles are
cut into smaller tiles and tried again, and only the cells of the mixed small tiles are
evaluated, with the predicate itself.

The answer is exact, never approximate: a tile is called full or empty only when the bounds prove
it, and the bounds are sound for each operation below (each is monotone in its arguments, or
bounded case by case; rounding to nearest is monotone, so float bounds computed at the ends hold
too). Anything else the predicate does (an operation not listed, Python control flow on an index,
indexing with a negative or out-of-range index, a tensor argument that is not a 0-d constant,
``vmap``) raises :class:`CannotFollow`, and the caller evaluates every cell instead.

Understood: ``+ - * neg abs``, division and floor division by a constant, ``%`` by a positive
integer constant, comparisons, ``& | ^ ~`` and their ``logical_*`` forms, ``minimum``/``maximum``/
``clamp``, ``where``, casts between bool, integer and float dtypes, ``new_ones``/``ones_like`` and
friends (constants), and indexing a captured 1-D or 2-D tensor with ranges (``doc_ids[q_idx]``,
``layout[q_idx // 64, kv_idx // 64]``: the smallest and largest entry over the ranges, from sparse
tables; a 2-D tensor up to :data:`TABLE_ENTRIES`). That covers causal and sliding windows,
documents, prefix-LM, global tokens, dilated and strided patterns, block layouts, 2-D
neighbourhoods, and their ``and_masks``/``or_masks`` compositions.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from ..masks import as_grid
from .rows import join, runs
from .stand_ins import CannotFollow, ReadsHead, call_on_stand_ins, current, deriving, rule_table, stands_in


class Range:
    """Bounds ``lo <= x <= hi`` of a value over the cells of each tile (bool: False < True)."""

    __slots__ = ("lo", "hi")

    def __init__(self, lo: Tensor, hi: Tensor):
        self.lo, self.hi = lo, hi

    @property
    def dtype(self) -> torch.dtype:
        return self.lo.dtype

    @property
    def device(self) -> torch.device:
        return self.lo.device


def _exact(x) -> Range:
    """A constant as a range: a Python number or a 0-d tensor (a larger captured tensor used
    directly, not indexed, has a shape the tiles do not share)."""
    if isinstance(x, Range):
        return x
    if isinstance(x, (bool, int, float)):
        t = torch.tensor(x)
        return Range(t, t)
    if isinstance(x, Tensor) and x.dim() == 0:
        return Range(x, x)
    raise CannotFollow(f"a {type(x).__name__} operand")


def _is_bool(t: Tensor) -> bool:
    return t.dtype == torch.bool


def _min(a: Tensor, b: Tensor) -> Tensor:
    return a & b if _is_bool(a) and _is_bool(b) else torch.minimum(a, b)


def _max(a: Tensor, b: Tensor) -> Tensor:
    return a | b if _is_bool(a) and _is_bool(b) else torch.maximum(a, b)


def _number(t: Tensor) -> Tensor:
    return t.to(torch.int64) if _is_bool(t) else t


# ---- arithmetic -------------------------------------------------------------------------------


def _arithmetic(*xs) -> list[Range]:
    """Operands of ``+ - *``: torch adds two bools as a logical or (True + True is True), which
    the integer bounds below would not follow."""
    xs = [_exact(x) for x in xs]
    if all(_is_bool(x.lo) for x in xs):
        raise CannotFollow("arithmetic on booleans")
    return xs


def _add(a, b, alpha=1):
    a, b = _arithmetic(a, b)
    if alpha != 1:
        b = _mul(b, alpha)
    return Range(_number(a.lo) + _number(b.lo), _number(a.hi) + _number(b.hi))


def _sub(a, b, alpha=1):
    return _add(a, _neg(_mul(b, alpha) if alpha != 1 else b))


def _neg(a):
    a, = _arithmetic(a)
    return Range(-_number(a.hi), -_number(a.lo))


def _mul(a, b):
    a, b = _arithmetic(a, b)
    ends = [_number(x) * _number(y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo, hi = ends[0], ends[0]
    for e in ends[1:]:
        lo, hi = torch.minimum(lo, e), torch.maximum(hi, e)
    return Range(lo, hi)


def _abs(a):
    a = _exact(a)
    lo, hi = _number(a.lo), _number(a.hi)
    return Range(torch.where(lo >= 0, lo, torch.where(hi <= 0, -hi, torch.zeros_like(lo))),
                 torch.maximum(lo.abs(), hi.abs()))


def _constant_divisor(c) -> Tensor:
    if isinstance(c, Range) or not isinstance(c, (int, float, Tensor)) or isinstance(c, bool):
        raise CannotFollow("division by a non-constant")
    c = torch.as_tensor(c)
    if c.dim() != 0 or c.item() == 0:
        raise CannotFollow("division by a tensor or by zero")
    return c


def _div(a, c, *, rounding_mode=None):
    a, c = _exact(a), _constant_divisor(c)  # x -> x / c (rounded any way) is monotone
    lo, hi = (torch.div(_number(x), c, rounding_mode=rounding_mode) for x in (a.lo, a.hi))
    return Range(lo, hi) if c.item() > 0 else Range(hi, lo)


def _floor_divide(a, c):
    return _div(a, c, rounding_mode="floor")


def _remainder(a, m):
    a, m = _exact(a), _constant_divisor(m)
    if a.lo.is_floating_point() or m.is_floating_point() or m.item() < 0:
        raise CannotFollow("% of a float or by a negative number")
    lo, hi = _number(a.lo), _number(a.hi)
    same = torch.div(lo, m, rounding_mode="floor") == torch.div(hi, m, rounding_mode="floor")
    return Range(torch.where(same, lo % m, 0), torch.where(same, hi % m, m - 1))


def _minimum(a, b):
    a, b = _exact(a), _exact(b)
    return Range(_min(a.lo, b.lo), _min(a.hi, b.hi))


def _maximum(a, b):
    a, b = _exact(a), _exact(b)
    return Range(_max(a.lo, b.lo), _max(a.hi, b.hi))


def _clamp(a, min=None, max=None):  # noqa: A002 (torch's argument names)
    a = _exact(a)
    if min is not None:
        a = _maximum(a, min)
    return a if max is None else _minimum(a, max)


# ---- comparisons and logic --------------------------------------------------------------------


def _lt(a, b):
    a, b = _exact(a), _exact(b)
    return Range(_number(a.hi) < _number(b.lo), _number(a.lo) < _number(b.hi))


def _le(a, b):
    a, b = _exact(a), _exact(b)
    return Range(_number(a.hi) <= _number(b.lo), _number(a.lo) <= _number(b.hi))


def _gt(a, b):
    return _lt(b, a)


def _ge(a, b):
    return _le(b, a)


def _eq(a, b):
    a, b = _exact(a), _exact(b)
    alo, ahi, blo, bhi = (_number(t) for t in (a.lo, a.hi, b.lo, b.hi))
    return Range((alo == ahi) & (blo == bhi) & (alo == blo), (alo <= bhi) & (blo <= ahi))


def _ne(a, b):
    return _not(_eq(a, b))


def _boolean(a) -> Range:
    a = _exact(a)
    if not _is_bool(a.lo):
        raise CannotFollow("a bitwise operation on integers")
    return a


def _and(a, b):
    a, b = _boolean(a), _boolean(b)
    return Range(a.lo & b.lo, a.hi & b.hi)


def _or(a, b):
    a, b = _boolean(a), _boolean(b)
    return Range(a.lo | b.lo, a.hi | b.hi)


def _not(a):
    a = _boolean(a)
    return Range(~a.hi, ~a.lo)


def _xor(a, b):
    a, b = _boolean(a), _boolean(b)
    known = (a.lo == a.hi) & (b.lo == b.hi)
    value = a.lo ^ b.lo
    return Range(known & value, ~known | value)


def _where(cond, x, y):
    c, x, y = _boolean(cond), _exact(x), _exact(y)
    xl, xh, yl, yh = (_number(t) for t in (x.lo, x.hi, y.lo, y.hi))
    if _is_bool(x.lo) and _is_bool(y.lo):
        xl, xh, yl, yh = x.lo, x.hi, y.lo, y.hi
    either_lo, either_hi = _min(xl, yl), _max(xh, yh)
    return Range(torch.where(c.lo, xl, torch.where(c.hi, either_lo, yl)),
                 torch.where(c.lo, xh, torch.where(c.hi, either_hi, yh)))


# ---- dtypes and constants ---------------------------------------------------------------------


def _cast(a, dtype: torch.dtype | None) -> Range:
    a = _exact(a)
    if dtype is None:
        return a
    if dtype == torch.bool:
        return a if _is_bool(a.lo) else _ne(a, 0)
    if a.lo.is_floating_point() and not dtype.is_floating_point:
        raise CannotFollow("a float index rounded to an integer")
    return Range(a.lo.to(dtype), a.hi.to(dtype))


def _constant(a, value, dtype) -> Range:
    a = _exact(a)
    t = torch.tensor(value, dtype=dtype if dtype is not None else a.lo.dtype)
    return Range(t, t)


#: Most entries of a range-minimum table for a captured 2-D tensor (its size times the levels along
#: each axis); a bigger one (a per-cell pattern) is not followed, and every cell is evaluated.
TABLE_ENTRIES = 1 << 24


def _getitem(table, index):
    """``table[index]`` for a captured 1-D or 2-D tensor indexed along every axis by ranges (or
    constants) within it: the smallest and largest entry over each range (``doc_ids[q_idx]``, a
    block layout's ``layout[q_idx // 64, kv_idx // 64]``), from sparse tables."""
    index = index if isinstance(index, tuple) else (index,)
    if (isinstance(table, Range) or not isinstance(table, Tensor) or table.dim() not in (1, 2)
            or len(index) != table.dim() or not any(isinstance(i, Range) for i in index)):
        raise CannotFollow("indexing other than a 1-D or 2-D tensor by an index range per axis")
    ranges = [_exact(i) for i in index]
    for r, size in zip(ranges, table.shape, strict=True):
        if r.lo.is_floating_point() or _is_bool(r.lo) or r.lo.numel() == 0:
            raise CannotFollow("indexing with float, bool or empty ranges")
        if bool((r.lo < 0).any()) or bool((r.hi >= size).any()) or bool((r.hi < r.lo).any()):
            raise CannotFollow("an index outside the tensor")  # cell by cell, this raises or wraps around
    low, high = _sparse_tables(table)  # [levels..., *table.shape]
    # Each axis: the largest power of two 2^j <= the range's length, and the two windows of that
    # length that together cover the range (from its start, and ending at its end).
    levels, starts = [], []
    for axis, r in enumerate(ranges):
        span = r.hi - r.lo + 1
        top = low.shape[axis] - 1
        j = torch.floor(torch.log2(span.double())).long().clamp(0, top)
        j = torch.where((1 << j) > span, j - 1, j)  # log2 rounded past an exact power of two
        j = torch.where((j + 1 <= top) & ((2 << j) <= span), j + 1, j)
        levels.append(j)
        starts.append((r.lo, r.hi - (1 << j) + 1))
    flat_low, flat_high = low.reshape(-1), high.reshape(-1)
    shape = (*low.shape[:table.dim()], *table.shape)
    pick_lo = pick_hi = None
    for corner in itertools.product(*starts):  # 2 windows along one axis, 4 rectangles over two
        at = torch.zeros((), dtype=torch.int64)
        for size, position in zip(shape, (*levels, *corner), strict=True):
            at = at * size + position
        lo, hi = flat_low[at], flat_high[at]
        pick_lo = lo if pick_lo is None else torch.minimum(pick_lo, lo)
        pick_hi = hi if pick_hi is None else torch.maximum(pick_hi, hi)
    if _is_bool(table):
        pick_lo, pick_hi = pick_lo.bool(), pick_hi.bool()
    return Range(pick_lo, pick_hi)


def _sparse_tables(table: Tensor) -> tuple[Tensor, Tensor]:
    """Range-minimum and -maximum tables ``[levels along each axis..., *table.shape]``: entry
    ``[j, i]`` (1-D) holds the min/max of ``table[i : i + 2^j]``, ``[j, k, i, c]`` (2-D) of
    ``table[i : i + 2^j, c : c + 2^k]`` (cut short at the ends). Kept for one derivation."""
    key = id(table)
    if key in current().tables and current().tables[key][0] is table:
        return current().tables[key][1], current().tables[key][2]
    base = (table.to(torch.int64) if _is_bool(table) else table).detach()
    counts = [max(1, math.ceil(math.log2(max(2, n)))) + 1 for n in base.shape]
    if base.dim() == 2 and math.prod(counts) * base.numel() > TABLE_ENTRIES:
        raise CannotFollow("a 2-D tensor too large for a range table")
    low, high = _doubling(base, 0, counts[0]), _doubling(base, 0, counts[0], maximum=True)  # [levels, *shape]
    if base.dim() == 2:
        low = torch.stack([_doubling(t, 1, counts[1]) for t in low])
        high = torch.stack([_doubling(t, 1, counts[1], maximum=True) for t in high])
    current().tables[key] = (table, low, high)
    return low, high


def _doubling(t: Tensor, axis: int, count: int, maximum: bool = False) -> Tensor:
    """``[count, *t.shape]``: level j the min (or max) of ``t`` over ``[i, i + 2^j)`` along ``axis``."""
    pick = torch.maximum if maximum else torch.minimum
    out, n = [t], t.shape[axis]
    for j in range(1, count):
        step = min(1 << (j - 1), n)
        prev = out[-1]
        shifted = torch.cat([prev.narrow(axis, step, n - step), prev.narrow(axis, n - 1, 1).expand(
            *[step if d == axis else s for d, s in enumerate(prev.shape)])], dim=axis)
        out.append(pick(prev, shifted))
    return torch.stack(out)


_RULES = rule_table({
    "add": _add, "sub": _sub, "mul": _mul, "neg": _neg, "abs": _abs, "div": _div, "floor_divide": _floor_divide,
    "remainder": _remainder, "minimum": _minimum, "maximum": _maximum, "clamp": _clamp,
    "lt": _lt, "le": _le, "gt": _gt, "ge": _ge, "eq": _eq, "ne": _ne,
    "and": _and, "or": _or, "xor": _xor, "not": _not, "where": _where, "getitem": _getitem,
}, _cast, _constant)

stands_in(Range, _RULES)


# ---- the tiles --------------------------------------------------------------------------------

#: Tile sides, coarse to fine: mixed tiles of one level are cut into tiles of the next, and the
#: cells of mixed tiles of the last level are evaluated with the predicate itself.
SIDES = (256, 16)
#: Most cells of a predicate evaluated at once while a plan is derived (a few MiB, cache-sized),
#: here and on the every-cell path.
CELLS = 1 << 20
#: Ranges give up (and every cell is evaluated, in row chunks) when, at a level of 64 tiles or
#: more, mixed tiles still cover over a quarter of the grid and more than this many cells: a
#: checkerboard or a random pattern settles nothing, and cutting its tiles would only cost memory.
SETTLE_FROM = 1 << 22


def flat_runs(mod, batch: int, heads: int, q_len: int, kv_len: int,
              sides: tuple[int, ...] = SIDES) -> tuple[Tensor, Tensor, Tensor, int]:
    """Every row's runs of allowed keys, flat: ``(row, start, end)`` sorted by row then start,
    touching runs merged, ``row`` counting ``pi * q_len + i``; and ``p``, 1 when the mask is the
    same for every batch element, else ``batch``. Raises :class:`CannotFollow` when the predicate
    cannot be run on ranges or reads the head (the caller then evaluates every cell)."""
    with deriving() as d:
        b = torch.arange(batch).view(-1, 1, 1, 1)
        h = torch.arange(heads).view(1, -1, 1, 1)
        side = sides[0]
        q0, k0 = torch.arange(0, q_len, side), torch.arange(0, kv_len, side)
        q0, k0 = q0.repeat_interleave(k0.numel()), k0.repeat(q0.numel())
        q1, k1 = torch.clamp(q0 + side, max=q_len), torch.clamp(k0 + side, max=kv_len)
        found = []  # per level (p, pi, q0, q1, k0, k1) of its full tiles, then the cells' runs alike
        for next_side in (*sides[1:], None):
            if q0.numel() == 0:
                break
            full, some = _kinds(mod, b, h, q0, q1, k0, k1)
            mixed = (some & ~full).any(0)  # a tile mixed for any batch element is cut for all of them
            whole = (full & ~mixed).nonzero()  # (pi, tile)
            t = whole[:, 1]
            found.append((full.shape[0], *_joined(whole[:, 0], q0[t], q1[t], k0[t], k1[t])))
            tiles = q0.numel()
            q0, q1, k0, k1 = q0[mixed], q1[mixed], k0[mixed], k1[mixed]
            unsettled = int(((q1 - q0) * (k1 - k0)).sum())
            if tiles >= 64 and unsettled > SETTLE_FROM and 4 * unsettled > q_len * kv_len:
                raise CannotFollow(f"ranges settle too little of the grid ({unsettled} of {q_len * kv_len} cells "
                                   "mixed)")
            if next_side is not None:
                q0, q1, k0, k1 = _split(q0, q1, k0, k1, next_side)
        found.append(_cells(mod, b, h, q0, q1, k0, k1, sides[-1], q_len, kv_len))
        if d.failed:
            raise CannotFollow(d.failed[0])
        p = max(x[0] for x in found)
        return (*_merge(found, p, q_len), p)


def _kinds(mod, b: Tensor, h: Tensor, q0: Tensor, q1: Tensor, k0: Tensor, k1: Tensor) -> tuple[Tensor, Tensor]:
    """(all allowed, any allowed) for the tiles ``[q0, q1) x [k0, k1)``, each ``[1 or B, N]``."""
    shape = (1, 1, 1, -1)
    out = call_on_stand_ins(mod, Range(b, b), Range(h, h), Range(q0.view(shape), (q1 - 1).view(shape)),
              Range(k0.view(shape), (k1 - 1).view(shape)))
    if isinstance(out, Tensor) and out.dim() == 0:
        out = Range(out, out)
    if not isinstance(out, Range) or not _is_bool(out.lo) or not _is_bool(out.hi) or out.lo.dim() > 4:
        raise CannotFollow("the predicate did not return booleans")
    lo, hi = (as_grid(x) for x in (out.lo, out.hi))
    if lo.shape[1] > 1 or hi.shape[1] > 1:
        raise ReadsHead()
    p = max(lo.shape[0], hi.shape[0])
    return tuple(x.expand(p, 1, 1, q0.numel())[:, 0, 0] for x in (lo, hi))


def _joined(pi: Tensor, q0: Tensor, q1: Tensor, k0: Tensor, k1: Tensor) -> tuple[Tensor, ...]:
    """Full tiles side by side in one row of tiles joined into one (a causal mask's full tiles:
    one per row of tiles, not one per tile), so each of their rows is one run, not many."""
    if pi.numel() < 2:
        return pi, q0, q1, k0, k1
    first, last = join(pi * (int(q0.max()) + 1) + q0, k0, k1)  # a row of tiles: one q0 (and so one q1)
    return pi[first], q0[first], q1[first], k0[first], last


def _split(q0, q1, k0, k1, side: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each tile cut into tiles of ``side`` (the last ones in each direction shorter)."""
    if q0.numel() == 0:
        return q0, q1, k0, k1
    per_q, per_k = -(-int((q1 - q0).max()) // side), -(-int((k1 - k0).max()) // side)
    sq0 = q0.view(-1, 1, 1) + torch.arange(per_q).view(1, -1, 1) * side
    sk0 = k0.view(-1, 1, 1) + torch.arange(per_k).view(1, 1, -1) * side
    sq1, sk1 = torch.minimum(sq0 + side, q1.view(-1, 1, 1)), torch.minimum(sk0 + side, k1.view(-1, 1, 1))
    sq0, sq1, sk0, sk1 = (x.expand(-1, per_q, per_k).reshape(-1) for x in (sq0, sq1, sk0, sk1))
    keep = (sq0 < sq1) & (sk0 < sk1)
    return sq0[keep], sq1[keep], sk0[keep], sk1[keep]


def _cells(mod, b, h, q0, q1, k0, k1, side: int, q_len: int, kv_len: int):
    """The predicate itself on every cell of the mixed tiles, :data:`CELLS` at a time: its runs, as
    the tiles are (``(p, pi, first row, last row + 1, start, end)``, one row each)."""
    if q0.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return 1, empty, empty, empty, empty, empty
    step = max(1, CELLS // (side * side))
    parts = [_tile_cells(mod, b, h, q0[i:i + step], q1[i:i + step], k0[i:i + step], k1[i:i + step], side, q_len,
                         kv_len) for i in range(0, q0.numel(), step)]
    p = max(x[0] for x in parts)
    if any(x[0] != p for x in parts):
        raise CannotFollow("the predicate's batch dependence changed between calls")
    return p, *(torch.cat([x[i] for x in parts]) for i in range(1, 6))


def _tile_cells(mod, b, h, q0, q1, k0, k1, side: int, q_len: int, kv_len: int):
    """:func:`_cells` for one chunk of tiles."""
    r = torch.arange(side)
    rows = (q0.view(-1, 1) + r).reshape(-1)  # each tile's rows, [N * side]
    cols = (k0.view(-1, 1, 1) + r.view(1, 1, -1)).expand(-1, side, -1).reshape(-1, side)  # their keys
    valid = (rows < q1.repeat_interleave(side)).view(-1, 1) & (cols < k1.repeat_interleave(side).view(-1, 1))
    out = mod(b, h, rows.clamp(max=q_len - 1).view(1, 1, -1, 1), cols.clamp(max=kv_len - 1).view(1, 1, -1, side))
    if not isinstance(out, Tensor) or out.dtype != torch.bool or out.dim() > 4:
        raise CannotFollow("the predicate did not return booleans")
    out = as_grid(out)
    if out.shape[1] > 1 and not bool((out == out[:, :1]).all()):
        raise ReadsHead()
    out = out[:, :1].expand(out.shape[0], 1, rows.numel(), side)[:, 0] & valid  # [p, N * side, side]
    first, last = runs(out.reshape(-1, side))
    pi, at = first[:, 0] // rows.numel(), first[:, 0] % rows.numel()
    return out.shape[0], pi, rows[at], rows[at] + 1, cols[at, 0] + first[:, 1], cols[at, 0] + last[:, 1]


def _merge(found: list, p: int, q_len: int) -> tuple[Tensor, Tensor, Tensor]:
    """Full tiles (each of their rows a run) and the cells' runs, as sorted ``(row, start, end)``
    with touching runs of a row merged; a part found for all batch elements at once is copied to each."""
    rows, starts, ends = [], [], []
    for part_p, pi, first, stop, start, end in found:
        span = stop - first
        each = torch.repeat_interleave(torch.arange(span.numel()), span)
        row = first[each] + torch.arange(each.numel()) - (span.cumsum(0) - span)[each]
        copies = p if part_p == 1 else 1
        for c in range(copies):
            rows.append((pi[each] + c) * q_len + row)
            starts.append(start[each])
            ends.append(end[each])
    row, start, end = torch.cat(rows), torch.cat(starts), torch.cat(ends)
    if row.numel() == 0:
        return row, start, end
    first, last = join(row, start, end)  # tiles are disjoint, so runs are too
    return row[first], start[first], last
