"""The tile backends ("fused_tiles", "tiles") against the float64 oracle, the reference backend and PyTorch SDPA.

Most tests use tiny tiles (``SMALL``) so that even short sequences cut into many tiles, chunks and
batches, with empty, full and partial blocks.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit
from attnkit import masks, scores
from attnkit.backends import tile_schedule, tiles
from attnkit.backends.tiles import FusedTilesBackend, TilesBackend
from attnkit.call import validate_call
from tests.support import oracle
from tests.support.tolerances import close

SMALL = FusedTilesBackend(q_tile=4, kv_block=3, kv_chunk=7, score_budget=200)  # see run()
SMALL_PLAIN = TilesBackend(q_tile=4, kv_block=3, kv_chunk=7, score_budget=200)
BOTH = pytest.mark.parametrize("small", [SMALL, SMALL_PLAIN], ids=["fused", "plain"])
REFERENCE = attnkit.backends.get("reference")


def qkv(b, h, hkv, lq, lk, d=8, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(b, n_h, n, d, generator=g, dtype=torch.float64).to(dtype)
           for n_h, n in ((h, lq), (hkv, lk), (hkv, lk))]
    return [t.requires_grad_(grad) for t in out]


def run(backend, q, k, v, **kw):
    """``backend``'s output; SMALL stands for "the fused kernel where it serves, else the plain tiles"."""
    req = validate_call(q, k, v, **kw)
    if backend is SMALL and backend.not_supported_reasons(req):
        backend = SMALL_PLAIN
    return backend(req)[0]


def checkerboard(b, h, q_idx, kv_idx):
    """Random-looking block pattern with whole rows masked (q_idx % 5 == 2) and empty tiles."""
    return (((q_idx // 3 + kv_idx // 4 + h) % 3) != 0) & (q_idx % 5 != 2)


_BLOCKS = torch.rand(8, 8, generator=torch.Generator().manual_seed(5)) > 0.5


def random_blocks(b, h, q_idx, kv_idx):
    """Whole tiles of SMALL (4 queries x 3 keys) allowed or not at random: empty and full tiles."""
    return _BLOCKS[q_idx // 4, kv_idx // 3]


SHAPES = {
    "odd": (1, 2, 2, 13, 13),
    "lq<lk": (2, 2, 1, 7, 19),
    "lq>lk": (1, 4, 2, 17, 6),
    "len1": (1, 2, 2, 1, 1),
    "gqa": (1, 6, 2, 11, 14),
}
CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "window0": {"window": (0, 0)},
    "window3_1": {"window": (3, 1)},
    "window_left_only": {"window": (None, 2)},
    "window_beyond": {"window": (100, 100)},
    "causal_window": {"is_causal": True, "window": (4, None)},
    "blocks": {"mask_mod": checkerboard},
    "blocks_window": {"mask_mod": checkerboard, "window": (5, 5)},
    "random_blocks": {"mask_mod": random_blocks},
    "dense_mask": {"mask": "random"},
    "bias_causal": {"bias": "random", "is_causal": True},
    "alibi": {"score_mod": "alibi"},
    "relbias_window": {"score_mod": "rel", "window": (2, 6)},
    "softcap_blocks": {"score_mod": "softcap", "mask_mod": checkerboard},
}


def materialise(case, b, h, lq, lk, dtype=torch.float64):
    """Turn the symbolic parts of a case into tensors/functions; also return the oracle's inputs."""
    kw = dict(case)
    g = torch.Generator().manual_seed(7)
    if kw.get("mask") == "random":
        kw["mask"] = torch.rand(b, 1, lq, lk, generator=g) > 0.4
    if kw.get("bias") == "random":
        kw["bias"] = torch.randn(lq, lk, generator=g, dtype=torch.float64).to(dtype)
    sm = kw.get("score_mod")
    if sm == "alibi":
        kw["score_mod"] = scores.alibi(scores.alibi_slopes(h, dtype=dtype), offset=lk - lq)
    elif sm == "rel":
        kw["score_mod"] = scores.relative_position_bias(torch.randn(h, 7, generator=g, dtype=torch.float64)
                                                        .to(dtype), 3, offset=lk - lq)
    elif sm == "softcap":
        kw["score_mod"] = scores.softcap(1.5)
    allowed = oracle.allowed_grid(b, h, lq, lk, is_causal=kw.get("is_causal", False), window=kw.get("window"),
                                  mask_mod=kw.get("mask_mod"), mask=kw.get("mask"))
    return kw, {"allowed": allowed, "bias": kw.get("bias"), "score_mod": kw.get("score_mod")}


@BOTH
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_matches_oracle_and_reference_gradients(shape, case, small):
    b, h, hkv, lq, lk = shape
    kw, ora = materialise(case, b, h, lq, lk)
    q, k, v = qkv(b, h, hkv, lq, lk, grad=True)
    out = run(small, q, k, v, **kw)
    close(out, oracle.attention(q, k, v, **ora)[0], torch.float64)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(run(REFERENCE, q, k, v, **kw), (q, k, v), dout)
    for got, want in zip(grads, ref, strict=True):
        close(got, want, torch.float64)


@BOTH
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["causal_window", "blocks", "alibi"])
def test_low_precision_against_oracle(dtype, case, small):
    b, h, hkv, lq, lk = SHAPES["gqa"]
    kw, ora = materialise(CASES[case], b, h, lq, lk, dtype=torch.float32)
    q, k, v = qkv(b, h, hkv, lq, lk, dtype=dtype)
    out = run(small, q, k, v, **kw)
    assert out.dtype == dtype
    close(out, oracle.attention(q, k, v, **ora)[0], dtype)


@pytest.mark.parametrize("with_score_mod", [True, False], ids=["plain", "fused"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_fully_masked_rows_give_zeros_and_zero_grads(dtype, with_score_mod):
    q, k, v = qkv(1, 2, 2, 10, 9, dtype=dtype, grad=True)
    dead = [2, 7]

    def mod(b, h, q_idx, kv_idx):
        return (q_idx != 2) & (q_idx != 7) & (kv_idx % 2 == 0)

    kw = {"score_mod": scores.softcap(3.0)} if with_score_mod else {}
    out = attnkit.attention(q, k, v, mask_mod=mod, backend="blockwise", **kw)
    out.sum().backward()
    for t in (out, q.grad, k.grad, v.grad):
        assert torch.isfinite(t).all()
    assert (out[:, :, dead] == 0).all() and (q.grad[:, :, dead] == 0).all()
    assert (k.grad[:, :, 1::2] == 0).all() and (v.grad[:, :, 1::2] == 0).all()  # masked keys
    assert out[:, :, 0].abs().sum() > 0


def test_random_block_pattern_has_empty_and_full_tiles():
    q, k, v = qkv(1, 2, 2, 19, 17)
    st = SMALL._plan(validate_call(q, k, v, mask_mod=random_blocks))
    assert sum(len(b.tiles) for b in st.batches) > 0
    kinds = attnkit.mask_plan(random_blocks, q_len=19, kv_len=17).kinds(4, 3)
    assert (kinds == tile_schedule.EMPTY).any() and (kinds == tile_schedule.FULL).any()
    allowed = oracle.allowed_grid(1, 2, 19, 17, mask_mod=random_blocks)
    close(run(SMALL, q, k, v, mask_mod=random_blocks), oracle.attention(q, k, v, allowed=allowed)[0])


def test_window_zero_length_and_empty_rows():
    # window (0, 0) with Lq > Lk: the first Lq - Lk queries sit before every key.
    q, k, v = qkv(1, 2, 2, 9, 4)
    out = run(SMALL, q, k, v, window=(0, 0))
    ora = oracle.attention(q, k, v, allowed=oracle.allowed_grid(1, 2, 9, 4, window=(0, 0)))[0]
    close(out, ora, torch.float64)
    assert (out[:, :, :5] == 0).all()


@pytest.mark.parametrize("param", ["alibi", "rel", "nonleaf"])
def test_gradients_into_captured_tensors(param):
    q, k, v = qkv(1, 4, 2, 12, 15, grad=True)
    if param == "alibi":
        p = torch.nn.Parameter(scores.alibi_slopes(4, dtype=torch.float64))
        make = lambda: scores.alibi(p, offset=3)  # noqa: E731
    elif param == "rel":
        p = torch.nn.Parameter(torch.randn(4, 9, dtype=torch.float64))
        make = lambda: scores.relative_position_bias(p, 4, offset=3)  # noqa: E731
    else:  # the captured tensor is computed from the parameter: the gradient must reach the leaf
        p = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
        make = lambda: scores.alibi(p.exp(), offset=3)  # noqa: E731
    grads = []
    for backend in (SMALL, REFERENCE):
        out = run(backend, q, k, v, score_mod=make(), window=(4, 2), mask_mod=checkerboard)
        grads.append(torch.autograd.grad(out.square().sum(), (p, q, k, v)))
    assert grads[0][0].abs().sum() > 0
    for got, want in zip(*grads, strict=True):
        close(got, want, torch.float64)


def test_score_mod_from_module_and_global_reach_parameters():
    q, k, v = qkv(1, 2, 2, 6, 6, grad=True)
    lin = torch.nn.Linear(1, 1).double()

    def mod(score, b, h, q_idx, kv_idx):
        return lin(score.unsqueeze(-1)).squeeze(-1)

    out = attnkit.attention(q, k, v, score_mod=mod, window=(1, 1), backend="blockwise")
    ref = attnkit.attention(q, k, v, score_mod=mod, window=(1, 1), backend="reference")
    g = torch.autograd.grad(out.sum(), list(lin.parameters()))
    r = torch.autograd.grad(ref.sum(), list(lin.parameters()))
    for got, want in zip(g, r, strict=True):
        close(got, want, torch.float64)


def test_hidden_tensor_requiring_grad_is_refused():
    q, k, v = qkv(1, 2, 2, 5, 5)
    holder = types.SimpleNamespace(t=torch.ones(2, dtype=torch.float64, requires_grad=True))

    def mod(score, b, h, q_idx, kv_idx):
        return score * holder.t[h]

    with pytest.raises(ValueError, match="requires grad"):
        attnkit.attention(q, k, v, score_mod=mod, window=(1, 1), backend="blockwise")


def test_gradcheck_float64():
    q, k, v = qkv(1, 2, 1, 6, 7, d=3, grad=True)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    table = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, slopes, table):
        mod = scores.compose(scores.alibi(slopes, offset=1), scores.relative_position_bias(table, 2, offset=1))
        return run(SMALL, q, k, v, score_mod=mod, window=(3, 1), mask_mod=checkerboard)

    assert torch.autograd.gradcheck(fn, (q, k, v, slopes, table))


# Found by 1,500 examples: the fused path reused the mask of another tile whose padding rows
# had made a column "full" (the cache key lacked the partial pattern).
@example(lq=6, lk=6, groups=(2, 2), left=0, right=None, causal=False, q_tile=4, kv_block=1, kv_chunk=2, budget=1,
         with_mod=False, fused=True)
@given(
    lq=st.integers(1, 12), lk=st.integers(1, 12), groups=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    left=st.one_of(st.none(), st.integers(0, 14)), right=st.one_of(st.none(), st.integers(0, 14)),
    causal=st.booleans(), q_tile=st.integers(1, 6), kv_block=st.integers(1, 6), kv_chunk=st.integers(1, 13),
    budget=st.sampled_from([1, 50, 10_000]), with_mod=st.booleans(), fused=st.booleans(),
)
def test_property_any_tiling_matches_oracle(lq, lk, groups, left, right, causal, q_tile, kv_block, kv_chunk,
                                            budget, with_mod, fused):
    h, hkv = groups
    kind = FusedTilesBackend if fused and not with_mod else TilesBackend
    backend = kind(q_tile=q_tile, kv_block=kv_block, kv_chunk=kv_chunk, score_budget=budget)
    q, k, v = qkv(1, h, hkv, lq, lk)
    kw = {"window": (left, right), "is_causal": causal}
    if with_mod:
        kw["mask_mod"] = checkerboard
        kw["score_mod"] = scores.alibi(scores.alibi_slopes(h, dtype=torch.float64))
    allowed = oracle.allowed_grid(1, h, lq, lk, is_causal=causal, window=(left, right), mask_mod=kw.get("mask_mod"))
    close(run(backend, q, k, v, **kw), oracle.attention(q, k, v, allowed=allowed, score_mod=kw.get("score_mod"))[0],
          torch.float64)


def test_batch_dims_other_than_four():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 2, 9, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 1, 11, 4, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 1, 11, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 1, 9, 11, generator=g) > 0.3
    close(run(SMALL, q, k, v, window=(2, 3), mask=mask), run(REFERENCE, q, k, v, window=(2, 3), mask=mask))
    q3, k3, v3 = q[0, 0], k[0, 0], v[0, 0]
    close(run(SMALL, q3, k3, v3, window=(1, 0)), run(REFERENCE, q3, k3, v3, window=(1, 0)))


def test_empty_lengths():
    q, k, v = qkv(1, 2, 2, 0, 5)
    assert run(SMALL, q, k, v, window=(1, 1)).shape == (1, 2, 0, 8)
    q, k, v = qkv(1, 2, 2, 3, 0, grad=True)
    out = run(SMALL, q, k, v, window=(1, 1))
    assert out.shape == (1, 2, 3, 8) and (out == 0).all()


def test_matches_pytorch_sdpa_float32():
    q, k, v = qkv(2, 4, 4, 70, 70, d=16, dtype=torch.float32)
    mask = masks.sliding_window(70, left=9, right=4)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    close(run(FusedTilesBackend(q_tile=16, kv_block=8), q, k, v, window=(9, 4)), want)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    close(run(FusedTilesBackend(q_tile=16, kv_block=8), q, k, v, is_causal=True), want)


class LargestProduct(TorchDispatchMode):
    """The most elements any matrix product returned while active (the score tiles a kernel held)."""

    PRODUCTS = {torch.ops.aten.bmm.default, torch.ops.aten.mm.default, torch.ops.aten.matmul.default,
                torch.ops.aten.baddbmm.default, torch.ops.aten.addmm.default}

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.PRODUCTS:
            self.largest = max(self.largest, out.numel())
        return out



def test_never_holds_the_score_matrix():
    n, h = 1024, 2
    q, k, v = qkv(1, h, h, n, n, d=16, dtype=torch.float32, grad=True)
    backend = TilesBackend(q_tile=64, kv_block=64, kv_chunk=256, score_budget=1 << 15)
    with LargestProduct() as seen:  # every matmul's output, forward and backward, seen from outside the backend
        out = run(backend, q, k, v, window=(100, 100), score_mod=scores.softcap(5.0))
        out.sum().backward()
    assert 0 < seen.largest <= (1 << 15)
    assert seen.largest * 32 <= h * n * n
    mask = masks.sliding_window(n, left=100, right=100)
    close(out, attnkit.attention(q, k, v, mask=mask, score_mod=scores.softcap(5.0), backend="reference"))


def test_plan_skips_empty_and_masks_only_partial_blocks():
    kinds = attnkit.mask_plan(q_len=8, is_causal=True).kinds(2, 2)
    E, Fu, P = tile_schedule.EMPTY, tile_schedule.FULL, tile_schedule.PARTIAL
    assert kinds.tolist() == [[P, E, E, E], [Fu, P, E, E], [Fu, Fu, P, E], [Fu, Fu, Fu, P]]
    kinds = attnkit.mask_plan(q_len=8, kv_len=9, window=(1, 1)).kinds(4, 4)
    assert kinds.tolist() == [[P, P, E], [E, P, P]]  # last block (1 real key of 4) is partial
    docs = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    doc = masks.document_mod(docs)
    refined = tile_schedule.refine_kinds(torch.full((2, 2), Fu, dtype=torch.int8),
                                   lambda q, kv: doc(None, None, q, kv), 8, 4, 4, 8)
    assert refined.tolist() == [[Fu, E], [E, Fu]]
    batches = tile_schedule.plan_batches(refined, 4, 8, rows_per_tile=4, score_budget=1000)
    assert [(b.tiles.tolist(), b.starts.tolist(), b.partial) for b in batches] == [([0, 1], [0, 4], ())]


def test_mask_mod_is_only_evaluated_on_partial_blocks_after_planning():
    calls = []

    def mod(b, h, q_idx, kv_idx):
        calls.append(kv_idx.shape[-1])
        return kv_idx >= 0

    q, k, v = qkv(1, 2, 2, 16, 16)
    backend = FusedTilesBackend(q_tile=4, kv_block=4, kv_chunk=16)
    req = validate_call(q, k, v, mask_mod=mod)
    st = backend._plan(req)
    assert calls and all(b.partial == () for b in st.batches)  # planning evaluated, all blocks full
    calls.clear()
    close(tiles._from_tiles(tiles._forward(st, q, k, v)[0], st), run(REFERENCE, q, k, v))
    assert calls == []


def test_auto_selection_and_refusals():
    q, k, v = qkv(1, 2, 2, 5, 5)
    assert attnkit.which_backend(q, k, v) == "sdpa"
    assert attnkit.which_backend(q, k, v, window=(1, 1)) == "band"
    assert attnkit.which_backend(q, k, v, mask_mod=checkerboard) == "band"  # intervals per head
    wide = qkv(1, 2, 2, 5, 600)
    every_other = lambda b, h, i, j: j % 2 == 0  # noqa: E731 (300 runs a row: no interval form)
    assert attnkit.which_backend(*wide, mask_mod=every_other) == "fused_tiles"
    assert attnkit.which_backend(q, k, v, score_mod=scores.softcap(2.0)) == "band"  # the kernel caps too
    assert attnkit.which_backend(q, k, v, score_mod=lambda s, b, h, i, j: s * 2) == "tiles"
    assert attnkit.which_backend(q, k, v, window=(1, 1), backend="blockwise") == "band"  # a family: its first fit
    assert attnkit.which_backend(q, k, v, window=(1, 1), return_weights=True) == "reference"
    assert attnkit.which_backend(q, k, v, window=(1, 1), dropout_p=0.1) == "reference"
    with pytest.raises(ValueError) as refused:
        attnkit.attention(q, k, v, window=(1, 1), return_weights=True, backend="blockwise")
    # the call, then each candidate on a line of its own with its reasons
    assert str(refused.value).splitlines() == [
        "no backend of the 'blockwise' family can serve this call (query (1, 2, 5, 8), key (1, 2, 5, 8), "
        "value (1, 2, 5, 8), torch.float64 on cpu; window (1, 1); return_weights):",
        "  band: the band backend never forms the weights (use backend='reference')",
        "  fused_tiles: the fused_tiles backend never forms the weights (use backend='reference')",
        "  tiles: the tiles backend never forms the weights (use backend='reference')"]
    with pytest.raises(ValueError, match="backend 'fused_tiles' cannot serve this call .*: PyTorch's fused CPU kernel"):
        attnkit.attention(q, k, v, score_mod=scores.softcap(2.0), backend="fused_tiles")
    with pytest.raises(ValueError, match="backend 'band' cannot serve this call .*: the score_mod is not an additive"):
        attnkit.attention(q, k, v, score_mod=lambda s, b, h, i, j: s * 2, backend="band")
    with pytest.raises(ValueError, match="q_tile must be a positive int or None, got 0"):
        TilesBackend(q_tile=0)


def test_invariants_masked_keys_and_future_tokens_do_not_matter():
    q, k, v = qkv(1, 2, 2, 12, 12)
    out = run(SMALL, q, k, v, window=(2, 0))
    k2, v2 = k.clone(), v.clone()
    k2[..., :3, :] += 5.0
    v2[..., :3, :] -= 5.0  # keys 0..2 are outside the window of queries 5..11
    close(run(SMALL, q, k2, v2, window=(2, 0))[..., 5:, :], out[..., 5:, :])
    k3, v3 = k.clone(), v.clone()
    k3[..., 8:, :] = 0.0
    v3[..., 8:, :] = 1.0  # future tokens never change earlier causal outputs
    close(run(SMALL, q, k3, v3, window=(2, 0))[..., :8, :], out[..., :8, :])
