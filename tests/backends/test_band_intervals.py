"""The banded C++ kernel called directly (``_band.run``) with several key intervals per query row.

Rows in any order (no monotonicity down the rows), 1, 2 or 5 intervals per row, rows with nothing
to attend, intervals shared by the batch or per element, GQA, ``Lq != Lk``, a diagonal bias per
head or shared, tanh soft-capping on and off. Outputs and dq/dk/dv/dbias against a float64
formula over a dense mask that this file builds from the intervals cell by cell (its output is
itself checked against :mod:`tests.support.oracle`); determinism bitwise; gradcheck; bad arguments.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.backends import _band
from tests.support import oracle
from tests.support.tolerances import close


def test_the_kernel_is_available():
    assert _band.available(), _band.unavailable_reason()


# ---- intervals -----------------------------------------------------------------------------------------------

def random_intervals(batches: int, lq: int, lk: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``[batches, lq, k]`` rows of 0..k sorted, disjoint, non-adjacent random intervals, empties ``(lk, lk)``
    last; rows independent of each other (so in no order down the rows), about one row in 8 empty."""
    starts = torch.full((batches, lq, k), lk, dtype=torch.long)
    ends = starts.clone()
    for b in range(batches):
        for i in range(lq):
            n = 0 if torch.rand((), generator=gen) < 0.125 else int(torch.randint(1, k + 1, (), generator=gen))
            n = min(n, (lk + 1) // 2)
            # 2n distinct cut points from 0..lk: [p0, p1), [p2, p3), ... with p1 < p2, never adjacent
            cuts = torch.randperm(lk + 1, generator=gen)[:2 * n].sort().values
            starts[b, i, :n], ends[b, i, :n] = cuts[0::2], cuts[1::2]
    return starts, ends


def longformer_intervals(n: int, window: int, globals_: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window +-window plus global tokens 0..globals_-1: global rows see every key, every row sees the
    global keys and its window (two intervals, or one where they touch)."""
    starts = torch.full((1, n, 2), n, dtype=torch.long)
    ends = starts.clone()
    for i in range(n):
        lo, hi = max(i - window, 0), min(i + window + 1, n)
        if i < globals_ or lo <= globals_:
            starts[0, i, 0], ends[0, i, 0] = 0, (n if i < globals_ else hi)
        else:
            starts[0, i, 0], ends[0, i, 0] = 0, globals_
            starts[0, i, 1], ends[0, i, 1] = lo, hi
    return starts, ends


def dense(starts: torch.Tensor, ends: torch.Tensor, lk: int) -> torch.Tensor:
    """Bool ``[P, 1, Lq, Lk]``: cell (i, j) allowed iff some interval of row i holds j (each of the K
    interval slots compared with every column)."""
    j = torch.arange(lk)
    allowed = torch.zeros(starts.shape[0], 1, starts.shape[1], lk, dtype=torch.bool)
    for n in range(starts.shape[2]):
        allowed[:, 0] |= (starts[:, :, n, None] <= j) & (j < ends[:, :, n, None])
    return allowed


# ---- the float64 formula ---------------------------------------------------------------------------------

def formula(q, k, v, allowed, bias, scale, softcap):
    """softmax(cap(q k^T * scale + bias)) v in float64 with autograd; rows with nothing allowed give zeros."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    lq, lk = q.shape[2], k.shape[2]
    if bias is not None:
        diag = torch.arange(lk).view(1, -1) - torch.arange(lq).view(-1, 1) + lq - 1
        s = s + bias[:, diag]
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    return p @ v


def inputs(b, h, hkv, lq, lk, d, dv, bias_heads, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, *s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
               for s in ((h, lq, d), (hkv, lk, d), (hkv, lk, dv)))
    bias = None
    if bias_heads:
        bias = torch.randn(bias_heads, lq + lk - 1, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v, bias


def check(q, k, v, bias, starts, ends, scale, softcap, *, scaled=None, allowed=None):
    """Output and every gradient of ``_band.run`` against the float64 formula (``allowed``: ``dense(starts,
    ends, Lk)``, made here unless a caller checking several inputs on the same intervals made it once)."""
    out = _band.run(q, k, v, starts, ends, bias, scale, softcap)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:-1], v.shape[-1])
    leaves = [t for t in (q, k, v, bias) if t is not None]
    wide = [t.detach().double().requires_grad_() for t in leaves]
    if allowed is None:
        allowed = dense(starts, ends, k.shape[2])
    if starts.shape[0] == q.shape[0] * q.shape[1] > q.shape[0]:  # a set of intervals per batch element and head
        allowed = allowed.view(q.shape[0], q.shape[1], *allowed.shape[2:])
    want = formula(*wide[:3], allowed, wide[3] if bias is not None else None, scale, softcap)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got_grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    want_grads = torch.autograd.grad(want, wide, dout)
    tol = {} if scaled is None else {"scaled_atol": scaled, "rtol": 0.0}
    close(out, want, q.dtype, **tol)
    for got, expected in zip(got_grads, want_grads, strict=True):
        close(got, expected, q.dtype, **tol)
    return out


def assert_repeatable(q, k, v, bias, starts, ends, softcap, times):
    """Under deterministic algorithms, ``times`` calls give the same output and gradients bit for bit."""
    runs = []
    with torch.autograd.set_grad_enabled(True):
        torch.use_deterministic_algorithms(True)
        try:
            for _ in range(times):
                out = _band.run(q, k, v, starts, ends, bias, 0.25, softcap)
                runs.append((out, *torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))))
        finally:
            torch.use_deterministic_algorithms(False)
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def test_the_formula_here_is_the_oracle():
    q, k, v, bias = inputs(2, 4, 2, 23, 31, 8, 8, 4, torch.float64, 0)
    starts, ends = random_intervals(2, 23, 31, 3, torch.Generator().manual_seed(0))
    allowed = dense(starts, ends, 31)
    dense_bias = bias[:, torch.arange(31).view(1, -1) - torch.arange(23).view(-1, 1) + 22]
    want = oracle.attention(q, k, v, allowed=allowed, bias=dense_bias, scale=0.4)[0]
    close(formula(q, k, v, allowed, bias, 0.4, 0.0), want)
    capped = oracle.attention(q, k, v, allowed=allowed, bias=dense_bias, scale=0.4,
                              score_mod=lambda s, *_: 1.5 * torch.tanh(s / 1.5))[0]
    close(formula(q, k, v, allowed, bias, 0.4, 1.5), capped)


# ---- against the formula -----------------------------------------------------------------------------------

@settings(deadline=None, max_examples=60)
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]), lq=st.integers(1, 90),
       lk=st.integers(1, 90), d=st.sampled_from([4, 16]), dv=st.sampled_from([3, 16]), k=st.sampled_from([1, 2, 5]),
       sets=st.sampled_from(["shared", "per batch", "per head"]),
       bias_heads=st.sampled_from(["none", "shared", "per_head"]),
       softcap=st.sampled_from([0.0, 0.7, 4.0]), seed=st.integers(0, 2**16))
def test_random_intervals_match_the_formula(b, hkv, group, lq, lk, d, dv, k, sets, bias_heads, softcap, seed):
    h = hkv * group
    heads = {"none": 0, "shared": 1, "per_head": h}[bias_heads]
    q, k_, v, bias = inputs(b, h, hkv, lq, lk, d, dv, heads, torch.float64, seed)
    p = {"shared": 1, "per batch": b, "per head": b * h}[sets]
    starts, ends = random_intervals(p, lq, lk, k, torch.Generator().manual_seed(seed))
    check(q, k_, v, bias, starts, ends, 0.5, softcap)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("pattern", ["longformer", "dilated", "random_k5"])
def test_patterns_in_float32_and_float64(pattern, softcap):
    """Sizes past one block of rows and keys (the kernel's 64-row blocks, 1024-key chunks)."""
    n = 200
    if pattern == "longformer":
        starts, ends = longformer_intervals(n, 20, 5)
    elif pattern == "dilated":  # every 3rd key within +-30, plus rows 0 and 150 that see everything
        i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
        grid = ((i - j).abs() <= 30) & ((i - j) % 3 == 0)
        grid[[0, 150]] = True
        starts, ends = _band._intervals(grid[None])
    else:
        starts, ends = random_intervals(2, n, n, 5, torch.Generator().manual_seed(3))
    for dtype in (torch.float64, torch.float32):
        q, k, v, bias = inputs(2, 4, 2, n, n, 16, 16, 4, dtype, 0)
        check(q, k, v, bias, starts, ends, 0.25, softcap, scaled=None if dtype == torch.float64 else 2e-6)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("sets", ["shared", "per head"])
def test_rows_that_see_every_key_beside_a_window(sets, softcap):
    """Global tokens spread over the sequence: their rows see every key, far more than the rest of
    their 64-row block, and their keys are seen by every row, far more than the rest of their
    64-key block. Both are computed apart, gathered: in the forward the rows in groups and the lone
    keys in one chunk per block, in the backward the keys in groups (79 global keys, more than a
    group of 64 holds) and each key block's lone rows. Outputs and gradients against the formula,
    in both modes."""
    n, b, h = 900, 2, 4
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    grid = (i - j).abs() <= 20
    for g in (3, 150, 151, 420, *range(600, 900, 4)):  # two side by side; every fourth of the last 300
        grid[g, :], grid[:, g] = True, True
    grids = grid[None] if sets == "shared" else torch.stack([grid.roll(7 * x, 0) for x in range(b * h)])
    starts, ends = _band._intervals(grids)
    allowed = dense(starts, ends, n)  # up to 80 intervals a row, each compared with every cell: made once
    for dtype in (torch.float64, torch.float32):
        q, k, v, bias = inputs(b, h, 2, n, n, 16, 16, h, dtype, 0)
        check(q, k, v, bias, starts, ends, 0.25, softcap, scaled=None if dtype == torch.float64 else 2e-6,
              allowed=allowed)
    torch.use_deterministic_algorithms(True)
    try:
        check(*inputs(b, h, 2, n, n, 16, 16, h, torch.float64, 2), starts, ends, 0.25, softcap, allowed=allowed)
    finally:
        torch.use_deterministic_algorithms(False)
    # the gathered groups too: bitwise repeatable, forward and backward
    assert_repeatable(*inputs(b, h, 2, n, n, 16, 16, h, torch.float32, 1), starts, ends, softcap, times=2)


def test_one_interval_per_row_is_the_window():
    """K = 1 through run() equals the request path's window."""
    q, k, v, _ = inputs(1, 2, 2, 100, 100, 8, 8, 0, torch.float64, 0)
    pos = torch.arange(100)
    starts, ends = (pos - 7).clamp(0).view(1, -1, 1), (pos + 4).clamp(max=100).view(1, -1, 1)
    out = check(q, k, v, None, starts, ends, 8 ** -0.5, 0.0)
    want = oracle.attention(q, k, v, allowed=oracle.allowed_grid(1, 2, 100, 100, window=(7, 3)))[0]
    close(out, want)


def test_soft_capping_bounds_large_scores():
    """Scores of 1e3..1e17 capped at 3: finite, and the same as the formula."""
    q, k, v, bias = inputs(1, 2, 1, 40, 40, 8, 8, 2, torch.float64, 0)
    with torch.no_grad():
        q.mul_(1e8)
        k.mul_(1e8)
    starts, ends = random_intervals(1, 40, 40, 2, torch.Generator().manual_seed(0))
    out = check(q, k, v, bias, starts, ends, 1.0, 3.0)
    assert out.isfinite().all()


def test_a_nan_score_makes_its_row_nan_with_soft_capping():
    q, k, v, _ = inputs(1, 1, 1, 6, 6, 4, 4, 0, torch.float64, 0)
    with torch.no_grad():
        q[0, 0, 2, 0] = float("nan")
    starts, ends = torch.zeros(1, 6, 1, dtype=torch.long), torch.full((1, 6, 1), 6, dtype=torch.long)
    out = _band.run(q, k, v, starts, ends, None, 0.5, 2.0)
    assert out[0, 0, 2].isnan().all() and out[0, 0, [0, 1, 3, 4, 5]].isfinite().all()


def test_a_constant_bias_skips_its_gradient_and_changes_nothing_else():
    # A table that needs no gradient (ALiBi's fixed slopes) is not summed along its diagonals in the
    # backward; the other gradients are the same numbers either way.
    q, k, v, bias = inputs(2, 4, 2, 90, 110, 16, 8, 4, torch.float64, 3)
    starts, ends = random_intervals(2, 90, 110, 3, torch.Generator().manual_seed(1))
    torch.use_deterministic_algorithms(True)  # dQ in one order, so the two runs can be compared bit for bit
    try:
        learned = _band.run(q, k, v, starts, ends, bias, 0.25, 0.0)
        with_table = torch.autograd.grad(learned, (q, k, v, bias), torch.ones_like(learned))
        constant = _band.run(q, k, v, starts, ends, bias.detach(), 0.25, 0.0)
        without = torch.autograd.grad(constant, (q, k, v), torch.ones_like(constant))
    finally:
        torch.use_deterministic_algorithms(False)
    for got, want in zip(without, with_table[:3], strict=True):
        assert torch.equal(got, want)
    check(q, k, v, bias, starts, ends, 0.25, 0.0)  # and the learned table's own gradient is the formula's
    out, stats = torch.ops.attnkit.band_forward(q, k, v, starts, ends, bias.detach(), 0.25, 0.0)
    dbias = torch.ops.attnkit.band_backward(torch.ones_like(out), q.detach(), k.detach(), v.detach(), out, stats,
                                            starts, ends, bias.detach(), 0.25, 0.0, False, False)[3]
    assert dbias.shape == bias.shape and not dbias.any()


# ---- determinism, gradcheck, arguments ------------------------------------------------------------------------

@pytest.mark.parametrize("softcap", [0.0, 1.0])
def test_deterministic_mode_is_bitwise_repeatable(softcap):
    q, k, v, bias = inputs(2, 4, 2, 300, 300, 16, 16, 4, torch.float32, 0)
    starts, ends = random_intervals(2, 300, 300, 5, torch.Generator().manual_seed(0))
    assert_repeatable(q, k, v, bias, starts, ends, softcap, times=3)
    check(q, k, v, bias, starts, ends, 0.25, softcap, scaled=2e-6)  # and the other mode agrees with the formula


def test_deterministic_mode_with_intervals_per_head_agrees_with_the_formula():
    q, k, v, bias = inputs(2, 4, 2, 150, 150, 16, 16, 4, torch.float64, 3)
    starts, ends = random_intervals(8, 150, 150, 3, torch.Generator().manual_seed(3))  # batch 2 x 4 heads
    torch.use_deterministic_algorithms(True)
    try:
        check(q, k, v, bias, starts, ends, 0.25, 0.0)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("softcap", [0.0, 1.3])
def test_gradcheck(softcap):
    q, k, v, bias = inputs(1, 2, 1, 9, 11, 4, 3, 2, torch.float64, 0)
    starts, ends = random_intervals(1, 9, 11, 2, torch.Generator().manual_seed(5))
    assert torch.autograd.gradcheck(lambda a, b, c, t: _band.run(a, b, c, starts, ends, t, 0.7, softcap),
                                    (q, k, v, bias))


def test_empty_inputs():
    q, k, v, _ = inputs(1, 2, 2, 0, 5, 4, 4, 0, torch.float64, 0)
    starts = ends = torch.zeros(1, 0, 1, dtype=torch.long)
    assert _band.run(q, k, v, starts, ends, None, 1.0, 1.0).shape == (1, 2, 0, 4)


@pytest.mark.parametrize("softcap, error, words", [
    (-1.0, ValueError, "softcap must be a finite float >= 0"),
    (float("inf"), ValueError, "softcap must be a finite float >= 0"),
    ("2", TypeError, "softcap must be a float"),
])
def test_bad_softcap(softcap, error, words):
    q, k, v, _ = inputs(1, 1, 1, 4, 4, 4, 4, 0, torch.float64, 0)
    starts, ends = torch.zeros(1, 4, 1, dtype=torch.long), torch.full((1, 4, 1), 4, dtype=torch.long)
    with pytest.raises(error, match=words):
        _band.run(q, k, v, starts, ends, None, 1.0, softcap)


@pytest.mark.parametrize("starts, ends, words", [
    (torch.zeros(1, 4, 1, dtype=torch.int32), torch.ones(1, 4, 1, dtype=torch.int32), "starts must be an int64"),
    (torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), "starts must be an int64"),
    (torch.zeros(1, 5, 1, dtype=torch.long), torch.ones(1, 5, 1, dtype=torch.long), r"\[P, L, K\], P 1, B or B\*H"),
    (torch.zeros(3, 4, 1, dtype=torch.long), torch.ones(3, 4, 1, dtype=torch.long), r"\[P, L, K\], P 1, B or B\*H"),
    (torch.zeros(1, 4, 1, dtype=torch.long), torch.full((1, 4, 1), 5, dtype=torch.long), "end <= S"),
    (torch.full((1, 4, 1), 3, dtype=torch.long), torch.full((1, 4, 1), 2, dtype=torch.long), "start <= end"),
    (torch.full((1, 4, 1), -1, dtype=torch.long), torch.full((1, 4, 1), 2, dtype=torch.long), "0 <= start"),
])
def test_bad_intervals_are_refused(starts, ends, words):
    q, k, v, _ = inputs(1, 1, 1, 4, 4, 4, 4, 0, torch.float64, 0)
    with pytest.raises((ValueError, RuntimeError), match=words):
        _band.run(q, k, v, starts, ends, None, 1.0)


def test_intervals_out_of_order_do_not_crash():
    """Sortedness and disjointness are the caller's (the plan's) to guarantee; the kernel checks only
    bounds, and intervals out of order or overlapping must not make it read or write out of bounds."""
    q, k, v, _ = inputs(1, 2, 1, 70, 90, 8, 8, 0, torch.float64, 0)
    starts = torch.tensor([[[50, 0, 10], [0, 5, 90]] * 35])
    ends = torch.tensor([[[90, 20, 60], [40, 30, 90]] * 35])
    for det in (False, True):
        torch.use_deterministic_algorithms(det)
        try:
            out = _band.run(q, k, v, starts, ends, None, 0.5, 1.0)
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        finally:
            torch.use_deterministic_algorithms(False)
    assert out.shape == (1, 2, 70, 8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_nan_key_in_a_dilated_rows_gap_stays_out_of_it(dtype):
    """Rows with many short intervals are computed over their whole span, the gaps masked: a NaN key
    in a gap must not reach the row; rows that see it are NaN, as everywhere."""
    n = 41  # odd: not folded into two plain bands (see the folding test below), so the gaps are computed
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    grid = ((i - j).abs() <= 12) & ((i - j) % 2 == 0)  # up to 7 one-key intervals per row
    starts, ends = _band._intervals(grid[None])
    q, k, v, _ = inputs(1, 2, 2, n, n, 8, 8, 0, dtype, 5)
    k = k.detach().clone()
    k[0, :, 7] = float("nan")  # odd key: in the gaps of every even row
    out = _band.run(q.detach(), k, v.detach(), starts, ends, None, 0.3, 0.0)
    sees = grid[:, 7]
    assert torch.isnan(out[0, :, sees]).all() and torch.isfinite(out[0, :, ~sees]).all()
    want = formula(q.detach().double(), k.double(), v.detach().double(), grid[None, None], None, 0.3, 0.0)
    close(out[0, :, ~sees], want[0, :, ~sees], dtype)


# ---- every d-th key: folded into the batch --------------------------------------------------------------------

def dilated_grids(n: int, d: int, causal: bool, sets: int) -> torch.Tensor:
    """``[sets, n, n]``: every d-th key within a window (of 3 + set keys each way) in the row's own
    class of positions mod d, causal or not; the last set's last 5 rows see nothing."""
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    grids = torch.stack([((i - j).abs() <= (3 + x) * d) & ((i - j) % d == 0) & ((i >= j) | (not causal))
                         for x in range(sets)])
    grids[-1, -5:] = False
    return grids


class Folds:
    """Counts the calls of ``_band._fold`` (one per q, k and v of a folded call)."""

    def __init__(self, monkeypatch):
        self.calls, real = 0, _band._fold

        def counted(x, d):
            self.calls += 1
            return real(x, d)

        monkeypatch.setattr(_band, "_fold", counted)


@pytest.mark.parametrize("sets", ["shared", "per batch", "per head"])
@pytest.mark.parametrize("d, causal", [(2, False), (3, True), (4, False)])
def test_every_dth_key_in_its_own_class_is_folded_into_the_batch(monkeypatch, d, causal, sets):
    """Rows that see single keys d apart, each in its own class of positions mod d (a dilated
    window), run as d plain bands, each class folded into the batch: outputs and every gradient
    against the formula (GQA, several blocks of rows, rows with nothing to attend, intervals shared,
    per batch element or per head, with and without a bias per diagonal), and the fold is taken."""
    b, h, n = 2, 4, 45 * d
    folds = Folds(monkeypatch)
    p = {"shared": 1, "per batch": b, "per head": b * h}[sets]
    starts, ends = _band._intervals(dilated_grids(n, d, causal, p))
    for dtype in (torch.float64, torch.float32):
        for softcap in (0.0, 1.5):
            folds.calls = 0
            for bias_heads in (0, h):  # a bias per head and diagonal: each class reads every d-th diagonal
                q, k, v, bias = inputs(b, h, 2, n, n, 16, 8, bias_heads, dtype, d)
                check(q, k, v, bias, starts, ends, 0.25, softcap, scaled=None if dtype == torch.float64 else 2e-6)
            assert folds.calls == 6
    # Lq < Lk (the last rows, as under a cache): query i sits at i + 3d, in the same class as i
    q, k, v, bias = inputs(b, h, 2, n - 3 * d, n, 16, 8, h, torch.float64, d)
    check(q, k, v, bias, *_band._intervals(dilated_grids(n, d, causal, p)[:, 3 * d:]), 0.25, 0.0)
    assert folds.calls == 9


def test_what_is_not_every_dth_key_in_its_class_is_not_folded(monkeypatch):
    """A length d does not divide, a row with a run of keys, keys of another class: computed as they
    are, as the formula says."""
    folds = Folds(monkeypatch)
    n = 90
    grid = dilated_grids(n, 2, False, 1)
    odd = dilated_grids(n - 1, 2, False, 1)
    run = grid.clone()
    run[0, 40, 30:50] = True
    other = grid.clone()
    other[0, 41] = grid[0, 40]  # row 41 sees even keys
    q, k, v, bias = inputs(1, 2, 2, n, n, 8, 8, 2, torch.float64, 0)
    cases = [(odd, q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], bias[:, 2:]), (run, q, k, v, bias), (other, q, k, v, None)]
    for allowed, q_, k_, v_, bias_ in cases:
        check(q_, k_, v_, bias_, *_band._intervals(allowed), 0.3, 0.0)
    assert folds.calls == 0


def test_a_plan_written_after_it_was_folded_is_seen_again(monkeypatch):
    """What the fold found is kept per intervals tensor for the next call; a write to the tensor
    (its version) makes it look again."""
    folds = Folds(monkeypatch)
    n = 60
    starts, ends = _band._intervals(dilated_grids(n, 3, False, 1))
    q, k, v, _ = inputs(1, 2, 1, n, n, 8, 8, 0, torch.float64, 1)
    check(q, k, v, None, starts, ends, 0.3, 0.0)
    check(q, k, v, None, starts, ends, 0.3, 0.0)
    assert folds.calls == 6
    grid = dilated_grids(n, 3, False, 1)
    grid[0, 30, 21:40] = True  # a run of keys where every 3rd was: no longer foldable, as many intervals
    new_starts, new_ends = _band._intervals(grid)
    assert new_starts.shape == starts.shape
    starts.copy_(new_starts)
    ends.copy_(new_ends)
    check(q, k, v, None, starts, ends, 0.3, 0.0)
    assert folds.calls == 6


def test_gradcheck_through_the_fold():
    q, k, v, bias = inputs(2, 2, 1, 12, 12, 4, 3, 2, torch.float64, 0)
    starts, ends = _band._intervals(dilated_grids(12, 2, True, 2))
    assert _band._dilated(starts, ends, 2, 2, 12, 12)[0] == 2
    assert torch.autograd.gradcheck(lambda a, b, c, t: _band.run(a, b, c, starts, ends, t, 0.7, 0.0), (q, k, v, bias))


def test_intervals_made_in_inference_mode_are_folded_too(monkeypatch):
    """Inference tensors have no version counter: what the fold finds for them is worked out per call."""
    folds = Folds(monkeypatch)
    q, k, v, _ = inputs(1, 2, 1, 30, 30, 8, 8, 0, torch.float64, 2)
    starts, ends = _band._intervals(dilated_grids(30, 3, False, 1))
    want = _band.run(q, k, v, starts, ends, None, 0.3, 0.0)
    with torch.inference_mode():
        frozen = starts.clone(), ends.clone()
        for _ in range(2):
            assert torch.equal(_band.run(q, k, v, *frozen, None, 0.3, 0.0), want)
    assert folds.calls == 9
