"""Every backend against the float64 oracle and PyTorch SDPA over the grid of shapes x masks x dtypes."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import backends, masks
from attnkit.backends import sdpa as sdpa_module
from attnkit.call import validate_call
from tests.support import oracle
from tests.support.backends import eager_backends
from tests.support.tolerances import close

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# (B, H, Hkv, Lq, Lk, E, Ev)
SHAPES = {
    "square": (2, 4, 4, 8, 8, 16, 16),
    "lq<lk": (2, 4, 4, 5, 7, 16, 16),
    "lq>lk": (1, 2, 2, 9, 4, 8, 8),
    "odd": (1, 3, 3, 13, 11, 7, 7),
    "L=1": (2, 2, 2, 1, 1, 8, 8),
    "decode": (2, 2, 2, 1, 9, 8, 8),
    "gqa": (2, 8, 2, 6, 6, 8, 8),
    "mqa": (1, 4, 1, 6, 10, 8, 8),
    "ev!=e": (2, 2, 2, 6, 6, 16, 5),
}

MASKINGS = ["none", "causal", "padding", "window", "bias", "dead-row", "all",
            "window-arg", "mask_mod", "score_mod", "structured-all"]


def stripes(b, h, q_idx, kv_idx):
    """A mask_mod with an irregular pattern that also empties some rows."""
    return ((q_idx * 3 + kv_idx + h) % 4 != 0) & (q_idx != 2)


def alibi_like(score, b, h, q_idx, kv_idx):
    return score - 0.25 * (h + 1) * (q_idx - kv_idx).abs()


def make(shape, dtype, seed=0):
    b, h, hkv, lq, lk, e, ev = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, e, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, lk, e, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, lk, ev, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v)], g


def masking(kind, shape, g):
    """Keyword arguments for attnkit.attention and the matching oracle 'allowed' / bias."""
    b, h, _, lq, lk, _, _ = shape
    kw, allowed, bias = {}, None, None
    if kind in ("padding", "all"):
        lengths = torch.randint(1, lk + 1, (b,), generator=g)
        lengths[0] = lk
        pad = torch.arange(lk).view(1, -1) < lengths.view(-1, 1)  # [B, Lk]
        kw["mask"] = pad[:, None, None, :]
        allowed = pad[:, None, None, :].expand(b, h, lq, lk)
    if kind in ("causal", "all"):
        kw["is_causal"] = True
        grid = oracle.allowed_grid(b, h, lq, lk, is_causal=True)
        allowed = grid if allowed is None else allowed & grid
    if kind == "window":
        kw["mask"] = masks.sliding_window(lq, lk, left=2, right=1)
        allowed = oracle.allowed_grid(b, h, lq, lk, window=(2, 1))
    if kind in ("bias", "all"):
        bias = torch.randn(b, 1, lq, lk, generator=g, dtype=torch.float64)
        kw["bias"] = bias
    if kind in ("window-arg", "structured-all"):
        kw["window"] = (2, 1)
        grid = oracle.allowed_grid(b, h, lq, lk, window=(2, 1))
        allowed = grid if allowed is None else allowed & grid
    if kind in ("mask_mod", "structured-all"):
        kw["mask_mod"] = stripes
        grid = oracle.allowed_grid(b, h, lq, lk, mask_mod=stripes)
        allowed = grid if allowed is None else allowed & grid
    if kind in ("score_mod", "structured-all"):
        kw["score_mod"] = alibi_like
    if kind == "structured-all":
        kw["is_causal"] = True
        allowed = allowed & oracle.allowed_grid(b, h, lq, lk, is_causal=True)
    if kind == "dead-row":
        m = torch.ones(lq, lk, dtype=torch.bool)
        m[lq // 2] = False
        kw["mask"] = m
        allowed = m.expand(b, h, lq, lk)
    return kw, allowed, bias


def run_backend(name, q, k, v, kw):
    backend = backends.get(name)
    req = attnkit.call.validate_call(q, k, v, **kw)
    reasons = backend.not_supported_reasons(req)
    if reasons:
        with pytest.raises(ValueError, match=name):  # forcing it must say why, not fall back
            attnkit.attention(q, k, v, backend=name, **kw)
        return None
    return attnkit.attention(q, k, v, backend=name, **kw)


@functools.cache
def grid_masking(kind, shape_name):
    """``masking`` of one (kind, shape) cell of the grid. Its draws follow ``make``'s, which draws in float64
    whatever the dtype, so they are the same for every dtype and backend: the oracle's ``allowed`` grid
    (walked cell by cell) is made once per cell instead of once per dtype and backend."""
    shape = SHAPES[shape_name]
    _, g = make(shape, torch.float64)
    return masking(kind, shape, g)


@functools.cache
def grid_cell(kind, shape_name, dtype):
    """Inputs and attention kwargs (a bias in ``dtype``) of one cell of the grid, and the oracle's ``allowed``."""
    (q, k, v), _ = make(SHAPES[shape_name], dtype)
    kw, allowed, _ = grid_masking(kind, shape_name)
    kw = dict(kw)
    if "bias" in kw:
        kw["bias"] = kw["bias"].to(dtype)
    return (q, k, v), kw, allowed


def fresh_cell(kind, shape_name, dtype):
    """``grid_cell``'s inputs and kwargs as copies: a backend that wrote into its inputs cannot reach another case."""
    (q, k, v), kw, _ = grid_cell(kind, shape_name, dtype)
    return [t.clone() for t in (q, k, v)], {n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in kw.items()}


@functools.cache
def oracle_result(kind, shape_name, dtype):
    """The oracle's (output, weights) for ``grid_cell(kind, shape_name, dtype)``: the same for every backend."""
    (q, k, v), kw, allowed = grid_cell(kind, shape_name, dtype)
    return oracle.attention(q, k, v, allowed=allowed, bias=kw.get("bias"), score_mod=kw.get("score_mod"))


@pytest.mark.parametrize("backend", eager_backends())
@pytest.mark.parametrize("kind", MASKINGS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_oracle(backend, kind, shape_name, dtype):
    (q, k, v), kw = fresh_cell(kind, shape_name, dtype)
    out = run_backend(backend, q, k, v, kw)
    if out is None:
        return
    expected, _ = oracle_result(kind, shape_name, dtype)
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.isfinite(out).all()
    close(out, expected, dtype)


@pytest.mark.parametrize("kind", MASKINGS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_weights_match_oracle(kind, shape_name):
    (q, k, v), kw = fresh_cell(kind, shape_name, torch.float64)
    out, w = attnkit.attention(q, k, v, return_weights=True, **kw)
    expected_out, expected_w = oracle_result(kind, shape_name, torch.float64)
    close(out, expected_out)
    close(w, expected_w)


# float64 holds at the float64 row on any CPU; float32 is what users run, and the float32 row is 10x
# the measured float32 kernel-against-SDPA error (tests/support/measure_tolerances.py).
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "bias", "all"])
@pytest.mark.parametrize("shape_name", ["square", "lq<lk", "gqa", "ev!=e", "odd"])
def test_matches_torch_sdpa(kind, shape_name, dtype):
    """Parity with the real thing, F.scaled_dot_product_attention, converting only conventions."""
    (q, k, v), kw = fresh_cell(kind, shape_name, dtype)
    ours = attnkit.attention(q, k, v, **kw)
    groups = q.shape[1] // k.shape[1]
    kx, vx = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    attn_mask = kw.get("mask")
    if kw.get("is_causal"):  # PyTorch aligns top-left: build the bottom-right mask ourselves
        lq, lk = q.shape[2], k.shape[2]
        causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        attn_mask = causal if attn_mask is None else attn_mask & causal
    if "bias" in kw:
        attn_mask = kw["bias"] if attn_mask is None else kw["bias"].masked_fill(~attn_mask, float("-inf"))
    theirs = F.scaled_dot_product_attention(q, kx, vx, attn_mask=attn_mask)
    assert ours.dtype == dtype
    close(ours, theirs)


def test_auto_prefers_decode_then_sdpa_and_never_drops_masks():
    (q, k, v), _ = make(SHAPES["lq<lk"], torch.float32)
    assert attnkit.which_backend(q, k, v) == "decode"  # a few queries without a gradient
    assert attnkit.which_backend(q.requires_grad_(), k, v) == "sdpa"
    assert attnkit.which_backend(q, k, v, return_weights=True) == "reference"
    m = torch.zeros(5, 7, dtype=torch.bool)
    m[:, 0] = True  # everything may only attend key 0: the output must be v[..., 0, :]
    out = attnkit.attention(q, k, v, mask=m)
    close(out, v[:, :, :1, :].expand_as(out))


def test_causal_is_bottom_right_with_cache_layout():
    """Lq < Lk: the last query sees every key, the first sees Lk - Lq + 1 keys."""
    (q, k, v), _ = make(SHAPES["lq<lk"], torch.float64)
    _, w = attnkit.attention(q, k, v, is_causal=True, return_weights=True)
    lq, lk = q.shape[2], k.shape[2]
    seen = (w > 0).sum(-1)
    assert seen[0, 0].tolist() == [lk - lq + 1 + i for i in range(lq)]


def test_one_causal_query_sees_every_key_and_sdpa_builds_no_mask_for_it():
    """A decode step: one query aligned bottom-right sits after every key, so causal masks nothing; SDPA then
    gets no mask (none to build or read), and the answer is the unmasked call's, bit for bit, and the oracle's."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (1, 9, 9))
    sdpa = backends.get("sdpa")
    calls = []
    real = sdpa_module.F.scaled_dot_product_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sdpa_module.F, "scaled_dot_product_attention",
                   lambda *a, **kw: calls.append(kw) or real(*a, **kw))
        out = sdpa(validate_call(q, k, v, is_causal=True))[0]
    assert calls[0]["attn_mask"] is None and not calls[0]["is_causal"]
    assert torch.equal(out, attnkit.attention(q, k, v, backend="sdpa"))
    allowed = oracle.allowed_grid(2, 3, 1, 9, is_causal=True)
    ref, _ = oracle.attention(q.double(), k.double(), v.double(), allowed=allowed)
    close(out, ref, torch.float32)


def test_leading_batch_dims_and_3d_inputs():
    q, k, v = torch.randn(2, 3, 4, 5, 8), torch.randn(2, 3, 4, 6, 8), torch.randn(2, 3, 4, 6, 8)
    out = attnkit.attention(q, k, v, is_causal=True)
    ref, _ = oracle.attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                              allowed=oracle.allowed_grid(6, 4, 5, 6, is_causal=True))
    close(out.flatten(0, 1), ref, torch.float32)
    out3 = attnkit.attention(q[0, 0], k[0, 0], v[0, 0])
    close(out3, attnkit.attention(q[0, 0], k[0, 0], v[0, 0], backend="reference"))


def test_empty_key_sequence_gives_zeros():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 0, 4), torch.randn(1, 2, 0, 5)
    out = attnkit.attention(q, k, v)
    assert out.shape == (1, 2, 3, 5) and (out == 0).all()


def test_dropout_in_training_changes_output_but_keeps_expectation_shape():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    a = attnkit.attention(q, k, v, dropout_p=0.5, backend="reference")
    b = attnkit.attention(q, k, v, backend="reference")
    assert a.shape == b.shape and not torch.allclose(a, b)
    # with p close to 0 nothing is dropped in practice; p = 0 is exactly the plain result
    close(attnkit.attention(q, k, v, dropout_p=0.0, backend="sdpa"), b)


def test_weights_are_pre_dropout_probabilities():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    _, w = attnkit.attention(q, k, v, dropout_p=0.3, return_weights=True)
    close(w.sum(-1), torch.ones(1, 2, 6))


def test_float16_on_a_cpu_without_float16_products_is_computed_in_float32_and_rounded(monkeypatch):
    """The SDPA backend's float16 on such a CPU: PyTorch's float32 kernel on the exactly widened
    inputs, rounded once (its float16 kernel is slower there); gradients come back in float16."""
    import torch.nn.functional as F

    from attnkit import _cpu

    monkeypatch.setattr(_cpu, "flags", lambda: frozenset({"avx2"}))
    assert not _cpu.has_fp16_products()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g).half().requires_grad_() for _ in range(3))
    out = attnkit.attention(q, k, v, is_causal=True, backend="sdpa")  # (auto: the band kernel, for causal)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).half()
    assert out.dtype == torch.float16 and torch.equal(out, want)
    out.sum().backward()
    assert all(t.grad.dtype == torch.float16 and torch.isfinite(t.grad).all() for t in (q, k, v))
    monkeypatch.setattr(_cpu, "flags", lambda: frozenset({"avx512_fp16"}))
    assert _cpu.has_fp16_products()
    with torch.no_grad():
        native = attnkit.attention(q, k, v, is_causal=True, backend="sdpa")
        assert torch.equal(native, F.scaled_dot_product_attention(q, k, v, is_causal=True))


class _Stub:
    """A backend of one's own that serves nothing: enough to be placed in the order."""

    def __init__(self, name: str):
        self.name = name

    def not_supported_reasons(self, req):
        return ["a stub"]

    def __call__(self, req):
        raise AssertionError("a stub never serves")


@pytest.fixture
def own_registry(monkeypatch):
    """The registry's tables as copies, so a test's registrations go when it ends."""
    from attnkit.backends import registry

    for name in ("_REGISTRY", "AUTO_RANKS", "AUTO_ORDER", "_PREFERRING", "DEVICE_FIRST"):
        monkeypatch.setattr(registry, name, type(getattr(registry, name))(getattr(registry, name)))
    return registry


class _Serves(_Stub):
    """A backend of one's own that serves every call with zeros (and, with ``prefers``, claims every call)."""

    def __init__(self, name: str, prefers: bool = False):
        super().__init__(name)
        if prefers:
            self.prefers = lambda req: True

    def not_supported_reasons(self, req):
        return []

    def __call__(self, req):
        return req.query.new_zeros(*req.query.shape[:-1], req.value.shape[-1]), None


def _step():
    return tuple(torch.randn(1, 4, n, 8, generator=torch.Generator().manual_seed(n)) for n in (1, 30, 30))


@pytest.mark.parametrize("how", ["a lower rank", "a prefers rule", "the CPU's own first"])
def test_the_decode_lane_steps_aside_for_whatever_auto_would_pick_first(own_registry, how):
    q, k, v = _step()
    assert own_registry.step_leader() is own_registry.get("decode")
    if how == "a lower rank":
        own_registry.register(_Serves("mine"), auto_rank=own_registry.AUTO_RANKS["decode"] - 1)
    elif how == "a prefers rule":
        own_registry.register(_Serves("mine", prefers=True), auto_rank=own_registry.AUTO_RANKS["flex"] + 1)
    else:
        own_registry.DEVICE_FIRST["cpu"] = ("mine",)
        own_registry.register(_Serves("mine"))
    leader = own_registry.step_leader()
    assert leader is own_registry.get("mine") if how == "a lower rank" else leader is None  # None: no lane at all
    with attnkit.backends.served() as names:
        out = attnkit.attention(q, k, v)
    assert names == ["mine"] and not out.any()


def test_a_leader_with_a_step_of_its_own_answers_plain_steps_and_only_those(own_registry):
    mine = _Serves("mine")
    asked = []
    mine.step = lambda q, k, v, is_causal, scale: asked.append((is_causal, scale)) or q.new_ones(q.shape)
    own_registry.register(mine, auto_rank=own_registry.AUTO_RANKS["decode"] - 1)
    q, k, v = _step()
    with attnkit.backends.served() as names:
        lane = attnkit.attention(q, k, v, is_causal=True, scale=0.5)
        whole = attnkit.attention(q, k, v, window=(3, 0))  # not plain: select, then __call__
    assert asked == [(True, 0.5)] and names == ["mine", "mine"]
    assert bool((lane == 1).all()) and not whole.any()


@settings(deadline=None, derandomize=True, max_examples=30)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), causal=st.booleans(),
       lk=st.integers(1, 64), heads=st.sampled_from([(4, 4), (4, 1), (6, 2)]))
def test_no_builtin_prefers_rule_claims_a_one_query_call(dtype, causal, lk, heads):
    """What lets the decode lane run before select: of the built-ins, only band has a rule, and it asks for more
    than one query (registry.step_leader)."""
    from attnkit.backends import registry

    q = torch.randn(1, heads[0], 1, 8).to(dtype)
    k, v = (torch.randn(1, heads[1], lk, 8).to(dtype) for _ in range(2))
    req = validate_call(q, k, v, is_causal=causal)
    assert set(registry._PREFERRING) == {"band"}
    assert not any(b.prefers(req) for b in registry._PREFERRING.values())


def test_an_auto_rank_places_a_backend_between_the_ranks_around_it_whatever_the_order_of_registration(own_registry):
    builtin = ["decode", "sdpa", "band", "fused_tiles", "tiles", "reference", "flex"]
    assert own_registry.AUTO_ORDER == builtin
    ranks = own_registry.AUTO_RANKS
    own_registry.register(_Stub("late"), auto_rank=(ranks["band"] + ranks["fused_tiles"]) // 2)
    own_registry.register(_Stub("early"), auto_rank=(ranks["decode"] + ranks["sdpa"]) // 2)
    assert own_registry.AUTO_ORDER == ["decode", "early", "sdpa", "band", "late", "fused_tiles", "tiles",
                                       "reference", "flex"]
    assert own_registry.auto_order("cpu") == own_registry.AUTO_ORDER
    own_registry.register(_Stub("late"), auto_rank=ranks["flex"] + 1)  # again, with another rank: it moves
    assert own_registry.AUTO_ORDER[-2:] == ["flex", "late"] and own_registry.AUTO_ORDER.count("late") == 1


def test_an_auto_rank_another_backend_holds_is_refused_naming_it(own_registry):
    before = (dict(own_registry._REGISTRY), list(own_registry.AUTO_ORDER))
    band = own_registry.AUTO_RANKS["band"]
    with pytest.raises(ValueError, match=rf"auto_rank {band} is taken by 'band': give 'mine' a rank"):
        own_registry.register(_Stub("mine"), auto_rank=band)
    with pytest.raises(TypeError, match="auto_rank must be an int or None, got str"):
        own_registry.register(_Stub("mine"), auto_rank="first")
    assert (own_registry._REGISTRY, own_registry.AUTO_ORDER) == before  # nothing registered


def test_served_names_the_backend_of_each_call_in_order_and_nothing_else():
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with attnkit.backends.served() as outer:
        attnkit.attention(q, k, v)
        with attnkit.backends.served() as inner:
            attnkit.attention(q, k, v, return_weights=True)
            attnkit.which_backend(q, k, v, score_mod=lambda s, b, h, i, j: s)  # chooses, serves nothing
        attnkit.attention(q, k, v, backend="tiles")
    assert inner == ["reference"]
    assert outer == ["decode", "reference", "tiles"]  # an inner block's calls count in the outer one too
    seen = []

    def other_thread():
        with attnkit.backends.served() as names:
            attnkit.attention(q, k, v, backend="reference")
        seen.append(names)

    import threading

    with attnkit.backends.served() as mine:
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        attnkit.attention(q, k, v)
    assert seen == [["reference"]] and mine == ["decode"]  # each thread its own calls
