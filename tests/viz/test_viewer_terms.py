"""The viewer's score-terms panel, without a browser: ``recorded_qk`` keeps the queries and keys a
module's attention scored (their softmax is the module's own weights, against the float64 oracle),
the page embeds them so that its terms are :func:`attnkit.analysis.score_terms` and their softmax
the recorded weights, names stay escaped, the size budget leaves the terms out (and says so), and
bad ``qk`` is named. The panel itself is driven in headless Chromium in ``test_viewer_browser.py``."""

from __future__ import annotations

import base64
import json
import math
import re

import numpy as np
import pytest
import torch

import attnkit
from attnkit.analysis import score_terms
from attnkit.analysis.record import recorded_qk, recorded_weights
from attnkit.cache import KVCache
from attnkit.positional import ALiBi, RotaryEmbedding
from attnkit.viz import viewer_html
from tests.support import oracle
from tests.support.tolerances import close

EVIL = "</script><img src=x onerror=alert(1)>"
TOKENS = ["[CLS]", "the", "river", "bank", "was", "eroding", ".", "[SEP]", EVIL]
N, E, H, D = len(TOKENS), 32, 4, 8


def _weights_of(q, k, scale, *, is_causal=False):
    v = torch.zeros(*k.shape[:-1], 1, dtype=torch.float64)
    allowed = oracle.allowed_grid(q.shape[0], q.shape[1], q.shape[2], k.shape[2], is_causal=is_causal)
    return oracle.attention(q, k, v, allowed=allowed, scale=scale)[1]


@pytest.mark.parametrize("kwargs, call", [
    ({}, {}),
    ({"num_kv_heads": 2, "rotary": RotaryEmbedding(D)}, {"is_causal": True}),
    ({"share_qk": True, "scale": 0.3}, {}),
])
def test_recorded_q_and_k_give_the_modules_own_weights(kwargs, call):
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(E, H, dtype=torch.float64, **kwargs).eval()
    x = torch.randn(2, 7, E, dtype=torch.float64)
    plain = mha(x, **call)
    with recorded_qk([mha]) as (alone,):
        out = mha(x, **call)
    assert torch.equal(out, plain)  # the output is untouched
    with recorded_weights([mha]) as (weights,), recorded_qk([mha]) as (calls,):
        mha(x, **call)
    assert not mha._forward_hooks and not mha._forward_pre_hooks
    (q, k, scale), = calls
    assert torch.equal(q, alone[0].q) and torch.equal(k, alone[0].k)
    assert q.shape == (2, H, 7, D) and k.shape == (2, kwargs.get("num_kv_heads", H), 7, D)
    assert scale == kwargs.get("scale", 1 / math.sqrt(D))
    close(_weights_of(q, k, scale, is_causal=call.get("is_causal", False)), weights[0])
    if not kwargs:  # without positions, q is the projection itself
        close(q, (x @ mha.q_proj.weight.T + mha.q_proj.bias).view(2, 7, H, D).transpose(1, 2))


def test_cross_attention_and_cached_decoding_record_what_the_attention_saw():
    torch.manual_seed(1)
    cross = attnkit.MultiHeadAttention(E, H, kdim=12, vdim=12, dtype=torch.float64).eval()
    x, mem = torch.randn(1, 3, E, dtype=torch.float64), torch.randn(1, 5, 12, dtype=torch.float64)
    with recorded_weights([cross]) as (w,), recorded_qk([cross]) as (calls,):
        cross(x, mem, mem)
    assert calls[0].q.shape == (1, H, 3, D) and calls[0].k.shape == (1, H, 5, D)
    close(_weights_of(*calls[0]), w[0])

    dec = attnkit.MultiHeadAttention(E, H, num_kv_heads=2, rotary=RotaryEmbedding(D), dtype=torch.float64).eval()
    cache = KVCache(1, 8, 2, D, dtype=torch.float64)
    seq = torch.randn(1, 5, E, dtype=torch.float64)
    with recorded_weights([dec]) as (w,), recorded_qk([dec]) as (calls,):
        dec(seq[:, :3], is_causal=True, cache=cache)  # prefill, then one token at a time
        for t in (3, 4):
            dec(seq[:, t:t + 1], is_causal=True, cache=cache)
    assert [c.k.shape[2] for c in calls] == [3, 4, 5] and [c.q.shape[2] for c in calls] == [3, 1, 1]
    for c, weights in zip(calls, w, strict=True):
        close(_weights_of(*c, is_causal=True), weights)
    with recorded_qk([dec]) as (full,):  # the last step's keys are the full pass's keys
        dec(seq, is_causal=True)
    close(calls[-1].k, full[0].k)
    close(calls[-1].q, full[0].q[:, :, -1:])


def test_recorded_qk_refuses_foreign_and_approximate_modules():
    with pytest.raises(TypeError, match="MultiHeadAttention, got MultiheadAttention"), \
            recorded_qk([torch.nn.MultiheadAttention(E, H)]):
        pass
    approx = attnkit.MultiHeadAttention(E, H, kind="performer", kind_args={"num_features": 16})
    with pytest.raises(ValueError, match="kind 'performer'"), recorded_qk([approx]):
        pass


# ---------------------------------------------------------------- the page's data


def recorded_model():
    """Three layers with 2 key heads (GQA), float32: rotary and causal; plain; ALiBi (whose weights are
    not a softmax of q . k alone)."""
    torch.manual_seed(0)
    layers = [attnkit.MultiHeadAttention(E, H, num_kv_heads=2, rotary=RotaryEmbedding(D)),
              attnkit.MultiHeadAttention(E, H, num_kv_heads=2),
              attnkit.MultiHeadAttention(E, H, num_kv_heads=2, position_bias=ALiBi(H))]
    x = torch.randn(1, N, E)
    with recorded_weights(layers) as weights, recorded_qk(layers) as qk, torch.no_grad():
        for i, layer in enumerate(layers):
            x = layer(x, is_causal=i == 0)
    return [w[0] for w in weights], [c[0] for c in qk]


@pytest.fixture(scope="module")
def recorded():
    return recorded_model()


def _data(page: str) -> dict:
    payload = re.search(r'<script id="attnkit-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    return json.loads(payload)


def _floats(b64: str, dtype: str, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=dtype).reshape(shape).copy()


def test_the_page_holds_the_terms_of_the_recorded_q_and_k(recorded):
    weights, qk = recorded
    data = _data(viewer_html(weights, TOKENS, qk=qk))
    t = data["terms"]
    assert (t["dim"], t["kv_heads"], data["terms_note"]) == (D, 2, "")
    q = _floats(t["q"], "<f4", (3, H, N, D))
    k = _floats(t["k"], "<f4", (3, 2, N, D))
    lse = _floats(t["lse"], "<f8", (3, H, N))
    bits = np.unpackbits(np.frombuffer(base64.b64decode(t["masked"]), np.uint8))
    masked = bits[:3 * H * N * N].reshape(3, H, N, N).astype(bool)
    np.testing.assert_array_equal(masked[0], np.broadcast_to(np.triu(np.ones((N, N), bool), 1), (H, N, N)))
    assert not masked[1:].any()  # only layer 0 masks (causal)
    for layer, (rq, rk, scale) in enumerate(qk):
        assert t["scale"][layer] == scale
        np.testing.assert_array_equal(q[layer], rq[0].numpy())  # float32 as recorded: nothing rounded
        np.testing.assert_array_equal(k[layer], rk[0].numpy())
        # The page's terms, as its script makes them (float64 products of the stored float32), are score_terms
        qd = torch.from_numpy(q[layer]).double()
        kd = torch.from_numpy(k[layer]).double().repeat_interleave(2, dim=0)
        page_terms = qd[:, :, None, :] * kd[:, None, :, :] * t["scale"][layer]  # (H, L, L, D)
        close(page_terms, score_terms(rq[0].double(), rk[0].double(), scale=scale))
        if layer < 2:  # the page's weight, exp(sum of the terms - lse), is the softmax of the scores
            page_weights = torch.exp(page_terms.sum(-1) - torch.from_numpy(lse[layer])[..., None])
            page_weights = page_weights.masked_fill(torch.from_numpy(masked[layer]), 0.0)
            close(page_weights, _weights_of(rq.double(), rk.double(), scale, is_causal=layer == 0)[0])
            close(page_weights.float(), weights[layer][0])  # and the model's own float32 weights
    # The page takes the softmax of q . k * scale for each head's weights, except under ALiBi.
    assert t["softmax"] == [[True] * H, [True] * H, [False] * H]


def test_names_stay_escaped_with_terms(recorded):
    weights, qk = recorded
    title = "<b>q & k</b> __ATTNKIT_DATA__"
    page = viewer_html(weights, TOKENS, qk=qk, title=title, text=EVIL)
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert EVIL not in page and "<b>q" not in page
    assert "<title>&lt;b&gt;q &amp; k&lt;/b&gt; __ATTNKIT_DATA__</title>" in page
    data = _data(page)
    assert data["tokens"][-1] == EVIL and data["title"] == title and data["terms"] is not None


def test_terms_over_the_size_budget_are_left_out_and_the_page_says_so(recorded):
    weights, qk = recorded
    # q and k as float32, each row's log-sum-exp as float64, one bit a cell (layer 0 has zero weights)
    need = 4 * (3 * H * N * D + 3 * 2 * N * D) + 8 * 3 * H * N + math.ceil(3 * H * N * N / 8)
    fits = viewer_html(weights, TOKENS, qk=qk, max_dense_cells=need)
    over = viewer_html(weights, TOKENS, qk=qk, max_dense_cells=need - 1)
    assert _data(fits)["terms"] is not None and _data(fits)["note"] == ""
    data = _data(over)
    assert data["terms"] is None and data["mode"] == "dense"  # the weights still fit
    assert data["terms_note"].startswith(f"Score terms left out: their queries, keys and row sums take {need:,} bytes")
    assert data["note"] == data["terms_note"]  # in the header too
    assert len(fits) - len(over) > 4 * need // 3 - 300  # the base64 of what was left out, less the note
    assert _data(viewer_html(weights, TOKENS))["terms"] is None  # no qk: nothing, nothing to say
    assert _data(viewer_html(weights, TOKENS))["terms_note"] == ""


@pytest.mark.parametrize("change, error, words", [
    (lambda qk: qk[:2], ValueError, "qk must hold one (q, k) per layer: the attentions have 3 layers, qk has 2"),
    (lambda qk: "qk", TypeError, "qk must be a sequence of (q, k) or (q, k, scale)"),
    (lambda qk: [qk[0][0]] + qk[1:], TypeError, "qk[0] must be (q, k) or (q, k, scale), got Tensor"),
    (lambda qk: [(qk[0].q[:, :3], qk[0].k)] + qk[1:], ValueError, "qk[0] must hold q [H, L, D] = [4, 9, D]"),
    (lambda qk: [(qk[0].q, qk[0].k[:, :, :5])] + qk[1:], ValueError, "and k [Hkv, 9, D]"),
    (lambda qk: [(qk[0].q, qk[0].k.repeat(1, 2, 1, 1)[:, :3])] + qk[1:], ValueError, "q has 4 heads and k 3"),
    (lambda qk: [qk[0], (qk[1].q, qk[1].k[:, :1])] + qk[2:], ValueError,
     "expected q (4, 9, 8) and k (2, 9, 8) like layer 0"),
    (lambda qk: [(qk[0].q, qk[0].k, "1")] + qk[1:], TypeError, "qk[0] scale must be a real number"),
    (lambda qk: [(qk[0].q, qk[0].k, math.nan)] + qk[1:], ValueError, "qk[0] scale must be finite"),
    (lambda qk: [(qk[0].q.tolist(), qk[0].k)] + qk[1:], TypeError, "qk[0] q must be a torch.Tensor or numpy"),
    (lambda qk: qk[:2] + [(qk[2].q.index_fill(2, torch.tensor([4]), math.inf), qk[2].k)], ValueError,
     "qk[2] q (layer 2) has 32 non-finite values, first at head 0, position 4, dimension 0 (inf)"),
])
def test_bad_qk_is_named(recorded, change, error, words):
    weights, qk = recorded
    with pytest.raises(error, match=re.escape(words)):
        viewer_html(weights, TOKENS, qk=change(list(qk)))
