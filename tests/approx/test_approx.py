"""attnkit.approx: each approximation against its own definition (float64), and the exact cases it contains."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.autograd import gradcheck

from attnkit import approx
from attnkit.approx import kernel, nystrom
from tests.approx.test_kernel import quadratic
from tests.support import oracle
from tests.support.tolerances import close


def qkv(b=2, h=2, hkv=1, lq=7, lk=9, e=4, ev=3, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, e, generator=g, dtype=torch.float64) * scale
    k = torch.randn(b, hkv, lk, e, generator=g, dtype=torch.float64) * scale
    v = torch.randn(b, hkv, lk, ev, generator=g, dtype=torch.float64)
    return q, k, v


def key_padding(b, lk, seed=0):
    km = torch.rand(b, lk, generator=torch.Generator().manual_seed(seed)) > 0.3
    km[:, 0] = True
    return km


def feature_map(kind, e, num_features=64, seed=0):
    if kind == "performer":
        w = kernel.orthogonal_features(num_features, e, generator=torch.Generator().manual_seed(seed))
        return kernel.favor_feature_map(w, 1.0 / math.sqrt(e))
    return {"elu": kernel.elu_feature_map, "relu": kernel.relu_feature_map}[kind]


@pytest.mark.parametrize("kind", ["elu", "relu", "performer"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("chunk", [1, 3, 128])
def test_kernel_kinds_match_quadratic_form(kind, is_causal, chunk):
    """Chunked causal (and non-causal) kernel attention == phi(Q) phi(K)^T written out, masked, GQA, Lq != Lk."""
    q, k, v = qkv()
    km = key_padding(2, 9)
    args = {"num_features": 64, "seed": 0} if kind == "performer" else {}
    out = approx.attention(q, k, v, kind=kind, is_causal=is_causal, mask=km[:, None, None, :], chunk_size=chunk,
                           **args)
    eps = 0.0 if kind == "performer" else 1e-6  # FAVOR+ runs unbiased, without eps
    close(out, quadratic(q, k, v, feature_map(kind, 4), is_causal=is_causal, key_mask=km, eps=eps))


@pytest.mark.parametrize("kind", ["elu", "relu", "performer"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_recurrent_state_equals_causal_form(kind, chunk):
    q, k, v = qkv(h=2, hkv=2, lq=8, lk=8)
    w = kernel.orthogonal_features(32, 4, generator=torch.Generator().manual_seed(3))
    extra = {"projection": w} if kind == "performer" else {}
    full = approx.attention(q, k, v, kind=kind, is_causal=True, **extra)
    state, outs = None, []
    for s in range(0, 8, chunk):
        out, state = approx.step(state, q[..., s:s + chunk, :], k[..., s:s + chunk, :], v[..., s:s + chunk, :],
                                 kind=kind, **extra)
        outs.append(out)
    close(torch.cat(outs, -2), full)


@pytest.mark.parametrize("lq, lk", [(6, 6), (5, 8)])
def test_nystrom_with_one_landmark_per_token_is_softmax_attention(lq, lk):
    q, k, v = qkv(lq=lq, lk=lk)
    km = key_padding(2, lk)
    out = approx.attention(q, k, v, kind="nystrom", num_landmarks=lk, exact_pinv=True, mask=km[:, None, None, :])
    allowed = km[:, None, None, :].expand(2, 2, lq, lk)
    close(out, oracle.attention(q, k, v, allowed=allowed)[0])


def test_nystrom_iterative_pinv_converges_to_the_pseudo_inverse():
    """The paper's iteration (6 steps by default) on a softmax matrix; error bound stated per iteration count."""
    q, k, _ = qkv(lq=8, lk=8, hkv=2)
    a = torch.softmax(q @ k.transpose(-2, -1) / 2, -1)
    exact = torch.linalg.pinv(a)
    errors = [((nystrom.iterative_pinv(a, n) - exact).norm() / exact.norm()).item() for n in (2, 6, 30)]
    assert errors[2] < errors[1] < errors[0], errors
    assert errors[2] < 1e-8, errors


def test_nystrom_segment_means_with_uneven_segments():
    x = torch.arange(7, dtype=torch.float64)[:, None]
    close(nystrom.segment_means(x, 3), torch.tensor([[1.0], [3.5], [5.5]], dtype=torch.float64))


def test_performer_error_falls_as_features_grow():
    """FAVOR+ is unbiased for exp(q.k / sqrt(d)): relative error, mean of 3 seeds, falls with m; < 3% at 4096."""
    q, k, v = qkv(b=1, h=1, hkv=1, lq=32, lk=32, e=8, ev=8, scale=0.5)
    exact = oracle.attention(q, k, v)[0]
    errors = {}
    for m in (16, 256, 4096):
        errs = [(approx.attention(q, k, v, kind="performer", num_features=m, seed=s) - exact).norm() / exact.norm()
                for s in range(3)]
        errors[m] = sum(e.item() for e in errs) / 3
    assert errors[4096] < errors[256] < errors[16], errors
    assert errors[4096] < 0.03, errors


def test_linformer_identity_projections_at_n_equal_k_is_softmax_attention():
    q, k, v = qkv(lq=6, lk=6)
    proj = approx.LinformerProjection(6, 6).double()
    with torch.no_grad():
        proj.e.copy_(torch.eye(6))
        proj.f.copy_(torch.eye(6))
    close(approx.attention(q, k, v, kind="linformer", projection=proj), oracle.attention(q, k, v)[0])


def loop_attention(score, q, k, v, allowed):
    """softmax over allowed keys of ``score(qi, kj)``, one query at a time; empty rows give zeros."""
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    out = torch.zeros(b, h, lq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(lq):
                js = [j for j in range(lk) if allowed[bi, hi, i, j]]
                if not js:
                    continue
                s = torch.stack([score(hi, q[bi, hi, i], k[bi, hi, j]) for j in js])
                w = torch.exp(s - s.max()) / torch.exp(s - s.max()).sum()
                out[bi, hi, i] = sum(wj * v[bi, hi, j] for wj, j in zip(w, js, strict=True))
    return out


def masked_case(lq=5, lk=6):
    """Causal plus an arbitrary mask that empties one query row."""
    q, k, v = qkv(h=2, hkv=2, lq=lq, lk=lk)
    mask = torch.rand(2, 2, lq, lk, generator=torch.Generator().manual_seed(5)) > 0.4
    mask[0, 1, 2] = False
    return q, k, v, mask, oracle.allowed_grid(2, 2, lq, lk, is_causal=True, mask=mask)


def test_additive_matches_loop_formula():
    q, k, v, mask, allowed = masked_case()
    g = torch.Generator().manual_seed(2)
    wq, wk = torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, 4, generator=g,
                                                                                 dtype=torch.float64)
    w = torch.randn(2, 3, generator=g, dtype=torch.float64)
    out = approx.attention(q, k, v, kind="additive", mask=mask, is_causal=True, query_weight=wq, key_weight=wk,
                           score_vector=w)
    close(out, loop_attention(lambda h, qi, kj: w[h] @ torch.tanh(wq[h] @ qi + wk[h] @ kj), q, k, v, allowed))


def test_multiplicative_and_dot_match_loop_formula():
    q, k, v, mask, allowed = masked_case()
    wm = torch.randn(4, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = approx.attention(q, k, v, kind="multiplicative", mask=mask, is_causal=True, weight=wm)
    close(out, loop_attention(lambda h, qi, kj: qi @ wm @ kj, q, k, v, allowed))
    out = approx.attention(q, k, v, kind="dot", mask=mask, is_causal=True)
    close(out, loop_attention(lambda h, qi, kj: qi @ kj, q, k, v, allowed))  # unscaled


def kind_args(kind, e=3):
    g = torch.Generator().manual_seed(6)
    if kind == "performer":
        return {"num_features": 8}
    if kind == "nystrom":
        return {"num_landmarks": 2}
    if kind == "linformer":
        return {"projection": approx.LinformerProjection(8, 3).double().requires_grad_(False)}
    if kind == "multiplicative":
        return {"weight": torch.randn(e, e, generator=g, dtype=torch.float64)}
    if kind == "additive":
        return {"score_vector": torch.randn(2, generator=g, dtype=torch.float64),
                "query_weight": torch.randn(2, e, generator=g, dtype=torch.float64),
                "key_weight": torch.randn(2, e, generator=g, dtype=torch.float64)}
    return {}


@pytest.mark.parametrize("kind", approx.KINDS)
def test_gradcheck(kind):
    q, k, v = (t.requires_grad_() for t in qkv(b=1, h=2, hkv=2, lq=4, lk=5, e=3, ev=2))
    args = kind_args(kind)
    causal = "is_causal" in approx.SUPPORTS[kind]
    assert gradcheck(lambda q, k, v: approx.attention(q, k, v, kind=kind, is_causal=causal, **args), (q, k, v))


def test_gradcheck_reaches_score_parameters():
    q, k, v = qkv(b=1, h=1, hkv=1, lq=3, lk=4, e=3, ev=2)
    args = {name: t.requires_grad_() for name, t in kind_args("additive").items()}
    assert gradcheck(lambda a, b, c: approx.attention(q, k, v, kind="additive", score_vector=a, query_weight=b,
                                                      key_weight=c), tuple(args.values()))


@pytest.mark.parametrize("call, pattern", [
    (dict(kind="softmax"), r"kind must be one of \('elu'.*got 'softmax'"),
    (dict(kind="performer", num_features=0), r"performer: num_features must be an int >= 1, got 0"),
    (dict(kind="nystrom", num_landmarks=0), r"nystrom: num_landmarks must be an int >= 1, got 0"),
    (dict(kind="nystrom", features=3), r"nystrom: unknown argument\(s\) \['features'\]; it takes \['num_landmarks'"),
    (dict(kind="nystrom", mask=torch.ones(5, 6, dtype=torch.bool).tril()),
     r"nystrom cannot honour a mask of shape \(5, 6\) exactly .* it supports: key-padding mask"),
    (dict(kind="nystrom", is_causal=True), r"nystrom cannot honour is_causal exactly; it supports: key-padding mask"),
    (dict(kind="linformer", projection=approx.LinformerProjection(4, 2)),
     r"linformer: key length 6 exceeds the projections' max_len 4"),
    (dict(kind="linformer", mask=torch.ones(6, dtype=torch.bool), projection=approx.LinformerProjection(8, 2)),
     r"linformer cannot honour a mask of shape \(6,\) exactly .* it supports: no mask"),
    (dict(kind="elu", mask=torch.ones(5, 6, dtype=torch.bool)), r"elu cannot honour a mask of shape \(5, 6\)"),
])
def test_bad_input(call, pattern):
    q, k, v = (torch.randn(1, 2, n, 4) for n in (5, 6, 6))
    with pytest.raises(ValueError, match=pattern):
        approx.attention(q, k, v, **call)


def test_linformer_projection_sizes_checked():
    with pytest.raises(ValueError, match=r"linformer: k must be an int >= 1, got 0"):
        approx.LinformerProjection(8, 0)


@pytest.mark.parametrize("kind", ["elu", "relu", "performer", "nystrom"])
def test_keys_all_padded_give_zeros(kind):
    """A batch element with every key padded attends nothing: zeros, not NaN (FAVOR+ runs without eps)."""
    q, k, v = qkv(b=2, lq=4, lk=5)
    km = torch.ones(2, 5, dtype=torch.bool)
    km[1] = False
    out = approx.attention(q, k, v, kind=kind, mask=km[:, None, None, :])
    close(out[1], torch.zeros_like(out[1]))
    assert out[0].abs().sum() > 0


def twin_modules(**kind):
    """An exact MultiHeadAttention and one with ``kind``, same weights, float64."""
    from attnkit import MultiHeadAttention

    torch.manual_seed(0)
    exact = MultiHeadAttention(8, 2).double()
    other = MultiHeadAttention(8, 2, **kind).double()
    other.load_state_dict(exact.state_dict(), strict=False)
    return exact, other


def test_module_kind_nystrom_with_a_landmark_per_token_equals_exact_module():
    exact, other = twin_modules(kind="nystrom", kind_args={"num_landmarks": 64, "exact_pinv": True})
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    km = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    close(other(x, key_mask=km), exact(x, key_mask=km))
    assert other.approx is not None and exact.approx is None


def test_module_kind_performer_uses_its_features_and_redraws_them():
    _, m = twin_modules(kind="performer", kind_args={"num_features": 16, "seed": 3})
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    q, k, v = m.project_qkv(x, x, x)
    w = kernel.orthogonal_features(16, 4, generator=torch.Generator().manual_seed(3))
    expected = m.out_proj(approx.attention(q, k, v, kind="performer", projection=w).transpose(1, 2).reshape(1, 5, 8))
    first = m(x, is_causal=True)
    close(m(x), expected)
    m.approx.redraw()
    assert (m(x, is_causal=True) - first).abs().max() > 1e-3  # new features, another estimate
    m.approx.redraw(3)
    close(m(x, is_causal=True), first)


def test_module_kind_refuses_what_it_cannot_do():
    _, m = twin_modules(kind="linformer", kind_args={"max_len": 8, "k": 4})
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"kind 'linformer' takes mask, key_mask and is_causal; got .'need_weights'."):
        m(x, need_weights=True)
    with pytest.raises(ValueError, match=r"linformer cannot honour is_causal exactly; it supports: no mask"):
        m(x, is_causal=True)
    with pytest.raises(ValueError, match=r"linformer: key length 9 exceeds the projections' max_len 8"):
        m(torch.randn(1, 9, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"kind must be one of .* got 'fast'"):
        twin_modules(kind="fast")
    m.set_kind(None)
    assert m(x, need_weights=True)[1].shape == (1, 2, 5, 5)


@pytest.mark.parametrize("kind", ["elu", "relu", "performer", "dot"])
def test_module_kind_cached_decoding_equals_full_forward(kind):
    """Grouped heads too: the cached keys are repeated for the query heads after the step's write, not before."""
    from attnkit import MultiHeadAttention
    from attnkit.cache import KVCache

    torch.manual_seed(1)
    m = MultiHeadAttention(8, 4, num_kv_heads=2, kind=kind, kind_args={"num_features": 16} if kind == "performer"
                           else None).double()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    cache = KVCache(1, 6, 2, 2, dtype=torch.float64)
    steps = [m(x[:, :3], cache=cache, is_causal=True), m(x[:, 3:4], cache=cache, is_causal=True),
             m(x[:, 4:], cache=cache, is_causal=True)]
    close(torch.cat(steps, dim=1), m(x, is_causal=True))


#: What a two-token cached step of an approximate kind may get wrong, each refused by the method itself, not by the
#: module's own checks: (kind, kind_args, the step's arguments, the error's text).
APPROX_MISTAKES = {
    "nystrom asked for is_causal": ("nystrom", None, {"is_causal": True}, r"nystrom cannot honour is_causal"),
    "linformer past its max_len": ("linformer", {"max_len": 4, "k": 2}, {}, r"key length 5 exceeds .* max_len 4"),
    "linformer given a mask": ("linformer", {"max_len": 8, "k": 2}, {"mask": torch.ones(1, 5, dtype=torch.bool)},
                               r"linformer cannot honour a mask of shape \(1, 5\)"),
    "elu with a mask that varies over queries": ("elu", None,
                                                 {"mask": torch.tensor([[True] * 4 + [False], [True] * 5])},
                                                 r"elu cannot honour a mask of shape \(2, 5\)"),
    "relu with a mask for three queries": ("relu", None, {"mask": torch.ones(3, 5, dtype=torch.bool)},
                                           r"mask of shape \(3, 5\) is not broadcastable"),
}


@pytest.mark.parametrize("mistake", list(APPROX_MISTAKES))
def test_a_refused_approximate_cached_step_leaves_the_cache_as_it_was(mistake):
    """As for exact attention: every check runs before the new tokens are written, so a caller that catches the
    error decodes on as if the mistake had never been made (compared with a cache that never saw it)."""
    from attnkit import MultiHeadAttention
    from attnkit.cache import KVCache

    kind, kind_args, wrong, says = APPROX_MISTAKES[mistake]
    torch.manual_seed(2)
    m = MultiHeadAttention(8, 2, kind=kind, kind_args=kind_args).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    cache, clean = KVCache(1, 5, 2, 4, dtype=torch.float64), KVCache(1, 5, 2, 4, dtype=torch.float64)
    m(x[:, :3], cache=cache)
    m(x[:, :3], cache=clean)
    before = (cache.k.clone(), cache.v.clone(), cache.seq_len, int(cache.cache_pos), bool(cache.finite))
    with pytest.raises(ValueError, match=says):
        m(x[:, 3:], cache=cache, **wrong)
    after = (cache.k, cache.v, cache.seq_len, int(cache.cache_pos), bool(cache.finite))
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]) and after[2:] == before[2:]
    step = x[:, 3:4]  # one token: within the linformer's max_len
    close(m(step, cache=cache), m(step, cache=clean))
    assert torch.equal(cache.k, clean.k) and torch.equal(cache.v, clean.v) and cache.seq_len == clean.seq_len


def tiny_bert():
    from attnkit.models import Bert
    from attnkit.models.bert import BertConfig

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32)
    bert = Bert(cfg).double().eval()
    ids = torch.randint(0, 40, (2, 7))
    am = torch.ones(2, 7, dtype=torch.long)
    am[1, 5:] = 0
    return bert, ids, am


def test_bert_with_exact_nystrom_layers_reproduces_the_model():
    """One landmark per token with the exact pseudo-inverse is softmax attention: same hidden states, padding too."""
    bert, ids, am = tiny_bert()
    swapped = bert.with_attention("nystrom", layers=[0, 2], num_landmarks=512, exact_pinv=True)
    close(swapped(ids, attention_mask=am).last_hidden_state, bert(ids, attention_mask=am).last_hidden_state)
    assert [layer.attn.approx is not None for layer in swapped.layers] == [True, False, True]


def test_bert_with_performer_changes_only_the_copy():
    bert, ids, am = tiny_bert()
    before = bert(ids, attention_mask=am).last_hidden_state
    swapped = bert.with_attention("performer", layers=[1], num_features=8)
    assert (swapped(ids, attention_mask=am).last_hidden_state - before).abs().max() > 1e-4
    close(bert(ids, attention_mask=am).last_hidden_state, before)
    assert all(layer.attn.approx is None for layer in bert.layers)
    with pytest.raises(ValueError, match=r"layers must be indices 0 \.\.\. 2 of this 3-layer model, got \[3\]"):
        bert.with_attention("performer", layers=[1, 3])


def test_bench_sentences_are_fixed_distinct_and_of_varied_length():
    from attnkit.bench.approx import sentences

    texts = sentences(600)
    assert texts == sentences(600) and len(set(texts)) == 600
    words = [len(t.split()) for t in texts]
    assert min(words) <= 6 and max(words) >= 40, (min(words), max(words))


def test_bench_fitted_exponent():
    from attnkit.bench.approx import _slope

    ns = [256, 512, 1024]
    close(torch.tensor(_slope(ns, [3e-9 * n ** 1.5 for n in ns]), dtype=torch.float64),
          torch.tensor(1.5, dtype=torch.float64))


# Properties over random shapes (hypothesis; examples fixed by the project's profile in conftest.py).

shapes = st.tuples(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2)]), st.integers(1, 6),
                   st.integers(0, 5), st.integers(1, 5), st.integers(1, 4), st.integers(0, 2 ** 16))


def random_case(shape):
    """q, k, v and a key-padding mask for ``(b, (h, hkv), lq, extra keys, e, ev, seed)``; Lk = Lq + extra."""
    b, (h, hkv), lq, extra, e, ev, seed = shape
    q, k, v = qkv(b=b, h=h, hkv=hkv, lq=lq, lk=lq + extra, e=e, ev=ev, seed=seed)
    km = torch.rand(b, lq + extra, generator=torch.Generator().manual_seed(seed)) > 0.4
    return q, k, v, km


@given(shape=shapes, kind=st.sampled_from(["elu", "relu", "performer"]), is_causal=st.booleans(),
       chunk=st.integers(1, 4))
def test_property_kernel_kinds_chunked_equal_quadratic_form(shape, kind, is_causal, chunk):
    q, k, v, km = random_case(shape)
    km[:, 0] = True  # FAVOR+ runs without eps: the written-out form divides 0 / 0 on a row that sees no key
    args = {"num_features": 8, "seed": shape[-1]} if kind == "performer" else {}
    out = approx.attention(q, k, v, kind=kind, is_causal=is_causal, mask=km[:, None, None, :], chunk_size=chunk,
                           **args)
    phi = feature_map(kind, q.shape[-1], num_features=8, seed=shape[-1])
    close(out, quadratic(q, k, v, phi, is_causal=is_causal, key_mask=km, eps=0.0 if kind == "performer" else 1e-6))


@given(shape=shapes, kind=st.sampled_from(["elu", "relu", "performer"]), chunk=st.integers(1, 4))
def test_property_recurrent_steps_equal_causal_form(shape, kind, chunk):
    b, (h, _), lq, _, e, ev, seed = shape
    q, k, v = qkv(b=b, h=h, hkv=h, lq=lq, lk=lq, e=e, ev=ev, seed=seed)
    extra = {"projection": kernel.orthogonal_features(8, e, generator=torch.Generator().manual_seed(seed))} \
        if kind == "performer" else {}
    full = approx.attention(q, k, v, kind=kind, is_causal=True, **extra)
    state, outs = None, []
    for s in range(0, lq, chunk):
        part = (t[..., s:s + chunk, :] for t in (q, k, v))
        out, state = approx.step(state, *part, kind=kind, **extra)
        outs.append(out)
    close(torch.cat(outs, -2), full)


@given(shape=shapes)
def test_property_nystrom_with_a_landmark_per_key_is_softmax_attention(shape):
    q, k, v, km = random_case(shape)
    km[:, 0] = True  # segment means of padded keys are undefined landmarks; one real key per batch element
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    out = approx.attention(q, k, v, kind="nystrom", num_landmarks=lk, exact_pinv=True, mask=km[:, None, None, :])
    close(out, oracle.attention(q, k, v, allowed=km[:, None, None, :].expand(b, h, lq, lk))[0])


@given(shape=shapes, kind=st.sampled_from(["elu", "relu", "performer", "dot"]))
def test_property_rows_that_see_no_key_are_zero(shape, kind):
    """Causal with key padding: a query whose visible keys are all padded gives zeros, never NaN or a guess."""
    q, k, v, km = random_case(shape)
    lq, lk = q.shape[2], k.shape[2]
    km[0, : lk - lq + 1] = False  # the first query of batch element 0 sees only padded keys
    out = approx.attention(q, k, v, kind=kind, is_causal=True, mask=km[:, None, None, :])
    seen = oracle.allowed_grid(q.shape[0], q.shape[1], lq, lk, is_causal=True, mask=km[:, None, None, :]).any(-1)
    assert not seen[0, :, 0].any()
    close(out[~seen], torch.zeros_like(out[~seen]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("block", [1, 7, 1 << 22])  # elements per tanh block: one row, a few rows, all rows
def test_additive_scores_in_blocks_equal_the_whole_formula(monkeypatch, block):
    from attnkit.approx import scores

    monkeypatch.setattr(scores, "BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)  # [B, H, Lq, A]
    k = torch.randn(2, 1, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)  # one key head for all
    for w in (torch.randn(4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)):
        w.requires_grad_()
        whole = (torch.tanh(q.unsqueeze(-2) + k.unsqueeze(-3)) * w.unsqueeze(-2).unsqueeze(-2)).sum(-1)
        close(scores.AdditiveScores.apply(q, k, w), whole)
        assert gradcheck(scores.AdditiveScores.apply, (q, k, w))


def test_additive_never_holds_the_whole_tanh_tensor(monkeypatch):
    """The backward keeps q, k, w and the [Lq, Lk] scores' graph, never a [Lq, Lk, A] tensor."""
    from attnkit.approx import scores

    monkeypatch.setattr(scores, "BLOCK_ELEMENTS", 64)
    lq, lk, a = 16, 12, 8
    q, k, v = (torch.randn(1, 2, n, a, requires_grad=True) for n in (lq, lk, lk))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = approx.attention(q, k, v, kind="additive", score_vector=torch.randn(a))
    out.sum().backward()
    assert saved and max(saved) == 2 * lq * lk and q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0
