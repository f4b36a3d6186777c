"""A predicate's rows in closed form (attnkit.maskplan.closed_form): the rows it derives equal those from
evaluating every cell, for the familiar families and for random expressions over the indices; the
familiar families are followed (not left to tiles); what it cannot follow is refused, and the plan
still gets every cell's answer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import maskplan, masks
from attnkit.maskplan import closed_form, stand_ins
from tests.maskplan.test_ranges import catalogue, every_cell, same_rows

#: The catalogue's families the pieces must follow at any size.
FOLLOWED = {"causal", "window (and_masks)", "documents, causal", "global tokens (or_masks)", "prefix-LM",
            "padding per batch", "nothing allowed", "everything", "2-D neighbourhood (image rows of 7)",
            "dilated", "strided (Sparse Transformer)"}


def pieces_rows(mod, batch, heads, q_len, kv_len, blocks=False):
    return closed_form.interval_tables(mod, batch, heads, q_len, kv_len, blocks=blocks)


#: Each row on its own, and rows in blocks (every choice checked at both ends of a block).
MODES = pytest.mark.parametrize("blocks", [False, True], ids=["rows", "blocks"])


@MODES
@settings(deadline=None, max_examples=25)
@given(q_len=st.integers(1, 90), extra=st.integers(-10, 40), batch=st.integers(1, 2), a=st.integers(0, 12),
       c=st.integers(0, 6), seed=st.integers(0, 2**16))
def test_rows_from_pieces_equal_every_cells(blocks, q_len, extra, batch, a, c, seed):
    kv_len = max(1, q_len + extra)
    for name, (mod, _) in catalogue(q_len, kv_len, batch, a, c, seed).items():
        want = every_cell(mod, batch, q_len, kv_len)
        try:
            got = pieces_rows(mod, batch, 2, q_len, kv_len, blocks)
        except stand_ins.CannotFollow:
            assert name not in FOLLOWED, name
        else:
            assert same_rows(got, want), name


# ---- random expressions over the indices --------------------------------------------------------

TABLE = torch.tensor([0, 0, 0, 1, 1, 4, 4, 4, 4, 2, 2, 7, 7, 7, 7, 7, 3, 3, 0, 0, 5, 5, 5, 5, 5, 5, 1, 1, 1, 1])
#: A 2-D table (a block layout's shape: a few rows, runs along each), as wide as any key index here.
TABLE2 = torch.stack([TABLE.roll(3 * r).repeat(13) for r in range(5)])  # 390 keys: the long rows reach 360


def integer(draw, depth: int):
    """An integer expression of the indices (as a function of (b, i, j)) and its text."""
    leaves = [(lambda b, i, j: i, "i"), (lambda b, i, j: j, "j"), (lambda b, i, j: b, "b")]
    k = draw(st.integers(-9, 9))
    leaves.append((lambda b, i, j: k, str(k)))
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(st.sampled_from(leaves))
    (f, sf), (g, sg) = integer(draw, depth - 1), integer(draw, depth - 1)
    m = draw(st.integers(1, 7))
    c = draw(st.booleans())
    forms = {
        "add": (lambda b, i, j: f(b, i, j) + g(b, i, j), f"({sf} + {sg})"),
        "sub": (lambda b, i, j: f(b, i, j) - g(b, i, j), f"({sf} - {sg})"),
        "scale": (lambda b, i, j: f(b, i, j) * m, f"({sf} * {m})"),
        "neg": (lambda b, i, j: -f(b, i, j), f"-{sf}"),
        "abs": (lambda b, i, j: (f(b, i, j) + 0 * i).abs(), f"abs({sf})"),
        "floordiv": (lambda b, i, j: f(b, i, j) // m, f"({sf} // {m})"),
        "mod": (lambda b, i, j: f(b, i, j) % m, f"({sf} % {m})"),
        "min": (lambda b, i, j: torch.minimum(f(b, i, j) + 0 * i, g(b, i, j) + 0 * j), f"min({sf}, {sg})"),
        "clamp": (lambda b, i, j: (f(b, i, j) + 0 * i).clamp(-3, 12 if c else None), f"clamp({sf})"),
        "where": (lambda b, i, j: torch.where(i > j, f(b, i, j), g(b, i, j)), f"where(i > j, {sf}, {sg})"),
        "table": (lambda b, i, j: TABLE[(f(b, i, j) + 0 * i).clamp(0, len(TABLE) - 1)], f"T[{sf}]"),
        "2-D table, key index // m": (lambda b, i, j: TABLE2[(f(b, i, j) + 0 * i).clamp(0, len(TABLE2) - 1), j // m],
                                      f"T2[{sf}, j // {m}]"),
        "bool as int": (lambda b, i, j: (f(b, i, j) + 0 * i < g(b, i, j)).long() * 3, f"3 * ({sf} < {sg})"),
    }
    return forms[draw(st.sampled_from(sorted(forms)))]


@st.composite
def predicates(draw, depth: int = 3):
    """A boolean expression of the indices, and its text."""
    (f, sf), (g, sg) = integer(draw, depth), integer(draw, depth)
    op = draw(st.sampled_from(["<", "<=", "==", "!=", ">", ">="]))
    compare = {"<": torch.lt, "<=": torch.le, "==": torch.eq, "!=": torch.ne, ">": torch.gt, ">=": torch.ge}[op]
    atom = (lambda b, h, i, j: compare(f(b, i, j) + 0 * i, g(b, i, j)), f"{sf} {op} {sg}")
    if draw(st.booleans()):
        return atom
    (p, sp) = atom
    (r, sr) = draw(predicates(depth - 1)) if depth > 0 else (lambda b, h, i, j: i >= j, "i >= j")
    join = draw(st.sampled_from(["&", "|", "^", "&~"]))
    both = {"&": lambda x, y: x & y, "|": lambda x, y: x | y, "^": lambda x, y: x ^ y, "&~": lambda x, y: x & ~y}[join]
    return (lambda b, h, i, j: both(p(b, h, i, j), r(b, h, i, j)), f"({sp}) {join} ({sr})")


@MODES
@settings(deadline=None, max_examples=150)
@given(pred=predicates(), q_len=st.integers(1, 40), extra=st.integers(-8, 20), batch=st.integers(1, 2))
def test_random_expressions_give_every_cells_rows_or_are_refused(blocks, pred, q_len, extra, batch):
    mod, text = pred
    kv_len = max(1, q_len + extra)
    want = every_cell(mod, batch, q_len, kv_len)
    try:
        got = pieces_rows(mod, batch, 1, q_len, kv_len, blocks)
    except stand_ins.CannotFollow:
        return  # left to tiles (an index outside the table, or a product of two moving values)
    assert want is not None and same_rows(got, want), text


@MODES
@settings(deadline=None, max_examples=60)
@given(pred=predicates(), q_len=st.integers(100, 300), extra=st.integers(-30, 60))
def test_random_expressions_on_long_rows_give_every_cells_rows_or_are_refused(blocks, pred, q_len, extra):
    """Rows long enough that ``%`` and ``//`` pass many multiples: remainders compared as patterns
    every few keys, quotients as intervals, and both cut into pieces where anything else uses them;
    in blocks, choices that change every row or two inside a block."""
    test_random_expressions_give_every_cells_rows_or_are_refused.hypothesis.inner_test(blocks, pred, q_len, extra, 1)


def test_random_expressions_are_mostly_followed():
    """The test above must not pass by refusing: most of its expressions are followed."""
    followed = []

    @settings(deadline=None, max_examples=120, database=None)
    @given(pred=predicates(), q_len=st.integers(1, 40))
    def count(pred, q_len):
        try:
            pieces_rows(pred[0], 1, 1, q_len, q_len)
            followed.append(True)
        except stand_ins.CannotFollow:
            followed.append(False)

    count()
    assert sum(followed) >= 0.6 * len(followed)


# ---- what a plan takes from pieces, and what pieces leave to tiles --------------------------------


def test_a_long_window_is_derived_without_evaluating_a_cell():
    from torch.nn.attention.flex_attention import and_masks

    n, seen = 4096, []

    def causal(b, h, i, j):
        seen.append((type(i), i.icept.shape[0]))  # how many rows each call is given
        return i >= j

    mod = and_masks(causal, lambda b, h, i, j: i - j <= 64)
    want = (torch.arange(n) - 64).clamp(min=0), torch.arange(n) + 1
    got, way, _ = maskplan.row_intervals(mod, 1, 8, n, n, torch.device("cpu"))
    assert {t for t, _ in seen} == {closed_form.Pieces} and way == "closed form"  # on pieces: no tile, no cell
    assert repr(maskplan.mask_plan(mod, q_len=n)).endswith("derived by closed form)")
    assert torch.equal(got[0].view(-1), want[0]) and torch.equal(got[1].view(-1), want[1])
    for blocks in (False, True):
        seen.clear()
        got = closed_form.interval_tables(mod, 1, 1, n, n, blocks=blocks)
        assert torch.equal(got[0].view(-1), want[0]) and torch.equal(got[1].view(-1), want[1])
        if blocks:  # a pass over one block, cut where a choice changes (the window's edge at row 64, the
            # last row), and one over those few blocks: each at its two ends
            assert len(seen) == 2 and seen[-1][1] <= 10, seen
        else:
            assert seen == [(closed_form.Pieces, n)]


@MODES
@pytest.mark.parametrize("q_len", [1, 70, 300])
def test_one_run_combined_with_another_or_a_row_value_is_worked_out_on_its_ends(blocks, q_len, monkeypatch):
    """``&`` of two comparisons that each hold on one run of keys, ``&``/``|`` of such a run with a
    value constant along the keys (a query-side condition), a distance's absolute value compared as
    at most a bound, and ``&`` of a run with any boolean take the run's ends: never the general merge
    of cuts (which sorts them), and exactly every cell's rows."""
    from torch.nn.attention.flex_attention import and_masks, or_masks

    def merged(*args):
        raise AssertionError("cuts merged")

    monkeypatch.setattr(closed_form, "_sorted", merged)
    monkeypatch.setattr(closed_form, "join", merged)  # (and the rows come from one run, not from pieces)
    mods = {
        "causal window": and_masks(lambda b, h, i, j: i >= j, lambda b, h, i, j: i - j <= 16),
        "runs that miss each other": lambda b, h, i, j: (j >= i + 5) & (j < i - 2),
        "window, rows 40 on": lambda b, h, i, j: (i - j <= 9) & (j <= i) & (i >= 40),
        "keys up to 30, or everything from row 50": or_masks(lambda b, h, i, j: j < 30, lambda b, h, i, j: i >= 50),
        "a window both ways, by abs": lambda b, h, i, j: (i - j).abs() <= 5,
        "below a distance by abs, rows 3 on": lambda b, h, i, j: ((j - i).abs() < 7) & (i >= 3),
        "abs against a row's own bound": lambda b, h, i, j: (i - j).abs() <= i // 4,
    }
    for name, mod in mods.items():
        got = pieces_rows(mod, 2, 1, q_len, q_len + 11, blocks)
        assert same_rows(got, every_cell(mod, 2, q_len, q_len + 11)), name
    # a run and a boolean of several pieces: that boolean's cuts clipped to the run; | of two runs: the
    # two in key order (the rows of either then joined as usual)
    monkeypatch.undo()
    taken, one_run = [], closed_form._one_run
    monkeypatch.setattr(closed_form, "_one_run", lambda *args: taken.append(one_run(*args)) or taken[-1])
    docs = torch.arange(q_len + 11) // 13
    clipped = {
        "documents, causal": and_masks(lambda b, h, i, j: j <= i, lambda b, h, i, j: docs[i] == docs[j]),
        "every other document, in a window": lambda b, h, i, j: ((i - j).abs() < 20) & (docs[j] % 2 == 0),
        "a window, in documents (the run second)": lambda b, h, i, j: (docs[i] == docs[j]) & (i - j <= 4),
        "a window or the first keys": lambda b, h, i, j: ((i - j).abs() <= 3) | (j < 5),
        "two runs that meet": lambda b, h, i, j: (((i - j).abs() <= 4) & (j <= i)) | ((j > i) & (j - i < 5)),
        "two runs apart": lambda b, h, i, j: ((j <= i) & (i - j <= 4)) | ((j - i >= 2) & (j - i <= 9)),
        "a run or one that is empty in early rows": lambda b, h, i, j: (j < i - 30) | (j >= 20),
    }
    for name, mod in clipped.items():
        taken.clear()
        got = pieces_rows(mod, 2, 1, q_len, q_len + 11, blocks)
        assert taken and all(t is not None for t in taken), name  # (& on the run's ends, not the merge)
        assert same_rows(got, every_cell(mod, 2, q_len, q_len + 11)), name


def test_patterns_every_few_keys_are_followed_on_long_rows():
    """Dilated and strided windows, block-local attention, keys every few positions, block layouts:
    a remainder compared holds every ``m`` keys, a quotient compared is one interval, a layout read
    at quotients is cut where its row changes; the predicate is called once, on pieces, and the
    rows equal every cell's, however many multiples a row passes."""
    n, seen = 1500, []
    bigbird = masks.bigbird_layout(-(-n // 64), seed=0)

    def dilated(b, h, i, j):
        seen.append(type(i))
        return ((i - j).abs() <= 64) & ((i - j) % 2 == 0)

    mods = {
        "dilated": dilated,
        "strided": lambda b, h, i, j: (i >= j) & (((i - j) % 64 == 0) | (i // 64 == j // 64)),
        "block-local": lambda b, h, i, j: i // 100 == j // 100,
        "two of every three keys, causal, 600 back": lambda b, h, i, j: (j <= i) & (i - j < 600) & (2 > j % 3),
        "BigBird layout (window, global and random blocks of 64)": lambda b, h, i, j: bigbird[i // 64, j // 64],
        "BigBird layout, causal": lambda b, h, i, j: bigbird[i // 64, j // 64] & (j <= i),
        "xor, and not, in a window": lambda b, h, i, j: ((i - j).abs() < 300) & ((j < i) ^ ((i + j) % 5 != 1)),
        "keys up to the square of the row (not affine in the row: in blocks, rows on their own)":
            lambda b, h, i, j: j <= i * i // 1000,
    }
    for name, mod in mods.items():
        seen.clear()
        got, way, _ = maskplan.row_intervals(mod, 1, 1, n, n, torch.device("cpu"))
        assert way == "closed form", name
        assert set(seen) == ({closed_form.Pieces} if name == "dilated" else set()), name  # no tile, no cell
        want = every_cell(mod, 1, n, n)
        assert same_rows(got, want), name
        assert same_rows(closed_form.interval_tables(mod, 1, 1, n, n, blocks=True), want), name
    # more runs in a row than a plan keeps: refused, and the plan has no intervals
    every_other = lambda b, h, i, j: (i + j) % 2 == 0  # noqa: E731
    with pytest.raises(stand_ins.CannotFollow, match="runs in a row"):
        closed_form.interval_tables(every_other, 1, 1, 600, 600, most=maskplan.MAX_INTERVALS)
    assert maskplan.row_intervals(every_other, 1, 1, 600, 600, torch.device("cpu"))[0] is None


@MODES
@settings(deadline=None, max_examples=40)
@given(q_len=st.integers(1, 120), extra=st.integers(-30, 60), m=st.integers(2, 7), r=st.integers(0, 6),
       lo=st.integers(-40, 10), width=st.integers(0, 70), shifted=st.booleans(), causal=st.booleans())
def test_patterns_every_few_keys_in_a_window_give_every_cells_rows(blocks, q_len, extra, m, r, lo, width, shifted,
                                                                     causal):
    """Keys every ``m`` positions within a window (a dilated window, cut by the sequence's ends
    and, when causal, by the diagonal): each row's runs, however many, equal every cell's, whether
    a row has as many runs as the most or fewer (its last slots empty)."""
    kv_len = max(1, q_len + extra)

    def mod(b, h, i, j):
        d = i - j + 3 if shifted else i - j
        keep = (d >= lo) & (d <= lo + width) & (d % m == r % m)
        return keep & (j <= i) if causal else keep

    got = pieces_rows(mod, 1, 1, q_len, kv_len, blocks)
    assert same_rows(got, every_cell(mod, 1, q_len, kv_len))


def test_patterns_every_few_keys_are_worked_out_in_blocks():
    """A dilated window over many rows is worked out in blocks: each block's runs every other key
    follow from its two ends (near the sequence's edges a run appears every other row, so blocks
    there are a row or two). Where the number of runs in a row changes inside a block, blocks
    cannot pair them: each row is worked out on its own, still exact."""
    passes = []
    evaluate = closed_form._evaluate

    def counted(*args):
        passes.append(args[-1] is not None)  # (the blocks' starts; None: each row on its own)
        return evaluate(*args)

    mods = {
        "dilated": (4096, lambda b, h, i, j: ((i - j).abs() <= 64) & ((i - j) % 2 == 0)),
        "a run more each row": (300, lambda b, h, i, j: (j <= 2 * i) & (j % 2 == 0)),
        "two of every three, causal, rows apart": (300, lambda b, h, i, j: (j <= i) & (j % 3 != 1)),
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(closed_form, "_evaluate", counted)
        for name, (n, mod) in mods.items():
            passes.clear()
            assert same_rows(closed_form.interval_tables(mod, 1, 1, n, n, blocks=True), every_cell(mod, 1, n, n)), name
            if name == "dilated":
                assert all(passes) and len(passes) <= closed_form.PASSES, passes  # in blocks throughout


def test_what_pieces_cannot_follow_is_refused_and_the_plan_still_gets_every_cells_rows():
    n = 200  # a key pattern of period 3 used in arithmetic: 67 pieces a row, over MOST_PIECES
    layout = torch.rand(50, 50, generator=torch.Generator().manual_seed(0)) < 0.5
    mods = {  # name: (predicate, the way that finds its rows)
        "a float": (lambda b, h, i, j: (i - j).float() * 0.5 <= 3.0, "ranges"),
        "a product of two moving values": (lambda b, h, i, j: (i - j) * (i - j) <= 9, "ranges"),
        "a 2-D table read at a row that moves along the keys": (lambda b, h, i, j: layout[j // 4, i // 4], "ranges"),
        "an index outside the table (wraps)": (lambda b, h, i, j: TABLE[(j - 1).clamp(max=len(TABLE) - 1)] > 2,
                                               "every cell"),
        "a key slope of 2 into a table": (lambda b, h, i, j: TABLE[(2 * j).clamp(max=len(TABLE) - 1)] > 2, "ranges"),
        "too many pieces": (lambda b, h, i, j: (i - j) % 3 * 2 == 2, "ranges"),
        "a constant near int64's limits": (lambda b, h, i, j: (i - j) * 10**15 <= 10**17, "ranges"),
    }
    for name, (mod, way) in mods.items():
        with pytest.raises(stand_ins.CannotFollow):
            closed_form.interval_tables(mod, 1, 2, n, n)
            pytest.fail(name)
        want = every_cell(mod, 1, n, n)
        got, found_by, _ = maskplan.row_intervals(mod, 1, 2, n, n, torch.device("cpu"))
        assert (got is None and want is None) or same_rows(got, want), name
        assert found_by == way, name


def test_a_refusal_the_predicate_swallows_still_counts():
    def swallows(b, h, i, j):
        try:
            return (i - j) ** 2 <= 9
        except Exception:  # noqa: BLE001
            return i < 0

    with pytest.raises(stand_ins.CannotFollow):
        closed_form.interval_tables(swallows, 1, 1, 30, 30)
    got, way, _ = maskplan.row_intervals(swallows, 1, 1, 30, 30, torch.device("cpu"))
    assert same_rows(got, every_cell(swallows, 1, 30, 30)) and way == "every cell"


@MODES
def test_a_predicate_that_reads_the_head_is_worked_out_per_head_in_closed_form(blocks):
    """With the heads folded into the batch the predicate is given the batch element and the head as
    each row's values (a head's table entry read once per row): equal to every cell of the predicate
    called with ``b // heads, b % heads``."""
    wins = torch.tensor([3, 0, 17])
    mods = {"3 h": lambda b, h, i, j: (i >= j) & (i - j <= 3 * h),
            "a table per head": lambda b, h, i, j: (i >= j) & (i - j <= wins[h]),
            "the head and the batch element": lambda b, h, i, j: (j <= i + h) | (j > 30 - 7 * b),
            "the head as a key": lambda b, h, i, j: j == 2 * h + b}
    for name, mod in mods.items():
        with pytest.raises(stand_ins.ReadsHead):
            closed_form.interval_tables(mod, 2, 3, 40, 40)
        want = every_cell(lambda b, h, i, j, mod=mod: mod(b // 3, b % 3, i, j), 6, 40, 40)
        assert same_rows(closed_form.interval_tables(mod, 6, 1, 40, 40, blocks=blocks, fold=3), want), name
        got, way, per_head = maskplan.row_intervals(mod, 2, 3, 40, 40, torch.device("cpu"))
        assert way == "closed form" and per_head and got[0].shape[0] == 6, name  # element b, head h at b * 3 + h
        assert same_rows(got, want), name


def test_the_benchmarks_user_masks_are_all_derived_in_closed_form():
    """Every mask family ``attnkit bench mods`` times, as its users write it, is worked out in
    closed form (the analysis cost it reports), equal to every cell."""
    from attnkit.bench.mods import H, families

    n = 640
    for name, (mod, _, _) in families(n).items():
        if mod is None:
            continue
        got, way, per_head = maskplan.row_intervals(mod, 1, H, n, n, torch.device("cpu"))
        assert way == "closed form", name
        folded = lambda b, h, i, j, mod=mod: mod(b // H, b % H, i, j)  # noqa: E731
        want = every_cell(folded, H, n, n) if per_head else every_cell(mod, 1, n, n)
        assert same_rows(got, want), name
        in_blocks = closed_form.interval_tables(mod, H, 1, n, n, blocks=True, fold=H) if per_head else \
            closed_form.interval_tables(mod, 1, 1, n, n, blocks=True)
        assert same_rows(in_blocks, want), name
