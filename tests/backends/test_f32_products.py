"""The band kernel's float32 products through oneDNN's brgemm or the BLAS's sgemm (``set_f32_brgemm``).

With brgemm on, the transposed products read transposed copies (k^T for q k^T, once per call; in the backward
q^T and dout^T once per call, where dV and dK are summed transposed, and each key block's k^T and v^T): each way
is held to the float32 row of the tolerance table against the float64 formula, outputs and gradients, over odd
head sizes (E not a multiple of 16, Ev != E), lengths that are not a multiple of the tiles, windows, causal with
``Lq != Lk``, a few rows over a longer cache, documents with rows that see nothing, grouped heads, global tokens
(gathered keys and rows), strided inputs and dQ from its own pass (deterministic algorithms).
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from attnkit import masks
from attnkit.backends import _band
from attnkit.call import validate_call
from tests.backends.test_fused_tiles import check_against_oracle, oracle_grid, qkv
from tests.support import oracle
from tests.support.tolerances import close

BAND = attnkit.backends.get("band")


@pytest.fixture
def float32_products_restored():
    """The kernel's float32 product choice (process-wide) as it was after the test."""
    mod = _band._module() if _band.available() else None
    before = mod.f32_brgemm() if mod is not None else False
    yield mod
    if mod is not None:
        mod.set_f32_brgemm(before)


@pytest.fixture
def f32_brgemm(float32_products_restored):
    mod = float32_products_restored
    if mod is None or not mod.has_f32_brgemm():
        pytest.skip("no float32 brgemm here")
    return mod


def test_float32_through_brgemm_or_sgemm_both_match_the_formula(f32_brgemm):
    """The float32 products go through oneDNN's brgemm where that timed faster here (`attnkit bench dtypes` says
    which): forward and backward meet the float32 tolerance against the oracle with either product, on a window
    over blocks of several key chunks and a causal call with Lq != Lk."""
    assert _band.float32_products().split(" (")[0] in ("oneDNN brgemm", "BLAS sgemm")
    for on in (False, True):
        f32_brgemm.set_f32_brgemm(on)
        q, k, v = qkv(1, 4, 2, 300, 300, d=64)
        check_against_oracle(BAND, q, k, v, window=(70, 5))
        q, k, v = qkv(2, 2, 2, 130, 200, d=32)
        check_against_oracle(BAND, q, k, v, is_causal=True)


def formula_grads(q, k, v, allowed, dout):
    """dq, dk, dv of ``softmax(q k^T / sqrt(E)) v`` in float64 by autograd on the plain formula, keys a row may
    not see masked out (``allowed``, bool ``[B, H, Lq, Lk]`` or None), rows that see nothing giving zeros."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # (B, H, Lk, E): query head h reads h // g
    s = q @ kk.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if allowed is not None:
        empty = ~allowed.any(-1, keepdim=True)
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(empty, 0.0)
    w = torch.softmax(s, -1)
    if allowed is not None:
        w = w.masked_fill(empty, 0.0)
    return torch.autograd.grad(w @ vv, (q, k, v), dout.double())


CASES = {
    # E not a multiple of 16, Ev != E, lengths not a multiple of the 64-row tiles, grouped heads
    "window_odd_sizes": ((1, 4, 2, 150, 150, 20, 24), {"window": (40, 9)}),
    "window_wide_head": ((1, 2, 1, 300, 300, 64, 64), {"window": (70, 70)}),
    "causal_lq_below_lk": ((2, 2, 2, 130, 200, 33, 17), {"is_causal": True}),
    "causal_lq_above_lk": ((1, 4, 1, 200, 130, 16, 16), {"is_causal": True}),
    "few_rows_long_cache": ((1, 4, 2, 3, 260, 16, 16), {"is_causal": True}),
    "documents_some_rows_see_nothing": ((2, 4, 2, 70, 70, 12, 12), {"mask_mod": masks.document_mod(
        torch.tensor([0] * 13 + [1] * 30 + [3] * 2 + [4] * 25), torch.tensor([0] * 40 + [3] * 30))}),
    "global_tokens": ((1, 2, 2, 300, 300, 24, 24), {"mask_mod": masks.global_tokens_mod(12, [0, 1, 150])}),
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["dq_under_locks", "dq_own_pass"])
@pytest.mark.parametrize("brgemm", [False, True], ids=["sgemm", "brgemm"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_product_way_matches_the_float64_formula(f32_brgemm, case, brgemm, deterministic):
    (b, h, hkv, lq, lk, d, dv), kw = case
    f32_brgemm.set_f32_brgemm(brgemm)
    q, k, v = qkv(b, h, hkv, lq, lk, d=d, dv=dv, dtype=torch.float32, seed=lq + d)
    allowed = oracle_grid(b, h, lq, lk, **kw)
    dout = torch.randn(b, h, lq, dv, generator=torch.Generator().manual_seed(1))
    with torch.autograd.set_grad_enabled(True):
        before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(deterministic)
        try:
            out = BAND(validate_call(q, k, v, **kw))[0]
            got = torch.autograd.grad(out, (q, k, v), dout)
        finally:
            torch.use_deterministic_algorithms(before)
    close(out, oracle.attention(q, k, v, allowed=allowed)[0], torch.float32)
    for name, a, w in zip("qkv", got, formula_grads(q, k, v, allowed, dout), strict=True):
        assert a.shape == w.shape, name
        close(a, w, torch.float32)


def test_strided_inputs_are_copied_transposed_as_they_are_laid_out(f32_brgemm):
    """q, k, v as a model hands them over, ``[B, L, H, E]`` viewed as ``[B, H, L, E]`` (rows H * E apart): the
    transposed copies read each row where it is."""
    f32_brgemm.set_f32_brgemm(True)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 257, 4, 40, generator=g).transpose(1, 2).requires_grad_() for _ in range(3))
    dout = torch.randn(1, 4, 257, 40, generator=g)
    out = BAND(validate_call(q, k, v, is_causal=True))[0]
    got = torch.autograd.grad(out, (q, k, v), dout)
    allowed = oracle_grid(1, 4, 257, 257, is_causal=True)
    close(out, oracle.attention(q, k, v, allowed=allowed)[0], torch.float32)
    for a, w in zip(got, formula_grads(q, k, v, allowed, dout), strict=True):
        close(a, w, torch.float32)
