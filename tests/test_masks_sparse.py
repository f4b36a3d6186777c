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
from tests.tolerances import close


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
       glob=st.lists(st.integers(0, 30), max_size=3), block=st.integers(1, 5), seed=st.integers(0, 2**16))
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
