"""attnkit._structure against per-cell Python loops: exact intervals, per-element semantics,
tile kinds, and score structure that is recognised only when it is really there."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import and_masks, or_masks

from attnkit._structure import EMPTY, FULL, PARTIAL, evaluator, mask_intervals, score_structure, tile_kinds

SETTINGS = settings(deadline=None, max_examples=30)


def cell(mod, b, h, q, kv, *score):
    t = [torch.tensor(x) for x in (b, h, q, kv)]
    return mod(*(torch.tensor(float(s), dtype=torch.float64) for s in score), *t)


def dense_mask(mod, batch, heads, lq, lk):
    return torch.tensor([[[[bool(cell(mod, b, h, q, k)) for k in range(lk)] for q in range(lq)]
                          for h in range(heads)] for b in range(batch)])


def from_intervals(starts, ends, lk):
    j = torch.arange(lk).view(1, 1, 1, -1)
    return ((starts.unsqueeze(-1) <= j) & (j < ends.unsqueeze(-1))).any(2)


def check_convention(starts, ends, lk):
    assert starts.dtype == ends.dtype == torch.int64
    assert bool(((0 <= starts) & (starts <= ends) & (ends <= lk)).all())
    empty = starts == ends
    assert bool((starts[empty] == lk).all())
    if starts.shape[-1] > 1:  # sorted, disjoint, empties last
        assert bool((ends[..., :-1] <= starts[..., 1:]).all())
        assert not bool((empty[..., :-1] & ~empty[..., 1:]).any())


def predicates(lq, lk, w, doc_len, stride):
    doc = torch.arange(max(lq, lk)) // doc_len
    return {
        "window": lambda b, h, q, kv: (q - kv).abs() <= w,
        "causal": lambda b, h, q, kv: kv <= q,
        "documents": lambda b, h, q, kv: doc[q] == doc[kv],
        "prefix_lm": lambda b, h, q, kv: (kv <= q) | (kv < w),
        "dilated": lambda b, h, q, kv: ((q - kv).abs() <= w * 2) & ((q - kv) % 2 == 0),
        "strided": lambda b, h, q, kv: (kv <= q) & (((q - kv) < stride) | ((q - kv) % stride == 0)),
        "global": lambda b, h, q, kv: (q < 2) | (kv < 2) | ((q - kv).abs() <= w),
        "and_or": and_masks(lambda b, h, q, kv: kv <= q,
                            or_masks(lambda b, h, q, kv: q - kv < w, lambda b, h, q, kv: kv == 0)),
    }


@SETTINGS
@given(lq=st.integers(1, 24), lk=st.integers(1, 24), w=st.integers(0, 6), doc_len=st.integers(1, 7),
       stride=st.integers(1, 5), batch=st.integers(1, 2))
def test_intervals_equal_predicate_cell_by_cell(lq, lk, w, doc_len, stride, batch):
    for name, mod in predicates(lq, lk, w, doc_len, stride).items():
        got = mask_intervals(mod, batch, 2, lq, lk, max_intervals=64, row_chunk=5)
        assert got is not None, name
        starts, ends = got
        check_convention(starts, ends, lk)
        assert starts.shape[:2] == (1, lq), name  # nothing here depends on b
        want = dense_mask(mod, 1, 1, lq, lk)[:, 0]
        assert torch.equal(from_intervals(starts, ends, lk), want), name


@SETTINGS
@given(lq=st.integers(1, 16), lk=st.integers(1, 16), shift=st.integers(0, 5))
def test_batch_dependent_and_head_dependent(lq, lk, shift):
    lens = torch.tensor([lk, max(1, lk - shift)])
    per_batch = lambda b, h, q, kv: kv < lens[b]  # noqa: E731
    starts, ends = mask_intervals(per_batch, 2, 3, lq, lk)
    want = dense_mask(per_batch, 2, 1, lq, lk)[:, 0]
    assert starts.shape[0] == (1 if shift == 0 or lk == 1 else 2)
    assert torch.equal(from_intervals(starts, ends, lk).expand_as(want), want)
    per_head = lambda b, h, q, kv: kv <= q + h  # noqa: E731
    depends = any(q + 1 < lk for q in range(lq))
    assert (mask_intervals(per_head, 1, 2, lq, lk) is None) == depends
    assert mask_intervals(lambda b, h, q, kv: (kv <= q) | (h < 0), 1, 4, lq, lk) is not None


def test_too_many_runs_and_one_cell_exception():
    every_other = lambda b, h, q, kv: kv % 2 == 0  # noqa: E731
    assert mask_intervals(every_other, 1, 1, 4, 40, max_intervals=19) is None
    assert mask_intervals(every_other, 1, 1, 4, 40, max_intervals=20)[0].shape[-1] == 20
    # banded except one cell far from the diagonal: the exact intervals carry it
    odd = lambda b, h, q, kv: ((q - kv).abs() <= 2) | ((q == 290) & (kv == 3))  # noqa: E731
    starts, ends = mask_intervals(odd, 1, 1, 300, 300)
    assert starts.shape[-1] == 2 and (int(starts[0, 290, 0]), int(ends[0, 290, 0])) == (3, 4)


def test_non_bool_mask_raises():
    with pytest.raises(ValueError, match="float"):
        mask_intervals(lambda b, h, q, kv: (kv <= q).float(), 1, 1, 4, 4)


@SETTINGS
@given(lq=st.integers(1, 30), lk=st.integers(1, 30), qt=st.integers(1, 8), kb=st.integers(1, 8),
       w=st.integers(0, 8), doc_len=st.integers(1, 9))
def test_tile_kinds_against_dense(lq, lk, qt, kb, w, doc_len):
    for mod in predicates(lq, lk, w, doc_len, 3).values():
        starts, ends = mask_intervals(mod, 1, 1, lq, lk)
        kinds = tile_kinds(starts, ends, lq, lk, qt, kb)
        dense = dense_mask(mod, 1, 1, lq, lk)[0, 0]
        for t in range(-(-lq // qt)):
            for c in range(-(-lk // kb)):
                part = dense[t * qt:(t + 1) * qt, c * kb:(c + 1) * kb]
                whole = part.shape[1] == kb
                want = FULL if bool(part.all()) and whole else EMPTY if not bool(part.any()) else PARTIAL
                assert int(kinds[t, c]) == want


def test_flamingo_and_mla_mods_equal_a_per_element_loop():
    g = torch.Generator().manual_seed(1)
    intervals = torch.tensor([[0, 4], [4, 9], [9, 12]])
    image_idx = torch.tensor([0, 0, 1, 1, 1, 2, 2])

    def flamingo(b, h, q_idx, kv_idx):
        interval = intervals[image_idx[q_idx]]
        return (kv_idx >= interval[0]) & (kv_idx < interval[1])

    bsz, heads, lq, lk = 2, 2, 7, 12
    query_rope = torch.randn(bsz, heads, lq, 4, generator=g, dtype=torch.float64)
    key_rope = torch.randn(bsz, heads, lk, 4, generator=g, dtype=torch.float64)

    def mla(score, b, h, q_idx, kv_idx):
        return score + torch.dot(query_rope[b, h, q_idx], key_rope[b, h, kv_idx])

    b, h = torch.arange(bsz).view(-1, 1, 1, 1), torch.arange(heads).view(1, -1, 1, 1)
    q, kv = torch.arange(lq).view(1, 1, -1, 1), torch.arange(lk).view(1, 1, 1, -1)
    got = evaluator(flamingo, "mask_mod")(b, h, q, kv)
    assert torch.equal(got.expand(bsz, heads, lq, lk), dense_mask(flamingo, bsz, heads, lq, lk))
    score = torch.randn(bsz, heads, lq, lk, generator=g, dtype=torch.float64)
    got = evaluator(mla, "score_mod")(score, b, h, q, kv)
    want = torch.tensor([[[[float(cell(mla, bi, hi, i, j, score[bi, hi, i, j])) for j in range(lk)]
                           for i in range(lq)] for hi in range(heads)] for bi in range(bsz)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    starts, ends = mask_intervals(flamingo, 1, 1, lq, lk)
    assert torch.equal(from_intervals(starts, ends, lk)[0], dense_mask(flamingo, 1, 1, lq, lk)[0, 0])


def test_evaluator_rejects_bad_kind():
    with pytest.raises(ValueError, match="kind"):
        evaluator(lambda *a: a[0], "score")


def dense_bias(mod, heads, lq, lk):
    return torch.tensor([[[float(cell(mod, 0, h, q, k, 0.0)) for k in range(lk)] for q in range(lq)]
                         for h in range(heads)], dtype=torch.float64)


def table_to_dense(table, heads, lq, lk):
    if table is None:  # no bias
        return torch.zeros(heads, lq, lk, dtype=torch.float64)
    d = torch.arange(lk).view(1, -1) - torch.arange(lq).view(-1, 1) + lq - 1
    return table.double()[:, d].expand(heads, lq, lk)


def t5_bucket(rel, num_buckets=8, max_distance=20):
    half = num_buckets // 2
    sign = (rel > 0).long() * half
    n = rel.abs()
    exact = half // 2
    large = exact + (torch.log(n.clamp(min=1).double() / exact) / math.log(max_distance / exact)
                     * (half - exact)).long()
    return sign + torch.where(n < exact, n, large.clamp(max=half - 1))


@SETTINGS
@given(lq=st.integers(1, 20), lk=st.integers(1, 20), heads=st.integers(1, 3), seed=st.integers(0, 99))
def test_hand_written_biases_give_the_right_table(lq, lk, heads, seed):
    g = torch.Generator().manual_seed(seed)
    slopes = torch.rand(heads, generator=g, dtype=torch.float64)
    rel_table = torch.randn(heads, 9, generator=g, dtype=torch.float64)
    t5_table = torch.randn(heads, 8, generator=g, dtype=torch.float64)
    mods = {
        "alibi": lambda s, b, h, q, kv: s + slopes[h] * (kv - q),
        "relative": lambda s, b, h, q, kv: s + rel_table[h, (kv - q).clamp(-4, 4) + 4],
        "t5": lambda s, b, h, q, kv: s + t5_table[h, t5_bucket(kv - q)],
    }
    for name, mod in mods.items():
        found = score_structure(mod, 2, heads, lq, lk, dtype=torch.float64)
        assert found is not None and found.softcap is None, name
        torch.testing.assert_close(table_to_dense(found.table, heads, lq, lk), dense_bias(mod, heads, lq, lk),
                                   rtol=1e-12, atol=1e-12)


@SETTINGS
@given(cap=st.floats(1.0, 60.0), lq=st.integers(1, 20), lk=st.integers(1, 20))
def test_softcap_recognised_with_its_cap(cap, lq, lk):
    found = score_structure(lambda s, b, h, q, kv: cap * torch.tanh(s / cap), 1, 2, lq, lk, dtype=torch.float32)
    assert found is not None and found.table is None
    assert found.softcap == pytest.approx(cap, rel=1e-12)
    capped = lambda s, b, h, q, kv: cap * torch.tanh((s + 0.1 * (kv - q)) / cap)  # noqa: E731
    found = score_structure(capped, 1, 1, lq, lk, dtype=torch.float64)
    assert found is not None and found.softcap == pytest.approx(cap, rel=1e-12)
    want = (0.1 * (torch.arange(lk).view(1, -1) - torch.arange(lq).view(-1, 1))).double()  # as the mod computes it
    got = table_to_dense(found.table, 1, lq, lk)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_what_is_not_diagonal_is_not_recognised():
    calls = [0]

    def counter(s, b, h, q, kv):
        calls[0] += 1
        return s + calls[0]

    extra = torch.randn(40, 40, dtype=torch.float64)
    odd_cell = lambda s, b, h, q, kv: s + torch.where((q == 37) & (kv == 2), 5.0, 0.0)  # noqa: E731
    mods = {
        "q_times_kv": lambda s, b, h, q, kv: s + 0.01 * q * kv,
        "counter": counter,
        "data_beyond_indices": lambda s, b, h, q, kv: s + extra[q, kv],
        "one_cell": odd_cell,
        "per_batch": lambda s, b, h, q, kv: s + b * (kv - q),
        "scaled": lambda s, b, h, q, kv: 2 * s,
        "random": lambda s, b, h, q, kv: s + torch.rand(()),
    }
    for name, mod in mods.items():
        assert score_structure(mod, 2, 2, 40, 40, dtype=torch.float32) is None, name


def test_table_is_differentiable_through_captured_parameters():
    slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25]))
    alibi = lambda s, b, h, q, kv: s + slopes[h] * (kv - q)  # noqa: E731
    found = score_structure(alibi, 1, 2, 5, 7, dtype=torch.float32)
    found.table.sum().backward()
    diag = (torch.arange(7).view(1, -1) - torch.arange(5).view(-1, 1)).unique().double()
    torch.testing.assert_close(slopes.grad.double(), diag.sum().expand(2))
