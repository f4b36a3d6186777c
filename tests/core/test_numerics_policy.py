"""Numerical policy shared by every backend: huge scores, determinism, mixed dtypes, NaN.

- Scores up to the float32 range give the reference backend's answer on every path (the banded
  kernel used to compare a fused ``s * scale - max`` against a separately rounded maximum and
  returned NaN, or zeros for rows that see keys, once scores passed about 1.5e9).
- Under ``torch.use_deterministic_algorithms(True)`` the banded kernel's backward is bitwise
  repeatable (dQ rows used to be added by threads in arrival order).
"""

from __future__ import annotations

import functools

import pytest
import torch

import attnkit
from attnkit.call import validate_call
from tests.backends.test_fused_tiles import qkv
from tests.support import oracle
from tests.support.tolerances import close

REFERENCE = attnkit.backends.get("reference")
SDPA = attnkit.backends.get("sdpa")
#: Every blockwise path: the banded kernel, PyTorch's fused kernel on tiles, and plain tiles.
BLOCKWISE = {name: attnkit.backends.get(name) for name in attnkit.backends.FAMILIES["blockwise"]}


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("path", list(BLOCKWISE))
def test_one_key_at_a_score_of_two_billion_is_that_key(path):
    # 86000^2 * 0.3 = 2.2e9; a scale that is not a power of two makes s * scale round.
    q = k = torch.full((1, 1, 1, 1), 86000.0)
    v = torch.full((1, 1, 1, 1), 5.0)
    out = BLOCKWISE[path](validate_call(q, k, v, is_causal=True, scale=0.3))[0]
    assert out.item() == 5.0


@functools.cache  # the oracle walks the grid cell by cell; 24 cases share two grids
def _huge_grid(**mask) -> torch.Tensor:
    return oracle.allowed_grid(1, 2, 150, 150, **mask)


@pytest.mark.parametrize("magnitude", [1e3, 1e5, 1e9, 1e17])  # scores up to ~1e36, short of float32's 3.4e38
@pytest.mark.parametrize("path", list(BLOCKWISE))
@pytest.mark.parametrize("mask", [{"is_causal": True}, {"window": (20, 3)}], ids=["causal", "window"])
def test_huge_scores_match_the_reference_and_the_oracle(path, magnitude, mask):
    q, k, v = qkv(1, 2, 2, 150, 150, d=16, dtype=torch.float32)
    with torch.no_grad():
        q.mul_(magnitude)
        k.mul_(magnitude)
    req = validate_call(q, k, v, scale=0.3, **mask)
    got, want = BLOCKWISE[path](req)[0], REFERENCE(req)[0]
    assert torch.isfinite(got).all()
    assert not (got == 0).all(-1).any()  # every row sees its own key at least
    close(got, want)
    close(got, oracle.attention(q, k, v, allowed=_huge_grid(**mask), scale=0.3)[0], torch.float32)
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout),
                    strict=True):
        assert torch.isfinite(a).all()
        # Rows are one-hot here, so dq, dk are rounding noise: eps * |dp| * |k|, with |k| ~ magnitude.
        close(a / magnitude, b / magnitude)


def _band_step(q, k, v):
    out = BLOCKWISE["band"](validate_call(q, k, v, window=(1024, 1024)))[0]
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))


def test_deterministic_mode_repeats_the_band_kernel_bit_for_bit(two_threads, deterministic):
    # One head, so both threads work on the same head and add into the same dQ rows at once.
    q, k, v = qkv(1, 1, 1, 4096, 4096, d=64, dtype=torch.float32)
    assert not attnkit.backends.get("band").not_supported_reasons(validate_call(q, k, v, window=(1024, 1024)))
    runs = [_band_step(q, k, v) for _ in range(5)]
    for run in runs[1:]:
        for got, first in zip(run, runs[0], strict=True):
            assert torch.equal(got, first)
    want = REFERENCE(validate_call(q, k, v, window=(1024, 1024)))[0]
    close(runs[0][0], want)
    for got, ref in zip(runs[0][1:], torch.autograd.grad(want, (q, k, v), torch.ones_like(want)), strict=True):
        close(got, ref)


# NaN in, NaN out: a row that depends on a NaN is NaN; a row with no visible key is 0. (Rows that do not
# see the NaN may be NaN too where a fused kernel adds the mask to a NaN score.)
NAN_QUERY_DOCS = torch.tensor([0] * 4 + [1] * 6 + [2] * 2)  # queries 10, 11: a document with no keys
NAN_KEY_DOCS = torch.tensor([0] * 4 + [1] * 8)
NAN_MASK = attnkit.masks.and_masks(attnkit.masks.document_mod(NAN_QUERY_DOCS, NAN_KEY_DOCS),
                                   attnkit.masks.causal_mod())
NAN_PATHS = {"reference": REFERENCE, "sdpa": SDPA, **BLOCKWISE}


@pytest.mark.parametrize("path", list(NAN_PATHS))
@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("mask", ["documents", "causal"])
def test_a_nan_reaches_the_rows_that_see_it_and_dead_rows_stay_zero(path, where, mask):
    q, k, v = (t.detach() for t in qkv(1, 2, 2, 12, 12, d=8, dtype=torch.float32))
    {"query": q, "key": k, "value": v}[where][0, 0, 5, 3] = float("nan")
    req = validate_call(q, k, v, mask_mod=NAN_MASK) if mask == "documents" else validate_call(q, k, v, is_causal=True)
    if path == "sdpa" and mask == "documents":  # takes no mask_mod: the same mask, dense
        req = validate_call(q, k, v, mask=req.dense_mask())
    elif path == "band":
        assert not attnkit.backends.get("band").not_supported_reasons(req)
    out = NAN_PATHS[path](req)[0]
    # Query 5; or the rows at or after key 5 (in its document, rows 5-9; causal, rows 5-11).
    dependent = [5] if where == "query" else list(range(5, 10 if mask == "documents" else 12))
    assert out[0, 0, dependent].isnan().any(-1).all()  # a NaN value: its column only
    dead = out[0, :, 10:] if mask == "documents" else out[0, :, :0]
    assert torch.equal(dead, torch.zeros_like(dead))  # no visible key
    assert torch.isfinite(out[0, 1]).all() or path in ("sdpa", "fused_tiles")  # head 1 never sees the NaN


def test_a_nan_bias_row_is_not_taken_for_a_masked_row():
    q, k, v = (t.detach() for t in qkv(1, 2, 2, 6, 6, d=8, dtype=torch.float32))
    bias = torch.zeros(6, 6)
    bias[3] = float("nan")
    bias[4] = float("-inf")  # this row really has no visible key
    for backend in (REFERENCE, SDPA):
        out = backend(validate_call(q, k, v, bias=bias))[0]
        assert out[:, :, 3].isnan().all()
        assert torch.equal(out[:, :, 4], torch.zeros_like(out[:, :, 4]))
        assert torch.isfinite(out[:, :, [0, 1, 2, 5]]).all()


# One dtype rule: a score_mod's captured tensors are used in the scores' compute dtype.
SCORE_MOD_PATHS = {"reference": REFERENCE, "band": BLOCKWISE["band"], "tiles": BLOCKWISE["tiles"]}


def _mixed_mod(dtype, heads=4):
    slopes = attnkit.scores.alibi_slopes(heads, dtype=dtype).requires_grad_()
    table = (torch.randn(heads, 2 * 6 + 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64) / 2)
    table = table.to(dtype).requires_grad_()
    return attnkit.scores.compose(attnkit.scores.alibi(slopes), attnkit.scores.relative_position_bias(table, 6)), \
        (slopes, table)


@pytest.mark.parametrize("path", list(SCORE_MOD_PATHS))
def test_float64_inputs_with_float32_parameters_are_exact_in_float64(path):
    q, k, v = qkv(1, 4, 2, 40, 40, d=8)
    mod, params = _mixed_mod(torch.float32)
    req = validate_call(q, k, v, score_mod=mod, window=(9, 3))
    if path == "band":
        assert not attnkit.backends.get("band").not_supported_reasons(req)
    out = SCORE_MOD_PATHS[path](req)[0]
    assert out.dtype == torch.float64
    allowed = oracle.allowed_grid(1, 4, 40, 40, window=(9, 3))
    close(out, oracle.attention(q, k, v, allowed=allowed, score_mod=mod)[0], torch.float64)
    grads = torch.autograd.grad(out.sum(), params)
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]


@pytest.mark.parametrize("path", list(SCORE_MOD_PATHS))
def test_float32_inputs_with_float64_parameters_compute_in_float32(path):
    q, k, v = qkv(1, 4, 2, 40, 40, d=8, dtype=torch.float32)
    mod, params = _mixed_mod(torch.float64)
    req = validate_call(q, k, v, score_mod=mod, is_causal=True)
    out = SCORE_MOD_PATHS[path](req)[0]
    assert out.dtype == torch.float32
    allowed = oracle.allowed_grid(1, 4, 40, 40, is_causal=True)
    want = oracle.attention(q, k, v, allowed=allowed, score_mod=mod)
    close(out, want[0], torch.float32)
    grads = torch.autograd.grad(out.sum(), params)
    assert [g.dtype for g in grads] == [torch.float64, torch.float64]
    if path == "reference":
        weights = REFERENCE(validate_call(q, k, v, score_mod=mod, is_causal=True, return_weights=True))[1]
        assert weights.dtype == torch.float32
        close(weights, want[1], torch.float32)
