"""The sparse patterns of attnkit.masks (Longformer global tokens and dilated windows, Sparse
Transformer strides, block layouts and BigBird): each predicate against a per-cell definition
written here, its dense builder and docstring picture, its plan, and the banded kernel against the
float64 reference, forward and backward."""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import masks
from tests.core.test_masks import assert_exact
from tests.support import oracle
from tests.support.tolerances import close


def cell_rules(window, dilation, stride, glob, layout, block):
    """Each pattern cell by cell, in plain Python on positions ``p`` (query) and ``j`` (key)."""
    return {
        "global_tokens": (masks.global_tokens_mod(window, glob),
                          lambda p, j: abs(p - j) <= window or j in glob or p in glob),
        "dilated_window": (masks.dilated_window_mod(window, dilation),
                           lambda p, j: abs(p - j) <= window * dilation and (p - j) % dilation == 0),
        "dilated_window causal": (masks.dilated_window_mod(window, dilation, causal=True),
                                  lambda p, j: 0 <= p - j <= window * dilation and (p - j) % dilation == 0),
        "strided": (masks.strided_mod(stride), lambda p, j: p >= j and (p - j < stride or (p - j) % stride == 0)),
        "block_sparse": (masks.block_sparse_mod(layout, block), lambda p, j: bool(layout[p // block, j // block])),
    }


def test_docstring_pictures_are_what_the_builders_give():
    result = doctest.testmod(masks, extraglobs={"torch": torch})
    assert result.attempted >= 5 and result.failed == 0


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 24), window=st.integers(0, 4), dilation=st.integers(1, 4), stride=st.integers(1, 6),
       glob=st.lists(st.integers(0, 30), max_size=6), block=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_predicates_builders_and_plans_match_the_definitions(n, window, dilation, stride, glob, block, seed):
    nb = -(-n // block)
    layout = torch.rand(nb, nb, generator=torch.Generator().manual_seed(seed)) > 0.5
    j = torch.arange(n)
    for name, (mod, rule) in cell_rules(window, dilation, stride, glob, layout, block).items():
        want = torch.tensor([[rule(p, k) for k in range(n)] for p in range(n)], dtype=torch.bool).view(n, n)
        assert torch.equal(masks.materialize(mod, 1, 1, n, n).expand(1, 1, n, n)[0, 0], want), name
        plan = attnkit.mask_plan(mod, q_len=n)
        assert plan.starts is not None, name
        assert torch.equal(((j >= plan.starts[..., None]) & (j < plan.ends[..., None])).any(-2)[0], want), name
    assert torch.equal(masks.global_tokens(n, window, glob), cell_rules(window, 1, 1, glob, layout, block)[
        "global_tokens"][0](None, None, j.view(-1, 1), j.view(1, -1)))
    assert torch.equal(masks.strided(n, stride), masks.materialize(masks.strided_mod(stride), 1, 1, n, n)[0, 0])
    assert masks.block_sparse(layout, block).shape == (nb * block, nb * block)


@pytest.mark.parametrize("name", ["global_tokens", "dilated_window", "strided", "block_sparse", "bigbird"])
def test_the_banded_kernel_serves_them_exactly(name):
    g = torch.Generator().manual_seed(1)
    lq, lk = 45, 53  # Lq != Lk: query i sits at i + 8
    q = torch.randn(2, 4, lq, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, lk, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mod = {"global_tokens": masks.global_tokens_mod(3, [0, 1, 30], offset=lk - lq),
           "dilated_window": masks.dilated_window_mod(3, 2, offset=lk - lq),
           "strided": masks.strided_mod(5, offset=lk - lq),
           "block_sparse": masks.block_sparse_mod(torch.rand(12, 14, generator=g) > 0.6, 4),
           "bigbird": masks.block_sparse_mod(masks.bigbird_layout(14, seed=3)[:12], 4)}[name]
    assert attnkit.which_backend(q, k, v, mask_mod=mod, backend="blockwise") == "band"
    out = attnkit.attention(q, k, v, mask_mod=mod, backend="band")
    want = attnkit.attention(q, k, v, mask_mod=mod, backend="reference")
    close(out, want)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout),
                    strict=True):
        close(a, b)


def test_bigbird_layout_is_the_same_on_every_machine_and_has_what_it_says():
    layout = masks.bigbird_layout(16, window_blocks=3, global_blocks=2, random_blocks=3, seed=7)
    assert torch.equal(layout, masks.bigbird_layout(16, window_blocks=3, global_blocks=2, random_blocks=3, seed=7))
    assert not torch.equal(layout, masks.bigbird_layout(16, seed=8))
    assert layout[:2].all() and layout[:, :2].all()
    i = torch.arange(16)
    band = (i.view(-1, 1) - i.view(1, -1)).abs() <= 1
    assert (layout | ~band).all()
    assert (layout[2:].sum(1) == (band[2:] | (i < 2)).sum(1) + 3).all()  # exactly 3 random blocks per row


def test_bad_arguments_name_what_came():
    with pytest.raises(ValueError, match="dilation must be a positive int, got 0"):
        masks.dilated_window_mod(2, 0)
    with pytest.raises(ValueError, match="stride must be a positive int, got -1"):
        masks.strided_mod(-1)
    with pytest.raises(ValueError, match="global_idx must hold non-negative positions, got \\[-1\\]"):
        masks.global_tokens_mod(2, [-1])
    with pytest.raises(ValueError, match="layout must be a 2-D bool tensor"):
        masks.block_sparse_mod(torch.ones(3, 3), 2)
    with pytest.raises(ValueError, match="block must be a positive int, got 0"):
        masks.block_sparse_mod(torch.ones(3, 3, dtype=torch.bool), 0)
    with pytest.raises(ValueError, match="random_blocks must be an int >= 0, got -2"):
        masks.bigbird_layout(4, random_blocks=-2)
    with pytest.raises(ValueError, match="mask must be a 2-D tensor"):
        masks.picture(torch.ones(2, 2, 2))


# --------------------------------------------------------------------------------------------
# Typed forms: exact intervals for any sizes and offsets, the variants, end to end
# --------------------------------------------------------------------------------------------


def variant_rules(window, dilation, stride, summary, glob):
    """The variants cell by cell in plain Python: an asymmetric Longformer window, the symmetric
    strided pattern and the Sparse Transformer's fixed pattern."""
    left, right = window, window + 1
    return {
        "global_tokens (left, right)": (masks.global_tokens_mod((left, right), glob),
                                        lambda p, j: -left <= j - p <= right or j in glob or p in glob),
        "strided both ways": (masks.strided_mod(stride, causal=False),
                              lambda p, j: abs(p - j) < stride or (p - j) % stride == 0),
        "fixed": (masks.fixed_mod(stride, summary=summary),
                  lambda p, j: j <= p and (p // stride == j // stride or j % stride >= stride - summary)),
    }


@settings(deadline=None, max_examples=40)
@given(n=st.integers(1, 20), window=st.integers(0, 3), dilation=st.integers(1, 4), stride=st.integers(1, 6),
       summary=st.integers(1, 6), glob=st.lists(st.integers(0, 25), max_size=3))
def test_the_variants_match_their_definitions(n, window, dilation, stride, summary, glob):
    summary = min(summary, stride)
    for name, (mod, rule) in variant_rules(window, dilation, stride, summary, glob).items():
        want = torch.tensor([[rule(p, k) for k in range(n)] for p in range(n)], dtype=torch.bool).view(n, n)
        assert torch.equal(masks.materialize(mod, 1, 1, n, n).expand(1, 1, n, n)[0, 0], want), name
    assert torch.equal(masks.fixed(n, stride, summary), variant_rules(window, dilation, stride, summary, glob)
                       ["fixed"][0](None, None, torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)))
    assert torch.equal(masks.strided(n, stride, causal=False),
                       masks.materialize(masks.strided_mod(stride, causal=False), 1, 1, n, n)[0, 0])
    assert torch.equal(masks.global_tokens(n, (window, window + 1), glob),
                       masks.materialize(masks.global_tokens_mod((window, window + 1), glob), 1, 1, n, n)[0, 0])


@settings(deadline=None, max_examples=60)
@given(lq=st.integers(0, 20), lk=st.integers(0, 24), offset=st.integers(-6, 10), window=st.integers(0, 4),
       dilation=st.integers(1, 4), stride=st.integers(1, 6), summary=st.integers(1, 6),
       glob=st.lists(st.integers(0, 30), max_size=6), block=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_intervals_are_the_predicates_cell_by_cell(lq, lk, offset, window, dilation, stride, summary, glob, block,
                                                   seed):
    """Every sparse pattern's own intervals (no evaluation of the predicate), in the shared form, at
    any sizes and offsets (Lq != Lk, keys past a layout's edge), alone and combined."""
    layout = torch.rand(max(1, -(-lq // block)), max(1, -(-lk // block) - 1),
                        generator=torch.Generator().manual_seed(seed)) > 0.5
    mods = [masks.global_tokens_mod(window, glob, offset), masks.global_tokens_mod((window, 1), glob, offset),
            masks.dilated_window_mod(window, dilation, offset), masks.dilated_window_mod(window, dilation, offset,
                                                                                         causal=True),
            masks.strided_mod(stride, offset), masks.strided_mod(stride, offset, causal=False),
            masks.fixed_mod(stride, min(summary, stride), offset), masks.block_sparse_mod(layout, block)]
    mods += [masks.and_masks(mods[2], masks.causal_mod(offset)), masks.or_masks(mods[4], mods[7]),
             masks.and_masks(masks.or_masks(mods[0], mods[6]), masks.padding_mod(torch.tensor([lk // 2, lk])))]
    for mod in mods:
        assert_exact(mod, 2, lq, lk)
    strided_k = mods[4].intervals(1, lq, lk)[0].shape[-1]
    assert strided_k <= lk // stride + 2  # K: about Lk / stride + 1, as its docstring says


@pytest.mark.parametrize("n", [1, 37, 300])
def test_the_sparse_builders_write_their_rows_without_normalizing_every_row(monkeypatch, n):
    """Global tokens, dilated windows and strides write each row's sorted intervals directly, and a
    block layout is normalized once per block of rows: sorting and merging a row's candidate keys,
    row by row, cost ten times as much at n = 8192. Whatever the shortcut, the rows are the
    predicate's, cell by cell."""
    normalized = []

    def spy(starts, ends, kv_len, real=masks.normalize):
        normalized.append(torch.broadcast_shapes(starts.shape, ends.shape))
        return real(starts, ends, kv_len)

    monkeypatch.setattr(masks, "normalize", spy)
    layout = masks.bigbird_layout(-(-n // 8), seed=1)
    for mod in (masks.global_tokens_mod(3, [0, 1, 2, 9, n // 2, n // 2 + 1, n - 1]),  # runs touching windows
                masks.global_tokens_mod((5, 0), [n // 3]), masks.dilated_window_mod(4, 3),
                masks.dilated_window_mod(6, 2, causal=True), masks.strided_mod(5), masks.strided_mod(4, causal=False),
                masks.block_sparse_mod(layout, 8)):
        normalized.clear()
        assert_exact(mod, 1, n, n)
        if isinstance(mod, masks.BlockSparse):
            assert all(shape[-2] == layout.shape[0] for shape in normalized), normalized
        else:
            assert normalized == [], (mod, normalized)


@pytest.mark.parametrize("name", ["fixed", "strided both ways", "global (left, right)", "dilated and causal",
                                  "strided or blocks"])
def test_attention_with_the_new_mods_matches_the_float64_reference(name):
    g = torch.Generator().manual_seed(2)
    lq, lk = 21, 26
    q = torch.randn(2, 3, lq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, lk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    off = lk - lq
    mod = {"fixed": masks.fixed_mod(4, summary=2, offset=off),
           "strided both ways": masks.strided_mod(4, off, causal=False),
           "global (left, right)": masks.global_tokens_mod((3, 1), [0, 9], offset=off),
           "dilated and causal": masks.and_masks(masks.dilated_window_mod(3, 3, off), masks.causal_mod(off)),
           "strided or blocks": masks.or_masks(masks.strided_mod(5, off),
                                               masks.block_sparse_mod(torch.rand(6, 7, generator=g) > 0.5, 4))}[name]
    allowed = masks.materialize(mod, 2, 3, lq, lk).expand(2, 3, lq, lk)
    want, _ = oracle.attention(q, k, v, allowed=allowed)
    close(attnkit.attention(q, k, v, mask_mod=mod), want)
    close(attnkit.attention(q, k, v, mask_mod=mod, backend="reference"), want)


def test_bad_arguments_of_the_variants_name_what_came():
    with pytest.raises(ValueError, match="summary must be <= stride \\(4\\), got 5"):
        masks.fixed_mod(4, summary=5)
    with pytest.raises(ValueError, match="summary must be a positive int, got 0"):
        masks.fixed_mod(4, summary=0)
    with pytest.raises(ValueError, match="stride must be a positive int, got 2.0"):
        masks.fixed_mod(2.0)
    with pytest.raises(ValueError, match="window must be an int >= 0 or a pair of them, got \\(None, 2\\)"):
        masks.global_tokens_mod((None, 2), [0])
    with pytest.raises(ValueError, match="window window must be None or a non-negative int, got -1"):
        masks.global_tokens_mod((-1, 2), [0])
    with pytest.raises(ValueError, match="layout must be a 2-D bool tensor .* non-empty"):
        masks.block_sparse_mod(torch.ones(0, 3, dtype=torch.bool), 2)
