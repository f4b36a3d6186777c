"""Mask builders against first-principles loops, their docstring pictures, and the converters."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from tests.support import oracle


def picture(fn) -> torch.Tensor:
    """Parse the ASCII picture in a builder's docstring ('x' = may attend, '.' = masked)."""
    rows = [line.split()[1:] for line in inspect.getdoc(fn).splitlines()
            if re.match(r"\s*(q\d+|b\d+)\s+[x.](\s+[x.])*\s*$", line)]
    assert rows, f"no picture in {fn.__name__}'s docstring"
    return torch.tensor([[c == "x" for c in r] for r in rows])


def test_docstring_pictures_are_what_the_builders_build():
    assert torch.equal(picture(masks.causal), masks.causal(3, 5))
    assert torch.equal(picture(masks.sliding_window), masks.sliding_window(5, left=1, right=1))
    assert torch.equal(picture(masks.prefix_lm), masks.prefix_lm(4, 2))
    assert torch.equal(picture(masks.padding), masks.padding([3, 1], 4)[:, 0, 0])
    assert torch.equal(picture(masks.document), masks.document(torch.tensor([0, 0, 1, 1, 1])))


@pytest.mark.parametrize("lq,lk", [(1, 1), (4, 4), (3, 7), (7, 3), (5, 9)])
def test_causal_and_window_match_loops(lq, lk):
    assert torch.equal(masks.causal(lq, lk), oracle.allowed_grid(1, 1, lq, lk, is_causal=True)[0, 0])
    for left, right in [(0, 0), (1, 0), (2, 3), (None, 1), (4, None), (100, 100)]:
        expected = oracle.allowed_grid(1, 1, lq, lk, window=(left, right))[0, 0]
        assert torch.equal(masks.sliding_window(lq, lk, left=left, right=right), expected), (left, right)


def test_causal_top_left_offset_matches_pytorch_convention():
    assert torch.equal(masks.causal(3, 5, offset=0), torch.ones(3, 5, dtype=torch.bool).tril())


def test_window_none_zero_is_causal():
    assert torch.equal(masks.sliding_window(6, left=None, right=0), masks.causal(6))


def test_block_diagonal_and_document():
    m = masks.block_diagonal([2, 3, 1])
    assert m.shape == (6, 6)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[:2, :2] = expected[2:5, 2:5] = expected[5:, 5:] = True
    assert torch.equal(m, expected)
    ids = torch.tensor([[0, 0, 1], [0, 1, 1]])
    assert masks.document(ids).shape == (2, 1, 3, 3)
    assert torch.equal(masks.document(ids)[1, 0], masks.block_diagonal([1, 2]))


def test_predicates_and_combinators_equal_dense_builders():
    both = masks.and_masks(masks.causal_mod(0), masks.padding_mod(torch.tensor([4, 2])))
    grid = masks.materialize(both, 2, 1, 5, 5)
    assert torch.equal(grid, masks.causal(5) & masks.padding([4, 2], 5))
    either = masks.or_masks(masks.causal_mod(0), masks.window_mod(0, 1))
    assert torch.equal(masks.materialize(either, 1, 1, 4, 4)[0, 0],
                       masks.causal(4) | masks.sliding_window(4, left=0, right=1))
    pre = masks.materialize(masks.prefix_lm_mod(torch.tensor([1, 3])), 2, 1, 4, 4)
    assert torch.equal(pre[1, 0], masks.prefix_lm(4, 3)) and torch.equal(pre[0, 0], masks.prefix_lm(4, 1))
    doc = masks.materialize(masks.document_mod(torch.tensor([0, 1, 1])), 1, 1, 3, 3)[0, 0]
    assert torch.equal(doc, masks.document(torch.tensor([0, 1, 1])))


def test_converters_flip_other_libraries_conventions():
    kpm = torch.tensor([[False, False, True], [False, True, True]])  # PyTorch: True = ignore
    assert torch.equal(masks.from_key_padding_mask(kpm)[:, 0, 0], ~kpm)
    additive = torch.tensor([[0.0, float("-inf"), 0.0]])
    assert masks.from_key_padding_mask(additive)[0, 0, 0].tolist() == [True, False, True]
    hf = torch.tensor([[1, 1, 0]])  # HF: 1 = real token
    assert masks.from_hf_attention_mask(hf)[0, 0, 0].tolist() == [True, True, False]
    assert masks.padding([2], 3).tolist() == masks.from_hf_attention_mask(hf).tolist()


@pytest.mark.parametrize("call, exc, words", [
    (lambda: masks.causal(-1), ValueError, "q_len"),
    (lambda: masks.sliding_window(4, left=-2), ValueError, "window left"),
    (lambda: masks.padding([3, 5], 4), ValueError, "max_len"),
    (lambda: masks.padding([1.5]), ValueError, "lengths"),
    (lambda: masks.from_key_padding_mask(torch.zeros(3, dtype=torch.bool)), ValueError, "key_padding_mask"),
    (lambda: masks.from_key_padding_mask(torch.zeros(2, 3, dtype=torch.int64)), TypeError, "key_padding_mask"),
    (lambda: masks.materialize(lambda b, h, q, kv: q - kv, 1, 1, 2, 2), TypeError, "bool"),
    (lambda: masks.materialize(lambda b, h, q, kv: (q >= kv).mT, 1, 1, 2, 3), ValueError,
     r"mask_mod '.*<lambda>' returned shape \(1, 1, 3, 2\) for indices broadcasting to \(1, 1, 2, 3\)"),
    (lambda: masks.materialize(lambda b, h, q, kv: (q >= kv).sum(-1), 1, 1, 2, 3), TypeError,
     r"mask_mod '.*<lambda>' returned a torch.int64 tensor; expected a bool tensor"),
    (lambda: masks.and_masks(), ValueError, "at least one"),
])
def test_bad_input_is_named(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@given(lq=st.integers(1, 40), lk=st.integers(1, 40), offset=st.integers(-10, 10), cut=st.integers(0, 45),
       left=st.one_of(st.none(), st.integers(0, 12)), right=st.one_of(st.none(), st.integers(0, 12)))
def test_row_intervals_agree_with_their_predicates(lq, lk, offset, cut, left, right):
    """Each mask's plan (its rows as intervals, what the banded kernel reads) against the predicate
    itself, cell by cell."""
    docs_q, docs_k = torch.arange(lq) * 3 // max(lq, 1), torch.arange(lk) * 3 // max(lk, 1)
    mods = [masks.causal_mod(offset), masks.window_mod(left, right, offset=offset),
            masks.prefix_lm_mod(cut, offset=offset), masks.prefix_lm_mod(torch.tensor([cut, 3]), offset=offset),
            masks.padding_mod(torch.tensor([cut, lk])), masks.document_mod(docs_q, docs_k),
            masks.and_masks(masks.document_mod(docs_q, docs_k), masks.causal_mod(offset)),
            masks.document_mod(torch.arange(lq) % 3, torch.arange(lk) % 3),  # documents in pieces
            masks.or_masks(masks.causal_mod(offset), masks.window_mod(0, 1, offset=offset))]
    j = torch.arange(lk)
    for mod in mods:
        plan = attnkit.mask_plan(mod, q_len=lq, kv_len=lk, batch=2)
        from_rows = ((j >= plan.starts[..., None]) & (j < plan.ends[..., None])).any(-2)  # [1|B, Lq, Lk]
        dense = masks.materialize(mod, 2, 1, lq, lk)[:, 0]
        assert torch.equal(*torch.broadcast_tensors(from_rows, dense))


# --------------------------------------------------------------------------------------------
# Typed masks: intervals in the shared convention, and the interval algebra
# --------------------------------------------------------------------------------------------


def covered(starts: torch.Tensor, ends: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The bool grid ``[Bp, Lq, Lk]`` that intervals describe, cell by cell."""
    j = torch.arange(kv_len)
    return ((j >= starts[..., None]) & (j < ends[..., None])).any(-2)


def assert_shared_form(starts: torch.Tensor, ends: torch.Tensor, q_len: int, kv_len: int) -> None:
    """The convention every kernel reads: int64 ``[Bp, Lq, K]``, ``0 <= start <= end <= Lk``, non-empty
    intervals sorted and disjoint (not even touching: merged), empties ``(Lk, Lk)`` after them."""
    assert starts.dtype == ends.dtype == torch.int64 and starts.shape == ends.shape
    assert starts.dim() == 3 and starts.shape[1] == q_len and starts.shape[2] >= 1
    assert ((0 <= starts) & (starts <= ends) & (ends <= kv_len)).all()
    full = starts < ends
    assert ((starts == kv_len) & (ends == kv_len) | full).all()
    assert (full[..., :-1] | ~full[..., 1:]).all()  # no non-empty one after an empty one
    both = full[..., :-1] & full[..., 1:]
    assert (ends[..., :-1][both] < starts[..., 1:][both]).all()


def assert_exact(mod, batch: int, q_len: int, kv_len: int) -> None:
    starts, ends = mod.intervals(batch, q_len, kv_len)
    assert_shared_form(starts, ends, q_len, kv_len)
    assert starts.shape[0] in (1, batch)
    dense = masks.materialize(mod, batch, 1, q_len, kv_len)[:, 0]
    assert torch.equal(*torch.broadcast_tensors(covered(starts, ends, kv_len), dense))


def random_intervals(gen: torch.Generator, batch: int, q_len: int, kv_len: int, k: int):
    """Unsorted, overlapping, empty and out-of-range intervals: what normalize must clean up."""
    a = torch.randint(-3, kv_len + 4, (batch, q_len, k), generator=gen)
    b = torch.randint(-3, kv_len + 4, (batch, q_len, k), generator=gen)
    return a, b


@settings(deadline=None, max_examples=60)
@given(batch=st.sampled_from([1, 2]), lq=st.integers(0, 12), lk=st.integers(0, 15), k=st.integers(1, 5),
       k2=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_interval_algebra_against_dense_grids(batch, lq, lk, k, k2, seed):
    gen = torch.Generator().manual_seed(seed)
    s1, e1 = random_intervals(gen, batch, lq, lk, k)
    s2, e2 = random_intervals(gen, 1, lq, lk, k2)
    a, b = masks.normalize(s1, e1, lk), masks.normalize(s2, e2, lk)
    for (s, e), raw in ((a, (s1, e1)), (b, (s2, e2))):
        assert_shared_form(s, e, lq, lk)
        assert torch.equal(covered(s, e, lk), covered(raw[0].clamp(0, lk), raw[1].clamp(0, lk), lk))
        assert s.shape[-1] == max(1, int((s < e).sum(-1).max()) if s.numel() else 1)  # compacted
    both = masks.intersect_intervals(a, b, lk)
    either = masks.union_intervals(a, b, lk)
    for got in (both, either):
        assert_shared_form(*got, lq, lk)
        assert got[0].shape[0] == batch
    assert torch.equal(covered(*both, lk), covered(*a, lk) & covered(*b, lk))
    assert torch.equal(covered(*either, lk), covered(*a, lk) | covered(*b, lk))


def test_normalize_merges_touching_and_overlapping_intervals():
    starts = torch.tensor([[[5, 0, 3, 9, 7]]])
    ends = torch.tensor([[[7, 3, 4, 9, 8]]])  # [0,3) [3,4) touch, [5,7) [7,8) touch, [9,9) empty
    s, e = masks.normalize(starts, ends, 10)
    assert s.tolist() == [[[0, 5]]] and e.tolist() == [[[4, 8]]]


@settings(deadline=None, max_examples=60)
@given(lq=st.integers(0, 20), lk=st.integers(0, 20), offset=st.integers(-8, 8), cut=st.integers(0, 25),
       left=st.one_of(st.none(), st.integers(0, 6)), right=st.one_of(st.none(), st.integers(0, 6)),
       seed=st.integers(0, 2**16))
def test_typed_masks_give_their_intervals_exactly(lq, lk, offset, cut, left, right, seed):
    gen = torch.Generator().manual_seed(seed)
    docs_q, docs_k = torch.randint(0, 3, (lq,), generator=gen), torch.randint(0, 3, (lk,), generator=gen)
    causal_, window_ = masks.causal_mod(offset), masks.window_mod(left, right, offset=offset)
    prefix = masks.prefix_lm_mod(torch.tensor([cut, 2]), offset=offset)
    pad = masks.padding_mod(torch.tensor([cut, lk]))
    docs = masks.document_mod(docs_q, docs_k)  # documents in pieces: several runs per id
    batched = masks.document_mod(torch.randint(0, 2, (2, lq), generator=gen),
                                 torch.randint(0, 2, (2, lk), generator=gen))
    for mod in (causal_, window_, masks.prefix_lm_mod(cut, offset=offset), prefix, pad, docs, batched,
                masks.and_masks(docs, causal_), masks.and_masks(window_, pad, prefix),
                masks.or_masks(causal_, masks.window_mod(0, 1, offset=offset)), masks.or_masks(docs, pad),
                masks.or_masks(masks.and_masks(batched, window_), prefix)):
        assert isinstance(mod, masks.Mask)
        assert_exact(mod, 2, lq, lk)


def test_a_plain_function_in_a_combination_has_no_intervals():
    def mine(b, h, q_idx, kv_idx):
        return kv_idx != q_idx

    assert masks.and_masks(masks.causal_mod(), mine).intervals(1, 4, 4) is None
    assert masks.or_masks(mine, masks.causal_mod()).intervals(1, 4, 4) is None
    assert masks.Mask().intervals(1, 4, 4) is None
    both = masks.and_masks(masks.causal_mod(), mine)  # still a predicate, whatever its intervals
    assert torch.equal(masks.materialize(both, 1, 1, 4, 4)[0, 0], torch.ones(4, 4, dtype=torch.bool).tril(-1))
    assert repr(masks.window_mod(2, 0)) == "Window(left=2, right=0, offset=0)"
    assert masks.prefix_lm_mod(torch.tensor([3]), 0).intervals(2, 4, 4) is None  # one prefix, two batch elements
