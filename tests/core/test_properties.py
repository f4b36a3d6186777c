"""Invariants of attention, property-tested with Hypothesis over shapes, masks and backends."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import backends
from tests.support.backends import eager_backends
from tests.support.tolerances import close


@st.composite
def problems(draw, causal=None):
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.integers(1, 3))
    lq = draw(st.integers(1, 12))
    lk = draw(st.integers(1, 12))
    e = draw(st.integers(1, 9))
    ev = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, e, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, e, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, ev, generator=g, dtype=torch.float64)
    mask = torch.rand(b, 1, lq, lk, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    is_causal = draw(st.booleans()) if causal is None else causal
    backend = draw(st.sampled_from(eager_backends()))
    return q, k, v, mask, is_causal, backend


def run(q, k, v, mask, is_causal, backend, **kw):
    req = attnkit.call.validate_call(q, k, v, mask=mask, is_causal=is_causal, **kw)
    name = backend if not backends.get(backend).not_supported_reasons(req) else "reference"
    return attnkit.attention(q, k, v, mask=mask, is_causal=is_causal, backend=name, **kw)


@given(problems())
def test_weight_rows_sum_to_one_or_are_all_zero(p):
    q, k, v, mask, is_causal, _ = p
    _, w = attnkit.attention(q, k, v, mask=mask, is_causal=is_causal, return_weights=True)
    sums = w.sum(-1)
    has_key = (w > 0).any(-1)
    close(sums[has_key], torch.ones_like(sums[has_key]))
    assert (sums[~has_key] == 0).all()
    assert (w >= 0).all()


@given(problems(), st.integers(0, 2**16))
def test_masked_out_keys_and_values_change_nothing(p, seed):
    q, k, v, mask, is_causal, backend = p
    out = run(q, k, v, mask, is_causal, backend)
    g = torch.Generator().manual_seed(seed)
    # a key is dead for everyone when no (batch, query) may attend it
    allowed = mask.expand(q.shape[0], 1, q.shape[2], k.shape[2])
    if is_causal:
        allowed = allowed & attnkit.masks.causal(q.shape[2], k.shape[2])
    dead = ~allowed.any(dim=2, keepdim=True).transpose(-1, -2)  # [B, 1, Lk, 1]
    k2 = torch.where(dead, torch.randn(k.shape, generator=g, dtype=k.dtype) * 100, k)
    v2 = torch.where(dead, torch.randn(v.shape, generator=g, dtype=v.dtype) * 100, v)
    close(run(q, k2, v2, mask, is_causal, backend), out)


@given(problems(causal=True))
def test_future_tokens_never_change_earlier_causal_outputs(p):
    q, k, v, _, _, backend = p
    lq, lk = q.shape[2], k.shape[2]
    if lk < lq:
        return
    out = run(q, k, v, None, True, backend)
    # drop the last key and the last query: everything before is unchanged
    if lq < 2:
        return
    out2 = run(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], None, True, backend)
    close(out2, out[:, :, :-1])
    # or perturb it: the earlier rows do not move
    k3, v3 = k.clone(), v.clone()
    k3[:, :, -1] += 5
    v3[:, :, -1] -= 5
    close(run(q, k3, v3, None, True, backend)[:, :, :-1], out[:, :, :-1])


@given(problems(causal=False), st.integers(0, 2**16))
def test_permuting_keys_with_values_changes_nothing(p, seed):
    q, k, v, _, _, backend = p
    perm = torch.randperm(k.shape[2], generator=torch.Generator().manual_seed(seed))
    close(run(q, k[:, :, perm], v[:, :, perm], None, False, backend), run(q, k, v, None, False, backend))


@given(problems())
def test_deterministic(p):
    q, k, v, mask, is_causal, backend = p
    a = run(q, k, v, mask, is_causal, backend)
    b = run(q, k, v, mask, is_causal, backend)
    assert torch.equal(a, b)


@given(problems())
def test_every_backend_agrees_with_reference(p):
    q, k, v, mask, is_causal, backend = p
    close(run(q, k, v, mask, is_causal, backend), attnkit.attention(q, k, v, mask=mask, is_causal=is_causal,
                                                                    backend="reference"))
