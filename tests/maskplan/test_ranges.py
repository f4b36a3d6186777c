"""A predicate run on ranges of indices (attnkit.maskplan.ranges): every rule's bounds hold for every cell
they stand for, the rows derived from ranges equal those from evaluating every cell, the familiar
families are settled by ranges (not by the fallback), and what ranges cannot follow falls back."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import maskplan
from attnkit.maskplan import every_cell as every_cell_way
from attnkit.maskplan import ranges, rows, stand_ins

# ---- each rule is sound: its bounds contain the value at every point of its input ranges -----------

ints = st.tuples(st.integers(-20, 20), st.integers(0, 6)).map(lambda t: (t[0], t[0] + t[1]))
bools = st.sampled_from([(False, False), (False, True), (True, True)])


def as_range(bounds, dtype=torch.int64) -> ranges.Range:
    lo, hi = bounds
    return ranges.Range(torch.tensor(lo, dtype=dtype), torch.tensor(hi, dtype=dtype))


def values(bounds, dtype=torch.int64):
    lo, hi = bounds
    return [torch.tensor(x, dtype=dtype) for x in ((False, True)[lo:hi + 1] if dtype == torch.bool
                                                  else range(lo, hi + 1))]


def contains(r: ranges.Range, x: torch.Tensor) -> bool:
    lo, hi, x = (t.to(torch.float64) for t in (r.lo, r.hi, x))
    return bool(lo <= x) and bool(x <= hi)


BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "min": torch.minimum, "max": torch.maximum,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
}
UNARY = {
    "neg": lambda a: -a, "abs": lambda a: a.abs(), "abs()": torch.abs,
    "floordiv 3": lambda a: a // 3, "div -2": lambda a: a / -2,
    "floor div 4": lambda a: torch.div(a, 4, rounding_mode="floor"),
    "mod 5": lambda a: a % 5, "remainder 2": lambda a: torch.remainder(a, 2), "clamp": lambda a: a.clamp(-3, 4),
    "float": lambda a: a.float() * 0.5 - 1.25, "bool": lambda a: a.bool(), "to long": lambda a: a.to(torch.int64) + 1,
    "const first": lambda a: 7 - a, "tensor const": lambda a: torch.tensor(3) * a,
}
LOGIC = {
    "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
    "logical_and": torch.logical_and, "not a": lambda a, b: ~a, "where": lambda a, b: torch.where(a, b, ~b),
    "where ints": lambda a, b: torch.where(a, 3, torch.where(b, -1, 5)),
    "bool plus int": lambda a, b: (a + 1) * 2 - b.long(),
}


@settings(deadline=None, max_examples=60)
@given(a=ints, b=ints)
def test_arithmetic_and_comparison_bounds_hold_at_every_point(a, b):
    for name, op in BINARY.items():
        got = op(as_range(a), as_range(b))
        for x, y in itertools.product(values(a), values(b)):
            assert contains(got, op(x, y)), (name, a, b, x, y)
    for name, op in UNARY.items():
        got = op(as_range(a))
        for x in values(a):
            assert contains(got, op(x)), (name, a, x)


@settings(deadline=None, max_examples=30)
@given(a=bools, b=bools)
def test_logic_bounds_hold_at_every_point(a, b):
    for name, op in LOGIC.items():
        got = op(as_range(a, torch.bool), as_range(b, torch.bool))
        for x, y in itertools.product(values(a, torch.bool), values(b, torch.bool)):
            assert contains(got, op(x, y)), (name, a, b, x, y)


@settings(deadline=None, max_examples=60)
@given(table=st.lists(st.integers(-5, 5), min_size=1, max_size=40), data=st.data())
def test_indexing_a_tensor_bounds_its_entries_over_the_range(table, data):
    t = torch.tensor(table)
    lo = data.draw(st.integers(0, len(table) - 1))
    hi = data.draw(st.integers(lo, len(table) - 1))
    got = t[as_range((lo, hi))]
    assert int(got.lo) == min(table[lo:hi + 1]) and int(got.hi) == max(table[lo:hi + 1])  # tight, not just sound
    flags = t > 0
    got = flags[as_range((lo, hi))]
    assert bool(got.lo) == all(x > 0 for x in table[lo:hi + 1]) and bool(got.hi) == any(x > 0 for x in table[lo:hi + 1])


@settings(deadline=None, max_examples=40)
@given(rows=st.integers(1, 9), cols=st.integers(1, 9), seed=st.integers(0, 2**16), data=st.data())
def test_indexing_a_2d_tensor_bounds_its_entries_over_the_rectangle(rows, cols, seed, data):
    t = torch.randint(-5, 6, (rows, cols), generator=torch.Generator().manual_seed(seed))
    r0 = data.draw(st.integers(0, rows - 1))
    r1 = data.draw(st.integers(r0, rows - 1))
    c0 = data.draw(st.integers(0, cols - 1))
    c1 = data.draw(st.integers(c0, cols - 1))
    block = t[r0:r1 + 1, c0:c1 + 1]
    got = t[as_range((r0, r1)), as_range((c0, c1))]
    assert int(got.lo) == int(block.min()) and int(got.hi) == int(block.max())
    got = (t > 0)[as_range((r0, r1)), c0]  # a constant along one axis
    col = t[r0:r1 + 1, c0] > 0
    assert bool(got.lo) == bool(col.all()) and bool(got.hi) == bool(col.any())


def test_a_2d_tensor_too_large_for_a_range_table_is_refused(monkeypatch):
    layout = torch.rand(16, 16) < 0.5
    monkeypatch.setattr(ranges, "TABLE_ENTRIES", 100)
    with pytest.raises(stand_ins.CannotFollow):
        ranges.flat_runs(lambda b, h, i, j: layout[i // 4, j // 4], 1, 1, 64, 64)
    want = every_cell(lambda b, h, i, j: layout[i // 4, j // 4], 1, 64, 64)
    got = maskplan.row_intervals(lambda b, h, i, j: layout[i // 4, j // 4], 1, 1, 64, 64, torch.device("cpu"))[0]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- the derived rows equal every cell's --------------------------------------------------------


def catalogue(q_len: int, kv_len: int, batch: int, a: int, c: int, seed: int) -> dict:
    """Predicates as users write them: name -> (mod, whether ranges settle it)."""
    from torch.nn.attention.flex_attention import and_masks, or_masks

    g = torch.Generator().manual_seed(seed)
    docs = torch.sort(torch.randint(0, 5, (max(q_len, kv_len),), generator=g)).values
    lengths = torch.randint(0, kv_len + 1, (batch,), generator=g)
    is_global = torch.rand(kv_len, generator=g) < 0.05
    layout = torch.rand(-(-q_len // 4), -(-kv_len // 4), generator=g) < 0.4
    pattern = torch.rand(q_len, kv_len, generator=g) > 0.5
    off = kv_len - q_len

    def causal(b, h, i, j):
        return i + off >= j

    def near(b, h, i, j):
        return (i + off - j).abs() <= a

    return {
        "causal": (causal, True),
        "window (and_masks)": (and_masks(causal, lambda b, h, i, j: i + off - j <= a), True),
        "documents, causal": (and_masks(causal, lambda b, h, i, j: docs[i] == docs[j]), True),
        "dilated": (lambda b, h, i, j: near(b, h, i, j) & ((i - j) % (c + 1) == 0), True),
        "strided (Sparse Transformer)": (lambda b, h, i, j: causal(b, h, i, j)
                                         & (((i + off - j) % (c + 2) == 0) | (i // (c + 2) == j // (c + 2))), True),
        "global tokens (or_masks)": (or_masks(near, lambda b, h, i, j: is_global[j], lambda b, h, i, j: i < c), True),
        "prefix-LM": (lambda b, h, i, j: (j < c + 1) | causal(b, h, i, j), True),
        "padding per batch": (lambda b, h, i, j: j < lengths[b], True),
        "where and casts": (lambda b, h, i, j: torch.where(i > c, (i - j).float() * 0.5 >= -1.0, (j % 3).bool()), True),
        "nothing allowed": (lambda b, h, i, j: i < -1, True),
        "everything": (lambda b, h, i, j: b.new_ones((), dtype=torch.bool), True),
        "block layout (2-D index)": (lambda b, h, i, j: layout[i // 4, j // 4], True),
        "random cells (2-D index)": (lambda b, h, i, j: pattern[i, j], True),
        "2-D neighbourhood (image rows of 7)": (lambda b, h, i, j: ((i // 7 - j // 7).abs() <= 1)
                                                & ((i % 7 - j % 7).abs() <= a % 3), True),
        # not settled by ranges (a wrapped negative index): every cell decides
        "wrapping index": (lambda b, h, i, j: docs[i - 1] == docs[j], False),
    }


def every_cell(mod, batch, q_len, kv_len):
    return every_cell_way.every_cell(mod, batch, 2, q_len, kv_len, torch.device("cpu"))


def same_rows(got, want) -> bool:
    """Equal intervals; pieces share one set of rows among batch elements that have the same mask."""
    if got is None or want is None:
        return False
    return all(torch.equal(g.expand_as(w), w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("sides", [(256, 16), (8, 3), (5, 2, 1)])
@settings(deadline=None, max_examples=12)
@given(q_len=st.integers(1, 90), extra=st.integers(-10, 40), batch=st.integers(1, 2), a=st.integers(0, 12),
       c=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_rows_from_ranges_equal_every_cells(sides, q_len, extra, batch, a, c, seed):
    kv_len = max(1, q_len + extra)
    for name, (mod, settled) in catalogue(q_len, kv_len, batch, a, c, seed).items():
        want = every_cell(mod, batch, q_len, kv_len)
        try:
            row, first, last, p = ranges.flat_runs(mod, batch, 2, q_len, kv_len, sides)
        except stand_ins.CannotFollow:
            assert not settled, name
        else:
            assert settled, name
            got = rows.pack(row, first, last, p, q_len, kv_len)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
        got = maskplan.row_intervals(mod, batch, 2, q_len, kv_len, torch.device("cpu"))[0]  # the path plans take
        assert same_rows(got, want), name  # (the closed form shares one set of rows among equal batch elements)


def test_a_long_sequence_evaluates_only_the_cells_near_the_mask_edges():
    n = 4096
    from torch.nn.attention.flex_attention import and_masks

    seen = []

    def causal(b, h, i, j):
        if isinstance(i, torch.Tensor):
            seen.append(torch.broadcast_shapes(i.shape, j.shape).numel())
        return i >= j

    mod = and_masks(causal, lambda b, h, i, j: i - j <= 64)
    row, first, last, p = ranges.flat_runs(mod, 1, 8, n, n)
    evaluated = sum(seen)  # cells the predicate was called on (ranges are not tensors)
    want = every_cell(mod, 1, n, n)
    got = rows.pack(row, first, last, p, n, n)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert 0 < evaluated < n * n // 50  # under 2% of the cells were evaluated (the rest settled as tiles)


def test_cells_are_evaluated_a_chunk_at_a_time_with_the_same_answer(monkeypatch):
    docs = torch.arange(300) // 37
    mod = lambda b, h, i, j: (docs[i] == docs[j]) & (i >= j)  # noqa: E731
    want = every_cell(mod, 1, 300, 300)
    monkeypatch.setattr(ranges, "CELLS", 3 * 16 * 16)  # three 16-tiles per call
    row, first, last, p = ranges.flat_runs(mod, 1, 1, 300, 300)
    got = rows.pack(row, first, last, p, 300, 300)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_ranges_give_up_where_they_settle_little_of_a_large_grid(monkeypatch):
    checkerboard = lambda b, h, i, j: (i + j) % 2 == 0  # noqa: E731 (no tile bigger than a cell is settled)
    monkeypatch.setattr(ranges, "SETTLE_FROM", 1000)
    with pytest.raises(stand_ins.CannotFollow, match="settle too little"):
        ranges.flat_runs(checkerboard, 1, 1, 200, 200, (20, 4))  # 100 tiles of 20, all mixed
    want = every_cell(checkerboard, 1, 200, 200)
    got = maskplan.row_intervals(checkerboard, 1, 1, 200, 200, torch.device("cpu"))[0]
    assert got is want is None or (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
    row, first, last, p = ranges.flat_runs(lambda b, h, i, j: i >= j, 1, 1, 200, 200, (20, 4))  # causal still settles
    assert row.numel() == 200


# ---- what ranges cannot follow falls back, with the right answer ---------------------------------


def test_what_ranges_cannot_follow_is_refused_and_every_cell_decides():
    n = 40
    counter = {"calls": 0}

    def reads_head(b, h, i, j):
        return (i >= j) & (h % 2 == 0)

    def branches(b, h, i, j):
        if (i >= j).any():  # Python control flow on an index
            return i >= j
        return j < 0

    def random_mask(b, h, i, j):
        return torch.rand(torch.broadcast_shapes(i.shape, j.shape)) < 2  # always True, but not boundable

    def swallows(b, h, i, j):
        try:
            return (i - j) ** 2 <= 9  # ** is not followed; the predicate then goes another way
        except Exception:  # noqa: BLE001
            counter["calls"] += 1
            return i < 0

    def reads_shape(b, h, i, j):
        return (i >= j) if i.shape[-1] == 1 else (i < 0)

    def adds_booleans(b, h, i, j):  # torch: True + True is True, not 2
        return ((i >= j) + (i >= j + 1)) >= 2

    for mod in (reads_head, branches, random_mask, swallows, reads_shape, adds_booleans):
        with pytest.raises(stand_ins.CannotFollow):
            ranges.flat_runs(mod, 1, 2, n, n)
    assert counter["calls"] >= 1  # the exception was caught inside the predicate, and still refused
    for mod in (swallows, adds_booleans):
        want = every_cell(mod, 1, n, n)
        got = maskplan.row_intervals(mod, 1, 2, n, n, torch.device("cpu"))[0]
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # heads folded into the batch
    got, _, per_head = maskplan.row_intervals(reads_head, 1, 2, n, n, torch.device("cpu"))
    assert per_head and same_rows(got, every_cell(lambda b, h, i, j: reads_head(0, b, i, j), 2, n, n))
