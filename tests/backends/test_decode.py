"""The decode backend (``backends/decode.py``, ``csrc/band/decode.cpp``): a few queries over a cache, each key and
value read once. Against the float64 oracle and SDPA, in every dtype it takes, grouped and plain heads, masks and
key ranges, the split of a long range over threads, its finiteness flag, what it refuses, and its native boundary."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.backends import _band
from attnkit.backends import decode as decode_module
from attnkit.backends.sdpa import SDPABackend
from attnkit.call import validate_call
from tests.support import oracle, poison
from tests.support.tolerances import close

pytestmark = [pytest.mark.skipif(not _band.available(), reason="the band kernel (which holds decode) is not built"),
              pytest.mark.usefixtures("one_thread")]

NAN, INF = float("nan"), float("inf")
BACKEND = decode_module.DecodeBackend()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]




def _qkv(b, h, hkv, lq, lk, dtype=torch.float32, d=16, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, lk, dv or d, generator=g).to(dtype)
    return q, k, v


def _padding(b, lk, seed=5):
    """One mask row per batch element (left padding of a batch): element i drops its first 3 * i keys."""
    m = torch.ones(b, 1, 1, lk, dtype=torch.bool)
    for i in range(b):
        m[i, ..., : 3 * i] = False
    return m


def _check(q, k, v, dtype, **kw):
    req = validate_call(q, k, v, **kw)
    assert not BACKEND.not_supported_reasons(req)
    out, _ = BACKEND(req)
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    allowed = oracle.allowed_grid(b, h, lq, lk, is_causal=kw.get("is_causal", False), window=kw.get("window"),
                                  mask=kw.get("mask"))
    want, _ = oracle.attention(q, k, v, allowed=allowed, scale=kw.get("scale"), score_mod=kw.get("score_mod"))
    close(out, want, dtype)
    if "window" not in kw and "score_mod" not in kw:  # SDPA takes no window or score_mod
        close(out, SDPABackend()(req)[0], dtype)
    got = BACKEND.if_finite(req)
    assert got is not None and torch.equal(got[0], out)  # the checked call is the same call
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (6, 1)], ids=["GQA", "MHA", "MQA"])
@pytest.mark.parametrize("lq", [1, 3, 8])
@pytest.mark.parametrize("case", ["none", "causal", "padding", "window", "per-head mask with a dead row"])
def test_the_kernel_gives_the_oracles_answer(dtype, heads, lq, case):
    h, hkv = heads
    lk = 77  # odd: a partial block of keys and of vector lanes
    q, k, v = _qkv(2, h, hkv, lq, lk, dtype, d=24, dv=40)
    kw = {"none": {}, "causal": {"is_causal": True}, "padding": {"mask": _padding(2, lk), "is_causal": True},
          "window": {"window": (20, 0)}}.get(case)
    if kw is None:
        m = torch.rand(2, h, lq, lk, generator=torch.Generator().manual_seed(3)) < 0.5
        m[1, -1, -1] = False
        kw = {"mask": m}
    out = _check(q, k, v, dtype, **kw)
    if case.endswith("dead row"):
        assert torch.equal(out[1, -1, -1], torch.zeros_like(out[1, -1, -1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_real_head_sizes_over_a_long_cache(dtype, d):
    q, k, v = _qkv(1, 4, 2, 1, 1000, dtype, d=d)
    _check(q, k, v, dtype, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [2, 3, 4, 5, 7, 9])
@pytest.mark.parametrize("d", [64, 80, 128])
def test_grouped_rows_read_together_give_each_rows_answer(dtype, g, d):
    """Rows that share keys are scored four or two at a time over whole blocks (dots4x4, dots2x8) and take the
    values two at a time (add_values2), the rest one by one: every split of G rows into those, over several whole
    blocks and a partial one, against the oracle; a window and a padding mask keep per-row masking in the mix."""
    q, k, v = _qkv(2, 2 * g, 2, 1, 100, dtype, d=d, dv=d, seed=g + d)
    _check(q, k, v, dtype)
    _check(q, k, v, dtype, window=(70, 0), mask=_padding(2, 100))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 4), (4, 4)], ids=["GQA", "MHA"])
@pytest.mark.parametrize("cap", [50.0, 0.5])
def test_soft_capped_scores_are_served_as_gemma_2_caps_them(dtype, heads, cap):
    """``cap * tanh(score * scale / cap)``, Gemma 2's soft cap, inside the pass: a cap of 0.5 bends every score."""
    q, k, v = _qkv(2, heads[0], heads[1], 1, 300, dtype, d=256)
    kw = {"is_causal": True, "score_mod": attnkit.scores.softcap(cap), "scale": 0.0625}
    assert attnkit.which_backend(q, k, v, **kw) == "decode"
    _check(q, k, v, dtype, **kw)


def test_a_score_mod_other_than_a_soft_cap_is_refused():
    q, k, v = _qkv(1, 4, 2, 1, 20)
    capped_alibi = attnkit.scores.compose(attnkit.scores.alibi(attnkit.scores.alibi_slopes(4)),
                                          attnkit.scores.softcap(5.0))
    for mod in (lambda s, b, h, i, j: s * 2, capped_alibi):
        reasons = BACKEND.not_supported_reasons(validate_call(q, k, v, score_mod=mod))
        assert any("tanh soft-capping alone" in r for r in reasons), reasons


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", [NAN, INF], ids=["NaN", "+inf"])
def test_a_zero_query_or_a_zero_weight_hides_no_non_finite_key_or_value(dtype, where, value):
    """The flag reads keys through row 0's raw scores and values through its accumulator: a query of zeros scores
    an infinite key NaN (0 * inf), and a value whose weight is 0 (masked inside the range read) is still added in."""
    q, k, v = _qkv(2, 4, 2, 1, 100, dtype, d=64)
    q.zero_()
    mask = torch.ones(2, 1, 1, 100, dtype=torch.bool)
    mask[..., 40] = False
    {"k": k, "v": v}[where][1, 0, 40, 7] = value
    assert BACKEND.if_finite(validate_call(q, k, v, mask=mask)) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_call_that_reads_past_the_last_level_cache_gives_the_same_answer(dtype):
    """Over 32 MiB of keys and values read (6,001 keys of 16 heads): the kernel asks for its blocks ahead
    (prefetch_pays) and reads float keys a row at a time (Shape.grouped), which must change no number. Against
    SDPA on the same inputs widened to float32, with the key range cut by a window."""
    q, k, v = _qkv(1, 32, 16, 1, 8192, dtype, d=128)
    req = validate_call(q, k, v, window=(6000, 0))
    out, _ = BACKEND(req)
    allowed = torch.zeros(1, 1, 1, 8192, dtype=torch.bool)
    allowed[..., 8191 - 6000:] = True
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed,
                                                            enable_gqa=True)
    close(out, want.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_long_range_split_over_threads_merges_to_the_same_answer(dtype):
    """One batch element and one key/value head, four threads: the range is split in chunks merged after."""
    q, k, v = _qkv(1, 4, 1, 2, 3000, dtype, d=32)
    one = _check(q, k, v, dtype, is_causal=True)
    torch.set_num_threads(4)
    split = _check(q, k, v, dtype, is_causal=True)
    close(split, one, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_strided_cache_view_is_read_in_place(dtype):
    """A KV cache's written part is a view with a row stride of the whole buffer: no copy needed. Such a cache
    (written in place, cold) is read with its blocks, and each next (b, c)'s first blocks, asked for ahead
    (written_in_place, prefetch_pays): the same bits as the fresh tensors, which are not."""
    q, k, v = _qkv(2, 4, 2, 1, 300, dtype, d=16)
    kb, vb = torch.zeros(2, 2, 512, 16, dtype=dtype), torch.zeros(2, 2, 512, 16, dtype=dtype)
    kb[:, :, :300], vb[:, :, :300] = k, v
    out = _check(q, kb[:, :, :300], vb[:, :, :300], dtype)
    close(out, _check(q, k, v, dtype), dtype, atol=0, rtol=0)


@settings(deadline=None, derandomize=True, max_examples=25)
@given(b=st.integers(1, 3), hkv=st.integers(1, 3), g=st.integers(1, 4), lq=st.integers(1, 8), lk=st.integers(1, 90),
       d=st.integers(1, 40), dtype=st.sampled_from(DTYPES), causal=st.booleans(), masked=st.booleans(),
       seed=st.integers(0, 2**16))
def test_any_small_shape_matches_the_oracle(b, hkv, g, lq, lk, d, dtype, causal, masked, seed):
    q, k, v = _qkv(b, hkv * g, hkv, lq, lk, dtype, d=d, seed=seed)
    kw = {"is_causal": causal}
    if masked:
        kw["mask"] = torch.rand(b, 1, lq, lk, generator=torch.Generator().manual_seed(seed)) < 0.7
    _check(q, k, v, dtype, **kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["NaN", "+inf", "-inf"])
@pytest.mark.parametrize("where", poison.PLACES)
@pytest.mark.parametrize("key", [0, 700, 1499], ids=["first key", "a later block", "last key"])
def test_the_flag_sees_every_non_finite_input(dtype, value, where, key):
    """A key of ``-inf`` scores ``-inf`` against an ordinary query (weight 0: the row stays finite); ``k * 0`` is
    NaN for it. Every kind of non-finite key or value, in any block of the pass, makes :meth:`if_finite` decline."""
    q, k, v = _qkv(2, 4, 2, 1, 1500, dtype, d=64)
    poison.poison(q, k, v, where, key, value)
    assert BACKEND.if_finite(validate_call(q, k, v)) is None


def test_large_finite_keys_are_no_false_alarm():
    q, k, v = _qkv(2, 4, 2, 1, 64, d=64)
    k[0, 0, 3] = 3e38  # a sum of this key's elements would overflow; k * 0 does not
    assert BACKEND.if_finite(validate_call(q, k, v)) is not None


def test_keys_outside_every_rows_range_are_not_read():
    """A window's far keys are not read: a NaN there changes no output and is no alarm."""
    q, k, v = _qkv(1, 2, 1, 1, 200, d=16)
    k[0, 0, 10] = NAN
    assert BACKEND.if_finite(validate_call(q, k, v, window=(50, 0))) is not None


def test_a_decode_step_through_attention_picks_it_and_keeps_the_nonfinite_rule():
    q, k, v = _qkv(2, 8, 2, 1, 50, d=16)
    assert attnkit.which_backend(q, k, v, is_causal=True) == "decode"
    clean = attnkit.attention(q, k, v, is_causal=True)
    k[1, 0, 12, 3] = NAN  # kv head 0 of batch 1: query heads 0..3 of batch 1
    got = attnkit.attention(q, k, v, is_causal=True)
    assert got[1, :4].isnan().all()
    assert torch.equal(got[0], clean[0]) and torch.equal(got[1, 4:], clean[1, 4:])


# The lane (DecodeBackend.step): a plain one-query call answered before validate_call and select; the two agree.


def _lane_case(dtype, b, hkv, g, lk, e, ev, causal, scale, strided):
    g_ = torch.Generator().manual_seed(lk + e)
    if strided:  # a model's views: q out of a fused projection [B, 1, 3 H E] viewed as heads; k, v columns apart
        q = torch.randn(b, 1, 3 * hkv * g * e, generator=g_).to(dtype)[..., : hkv * g * e]
        q = q.view(b, 1, hkv * g, e).transpose(1, 2)
        k = torch.randn(b, hkv, lk, 2 * e, generator=g_).to(dtype)[..., ::2]  # not unit stride: copied first
        v = torch.randn(b, lk, hkv, ev, generator=g_).to(dtype).transpose(1, 2)
    else:
        q, k, v = _qkv(b, hkv * g, hkv, 1, lk, dtype, d=e, dv=ev, seed=lk)
    return q, k, v, {"is_causal": causal, "scale": scale}


@settings(deadline=None, derandomize=True, max_examples=40)
@given(dtype=st.sampled_from(DTYPES), b=st.integers(1, 3), hkv=st.integers(1, 3), g=st.integers(1, 4),
       lk=st.integers(1, 300), e=st.sampled_from([1, 8, 64, 80]), ev=st.sampled_from([8, 64]),
       causal=st.booleans(), scale=st.sampled_from([None, 0.125, 1, 3.0]), strided=st.booleans())
def test_the_lane_answers_what_the_whole_path_answers(dtype, b, hkv, g, lk, e, ev, causal, scale, strided):
    q, k, v, kw = _lane_case(dtype, b, hkv, g, lk, e, ev, causal, scale, strided)
    lane = BACKEND.step(q, k, v, causal, scale)
    assert lane is not None  # the lane took it
    whole = attnkit.attention(q, k, v, backend="decode", **kw)  # forced: validate_call, select, the NaN rule
    assert torch.equal(lane, whole)
    with attnkit.backends.served() as names:
        got = attnkit.attention(q, k, v, **kw)
    assert torch.equal(got, whole) and names == ["decode"] and attnkit.which_backend(q, k, v, **kw) == "decode"
    assert got.shape == (b, hkv * g, 1, ev) and got.dtype == dtype


def _poisoned(k):
    """``k`` with a NaN in key 3 of key/value head 0 (query heads 0 and 1 see it), every batch element."""
    k = k.clone()
    k[:, 0, 3, 0] = NAN
    return k


def _float_param(x):
    return torch.nn.Parameter(x, requires_grad=False)


@pytest.mark.parametrize(("what", "change", "raises"), [
    ("two queries", lambda q, k, v, kw: (torch.cat([q, q], 2), k, v, kw), None),
    ("float64", lambda q, k, v, kw: (q.double(), k.double(), v.double(), kw), None),
    ("a Parameter", lambda q, k, v, kw: (q, _float_param(k), v, kw), None),
    ("3-D", lambda q, k, v, kw: (q[0], k[0], v[0], kw), None),
    ("a NaN key", lambda q, k, v, kw: (q, _poisoned(k), v, kw), None),
    ("a bool scale", lambda q, k, v, kw: (q, k, v, {**kw, "scale": True}), (ValueError, "scale must be a finite")),
    ("a NaN scale", lambda q, k, v, kw: (q, k, v, {**kw, "scale": NAN}), (ValueError, "scale must be a finite")),
    ("is_causal 1", lambda q, k, v, kw: (q, k, v, {**kw, "is_causal": 1}), (TypeError, "is_causal must be a bool")),
    ("dropout False", lambda q, k, v, kw: (q, k, v, {**kw, "dropout_p": False}), (ValueError, "dropout_p must")),
    ("backend None", lambda q, k, v, kw: (q, k, v, {**kw, "backend": None}), (TypeError, "backend must be a str")),
    ("backend an array", lambda q, k, v, kw: (q, k, v, {**kw, "backend": torch.tensor([1])}),
     (TypeError, "backend must be a str, got Tensor")),
    ("dropout a tensor", lambda q, k, v, kw: (q, k, v, {**kw, "dropout_p": torch.tensor(0.0)}),
     (ValueError, "dropout_p must be a number")),
    ("k in float16", lambda q, k, v, kw: (q, k.half(), v, kw), (TypeError, "key dtype torch.float16 does not")),
    ("head sizes", lambda q, k, v, kw: (q, k[..., :4], v, kw), (ValueError, "key head size 4 must equal")),
    ("3 heads over 2", lambda q, k, v, kw: (q[:, :3], k, v, kw), (ValueError, r"query heads \(3\) must be a multiple")),
    ("batches", lambda q, k, v, kw: (q, k[:1], v[:1], kw), (ValueError, "key batch dims")),
    ("value length", lambda q, k, v, kw: (q, k, v[:, :, :5], kw), (ValueError, "value must have the same heads")),
    ("no keys", lambda q, k, v, kw: (q, k[:, :, :0], v[:, :, :0], kw), None),
])
def test_the_lane_hands_back_every_call_it_does_not_serve(what, change, raises):
    """Each of these is either not a plain step or not valid: the lane answers None, and attention then does
    what the whole path does (the answer of the backend it picks, or the error naming the argument)."""
    q, k, v = _qkv(2, 4, 2, 1, 20, d=8)
    q, k, v, kw = change(q, k, v, {"is_causal": True, "scale": None})
    call = {n: kw[n] for n in ("is_causal", "scale")}
    assert BACKEND.step(q, k, v, call["is_causal"], call["scale"]) is None or what in {
        "dropout False", "backend None", "backend an array", "dropout a tensor"}  # attention's own: not the lane's
    if raises is not None:
        with pytest.raises(raises[0], match=raises[1]):
            attnkit.attention(q, k, v, **kw)
        return
    with attnkit.backends.served() as names:
        got = attnkit.attention(q, k, v, **kw)
    want = attnkit.attention(q, k, v, backend=names[0], **kw)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    if what == "a NaN key":
        assert names == ["decode"] and got[:, :2].isnan().all() and not got[:, 2:].isnan().any()


@pytest.mark.parametrize(("what", "change"), [
    ("int64", lambda q, k, v: (q.long(), k.long(), v.long())),
    ("float64", lambda q, k, v: (q.double(), k.double(), v.double())),
    ("mixed dtypes", lambda q, k, v: (q, k.bfloat16(), v)),
    ("3-D", lambda q, k, v: (q[0], k[0], v[0])),
    ("5-D", lambda q, k, v: (q[None], k[None], v[None])),
    ("two queries", lambda q, k, v: (torch.cat([q, q], 2), k, v)),
    ("3 heads over 2", lambda q, k, v: (q[:, :3], k, v)),
    ("batches", lambda q, k, v: (q, k[:1], v[:1])),
    ("head sizes", lambda q, k, v: (q, k[..., :4], v)),
    ("value length", lambda q, k, v: (q, k, v[:, :, :5])),
    ("no keys", lambda q, k, v: (q, k[:, :, :0], v[:, :, :0])),
    ("no key heads", lambda q, k, v: (q[:, :0], k[:, :0], v[:, :0])),
    ("sparse", lambda q, k, v: (q, k.to_sparse(), v)),
    ("a NaN value", lambda q, k, v: (q, k, _poisoned(v))),
])
def test_the_native_step_answers_none_for_what_it_does_not_take(what, change):
    """decode_step is the lane's native half and a public boundary: whatever it is given, it answers the step or
    None (the whole path then checks and says why), and reads no memory it was not given."""
    q, k, v = _qkv(2, 4, 2, 1, 20, d=8)
    assert torch.equal(_band._checked().decode_step(q, k, v, float("nan")), BACKEND.step(q, k, v, False, None))
    assert _band._checked().decode_step(*change(q, k, v), float("nan")) is None


@pytest.mark.parametrize("scale", [float("inf"), -float("inf"), 1e39, -1e39])
def test_the_native_step_answers_none_for_a_scale_past_float32(scale):
    q, k, v = _qkv(1, 2, 1, 1, 5, d=8)
    assert _band._checked().decode_step(q, k, v, scale) is None
    assert _band._checked().decode_step(q, k, v, 1e30) is not None  # (3e38 would overflow a score: None too)


def test_the_native_step_asks_for_no_gradient():
    q, k, v = _qkv(1, 2, 1, 1, 5, d=8)
    v.requires_grad_(True)
    assert _band._checked().decode_step(q, k, v, 0.5) is None
    with torch.no_grad():
        assert _band._checked().decode_step(q, k, v, 0.5) is not None


def test_the_lane_serves_no_gradient():
    q, k, v = _qkv(1, 4, 2, 1, 20, d=8)
    q.requires_grad_(True)
    assert BACKEND.step(q, k, v, False, None) is None
    attnkit.attention(q, k, v).sum().backward()  # the whole path: a backend with a gradient
    assert q.grad is not None and q.grad.isfinite().all()
    with torch.no_grad():
        assert BACKEND.step(q, k, v, False, None) is not None


@pytest.mark.parametrize(("what", "kw", "reason"), [
    ("grad", {}, "forward only"),
    ("9 queries", {}, "at most 8 queries"),
    ("float64", {}, "float32, bfloat16 or float16"),
    ("bias", {"bias": torch.zeros(1, 1, 1, 20)}, "no bias"),
    ("dropout", {"dropout_p": 0.1}, "dropout"),
    ("weights", {"return_weights": True}, "weights"),
])
def test_it_refuses_what_it_does_not_serve(what, kw, reason):
    q, k, v = _qkv(1, 4, 2, 9 if what == "9 queries" else 1, 20, torch.float64 if what == "float64" else torch.float32)
    if what == "grad":
        q.requires_grad_(True)
    reasons = BACKEND.not_supported_reasons(validate_call(q, k, v, **kw))
    assert any(reason in r for r in reasons), reasons
    assert attnkit.which_backend(q, k, v, **kw) != "decode"


def test_under_no_grad_a_leaf_that_requires_grad_is_served():
    q, k, v = _qkv(1, 4, 2, 1, 20)
    q.requires_grad_(True)
    with torch.no_grad():
        assert attnkit.which_backend(q, k, v) == "decode"


def _ranges(b, lq, lo=0, hi=20):
    return torch.full((b, lq), lo, dtype=torch.long), torch.full((b, lq), hi, dtype=torch.long)


NONE = torch.empty(0, 0, 0, 0, dtype=torch.bool)


@pytest.mark.parametrize(("what", "args", "message"), [
    ("q float64", lambda q, k, v: (q.double(), k.double(), v.double(), NONE, *_ranges(2, 1), 1.0, 0.0), "q must be"),
    ("k bfloat16", lambda q, k, v: (q, k.bfloat16(), v, NONE, *_ranges(2, 1), 1.0, 0.0), "k must be"),
    ("k 3-D", lambda q, k, v: (q, k[0], v, NONE, *_ranges(2, 1), 1.0, 0.0), "k must be"),
    ("k of another batch", lambda q, k, v: (q, k[:1], v[:1], NONE, *_ranges(2, 1), 1.0, 0.0), "k must be"),
    ("v shorter", lambda q, k, v: (q, k, v[:, :, :10], NONE, *_ranges(2, 1), 1.0, 0.0), "v must be"),
    ("heads not a multiple", lambda q, k, v: (q[:, :3], k, v, NONE, *_ranges(2, 1), 1.0, 0.0), "multiple"),
    ("9 queries", lambda q, k, v: (q.expand(2, 4, 9, 16), k, v, NONE, *_ranges(2, 9), 1.0, 0.0), "queries"),
    ("k columns strided", lambda q, k, v: (q, k.repeat(1, 1, 1, 2)[..., ::2], v, NONE, *_ranges(2, 1), 1.0, 0.0),
     "k must have unit stride"),
    ("mask int", lambda q, k, v: (q, k, v, torch.ones(2, 1, 1, 20, dtype=torch.int), *_ranges(2, 1), 1.0, 0.0), "mask"),
    ("mask too short", lambda q, k, v: (q, k, v, torch.ones(2, 1, 1, 19, dtype=torch.bool), *_ranges(2, 1), 1.0, 0.0),
     "mask"),
    ("mask of 3 batch elements", lambda q, k, v: (q, k, v, torch.ones(3, 1, 1, 20, dtype=torch.bool),
                                                  *_ranges(2, 1), 1.0, 0.0), "mask"),
    ("hi past Lk", lambda q, k, v: (q, k, v, NONE, *_ranges(2, 1, hi=21), 1.0, 0.0), "key ranges"),
    ("lo above hi", lambda q, k, v: (q, k, v, NONE, *_ranges(2, 1, lo=5, hi=4), 1.0, 0.0), "key ranges"),
    ("lo negative", lambda q, k, v: (q, k, v, NONE, *_ranges(2, 1, lo=-1), 1.0, 0.0), "key ranges"),
    ("lo int32", lambda q, k, v: (q, k, v, NONE, _ranges(2, 1)[0].int(), _ranges(2, 1)[1], 1.0, 0.0), "lo must be"),
    ("hi of 3 rows", lambda q, k, v: (q, k, v, NONE, _ranges(2, 1)[0], torch.full((3, 1), 20), 1.0, 0.0), "hi must be"),
    ("scale inf", lambda q, k, v: (q, k, v, NONE, *_ranges(2, 1), INF, 0.0), "scale"),
    ("scale past float32", lambda q, k, v: (q, k, v, NONE, *_ranges(2, 1), 1e39, 0.0), "scale"),
    ("softcap negative", lambda q, k, v: (q, k, v, NONE, *_ranges(2, 1), 1.0, -1.0), "softcap"),
    ("softcap NaN", lambda q, k, v: (q, k, v, NONE, *_ranges(2, 1), 1.0, NAN), "softcap"),
    ("softcap past float32", lambda q, k, v: (q, k, v, NONE, *_ranges(2, 1), 1.0, 1e39), "softcap"),
])
def test_the_native_entry_point_refuses_bad_arguments_by_name(what, args, message):
    """Checked before any memory is read (a wrong size read as a right one would read out of bounds)."""
    q, k, v = _qkv(2, 4, 2, 1, 20)
    with pytest.raises(RuntimeError, match=f"band kernel: .*{message}"):
        _band._checked().decode(*args(q, k, v))
