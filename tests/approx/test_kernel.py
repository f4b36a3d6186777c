"""Kernel (linearised) attention against its quadratic definition in float64, and FAVOR+ against softmax."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

import attnkit
from attnkit.approx import kernel
from tests.support import oracle
from tests.support.tolerances import close


def quadratic(q, k, v, phi, *, is_causal=False, key_mask=None, eps=1e-6):
    """The definition, with the n x n kernel matrix written out (float64)."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    a = phi(q) @ phi(k).transpose(-2, -1)  # [B, H, Lq, Lk]
    allowed = oracle.allowed_grid(q.shape[0], q.shape[1], q.shape[2], k.shape[2], is_causal=is_causal)
    if key_mask is not None:
        km = key_mask[:, None, None, :].expand_as(a)
        allowed = km if allowed is None else allowed & km
    if allowed is not None:
        a = a * allowed
    return (a @ v) / (a.sum(-1, keepdim=True) + eps)


@pytest.mark.parametrize("phi", [kernel.elu_feature_map, kernel.relu_feature_map])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 9, 9, 5, 3), (1, 2, 2, 4, 11, 6, 6), (1, 3, 1, 1, 1, 2, 4)])
@pytest.mark.parametrize("chunk", [1, 3, 128])
def test_matches_quadratic_definition(phi, is_causal, shape, chunk):
    b, h, hkv, lq, lk, e, ev = shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, lq, e, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, e, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, ev, generator=g, dtype=torch.float64)
    km = torch.rand(b, lk, generator=g) > 0.3
    km[:, -1] = True
    out = kernel.linear_attention(q, k, v, feature_map=phi, is_causal=is_causal, key_mask=km, chunk_size=chunk)
    close(out, quadratic(q, k, v, phi, is_causal=is_causal, key_mask=km))


def test_gradcheck():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert gradcheck(lambda q, k, v: kernel.linear_attention(q, k, v, chunk_size=2), (q, k, v))
    assert gradcheck(lambda q, k, v: kernel.linear_attention(q, k, v, is_causal=True, chunk_size=2), (q, k, v))


def test_random_features_estimate_softmax_attention():
    """FAVOR+ is unbiased for exp(q.k/sqrt(d)): more features, closer to softmax attention."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 32, 8, generator=g, dtype=torch.float64) * 0.5 for _ in range(3))
    exact = attnkit.attention(q, k, v)
    errors = {}
    for m in (16, 256, 8192):
        phi = kernel.random_feature_map(8, m, generator=torch.Generator().manual_seed(m), dtype=torch.float64)
        approx = kernel.linear_attention(q, k, v, feature_map=phi)
        errors[m] = ((approx - exact).norm() / exact.norm()).item()
    assert errors[8192] < errors[256] < errors[16]
    assert errors[8192] < 0.05, errors


@pytest.mark.parametrize("kwargs, pattern", [
    ({"query": torch.randn(2, 3, 4)}, r"query must be a floating \[B, H, L, D\] tensor, got shape \(2, 3, 4\)"),
    ({"key_mask": torch.ones(1, 5)}, r"key_mask must be a bool \[B, Lk\] = \(1, 6\) tensor"),
    ({"chunk_size": 0}, r"chunk_size must be positive, got 0"),
    ({"key": torch.randn(1, 3, 6, 4), "value": torch.randn(1, 3, 6, 4)}, r"query heads \(2\) must be a multiple"),
])
def test_bad_input(kwargs, pattern):
    args = {"query": torch.randn(1, 2, 5, 4), "key": torch.randn(1, 1, 6, 4), "value": torch.randn(1, 1, 6, 4)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        kernel.linear_attention(**args)
