"""The SDPA backend's grouped-query heads (read in place: ``enable_gqa``, its fallback, and the folded decode
call) and the folded call's probe row, which answers for the finiteness of the keys and values it reads."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.backends import sdpa as sdpa_module
from attnkit.call import validate_call
from tests.support import oracle, poison
from tests.support.tolerances import close

NAN, INF = float("nan"), float("inf")
BACKEND = sdpa_module.SDPABackend()


pytestmark = pytest.mark.usefixtures("one_thread")


def _qkv(h, hkv, lq, lk, dtype=torch.float32, d=16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, length, d, generator=g).to(dtype) for n, length in ((h, lq), (hkv, lk), (hkv, lk)))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _mask(lq, lk, dead_row=None):
    m = torch.rand(2, 1, lq, lk, generator=torch.Generator().manual_seed(5)) < 0.6
    if dead_row is not None:
        m[:, :, dead_row] = False
    return m


def _calls(monkeypatch):
    """The positional and keyword arguments of each F.scaled_dot_product_attention call the backend makes."""
    calls, real = [], sdpa_module.F.scaled_dot_product_attention
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((a, kw)) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("native", [True, False], ids=["enable_gqa", "repeated (torch < 2.5)"])
@pytest.mark.parametrize("case", ["causal", "mask", "causal, Lq < Lk", "decode"])
def test_grouped_heads_forward_and_backward_match_the_oracle_on_both_paths(monkeypatch, native, case):
    """The fallback for a torch without ``enable_gqa`` (forced here) and the native path give the oracle's
    answer and gradients; the native path hands SDPA the key and value tensors themselves, never a copy."""
    if native and not sdpa_module.NATIVE_GQA:
        pytest.skip("this torch has no enable_gqa")
    monkeypatch.setattr(sdpa_module, "NATIVE_GQA", native)
    lq, lk = {"causal": (20, 20), "mask": (20, 20), "causal, Lq < Lk": (11, 20), "decode": (1, 20)}[case]
    q, k, v = _qkv(6, 2, lq, lk, torch.float64, grad=True)
    kw = {"mask": _mask(lq, lk, dead_row=3)} if case == "mask" else {"is_causal": case != "decode"}
    calls = _calls(monkeypatch)
    out = attnkit.attention(q, k, v, backend="sdpa", **kw)
    (args, used), = calls
    if native or case == "decode":  # the folded decode call reads the groups in place on every torch
        assert args[1] is k and args[2] is v
    else:
        assert args[1].shape[1] == 6
    assert used.get("enable_gqa", False) == (native and case != "decode")
    allowed = oracle.allowed_grid(2, 6, lq, lk, is_causal=kw.get("is_causal", False), mask=kw.get("mask"))
    want, _ = oracle.attention(q, k, v, allowed=allowed)
    close(out, want)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(attnkit.attention(q, k, v, backend="reference", **kw), (q, k, v), dout)
    for a, b in zip(got, ref, strict=True):
        close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", ["decode", "decode, dead row", "3 causal queries", "MHA decode"])
def test_a_folded_call_gives_the_oracles_answer_and_zeros_for_a_dead_row(dtype, case):
    h, hkv, lq = (4, 4, 1) if case == "MHA decode" else ((8, 2, 3) if case.startswith("3") else (8, 2, 1))
    lk = 40
    q, k, v = _qkv(h, hkv, lq, lk, dtype)
    kw = {"is_causal": True} if lq > 1 else {}
    if case == "decode, dead row":
        kw = {"mask": _mask(lq, lk)}
        kw["mask"][1] = False  # the second batch element's one query sees nothing
    req = validate_call(q, k, v, **kw)
    assert sdpa_module._folds(req) and BACKEND.sees_nonfinite(req)
    out, _ = BACKEND(req)
    allowed = oracle.allowed_grid(2, h, lq, lk, is_causal=kw.get("is_causal", False), mask=kw.get("mask"))
    want, _ = oracle.attention(q, k, v, allowed=allowed)
    close(out, want, dtype)
    if case == "decode, dead row":
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(BACKEND.if_finite(req)[0], out)  # the checked call is the same call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["NaN", "+inf", "-inf"])
@pytest.mark.parametrize("where", poison.KV_PLACES)
@pytest.mark.parametrize("key", [0, 700, 1499], ids=["first key", "a later block", "last key"])
def test_the_probe_row_sees_every_non_finite_key_and_value(dtype, value, where, key):
    """A key of ``-inf`` scores ``-inf`` against an ordinary query (weight 0: the row stays finite); the probe
    of zeros scores NaN against it. Every kind of non-finite key or value, in any block of the kernel's pass,
    makes :meth:`if_finite` decline."""
    q, k, v = _qkv(4, 2, 1, 1500, dtype, d=64)
    poison.poison(q, k, v, where, key, value)
    assert BACKEND.if_finite(validate_call(q, k, v)) is None


def test_large_finite_keys_are_no_false_alarm_for_the_probe():
    q, k, v = _qkv(4, 2, 1, 64, d=64)
    k[0, 0, 3] = 3e38  # a sum of this key's elements would overflow; the probe's score is 0 * k, which does not
    assert BACKEND.if_finite(validate_call(q, k, v)) is not None


@pytest.mark.parametrize("where", ["k -inf", "k +inf", "k NaN", "v +inf", "v NaN", "q NaN"])
@pytest.mark.parametrize("masked", [False, True], ids=["allowed key", "a key no row allows"])
@pytest.mark.parametrize("shared", [False, True], ids=["mask per head", "one mask row per batch element"])
@pytest.mark.parametrize("backend", ["sdpa", "decode"])
def test_a_decode_step_keeps_the_nonfinite_rule_with_the_probe(where, masked, shared, backend):
    """Through attnkit.attention (the probe, or the decode kernel's own flag, instead of a read of the cache): the
    rows that allow the bad key are NaN, every other row is the clean call's bit for bit, a dead row is zeros."""
    q, k, v = _qkv(4, 2, 1, 30, d=8)
    mask = torch.ones(2, 1 if shared else 4, 1, 30, dtype=torch.bool)
    if not shared:
        mask[1, 2:] = False  # batch 1, heads 2 and 3 (kv head 1): dead rows
    mask[:, :, :, 7] = False  # key 7 allowed by nobody
    bad_key = 12
    if masked:
        bad_key = 7
    clean = attnkit.attention(q, k, v, mask=mask, backend=backend)
    name, kind = where.split()
    value = {"-inf": -INF, "+inf": INF, "NaN": NAN}[kind]
    t = {"q": q, "k": k, "v": v}[name]
    if name == "q":
        t[0, 1, 0, 3] = value
        rows = torch.zeros(2, 4, dtype=torch.bool)
        rows[0, 1] = True
    else:
        t[1, 0, bad_key, 3] = value  # kv head 0 of batch 1: query heads 0 and 1
        rows = torch.zeros(2, 4, dtype=torch.bool)
        rows[1, :2] = not masked
    got = attnkit.attention(q, k, v, mask=mask, backend=backend)
    assert got[rows].isnan().all()
    assert torch.equal(got[~rows], clean[~rows])
    if not shared:
        assert torch.equal(got[1, 2:], torch.zeros_like(got[1, 2:]))


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["MHA", "GQA"])
def test_a_vouched_cache_takes_no_probe_row_and_its_exact_path_computes_like_its_clean_call(monkeypatch, heads):
    """A KV cache's buffers are vouched for (their flag answers, at no cost): the folded call then carries no probe
    row, and a poisoned cache's exact path computes its clean rows as the clean cache's call does, bit for bit (a
    probe row in one of the two calls would change their rounding)."""
    from attnkit import nonfinite

    h, hkv = heads
    q, k, v = _qkv(h, hkv, 1, 600, d=64)
    dirty_k = k.clone()
    dirty_k[1, 0, 17, 3] = NAN  # kv head 0 of batch 1: its query heads' rows are poisoned
    clean_k = dirty_k.nan_to_num(0.0)
    nonfinite.vouch(torch.tensor(True), clean_k, v)
    calls = _calls(monkeypatch)
    want = attnkit.attention(q, clean_k, v, backend="sdpa")
    assert calls[-1][0][0].shape[2] == h // hkv  # the query rows alone
    vv = v.clone()
    nonfinite.vouch(torch.tensor(False), dirty_k, vv)
    got = attnkit.attention(q, dirty_k, vv, backend="sdpa")
    assert all(args[0].shape[2] == h // hkv for args, _ in calls)
    rows = torch.zeros(2, h, dtype=torch.bool)
    rows[1, : h // hkv] = True
    assert got[rows].isnan().all() and torch.equal(got[~rows], want[~rows])
