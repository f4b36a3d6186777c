"""torch.autograd.gradcheck in float64 for attention (every backend) and the module."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck

import attnkit
from attnkit import backends
from tests.support.backends import eager_backends


def inputs(h=2, hkv=1, lq=3, lk=4, e=3, ev=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, l, d, generator=g, dtype=torch.float64, requires_grad=True)
            for n, l, d in ((h, lq, e), (hkv, lk, e), (hkv, lk, ev))]


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "mask+dead-row": {"mask": torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1]], dtype=torch.bool)},
    "window": {"window": (1, 0)},
    "mask_mod": {"mask_mod": lambda b, h, q, kv: (q + kv) % 2 == 0},
    "score_mod": {"score_mod": lambda s, b, h, q, kv: s - 0.3 * (q - kv).abs()},
}


@pytest.mark.parametrize("backend", eager_backends())
@pytest.mark.parametrize("case", list(CASES))
def test_gradcheck_qkv(backend, case):
    q, k, v = inputs()
    kw = CASES[case]
    req = attnkit.call.validate_call(q, k, v, **kw)
    if backends.get(backend).not_supported_reasons(req):
        with pytest.raises(ValueError):
            attnkit.attention(q, k, v, backend=backend, **kw)
        return
    assert gradcheck(lambda q, k, v: attnkit.attention(q, k, v, backend=backend, **kw), (q, k, v))


@pytest.mark.parametrize("backend", eager_backends())
def test_gradcheck_bias(backend):
    q, k, v = inputs()
    bias = torch.randn(1, 1, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 4, dtype=torch.bool).tril(1)
    req = attnkit.call.validate_call(q, k, v, bias=bias, mask=mask)
    if backends.get(backend).not_supported_reasons(req):
        return
    assert gradcheck(lambda q, k, v, b: attnkit.attention(q, k, v, bias=b, mask=mask, backend=backend),
                     (q, k, v, bias))


def test_dead_row_gradients_are_zero_not_nan():
    q, k, v = inputs(h=1, hkv=1)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[0] = True
    for backend in eager_backends():
        for t in (q, k, v):
            t.grad = None
        req = attnkit.call.validate_call(q, k, v, mask=mask)
        if backends.get(backend).not_supported_reasons(req):
            continue
        attnkit.attention(q, k, v, mask=mask, backend=backend).sum().backward()
        assert torch.isfinite(q.grad).all() and (q.grad[0, 0, 1:] == 0).all(), backend


def test_gradcheck_module():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(6, 2, num_kv_heads=1, v_head_dim=2, dtype=torch.float64)
    x = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    key_mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert gradcheck(lambda x, y: mha(x, y, key_mask=key_mask), (x, y))
    assert gradcheck(lambda x: mha(x, is_causal=True), (x,))
