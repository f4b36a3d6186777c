"""The banded C++ kernel (``attnkit/backends/csrc/band/``) for pure window and causal requests.

Against the float64 oracle (outputs) and the reference backend (gradients): windows from 0 to
beyond the length, unbounded sides, causal, GQA, ``Lq != Lk`` both ways, rows with nothing to
attend, values narrower than queries, extra batch dims, strided inputs, two threads adding into
the same dQ rows; gradcheck; when it is chosen; and a build that fails its self-check (building
and caching it: ``test_build_cache.py``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import masks, scores
from attnkit.backends import _band
from attnkit.call import validate_call
from tests.backends.test_fused_tiles import check_against_oracle, oracle_grid, qkv
from tests.support import oracle
from tests.support.tolerances import EXP_WEIGHTS_FP32, LOG_ROW_SUM_HALF, close

BAND = attnkit.backends.get("band")
REFERENCE = attnkit.backends.get("reference")


def test_the_kernel_builds_and_passes_its_self_check():
    assert _band.available(), _band.unavailable_reason()
    assert _band.unavailable_reason() is None


@pytest.mark.parametrize("case", [
    {"window": (0, 0)},
    {"window": (3, 5)},
    {"window": (40, 40)},
    {"window": (500, 500)},  # wider than the sequence
    {"window": (None, 7)},
    {"window": (7, None)},
    {"is_causal": True},
    {"is_causal": True, "window": (9, 4)},  # causal caps the right side at 0
    {"is_causal": True, "window": (None, None)},
], ids=str)
@pytest.mark.parametrize("sizes", [(1, 2, 2, 130, 130), (2, 4, 1, 70, 150), (1, 4, 2, 150, 70)],
                         ids=["square", "gqa_short_queries", "gqa_long_queries"])
def test_matches_the_oracle(case, sizes):
    b, h, hkv, lq, lk = sizes
    check_against_oracle(BAND, *qkv(b, h, hkv, lq, lk, d=16), **case)


DOCS = torch.tensor([0] * 13 + [1] * 30 + [3] * 2 + [4] * 25)  # 70 packed tokens, documents of 13, 30, 2, 25
INTERVAL_MODS = {
    "documents": masks.document_mod(DOCS),
    "documents_causal": masks.and_masks(masks.document_mod(DOCS), masks.causal_mod()),
    "documents_per_batch": masks.document_mod(torch.stack([DOCS, torch.arange(70) // 9])),
    "documents_missing_in_keys": masks.document_mod(DOCS, torch.tensor([0] * 40 + [3] * 30)),  # 1, 4: no keys
    "prefix_lm": masks.prefix_lm_mod(20),
    "prefix_lm_per_batch": masks.prefix_lm_mod(torch.tensor([0, 33])),
    "padding": masks.padding_mod(torch.tensor([70, 0])),  # element 1 has no keys at all
    "padding_causal_offset": masks.and_masks(masks.padding_mod(torch.tensor([55, 70])), masks.causal_mod(-5)),
    "window_mod": masks.window_mod(4, None, offset=3),
}


@pytest.mark.parametrize("name", list(INTERVAL_MODS))
def test_interval_mask_mods_match_the_oracle(name):
    q, k, v = qkv(2, 4, 2, 70, 70, d=16)
    mod = INTERVAL_MODS[name]
    assert not BAND.not_supported_reasons(validate_call(q, k, v, mask_mod=mod))  # served by the kernel
    check_against_oracle(BAND, q, k, v, mask_mod=mod)
    check_against_oracle(BAND, q, k, v, mask_mod=mod, window=(6, 2))  # and intersected with a window


@given(lq=st.integers(1, 90), lk=st.integers(1, 90),
       left=st.one_of(st.none(), st.integers(0, 100)), right=st.one_of(st.none(), st.integers(0, 100)),
       causal=st.booleans(), heads=st.sampled_from([(1, 1), (2, 1), (3, 3), (4, 2)]),
       dims=st.sampled_from([(8, 8), (16, 4), (5, 9)]), extra=st.sampled_from(["", "padding", "prefix", "documents"]),
       cut=st.integers(0, 95))
def test_property_any_interval_mask_and_shape(lq, lk, left, right, causal, heads, dims, extra, cut):
    h, hkv = heads
    e, ev = dims
    q, k, v = qkv(2, h, hkv, lq, lk, d=e, dv=ev, seed=lq * 131 + lk)
    mod = {"": None, "padding": masks.padding_mod(torch.tensor([cut, lk])), "prefix": masks.prefix_lm_mod(cut),
           "documents": masks.document_mod(torch.arange(lq) * 4 // lq, torch.arange(lk) * 4 // lk)}[extra]
    check_against_oracle(BAND, q, k, v, window=(left, right), is_causal=causal, mask_mod=mod)


def test_rows_with_nothing_to_attend_are_zero_with_zero_gradients():
    q, k, v = qkv(1, 2, 2, 40, 12)  # queries 0..27 sit before every key the window (2, 0) allows
    out = BAND(validate_call(q, k, v, window=(2, 0)))[0]
    assert torch.equal(out[:, :, :26], torch.zeros_like(out[:, :, :26]))
    out.sum().backward()
    assert torch.equal(q.grad[:, :, :26], torch.zeros_like(q.grad[:, :, :26]))
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_float32_matches_the_oracle_and_pytorch_sdpa():
    q, k, v = qkv(2, 4, 4, 333, 333, d=32, dtype=torch.float32)
    band = masks.sliding_window(333, left=50, right=7)
    got = BAND(validate_call(q, k, v, window=(50, 7)))[0]
    close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band))
    close(got, oracle.attention(q, k, v, allowed=band)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_power_of_two_scale_taken_into_the_queries_is_exact(dtype):
    """With a scale of 1/8 the forward scales the queries, not the scores: every product and sum
    of q k^T is scaled by the same power of two, so it is bit for bit the unscaled product scaled,
    here the keys scaled instead (a window, ALiBi on causal rows, and rows that see every key)."""
    q, k, v = qkv(1, 3, 3, 1200, 1200, d=64, dtype=dtype)
    slopes = torch.tensor([0.5, 0.25, 0.125], dtype=dtype)

    def global_rows(b, h, i, j):  # rows that see every key, computed apart from their block's
        return ((i - j).abs() <= 20) | (i < 4) | (j < 4)

    for case in ({"window": (40, 3)}, {"is_causal": True, "score_mod": scores.alibi(slopes)},
                 {"mask_mod": global_rows}):
        got = attnkit.attention(q, k, v, scale=0.125, backend="band", **case)
        want = attnkit.attention(q, k * 0.125, v, scale=1.0, backend="band", **case)
        assert torch.equal(got, want), case


def exact_scores(keys: int, spread: int):
    """512 queries of sixteenths, each row times 2^0 .. 2^(spread - 1), and `keys` keys of integers (64 wide,
    exact in bfloat16 and float16 too), and their scores with a scale of 1/64 in float64: every product and
    sum exact in float32."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-64, 65, (1, 1, 512, 64), generator=g) / 16
    q = q * 2.0 ** torch.randint(0, spread, (1, 1, 512, 1), generator=g)
    k = torch.randint(-16, 17, (1, 1, keys, 64), generator=g).float()
    return q, k, (q.double() @ k.double().transpose(-1, -2)) / 64


def test_the_softmax_weights_on_exact_scores_are_float64s_exp_within_a_few_roundings():
    """Scores exact in float32 (keys of integers, queries of sixteenths, a power-of-two scale) and the values
    the identity, so that each output row is the row's weights: over the row's largest they are exp(s - max)
    but for the kernel's exponential and two roundings. The rows' scales spread s - max to -80. An
    exponential a few float32 roundings off (a polynomial of too low a degree, a wrong coefficient) fails
    here and passes every output tolerance (atol 2e-5)."""
    q, k, s = exact_scores(64, spread=5)
    assert torch.equal(q @ k.transpose(-1, -2) / 64, s.float())  # the premise: nothing rounded
    out = attnkit.attention(q, k, torch.eye(64).reshape(1, 1, 64, 64), scale=1 / 64, backend="band").double()
    x = s - s.amax(-1, keepdim=True)
    assert x.min() < -80  # the range the exponential is asked for
    ratio = out / out.gather(-1, s.argmax(-1, keepdim=True))
    keep = x > -80
    rel = ((ratio - x.exp()) / x.exp()).abs()[keep]
    assert rel.max() <= EXP_WEIGHTS_FP32, rel.max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_row_sums_are_float64s_within_the_shorter_exponentials_error(dtype):
    """Scores exact in the half type (queries of sixteenths, keys of integers, a power-of-two scale): the
    kernel's row maximum is float64's exactly, and the log of its row sum is float64's within the error
    of the exponential that half products take (a shorter polynomial, its weights rounded next). One of a
    lower degree, or a wrong coefficient, is 1e-4 off and fails here."""
    assert _band.available()
    q, k, s = exact_scores(256, spread=3)
    v = torch.randn(1, 1, 256, 64, generator=torch.Generator().manual_seed(1))
    starts = torch.zeros(1, 512, 1, dtype=torch.int64)
    _, stats = _band._run(q.to(dtype), k.to(dtype), v.to(dtype), starts, torch.full_like(starts, 256), None, 1 / 64)
    assert torch.equal(stats[0].double(), s.amax(-1))
    want = torch.logsumexp(s - s.amax(-1, keepdim=True), -1)
    assert want.max() > 2  # rows of many weights, not one
    err = (stats[1].double() - want).abs().max().item()
    assert err <= LOG_ROW_SUM_HALF, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_are_computed_in_float32(dtype):
    q, k, v = qkv(1, 2, 2, 50, 50, d=16, dtype=dtype)
    out = BAND(validate_call(q, k, v, window=(4, 4)))[0]
    assert out.dtype == dtype
    close(out, oracle.attention(q, k, v, allowed=masks.sliding_window(50, left=4, right=4))[0], dtype)
    out.float().sum().backward()
    assert q.grad.dtype == dtype and k.grad.dtype == dtype


def test_strided_inputs_and_extra_batch_dims():
    g = torch.Generator().manual_seed(3)
    # [B, L, H, E] storage seen as [B, H, L, E] (what a fused qkv projection gives), and a 5-D batch.
    q = torch.randn(2, 3, 37, 4, 8, generator=g, dtype=torch.float64).transpose(-2, -3).requires_grad_()
    k = torch.randn(2, 3, 37, 4, 8, generator=g, dtype=torch.float64).transpose(-2, -3).requires_grad_()
    v = torch.randn(2, 3, 4, 37, 16, generator=g, dtype=torch.float64)[..., ::2].requires_grad_()
    got = BAND(validate_call(q, k, v, window=(5, 2)))[0]
    want = REFERENCE(validate_call(q, k, v, window=(5, 2)))[0]
    close(got, want)
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout), strict=True):
        assert a.shape == b.shape
        close(a, b)


def test_two_threads_adding_into_shared_query_rows_give_the_exact_gradient():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q, k, v = qkv(1, 2, 1, 700, 700, d=16)  # 11 key blocks per head, each adding into ~8 query blocks
        check_against_oracle(BAND, q, k, v, window=(100, 100))
    finally:
        torch.set_num_threads(threads)


def test_gradcheck():
    q, k, v = qkv(1, 2, 1, 9, 11, d=4, dv=3)
    assert torch.autograd.gradcheck(lambda a, b, c: BAND(validate_call(a, b, c, window=(2, 1)))[0], (q, k, v))


def test_double_backward_is_refused_not_wrong():
    q, k, v = qkv(1, 1, 1, 6, 6, d=4)
    out = BAND(validate_call(q, k, v, window=(1, 1)))[0]
    (gq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|no autograd formula"):
        gq.sum().backward()


def test_chosen_when_every_row_sees_one_interval_of_keys(monkeypatch):
    calls = []
    monkeypatch.setattr(_band, "attention", lambda req, plan: calls.append(req) or REFERENCE(req)[0])
    q, k, v = qkv(2, 2, 2, 20, 20)
    served = [{"window": (2, 2)}, {"is_causal": True}, {"mask_mod": masks.causal_mod()},
              {"window": (2, 2), "mask_mod": masks.padding_mod(torch.tensor([20, 7]))},
              {"mask_mod": masks.and_masks(masks.document_mod(torch.arange(20) // 6), masks.causal_mod())},
              {"mask_mod": masks.prefix_lm_mod(torch.tensor([3, 9]))},
              {},  # no mask: every row sees every key
              {"mask_mod": lambda b, h, i, j: j <= i},  # a user's predicate: its plan finds the rows
              {"mask_mod": masks.or_masks(masks.causal_mod(), masks.window_mod(0, 2))},  # a union that is one run
              {"window": (2, 2), "mask": torch.ones(20, 20, dtype=torch.bool)},  # a dense mask: its rows are found
              {"mask_mod": lambda b, h, i, j: (i + h) % 2 == j % 2}]  # depends on the head: rows per head
    for case in served:
        assert attnkit.which_backend(q, k, v, backend="blockwise", **case) == "band"
        want = attnkit.attention(q, k, v, backend="reference", **case)
        close(attnkit.attention(q, k, v, backend="band", **case), want)
    assert len(calls) == len(served)
    wide = qkv(2, 2, 2, 20, 600)
    for case, args in [({"window": (2, 2), "bias": torch.ones(20, 20, dtype=torch.float64)}, (q, k, v)),  # dense bias
                       ({"mask_mod": lambda b, h, i, j: j % 2 == 0}, wide)]:  # 300 runs a row: no interval form
        assert attnkit.which_backend(*args, backend="blockwise", **case) == "fused_tiles"
    assert len(calls) == len(served)


def test_forcing_it_where_it_cannot_run_says_why():
    q, k, v = qkv(1, 2, 2, 5, 5)
    band = attnkit.backends.get("band")
    wide = qkv(1, 2, 2, 5, 600)
    reasons = band.not_supported_reasons(validate_call(*wide, mask_mod=lambda b, h, i, j: j % 2 == 0))
    assert reasons == ["the mask has no interval form (a row has too many runs of keys)"]
    assert band.not_supported_reasons(validate_call(q, k, v, window=(1, 1))) == []
    with pytest.raises(ValueError, match="backend 'band' cannot serve this call .*: a dense bias"):
        attnkit.attention(q, k, v, bias=torch.ones(5, 5), backend="band")
    with pytest.raises(ValueError, match="the score_mod is not an additive bias per head and diagonal"):
        band(validate_call(q, k, v, score_mod=lambda s, b, h, i, j: s * 2))


@pytest.fixture
def fresh_check():
    """Forget the once-per-process check (the compiled module itself stays cached)."""
    _band._checked.cache_clear()
    yield
    _band._checked.cache_clear()


def test_a_wrong_kernel_is_refused_and_the_tile_plan_takes_over(monkeypatch, fresh_check):
    real = _band._module()

    class Off:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def forward(q, k, v, *args):
            out, lse = real.forward(q, k, v, *args)
            return out * 1.001, lse

    monkeypatch.setattr(_band, "_module", lambda: Off())
    with pytest.warns(RuntimeWarning, match="banded kernel self-check against the formula failed") as seen:
        assert not _band.available()
    assert len(seen) == 1
    assert "self-check against the formula failed: out differs" in _band.unavailable_reason()
    q, k, v = qkv(1, 2, 2, 30, 30)
    check_against_oracle(attnkit.backends.get("fused_tiles"), q, k, v, window=(3, 3))


def test_the_first_call_may_come_under_no_grad_or_inference_mode(fresh_check):
    q, k, v = qkv(1, 2, 2, 30, 30)
    with torch.inference_mode():
        out = attnkit.backends.get("band")(validate_call(q, k, v, window=(3, 3)))[0]
    assert _band.available()
    close(out, oracle.attention(q, k, v, allowed=masks.sliding_window(30, left=3, right=3))[0])


@pytest.mark.parametrize("lengths", [(0, 5, 5, 8), (1, 0, 0, 8), (1, 5, 0, 8), (None, 5, 5, 8), (1, 5, 5, 0)],
                         ids=["no_batch", "no_queries", "no_keys", "3d", "no_value_dims"])
def test_empty_and_unbatched_inputs(lengths):
    b, lq, lk, ev = lengths
    lead = () if b is None else (b,)
    q, k = (torch.randn(*lead, 2, n, 8, dtype=torch.float64, requires_grad=True) for n in (lq, lk))
    v = torch.randn(*lead, 2, lk, ev, dtype=torch.float64, requires_grad=True)
    out = BAND(validate_call(q, k, v, window=(1, 1)))[0]
    assert out.shape == (*q.shape[:-1], ev)
    close(out, REFERENCE(validate_call(q, k, v, window=(1, 1)))[0])
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_rows_the_blas_cannot_read_in_place_are_copied_first():
    # A query row broadcast along the length (row stride 0) and a dout that is a broadcast 1.
    q = torch.randn(1, 2, 1, 8, dtype=torch.float64).expand(1, 2, 20, 8).requires_grad_()
    k, v = qkv(1, 2, 2, 20, 20)[1:]
    got = BAND(validate_call(q, k, v, window=(3, 3)))[0]
    want = REFERENCE(validate_call(q, k, v, window=(3, 3)))[0]
    close(got, want)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    for a, b in zip(grads, torch.autograd.grad(want.sum(), (q, k, v)), strict=True):
        close(a, b)


def check_scored(q, k, v, params, allowed, **kw):
    """A score_mod through the kernel: output against the oracle (``allowed``: its grid for ``kw``'s mask),
    gradients (params too) against the reference."""
    assert not BAND.not_supported_reasons(validate_call(q, k, v, **kw))  # served by the kernel
    out = BAND(validate_call(q, k, v, **kw))[0]
    close(out, oracle.attention(q, k, v, allowed=allowed, score_mod=kw["score_mod"])[0], q.dtype)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, *params), dout)
    want = torch.autograd.grad(REFERENCE(validate_call(q, k, v, **kw))[0], (q, k, v, *params), dout)
    for a, b in zip(got, want, strict=True):
        close(a, b, q.dtype)


@pytest.mark.parametrize("case", [{}, {"is_causal": True}, {"window": (9, 4)},
                                  {"mask_mod": masks.document_mod(torch.arange(60) // 25, torch.arange(70) // 29)}],
                         ids=["full", "causal", "window", "documents"])
@pytest.mark.parametrize("heads", [4, 6], ids=["one_per_head", "more_than_heads"])  # the mods read slopes[h]
def test_alibi_and_relative_position_bias_with_gradients_into_their_parameters(case, heads):
    q, k, v = qkv(2, 4, 2, 60, 70, d=16)
    slopes = torch.nn.Parameter(scores.alibi_slopes(heads).double())
    table = torch.nn.Parameter(torch.randn(heads, 2 * 6 + 1, dtype=torch.float64))
    allowed = oracle_grid(2, 4, 60, 70, **case)  # the three score_mods share the mask: its grid built once
    check_scored(q, k, v, [slopes], allowed, score_mod=scores.alibi(slopes, offset=10), **case)
    check_scored(q, k, v, [table], allowed, score_mod=scores.relative_position_bias(table, 6, offset=10), **case)
    both = scores.compose(scores.alibi(slopes), scores.relative_position_bias(table, 6))
    check_scored(q, k, v, [slopes, table], allowed, score_mod=both, **case)


def test_score_mods_that_are_not_a_diagonal_bias_take_the_tile_plan():
    q, k, v = qkv(1, 4, 4, 20, 20)
    for mod in (scores.compose(scores.softcap(5.0), scores.alibi(scores.alibi_slopes(4))),  # a cap before a bias
                scores.alibi(scores.alibi_slopes(3)),  # three slopes for four heads
                lambda s, b, h, i, j: s + (i * j)):  # a bias, not a function of j - i
        assert BAND.not_supported_reasons(validate_call(q, k, v, window=(3, 3), score_mod=mod))
    diagonal = lambda s, b, h, i, j: s + (i == j)  # noqa: E731 - a bias on one diagonal, written by hand
    for served in (diagonal, scores.softcap(5.0), scores.compose(scores.alibi(scores.alibi_slopes(4)),
                                                                 scores.softcap(5.0))):  # a bias, then a cap
        assert not BAND.not_supported_reasons(validate_call(q, k, v, window=(3, 3), score_mod=served))


def test_gradcheck_with_a_learned_table():
    q, k, v = qkv(1, 2, 1, 7, 9, d=4, dv=3)
    table = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)

    def fn(a, b, c, t):
        return BAND(validate_call(a, b, c, is_causal=True, score_mod=scores.relative_position_bias(t, 2)))[0]

    assert torch.autograd.gradcheck(fn, (q, k, v, table))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kw", [{"is_causal": True}, {"window": (2, 1)}], ids=["causal", "window"])
def test_head_size_zero_gives_each_row_the_mean_of_the_values_it_sees(kw, dtype):
    """With ``q``, ``k`` of head size 0 every score is 0: each row is the mean of the values it may attend, and
    ``dv`` is each key's share of the rows that see it (the kernel once returned zeros, and ``auto`` chose it)."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.empty(2, 3, 7, 0, dtype=dtype), torch.empty(2, 3, 7, 0, dtype=dtype)
    v = torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64)
    allowed = oracle.allowed_grid(2, 3, 7, 7, **kw)
    want, weights = oracle.attention(q, k, v, allowed=allowed, scale=1.0)
    dout = torch.randn(want.shape, generator=g, dtype=torch.float64)
    dv_want = weights.transpose(-2, -1) @ dout
    v = v.to(dtype).requires_grad_()
    out = attnkit.attention(q, k, v, **kw)
    (dv,) = torch.autograd.grad(out, v, dout.to(dtype))
    close(out, want, dtype)
    close(dv, dv_want, dtype)
    assert BAND.not_supported_reasons(validate_call(q, k, v, **kw)) == [
        "head size 0 (every score is 0, each row the mean of its values): the kernel needs q and k columns"]
