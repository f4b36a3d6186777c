"""score_mod helpers: values against their formulas, and as score_mods in every backend."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import scores
from tests.support import oracle
from tests.support.tolerances import close


def grid(h, lq, lk):
    return (torch.zeros(1, 1, 1, 1, dtype=torch.int64), torch.arange(h).view(1, -1, 1, 1),
            torch.arange(lq).view(1, 1, -1, 1), torch.arange(lk).view(1, 1, 1, -1))


def test_alibi_slopes_power_of_two_and_not():
    close(scores.alibi_slopes(8, dtype=torch.float64), torch.tensor([2.0 ** -(i + 1) for i in range(8)],
                                                                   dtype=torch.float64))
    # 6 heads: the 4 slopes of m = 4, then every other slope of 8 (Press et al. 2022, footnote code)
    want = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]
    close(scores.alibi_slopes(6, dtype=torch.float64), torch.tensor(want, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_heads must be a positive int, got 0"):
        scores.alibi_slopes(0)


def test_alibi_relative_bias_softcap_values():
    h, lq, lk, off = 3, 4, 6, 2
    s = torch.randn(1, h, lq, lk, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64)
    want = torch.empty_like(s)
    for hi in range(h):
        for i in range(lq):
            for j in range(lk):
                want[0, hi, i, j] = s[0, hi, i, j] - slopes[hi] * abs(i + off - j)
    close(scores.alibi(slopes, offset=off)(s, *grid(h, lq, lk)), want)

    table = torch.randn(h, 5, dtype=torch.float64)
    for hi in range(h):
        for i in range(lq):
            for j in range(lk):
                d = max(-2, min(2, j - (i + off)))
                want[0, hi, i, j] = s[0, hi, i, j] + table[hi, d + 2]
    close(scores.relative_position_bias(table, 2, offset=off)(s, *grid(h, lq, lk)), want)

    capped = scores.softcap(2.0)(s * 100, *grid(h, lq, lk))
    assert capped.abs().max() <= 2.0
    close(capped, 2.0 * torch.tanh(s * 50))
    with pytest.raises(ValueError, match="cap must be > 0"):
        scores.softcap(0.0)
    with pytest.raises(ValueError, match=r"table must be \[H, 2 \* max_distance \+ 1\]"):
        scores.relative_position_bias(table, 3)


def test_bias_builders_name_a_bad_argument():
    """A head count where slopes belong, an integer table, a float distance: a TypeError or
    ValueError naming the argument when the bias is built, not an AttributeError at the first call."""
    cases = [
        (lambda: scores.alibi(8), TypeError, r"alibi: slopes must be a floating-point tensor .*alibi_slopes.*got int"),
        (lambda: scores.alibi(torch.arange(8)), TypeError, r"slopes must be a floating-point tensor .*got torch.int64"),
        (lambda: scores.alibi(torch.ones(2, 4)), ValueError, r"slopes must have 1 dimension .*got shape \(2, 4\)"),
        (lambda: scores.alibi(torch.ones(4), offset=1.5), TypeError, "offset must be an int, got float"),
        (lambda: scores.relative_position_bias(torch.ones(2, 5), 2.0), TypeError, "max_distance must be an int"),
        (lambda: scores.relative_position_bias(torch.ones(2, 5), -1), ValueError, "max_distance must be >= 0, got -1"),
        (lambda: scores.relative_position_bias([[0.0] * 5], 2), TypeError, "table must be a floating-point tensor"),
        (lambda: scores.relative_position_bias(torch.ones(5), 2), ValueError, "table must have 2 dimensions"),
    ]
    for build, kind, message in cases:
        with pytest.raises(kind, match=message):
            build()


def test_compose_applies_left_to_right():
    s = torch.randn(1, 2, 3, 3, dtype=torch.float64)
    mod = scores.compose(scores.softcap(1.0), scores.alibi(torch.tensor([1.0, 2.0], dtype=torch.float64)))
    g = grid(2, 3, 3)
    close(mod(s, *g), scores.alibi(torch.tensor([1.0, 2.0], dtype=torch.float64))(torch.tanh(s), *g))


@pytest.mark.parametrize("backend", ["blockwise", "reference"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_alibi_as_score_mod_equals_a_dense_bias(backend, is_causal):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, n, 8, generator=g, dtype=torch.float64) for n in (5, 9, 9))
    slopes = scores.alibi_slopes(4, dtype=torch.float64)
    off = 4
    pos_q, pos_k = torch.arange(5).view(-1, 1) + off, torch.arange(9).view(1, -1)
    bias = -slopes.view(-1, 1, 1) * (pos_q - pos_k).abs()
    allowed = oracle.allowed_grid(1, 4, 5, 9, is_causal=is_causal)
    out = attnkit.attention(q, k, v, score_mod=scores.alibi(slopes, offset=off), is_causal=is_causal,
                            backend=backend)
    close(out, oracle.attention(q, k, v, allowed=allowed, bias=bias)[0])


def test_softcap_gradient_matches_closed_form():
    s = torch.randn(1, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(scores.softcap(1.5)(s, *grid(1, 3, 3)).sum(), s)
    close(g, 1 - torch.tanh(s.detach() / 1.5) ** 2)
    assert math.isclose(float(scores.softcap(1.5)(torch.tensor(1e6), 0, 0, 0, 0)), 1.5)


@given(lq=st.integers(1, 30), lk=st.integers(1, 30), offset=st.integers(-8, 8), dist=st.integers(0, 6))
def test_diagonal_biases_agree_with_their_score_mods(lq, lk, offset, dist):
    """``diagonal`` (what the banded kernel adds) against the score_mod itself, cell by cell."""
    heads = 3
    slopes, table = scores.alibi_slopes(heads), torch.randn(heads, 2 * dist + 1)
    mods = [scores.alibi(slopes, offset=offset), scores.relative_position_bias(table, dist, offset=offset),
            scores.compose(scores.alibi(slopes), scores.relative_position_bias(table, dist))]
    h, i, j = torch.arange(heads).view(-1, 1, 1), torch.arange(lq).view(1, -1, 1), torch.arange(lk).view(1, 1, -1)
    for mod in mods:
        want = mod(torch.zeros(heads, lq, lk), 0, h, i, j)
        assert isinstance(mod, scores.DiagonalBias)
        diag = mod.diagonal(heads, lq, lk)
        close(diag[:, j[0] - i[0] + lq - 1], want)



@pytest.mark.parametrize("own, score", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_captured_tensors_are_used_in_the_score_dtype(own, score):
    slopes = scores.alibi_slopes(4, dtype=own)
    table = torch.randn(4, 7, generator=torch.Generator().manual_seed(0), dtype=own)
    mod = scores.compose(scores.alibi(slopes), scores.relative_position_bias(table, 3))
    s = torch.zeros(1, 4, 5, 6, dtype=score)
    out = mod(s, *grid(4, 5, 6))
    assert out.dtype == score
    want = -slopes.to(score).view(1, 4, 1, 1) * (torch.arange(5).view(-1, 1) - torch.arange(6)).abs()
    d = (torch.arange(6) - torch.arange(5).view(-1, 1)).clamp(-3, 3) + 3
    close(out, want + table.to(score)[:, d])  # each part in the score's dtype, then added there
    diag = mod.diagonal(4, 5, 6, dtype=score)
    assert diag.dtype == score
    cols = torch.arange(6) - torch.arange(5).view(-1, 1) + 4  # column kv - q + Lq - 1
    close(diag[:, cols], out[0])
    assert scores.apply(lambda x, *_: x.double() * 2, s, *grid(4, 5, 6)).dtype == score  # any mod's result


def test_bias_then_cap_is_recognised_and_anything_else_is_not():
    slopes, table = scores.alibi_slopes(2, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    a, r, cap = scores.alibi(slopes), scores.relative_position_bias(table, 2), scores.softcap(3.0)

    def by_hand(score, b, h, q_idx, kv_idx):  # a diagonal bias the library did not build
        return score + 0.5 * (kv_idx - q_idx)

    both = scores.compose(a, r)
    assert isinstance(both, scores.DiagonalBias) and both.parts() == (both, None)
    assert isinstance(scores.compose(both, a), scores.DiagonalBias)  # terms flatten
    capped = scores.compose(a, r, cap)
    bias, c = scores.parts(capped)
    assert c == 3.0 and isinstance(bias, scores.DiagonalBias)
    s, g = torch.randn(1, 2, 4, 6, dtype=torch.float64) * 5, grid(2, 4, 6)
    close(capped(s, *g), 3.0 * torch.tanh(both(s, *g) / 3.0))
    close(bias(s, *g), both(s, *g))
    assert scores.parts(cap) == (None, 3.0) and cap.cap == 3.0
    assert scores.parts(None) == (None, None)
    for other in (by_hand, scores.compose(cap, a), scores.compose(a, cap, cap), scores.compose(a, by_hand)):
        assert scores.parts(other) is None
    sizes = dict(batch=1, heads=2, q_len=4, kv_len=6, dtype=torch.float64)
    assert scores.diagonal_bias(capped, **sizes) is None and scores.diagonal_bias(cap, **sizes) is None
    mixed = scores.diagonal_bias(scores.compose(a, by_hand), **sizes)  # probed: still a diagonal bias
    cols = torch.arange(6) - torch.arange(4).view(-1, 1) + 3
    close(mixed[:, cols], scores.compose(a, by_hand)(torch.zeros(1, 2, 4, 6, dtype=torch.float64), *g)[0])
    with pytest.raises(ValueError, match="cap must be > 0, got True"):
        scores.softcap(True)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_bias_then_cap_through_attention_matches_the_float64_oracle(backend):
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mod = scores.compose(scores.alibi(scores.alibi_slopes(4, dtype=torch.float64)), scores.softcap(0.7))
    want, _ = oracle.attention(q, k, v, score_mod=mod)
    close(attnkit.attention(q, k, v, score_mod=mod, backend=backend), want)
