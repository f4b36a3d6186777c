"""The "fused_tiles" backend: PyTorch's CPU flash kernel inside the tile schedule.

``test_blockwise.py`` runs every case through both paths with tiny tiles; here: when the fused
path is taken, that its default tiles and split chunks match the oracle, the self-check, and the
fall-back when the kernel is missing or wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks, scores
from attnkit.backends import _fused, tiles
from attnkit.backends.tiles import FusedTilesBackend, TilesBackend
from attnkit.call import validate_call
from tests.support import oracle
from tests.support.tolerances import close

REFERENCE = attnkit.backends.get("reference")
DOCS = torch.arange(300) // 70


def qkv(b, h, hkv, lq, lk, d=8, dtype=torch.float64, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    shapes = ((h, lq, d), (hkv, lk, d), (hkv, lk, dv or d))
    return [torch.randn(b, *s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def oracle_grid(b, h, lq, lk, **kw):
    """The oracle's allowed grid for these attention kwargs. A causal mask or a window alone reads
    neither the batch element nor the head, so the oracle's cell-by-cell loop walks one ``[lq, lk]``
    grid, expanded to ``[b, h, lq, lk]``, instead of ``b * h`` equal ones."""
    grid_kw = {"is_causal": kw.get("is_causal", False), "window": kw.get("window"),
               "mask_mod": kw.get("mask_mod"), "mask": kw.get("mask")}
    if grid_kw["mask_mod"] is None and grid_kw["mask"] is None:
        grid = oracle.allowed_grid(1, 1, lq, lk, **grid_kw)
        return None if grid is None else grid.expand(b, h, lq, lk)
    return oracle.allowed_grid(b, h, lq, lk, **grid_kw)


def check_against_oracle(backend, q, k, v, allowed=None, **kw):
    """Output against the float64 oracle, gradients against the reference backend."""
    if allowed is None:
        allowed = oracle_grid(q.shape[0], q.shape[1], q.shape[2], k.shape[2], **kw)
    out = backend(validate_call(q, k, v, **kw))[0]
    close(out, oracle.attention(q, k, v, allowed=allowed, bias=kw.get("bias"))[0], q.dtype)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(REFERENCE(validate_call(q, k, v, **kw))[0], (q, k, v), dout)
    for a, b in zip(got, want, strict=True):
        close(a, b, q.dtype)


@pytest.fixture
def fresh_self_check():
    """Re-run the once-per-process self-check around a test that changes the kernel."""
    _fused._checked.cache_clear()
    yield
    _fused._checked.cache_clear()


def test_the_kernel_passes_its_self_check_and_serves_mask_only_calls():
    assert _fused.available()
    q, k, v = qkv(1, 2, 2, 9, 9)
    fused = attnkit.backends.get("fused_tiles")
    assert fused._plan(validate_call(q, k, v, window=(2, 2))).fused
    assert fused._plan(validate_call(q, k, v, mask_mod=masks.causal_mod())).fused
    with_mod = validate_call(q, k, v, window=(2, 2), score_mod=scores.softcap(2.0))
    assert fused.not_supported_reasons(with_mod)  # a score_mod needs the scores
    assert attnkit.which_backend(q, k, v, window=(2, 2), score_mod=lambda s, b, h, i, j: s * 2) == "tiles"
    assert not TilesBackend()._plan(validate_call(q, k, v, window=(2, 2))).fused
    q2, k2, v2 = qkv(1, 2, 2, 9, 9, dv=5)
    assert fused.not_supported_reasons(validate_call(q2, k2, v2, window=(2, 2)))  # values narrower than queries


def test_forcing_the_fused_path_where_it_cannot_run_is_refused_with_the_reason():
    q, k, v = qkv(1, 2, 2, 5, 5)
    req = validate_call(q, k, v, window=(1, 1), score_mod=scores.softcap(2.0))
    reasons = FusedTilesBackend().not_supported_reasons(req)
    assert any("fused CPU kernel needs no score_mod" in r for r in reasons)
    assert TilesBackend().not_supported_reasons(req) == []
    with pytest.raises(ValueError, match="backend 'fused_tiles' cannot serve this call .*: PyTorch's fused"):
        FusedTilesBackend()(req)


@pytest.mark.parametrize("case", [
    {"window": (40, 40)},  # a narrow band: 64-row tiles, one masked call per batch
    {"window": (1000, 30)},  # a wide one (longer than the sequence): 256-row tiles
    {"is_causal": True},  # whole rows of keys: full spans without a mask, the diagonal with one
    {"is_causal": True, "window": (100, None)},
    {"mask_mod": masks.document_mod(DOCS)},
], ids=["narrow_window", "wide_window", "causal", "causal_window", "documents"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=["mha", "gqa"])
def test_default_tiles_match_the_oracle(case, heads):
    h, hkv = heads
    q, k, v = qkv(1, h, hkv, 300, 300, d=16)
    backend = attnkit.backends.get("fused_tiles")
    st = backend._plan(validate_call(q, k, v, **case))
    # A narrow band gets small tiles, plain causal masks one tile as long as the sequence (300 -> 320).
    want = 64 if case.get("window") == (40, 40) else 320 if case == {"is_causal": True} else 256
    assert st.fused and st.q_tile == want
    # The oracle evaluates a mask_mod cell by cell in Python; for the documents give it the grid.
    allowed = masks.document(DOCS).expand(1, h, 300, 300) if "mask_mod" in case else None
    check_against_oracle(backend, q, k, v, allowed=allowed, **case)


def test_float32_matches_pytorch_sdpa_with_the_dense_mask():
    q, k, v = qkv(2, 4, 4, 333, 333, d=32, dtype=torch.float32)
    mask = masks.sliding_window(333, left=50, right=7)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    close(FusedTilesBackend()(validate_call(q, k, v, window=(50, 7)))[0], want)


@pytest.mark.parametrize("cache", [0, 1 << 40], ids=["split_every_chunk", "never_split"])
def test_chunks_split_into_spans_or_not_give_the_same_answer(monkeypatch, cache):
    monkeypatch.setattr(tiles, "FUSED_MASK_CACHE", cache)
    backend = FusedTilesBackend(q_tile=8, kv_block=4)
    q, k, v = qkv(1, 2, 2, 37, 41)
    req = validate_call(q, k, v, is_causal=True, window=(9, None))
    st = backend._plan(req)
    spans = [len(tiles._fused_segments(st, bt, tiles._gather(st, bt, *_operands(st, q, k, v))))
             for bt in st.batches]
    assert (max(spans) > 1) == (cache == 0)
    check_against_oracle(backend, q, k, v, is_causal=True, window=(9, None))


def _operands(st, q, k, v):
    return tiles._to_tiles(q.detach(), st), tiles._to_rows(k.detach(), st), tiles._to_rows(v.detach(), st)


def test_dense_bias_and_mask_go_through_the_kernel_too():
    g = torch.Generator().manual_seed(1)
    q, k, v = qkv(2, 2, 2, 29, 23)
    bias = torch.randn(2, 1, 29, 23, generator=g, dtype=torch.float64)
    mask = torch.rand(29, 23, generator=g) > 0.3
    backend = FusedTilesBackend(q_tile=8, kv_block=4)
    assert backend._plan(validate_call(q, k, v, bias=bias, mask=mask)).fused
    check_against_oracle(backend, q, k, v, bias=bias, mask=mask, window=(6, 6))


def test_gradcheck_through_the_kernel():
    q, k, v = qkv(1, 2, 1, 7, 9, d=3)

    def fn(q, k, v):
        return attnkit.attention(q, k, v, window=(2, 1), mask_mod=lambda b, h, i, j: (i + j) % 4 != 1,
                                 backend="fused_tiles")

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_without_the_kernel_the_plain_path_runs(monkeypatch, fresh_self_check):
    monkeypatch.setattr(_fused, "_FWD", None)
    assert not _fused.available()
    q, k, v = qkv(1, 2, 2, 19, 600)
    every_other = lambda b, h, i, j: j % 2 == 0  # noqa: E731 - 300 runs a row, no intervals: not for the band
    assert attnkit.which_backend(q, k, v, mask_mod=every_other) == "tiles"
    q, k, v = qkv(1, 2, 2, 19, 19)
    check_against_oracle(TilesBackend(q_tile=4, kv_block=4), q, k, v, window=(3, 3))


def test_self_check_tolerates_nan_dead_rows_but_refuses_a_wrong_lse(monkeypatch, fresh_self_check):
    real = _fused._FWD

    def nan_for_dead_rows(q, k, v, *args, attn_mask=None, scale=None):  # what an older kernel might do
        out, lse = real(q, k, v, *args, attn_mask=attn_mask, scale=scale)
        if attn_mask is None:
            return out, lse
        dead = torch.isneginf(attn_mask).all(-1).expand_as(lse)
        return out.masked_fill(dead.unsqueeze(-1), float("nan")), lse

    monkeypatch.setattr(_fused, "_FWD", nan_for_dead_rows)
    assert _fused.available()  # dead rows are fixed up from the mask, so NaN there is harmless

    def wrong_lse(q, k, v, *args, attn_mask=None, scale=None):
        out, lse = real(q, k, v, *args, attn_mask=attn_mask, scale=scale)
        return out, lse + 1.0

    monkeypatch.setattr(_fused, "_FWD", wrong_lse)
    _fused._checked.cache_clear()
    assert not _fused.available()


@pytest.mark.parametrize("lengths", [(96, 96), (90, 100), (96, 40)], ids=["square", "offset", "lq>lk"])
def test_square_diagonal_blocks_use_the_kernels_causal_mode(monkeypatch, lengths):
    monkeypatch.setattr(tiles, "FUSED_MASK_CACHE", 0)  # split chunks into spans
    backend = FusedTilesBackend(q_tile=16, kv_block=16)
    lq, lk = lengths
    q, k, v = qkv(2, 2, 2, lq, lk)
    st = backend._plan(validate_call(q, k, v, is_causal=True))
    flags = [seg[4] for bt in st.batches
             for seg in tiles._fused_segments(st, bt, tiles._gather(st, bt, *_operands(st, q, k, v)))]
    assert any(flags) == (lq == lk)  # aligned only when the bottom-right diagonal starts at a block edge
    check_against_oracle(backend, q, k, v, is_causal=True)


@pytest.mark.parametrize("backend", ["band", "fused_tiles"])
@pytest.mark.parametrize("layout", ["bshd", "last_dim_strided", "expanded_kv"])
def test_inputs_in_any_memory_layout(layout, backend):
    g = torch.Generator().manual_seed(2)
    b, h, n, d = 2, 4, 90, 16
    if layout == "bshd":  # [B, L, H, D] storage seen as [B, H, L, D]
        q, k, v = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(3))
    elif layout == "last_dim_strided":
        q, k, v = (torch.randn(b, h, d, n, generator=g, dtype=torch.float64).transpose(-1, -2) for _ in range(3))
    else:
        q = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(b, 1, n, d, generator=g, dtype=torch.float64).expand(b, h, n, d) for _ in range(2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    check_against_oracle(attnkit.backends.get(backend), q, k, v, is_causal=True, window=(20, None))
