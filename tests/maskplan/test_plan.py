"""The mask plan (attnkit.maskplan): intervals and tile kinds equal the mask cell by cell, a plan is
built once and reused, and plans that do not fit a call are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import maskplan, masks
from attnkit.maskplan import plan_cache
from attnkit.maskplan.tile_kinds import EMPTY, FULL, PARTIAL
from tests.support import oracle
from tests.support.tolerances import close


def dense_of(p: maskplan.MaskPlan) -> torch.Tensor:
    """``[P, Lq, Lk]`` bool from the plan's intervals."""
    j = torch.arange(p.kv_len)
    return ((j >= p.starts[..., None]) & (j < p.ends[..., None])).any(-2)


def families(q_len: int, kv_len: int, batch: int, a: int, c: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    docs = torch.sort(torch.randint(0, 4, (kv_len,), generator=g)).values
    scattered = torch.randint(0, 3, (kv_len,), generator=g)
    lengths = torch.randint(0, kv_len + 1, (batch,), generator=g)
    pattern = torch.rand(q_len, kv_len, generator=g) > 0.5
    off = kv_len - q_len
    return {
        "window": lambda b, h, i, j: (i + off - j).abs() <= a,
        "strided": lambda b, h, i, j: ((i + off - j) % (c + 1) == 0) & (j <= i + off),
        "documents": lambda b, h, i, j: docs[(i + off).clamp(0, kv_len - 1)] == docs[j],
        "scattered documents": lambda b, h, i, j: scattered[(i + off).clamp(0, kv_len - 1)] == scattered[j],
        "padding per batch": lambda b, h, i, j: j < lengths[b],
        "random cells": lambda b, h, i, j: pattern[i, j],
        "global tokens": lambda b, h, i, j: ((i + off - j).abs() <= a) | (j < c) | (i < c),
    }


@settings(deadline=None, max_examples=40)
@given(q_len=st.integers(1, 13), extra=st.integers(0, 6), batch=st.integers(1, 2), a=st.integers(0, 4),
       c=st.integers(0, 3), seed=st.integers(0, 2**16), causal=st.booleans(),
       window=st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 5)),
                                             st.one_of(st.none(), st.integers(0, 5)))))
def test_intervals_and_tile_kinds_equal_the_mask_cell_by_cell(q_len, extra, batch, a, c, seed, causal, window):
    kv_len = q_len + extra
    for name, mod in families(q_len, kv_len, batch, a, c, seed).items():
        p = attnkit.mask_plan(mod, q_len=q_len, kv_len=kv_len, batch=batch, is_causal=causal, window=window)
        want = oracle.allowed_grid(batch, 1, q_len, kv_len, is_causal=causal, window=window, mask_mod=mod)[:, 0]
        assert p.starts is not None, name
        got = dense_of(p).expand(batch, q_len, kv_len)
        assert torch.equal(got, want), name
        # each row's intervals sorted and disjoint, empties last as (Lk, Lk)
        live = p.ends > p.starts
        assert bool((p.starts[..., 1:] >= p.ends[..., :-1])[live[..., 1:]].all()), name
        assert bool((p.starts[~live] == kv_len).all() and (p.ends[~live] == kv_len).all()), name
        for tq, bk in ((1, 1), (3, 2), (4, 5)):
            kinds = p.kinds(tq, bk)
            for t in range(-(-q_len // tq)):
                for k in range(-(-kv_len // bk)):
                    cells = want[:, t * tq:(t + 1) * tq, k * bk:(k + 1) * bk]
                    full = bool(cells.all()) and (k + 1) * bk <= kv_len
                    expected = EMPTY if not cells.any() else FULL if full else PARTIAL
                    assert int(kinds[t, k]) == expected, (name, tq, bk, t, k)


def test_a_head_dependent_mask_gets_intervals_per_head_and_the_band_kernel_serves_it():
    mod = lambda b, h, i, j: (i + h) % 2 == j % 2  # noqa: E731
    p = attnkit.mask_plan(mod, q_len=6, heads=2)
    assert p.heads == 2 and p.starts.shape[0] == 2 and "per head" in repr(p)
    want = attnkit.masks.materialize(mod, 1, 2, 6, 6)[0]  # [H, Lq, Lk]
    for h in range(2):
        got = torch.zeros(6, 6, dtype=torch.bool)
        for r in range(6):
            for s, e in zip(p.starts[h, r].tolist(), p.ends[h, r].tolist(), strict=True):
                got[r, s:e] = True
        assert torch.equal(got, want[h])
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    assert attnkit.which_backend(q, k, v, mask=p) == "band"
    close(attnkit.attention(q, k, v, mask=p), attnkit.attention(q, k, v, mask_mod=mod, backend="reference"))
    with pytest.raises(ValueError, match="per head for 2 heads, but the call has 4"):
        attnkit.attention(*(torch.randn(1, 4, 6, 4) for _ in range(3)), mask=p)
    # the same predicate that happens to agree across heads is shared by them
    same = lambda b, h, i, j: (i + 0 * h) % 2 == j % 2  # noqa: E731
    shared = attnkit.mask_plan(same, q_len=6, heads=2)
    assert shared.starts.shape[0] == 1 and shared.heads is None


@pytest.mark.parametrize("how", ["closed form", "ranges", "every cell"])
def test_per_head_masks_through_each_way_match_the_oracle_forward_and_backward(how):
    """A different window per head (grouped-query heads: 4 query heads on 2 key/value heads), worked
    out by each of the three ways, through the band kernel: the float64 oracle's values and gradients."""
    wins = torch.tensor([3, 9, 20, 50])
    mods = {
        "closed form": lambda b, h, i, j: (i >= j) & (i - j <= wins[h]),
        "ranges": lambda b, h, i, j: (i >= j) & ((i - j).float() <= wins[h].float()),
        "every cell": lambda b, h, i, j: (i >= j) & (i - j <= wins[h - 4]),  # a negative index: it wraps
    }
    mod = mods[how]
    p = attnkit.mask_plan(mod, q_len=70, batch=2, heads=4)
    assert p.derived_by == how and p.heads == 4 and p.starts.shape[0] == 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 70, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 70, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert attnkit.which_backend(q, k, v, mask=p) == "band"
    got = attnkit.attention(q, k, v, mask=p)
    want = attnkit.attention(q, k, v, mask_mod=mod, backend="reference")
    close(got, want)
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout),
                    strict=True):
        close(a, b)


def test_a_per_head_mask_with_a_per_head_bias_runs_on_the_band_kernel():
    """Each (batch element, head) reads its own intervals and its head's row of the bias: ALiBi
    with a learned slope per head, a window per head, grouped-query heads."""
    wins = torch.tensor([3, 9, 20, 50])
    mod = lambda b, h, i, j: (i >= j) & (i - j <= wins[h])  # noqa: E731
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 60, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, 60, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, requires_grad=True)
    alibi = attnkit.scores.alibi(slopes)
    assert attnkit.which_backend(q, k, v, mask_mod=mod, score_mod=alibi) == "band"
    got = attnkit.attention(q, k, v, mask_mod=mod, score_mod=alibi)
    want = attnkit.attention(q, k, v, mask_mod=mod, score_mod=alibi, backend="reference")
    close(got, want)
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v, slopes), dout),
                    torch.autograd.grad(want, (q, k, v, slopes), dout), strict=True):
        close(a, b)


def test_a_mask_with_too_many_runs_has_no_intervals_and_the_tiles_serve_it():
    mod = lambda b, h, i, j: j % 2 == 0  # noqa: E731 (every other key: 300 runs a row, over MAX_INTERVALS)
    p = attnkit.mask_plan(mod, q_len=8, kv_len=600)
    assert p.starts is None and p.kinds(2, 2) is None
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 600, 4, dtype=torch.float64) for _ in range(2))
    assert attnkit.which_backend(q, k, v, mask=p) == "fused_tiles"
    close(attnkit.attention(q, k, v, mask=p), attnkit.attention(q, k, v, mask_mod=mod, backend="reference"))


def test_a_plan_is_built_once_and_reused_across_calls_and_layers():
    calls = []
    docs = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])

    def mod(b, h, i, j):
        calls.append(1)
        return (docs[i] == docs[j]) & (j <= i)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    p = attnkit.mask_plan(mod, q_len=8, batch=2)
    built = len(calls)
    want = attnkit.attention(q, k, v, mask_mod=mod, backend="reference")
    calls.clear()
    for _ in range(3):
        assert attnkit.which_backend(q, k, v, mask=p) == "band"
        close(attnkit.attention(q, k, v, mask=p), want)
    assert calls == []  # the band kernel reads the plan only
    mha = attnkit.MultiHeadAttention(8, 2, dtype=torch.float64)
    x = torch.randn(2, 8, 8, dtype=torch.float64)
    close(mha(x, mask=p), mha(x, mask_mod=mod, backend="reference"))
    # Without a plan, attention builds one and keeps it: a second call does not derive it again.
    plan_cache._cache.clear()
    calls.clear()
    attnkit.attention(q, k, v, mask_mod=mod)
    first = len(calls)
    attnkit.attention(q, k, v, mask_mod=mod)
    assert 0 < built and 0 < first and len(calls) - first <= 2  # the second call only probes the mod
    # An in-place change of a captured tensor makes a new plan.
    docs[3:] = 5
    close(attnkit.attention(q, k, v, mask_mod=mod), attnkit.attention(q, k, v, mask_mod=mod, backend="reference"))


def test_the_plan_of_a_window_is_worked_out_without_a_predicate():
    p = attnkit.mask_plan(q_len=6, kv_len=8, is_causal=True, window=(2, None))
    assert p.starts[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5] and p.ends[0, :, 0].tolist() == [3, 4, 5, 6, 7, 8]
    dead = attnkit.mask_plan(q_len=4, kv_len=2, is_causal=True)  # the first two queries see nothing
    assert dead.starts[0, :, 0].tolist() == [2, 2, 0, 0] and dead.ends[0, :, 0].tolist() == [2, 2, 1, 2]


def test_plans_that_do_not_fit_the_call_are_refused():
    q, k, v = (torch.randn(2, 2, 6, 4) for _ in range(3))
    with pytest.raises(ValueError, match="mask plan was built for q_len=5, kv_len=5, but the call has q_len=6"):
        attnkit.attention(q, k, v, mask=attnkit.mask_plan(q_len=5, is_causal=True))
    per_batch = attnkit.mask_plan(masks.padding_mod(torch.tensor([3, 4, 5])), q_len=6, batch=3)
    with pytest.raises(ValueError, match="mask plan was built for a batch of 3, but the call has 2"):
        attnkit.attention(q, k, v, mask=per_batch)
    shared = attnkit.mask_plan(q_len=6, is_causal=True)  # shared by every batch element: any batch fits
    close(attnkit.attention(q, k, v, mask=shared), attnkit.attention(q, k, v, is_causal=True))
    with pytest.raises(ValueError, match="mask is a MaskPlan, which holds the whole mask"):
        attnkit.attention(q, k, v, mask=shared, is_causal=True)
    with pytest.raises(TypeError, match="returned a torch.int64 tensor; expected a bool tensor"):
        attnkit.mask_plan(lambda b, h, i, j: i - j, q_len=4)
    with pytest.raises(ValueError, match="q_len must be an int >= 0, got -1"):
        attnkit.mask_plan(q_len=-1)
    with pytest.raises(ValueError, match=r"window must be a \(left, right\) pair"):
        attnkit.mask_plan(q_len=3, window=3)
    mha = attnkit.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="key_mask cannot be combined with a MaskPlan"):
        mha(torch.randn(2, 6, 8), mask=shared, key_mask=torch.ones(2, 6, dtype=torch.bool))


def test_rows_with_nothing_to_attend_between_others_give_zeros_and_zero_gradients_on_the_band():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mod = lambda b, h, i, j: (j <= i) & (i % 4 != 3)  # noqa: E731 - rows 3 and 7 see nothing
    assert attnkit.which_backend(q, k, v, mask_mod=mod, backend="blockwise") == "band"
    out = attnkit.attention(q, k, v, mask_mod=mod, backend="band")
    want = oracle.attention(q, k, v, allowed=oracle.allowed_grid(2, 2, 9, 9, mask_mod=mod))[0]
    close(out, want)
    assert (out[:, :, 3] == 0).all() and (out[:, :, 7] == 0).all()
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(attnkit.attention(q, k, v, mask_mod=mod, backend="reference"), (q, k, v), dout)
    for a, b in zip(got, ref, strict=True):
        close(a, b)
    assert (got[0][:, :, 3] == 0).all()


def test_the_plan_cache_keeps_nothing_alive():
    import gc
    import weakref

    def make():
        docs = torch.arange(16) // 4
        return (lambda b, h, i, j: docs[i] == docs[j]), weakref.ref(docs)

    mod, docs_gone = make()
    q = torch.randn(1, 2, 16, 4)
    attnkit.attention(q, q, q, mask_mod=mod)
    assert mod in plan_cache._cache  # cached while the predicate lives
    gone = weakref.ref(mod)
    del mod
    gc.collect()
    assert gone() is None and docs_gone() is None


def test_predicates_over_inference_tensors_work_and_are_not_cached():
    """Under torch.inference_mode captured tensors keep no version counter: the plan is built per call."""
    with torch.inference_mode():
        doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
        q = torch.randn(1, 2, 8, 4)
        mod = masks.document_mod(doc)
        out = attnkit.attention(q, q, q, mask_mod=mod)
        want = attnkit.attention(q, q, q, mask_mod=mod, backend="reference")
        close(out, want)
        doc[5:] = 1  # in place: the next call must see it
        close(attnkit.attention(q, q, q, mask_mod=mod), attnkit.attention(q, q, q, mask_mod=mod, backend="reference"))


def test_the_older_names_of_the_plan_cache_and_the_derivation_keep_working():
    """``maskplan.cache`` (now ``plan_cache``: ``attnkit.cache`` is the KV cache) is the same module, so a setting
    made through the old name holds; ``maskplan.derive`` is ``row_intervals``."""
    import attnkit.maskplan.cache as old

    assert old is plan_cache and maskplan.derive is maskplan.row_intervals
    assert attnkit.cache.KVCache.__module__ == "attnkit.cache"
