"""Bad input gets a clear answer before any computation: a ValueError/TypeError naming the argument,
what came and what was expected.

Arguments of ``attnkit.attention`` and ``MultiHeadAttention``; dense calls that cannot fit in memory;
mask_mods and score_mods that return the wrong thing; 3-D masks whose first dim would land on the head
axis; module inputs with no rows or the wrong dtype.
"""

from __future__ import annotations

import re

import pytest
import torch

import attnkit
from attnkit import masks, scores
from attnkit.call import validate_call
from tests.support import oracle
from tests.support.tolerances import close

ENV = "ATTNKIT_MAX_DENSE_BYTES"


def _qkv(b=2, h=2, lq=5, lk=5, e=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, h, lq, e, generator=g, dtype=dtype), torch.randn(b, h, lk, e, generator=g, dtype=dtype),
            torch.randn(b, h, lk, e, generator=g, dtype=dtype))


def attention_oracle(q, k, v, *, is_causal=False, mask=None, bias=None):
    b, h, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    return oracle.attention(q, k, v, allowed=oracle.allowed_grid(b, h, lq, lk, is_causal=is_causal, mask=mask),
                            bias=bias)[0]


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

Q = torch.randn(2, 4, 5, 8)
K = torch.randn(2, 2, 7, 8)
V = torch.randn(2, 2, 7, 6)


@pytest.mark.parametrize("args, kwargs, exc, pattern", [
    ((Q.numpy(), K, V), {}, TypeError, r"query must be a torch.Tensor, got ndarray"),
    ((Q.long(), K, V), {}, TypeError, r"query must be a floating-point tensor, got dtype torch.int64"),
    ((Q.to(torch.float8_e4m3fn), K, V), {}, TypeError, r"query must be float16, bfloat16, float32 or float64 \(what "
     r"attnkit computes in\), got dtype torch.float8_e4m3fn on cpu; convert it first, e.g. query.to\(torch.bfloat16"),
    ((Q, K.to("meta"), V), {}, ValueError, r"key is on the meta device, which holds no values to attend over: attnkit "
     r"computes on CPU and CUDA tensors"),
    ((Q[0, 0], K, V), {}, ValueError, r"query must have shape \[..., heads, length, dim\].*\(5, 8\)"),
    ((Q, K.double(), V), {}, TypeError, r"key dtype torch.float64 does not match query dtype torch.float32"),
    ((Q, K[:1], V), {}, ValueError, r"key batch dims \(1,\) must equal query batch dims \(2,\)"),
    ((Q, K[..., :4], V), {}, ValueError, r"key head size 4 must equal query head size 8"),
    ((Q, K, V[:, :, :3]), {}, ValueError, r"value must have the same heads and length as key"),
    ((Q[:, :3], K, V), {}, ValueError, r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    ((Q, K, V), {"mask": torch.ones(5, 7)}, TypeError, r"mask must be a bool tensor .*got dtype torch.float32"),
    ((Q, K, V), {"mask": [[True]]}, TypeError, r"mask must be a bool tensor, a MaskPlan or None, got list"),
    ((Q, K, V), {"mask": torch.ones(5, 6, dtype=torch.bool)}, ValueError,
     r"mask of shape \(5, 6\) is not broadcastable to \[..., H, Lq, Lk\] = \(2, 4, 5, 7\)"),
    ((Q, K, V), {"mask": torch.ones(3, 2, 4, 5, 7, dtype=torch.bool)}, ValueError, r"mask of shape"),
    ((Q, K, V), {"bias": torch.ones(5, 7, dtype=torch.bool)}, TypeError, r"bias must be a floating-point"),
    ((Q, K, V), {"bias": torch.ones(4, 7)}, ValueError, r"bias of shape \(4, 7\) is not broadcastable"),
    ((Q, K, V), {"dropout_p": 1.0}, ValueError, r"dropout_p must be a number in \[0, 1\), got 1.0"),
    ((Q, K, V), {"dropout_p": -0.1}, ValueError, r"dropout_p"),
    ((Q, K, V), {"scale": float("nan")}, ValueError, r"scale must be a finite number or None, got nan"),
    ((Q, K, V), {"is_causal": 1}, TypeError, r"is_causal must be a bool, got int"),
    ((Q, K, V), {"window": 3}, ValueError, r"window must be a \(left, right\) pair, got 3"),
    ((Q, K, V), {"window": (-1, 0)}, ValueError, r"window left must be None or a non-negative int, got -1"),
    ((Q, K, V), {"mask_mod": "causal"}, TypeError, r"mask_mod must be callable, got str"),
    ((Q[0], K[0], V[0]), {"mask_mod": lambda b, h, q, kv: q >= kv}, ValueError, r"mask_mod needs 4-D inputs"),
    ((Q, K, V), {"backend": "flash"}, ValueError, r"backend must be 'auto' or one of \[.*'reference'.*\], got 'flash'"),
    ((Q, K, V), {"backend": "sdpa", "return_weights": True}, ValueError,
     r"backend 'sdpa' cannot serve this call .*: fused SDPA kernels do not return attention weights"),
    ((Q, K, V), {"return_weights": "yes"}, TypeError, r"return_weights must be a bool, got str"),
])
def test_bad_input(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        attnkit.attention(*args, **kwargs)


def test_forced_backend_lists_every_reason():
    with pytest.raises(ValueError) as info:
        attnkit.attention(Q, K, V, backend="sdpa", return_weights=True, score_mod=lambda s, *i: s)
    assert "do not return attention weights" in str(info.value) and "score_mod" in str(info.value)


@pytest.mark.parametrize("name", ["band", "fused_tiles", "tiles", "flex"])
def test_forced_backend_refusal_describes_the_call(name):
    # the call as the message for a call no backend serves describes it, then this backend's reasons
    call = ("query (2, 4, 5, 8), key (2, 2, 7, 8), value (2, 2, 7, 8), torch.float32 on cpu; window (1, 1); "
            "return_weights")
    expected = (f"backend {name!r} cannot serve this call ({call}): "
                f"the {name} backend never forms the weights (use backend='reference')")
    with pytest.raises(ValueError) as forced:
        attnkit.attention(Q, K, K, window=(1, 1), return_weights=True, backend=name)
    assert str(forced.value) == expected
    with pytest.raises(ValueError) as direct:  # a backend called directly, not through select()
        attnkit.backends.get(name)(validate_call(Q, K, K, window=(1, 1), return_weights=True))
    assert str(direct.value) == expected
    with pytest.raises(ValueError) as family:
        attnkit.attention(Q, K, K, window=(1, 1), return_weights=True, backend="blockwise")
    assert str(family.value).splitlines()[0].endswith(f"can serve this call ({call}):")


@pytest.mark.parametrize("kwargs, pattern", [
    ({"embed_dim": 10, "num_heads": 3}, r"embed_dim \(10\) must be divisible by num_heads \(3\)"),
    ({"embed_dim": 8, "num_heads": 4, "num_kv_heads": 3}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    ({"embed_dim": 8, "num_heads": 0}, r"num_heads must be a positive int, got 0"),
    ({"embed_dim": 8, "num_heads": 2, "share_kv": True, "vdim": 4}, r"share_kv needs kdim == vdim"),
    ({"embed_dim": 8, "num_heads": 2, "dropout": 1.5}, r"dropout must be in \[0, 1\), got 1.5"),
])
def test_module_constructor_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        attnkit.MultiHeadAttention(**kwargs)


def test_module_forward_errors():
    mha = attnkit.MultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"query must be \[B, L, 8\], got \(2, 5, 7\)"):
        mha(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match=r"key_mask must be a bool \[B, Lk\] = \(2, 5\) tensor"):
        mha(x, key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be \[Lq, Lk\], \[B, Lq, Lk\] or \[B, H, Lq, Lk\]"):
        mha(x, mask=torch.ones(5, dtype=torch.bool))


# --------------------------------------------------------------------------------------------
# Dense tensors that cannot fit
# --------------------------------------------------------------------------------------------


def test_weights_of_a_very_long_sequence_are_refused_before_allocating(monkeypatch):
    # 16 heads x 300,000^2 float32 scores is 5.2 TiB per copy: far beyond any machine's memory.
    monkeypatch.delenv(ENV, raising=False)
    q = torch.zeros(1, 16, 300_000, 1)
    with pytest.raises(ValueError, match=r"\(1, 16, 300000, 300000\) torch.float32 = 17280000000000 bytes "
                                         r"\(15.7 TiB\).*memory available now.*backend='blockwise'.*"
                                         r"return_weights=False"):
        attnkit.attention(q, q, q, return_weights=True)


@pytest.mark.parametrize("kwargs", [{"return_weights": True}, {"backend": "reference"},
                                    {"backend": "reference", "mask_mod": masks.causal_mod()}])
def test_reference_backend_refuses_past_the_limit(monkeypatch, kwargs):
    q, k, v = _qkv(1, 1, 16, 16)  # three float32 copies of [1, 1, 16, 16]: 3072 bytes
    monkeypatch.setenv(ENV, "3071")
    with pytest.raises(ValueError, match=r"reference backend.*3 x \(1, 1, 16, 16\) torch.float32 = 3072 bytes "
                                         r"\(3.0 KiB\), more than the limit of 3071 bytes \(3.0 KiB\) "
                                         r"\(set by ATTNKIT_MAX_DENSE_BYTES\)"):
        attnkit.attention(q, k, v, **kwargs)
    monkeypatch.setenv(ENV, "3072")
    res = attnkit.attention(q, k, v, **kwargs)
    out = res[0] if isinstance(res, tuple) else res
    close(out, attention_oracle(q, k, v, is_causal="mask_mod" in kwargs), torch.float32)


def test_half_inputs_count_the_reference_backends_float32_scores(monkeypatch):
    q, k, v = _qkv(1, 1, 16, 16, dtype=torch.bfloat16)
    monkeypatch.setenv(ENV, "3071")
    with pytest.raises(ValueError, match=r"torch.float32 = 3072 bytes"):
        attnkit.attention(q, k, v, return_weights=True)


@pytest.mark.parametrize("kwargs, shape, dtype, nbytes", [
    # Bottom-right causal with Lq != Lk: the adapter builds a [Lq, Lk] bool mask and its copy.
    ({"is_causal": True}, (16, 32), torch.bool, 1024),
    # A key mask and a per-query bias merge into one float mask of their joint shape.
    ({"mask": torch.arange(32) < 20, "bias": torch.zeros(1, 1, 16, 1)}, (1, 1, 16, 32), torch.float32, 4096),
])
def test_sdpa_refuses_a_combined_mask_past_the_limit(monkeypatch, kwargs, shape, dtype, nbytes):
    q, k, v = _qkv(1, 1, 16, 32)
    monkeypatch.setenv(ENV, str(nbytes - 1))
    pattern = rf"SDPA backend's combined attn_mask.*2 x {re.escape(str(shape))} {dtype} = {nbytes} bytes"
    with pytest.raises(ValueError, match=pattern):
        attnkit.attention(q, k, v, backend="sdpa", **kwargs)
    # Tile by tile, the blockwise backend forms no [Lq, Lk] tensor: the same call goes through.
    close(attnkit.attention(q, k, v, backend="blockwise", **kwargs), attention_oracle(q, k, v, **kwargs),
          torch.float32)


def test_auto_keeps_its_choice_and_the_sdpa_message_past_the_limit(monkeypatch):
    """The memory check is the chosen backend's alone: "auto" picks SDPA for a key mask with a bias as it does
    under any limit, and its refusal is SDPA's own message, raised before anything runs."""
    q, k, v = _qkv(1, 1, 16, 32)
    kwargs = {"mask": torch.arange(32) < 20, "bias": torch.zeros(1, 1, 16, 1)}
    monkeypatch.setenv(ENV, "4095")
    assert attnkit.which_backend(q, k, v, **kwargs) == "sdpa"
    with pytest.raises(ValueError, match=r"^the SDPA backend's combined attn_mask would materialise 2 x \(1, 1, 16, "
                                         r"32\) torch.float32 = 4096 bytes"):
        attnkit.attention(q, k, v, **kwargs)
    monkeypatch.setenv(ENV, "4096")
    close(attnkit.attention(q, k, v, **kwargs), attention_oracle(q, k, v, **kwargs), torch.float32)


@pytest.mark.parametrize("name, who", [("reference", "the reference backend"), ("sdpa", "the SDPA backend")])
def test_a_backend_run_by_hand_still_refuses_past_the_limit(monkeypatch, name, who):
    """``attnkit.attention`` sizes a call while it checks it; a backend run on a call by hand sizes it itself."""
    q, k, v = _qkv(1, 1, 16, 32)
    req = validate_call(q, k, v, bias=torch.zeros(1, 1, 16, 32))
    monkeypatch.setenv(ENV, "0")
    with pytest.raises(ValueError, match=rf"^{who}.* would materialise .* more than the limit of 0 bytes"):
        attnkit.backends.get(name)(req)


def test_module_weights_past_the_limit_are_refused(monkeypatch):
    mha = attnkit.MultiHeadAttention(8, 2)
    monkeypatch.setenv(ENV, "1000")
    with pytest.raises(ValueError, match=r"\(1, 2, 16, 16\)"):
        mha(torch.randn(1, 16, 8), need_weights=True)


@pytest.mark.parametrize("value", ["lots", "-1", "1e9"])
def test_a_bad_limit_names_the_variable(monkeypatch, value):
    q, k, v = _qkv()
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=rf"ATTNKIT_MAX_DENSE_BYTES must be a non-negative whole number of bytes, "
                                         rf"got '{value}'"):
        attnkit.attention(q, k, v, return_weights=True)


# --------------------------------------------------------------------------------------------
# mask_mod / score_mod that return the wrong thing
# --------------------------------------------------------------------------------------------


def float_causal(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx).float()


def int_causal(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx).long()


def rows_only(b, h, q_idx, kv_idx):
    return torch.ones(q_idx.shape[-2], 3, dtype=torch.bool)


@pytest.mark.parametrize("backend", ["auto", "blockwise", "reference"])
@pytest.mark.parametrize("mod, exc, pattern", [
    (float_causal, TypeError, r"mask_mod 'float_causal' returned a torch.float32 tensor; expected a bool tensor"),
    (int_causal, TypeError, r"mask_mod 'int_causal' returned a torch.int64 tensor; expected a bool tensor"),
    (lambda b, h, q, kv: None, TypeError, r"mask_mod '<lambda>' returned NoneType; expected a bool tensor"),
    (rows_only, ValueError, r"mask_mod 'rows_only' returned shape \(3, 3\) for indices broadcasting to "
                            r"\(2, 2, 3, 4\)"),
])
def test_mask_mod_returning_the_wrong_thing(backend, mod, exc, pattern):
    q, k, v = _qkv()
    with pytest.raises(exc, match=pattern):
        attnkit.attention(q, k, v, mask_mod=mod, backend=backend)


def scalar_score(score, b, h, q_idx, kv_idx):
    return score.sum()


@pytest.mark.parametrize("backend", ["auto", "blockwise", "reference"])
@pytest.mark.parametrize("mod, exc, pattern", [
    (lambda s, b, h, q, kv: None, TypeError, r"score_mod '<lambda>' returned NoneType; expected a floating-point"),
    (lambda s, b, h, q, kv: 0.5, TypeError, r"score_mod '<lambda>' returned float; expected a floating-point tensor"),
    (lambda s, b, h, q, kv: s > 0, TypeError, r"returned a torch.bool tensor; expected a floating-point tensor"),
    (scalar_score, ValueError, r"score_mod 'scalar_score' returned shape \(\) for scores of shape \(2, 2, 3, 4\); "
                               r"expected the score's shape"),
    (lambda s, b, h, q, kv: s[..., :1], ValueError, r"returned shape \(2, 2, 3, 1\)"),
])
def test_score_mod_returning_the_wrong_thing(backend, mod, exc, pattern):
    q, k, v = _qkv()
    with pytest.raises(exc, match=pattern):
        attnkit.attention(q, k, v, score_mod=mod, backend=backend)


def test_the_probe_runs_first_in_range_without_grad_and_breaks_no_working_mod():
    # Mods that index captured per-batch/per-token tensors and a score_mod with a learned
    # parameter: the probe calls each once, first, in range, outside autograd; results and
    # gradients stay those of the plain call.
    q, k, v = _qkv(2, 2, 6, 6)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    inner = masks.and_masks(masks.document_mod(ids), masks.padding_mod(torch.tensor([6, 4])),
                            masks.prefix_lm_mod(torch.tensor([2, 0])))
    slopes = torch.nn.Parameter(scores.alibi_slopes(2))
    calls = []

    def seen(kind, *idx):
        calls.append((kind, torch.is_grad_enabled(), *(int(i.max()) for i in idx)))

    def mask_mod(b, h, q_idx, kv_idx):
        seen("mask", b, h, q_idx, kv_idx)
        return inner(b, h, q_idx, kv_idx)

    def score_mod(score, b, h, q_idx, kv_idx):
        seen("score", b, h, q_idx, kv_idx)
        return score - slopes[h] * (q_idx - kv_idx).abs()

    out = attnkit.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod, backend="reference")
    assert calls[:2] == [("mask", False, 1, 1, 5, 5), ("score", False, 1, 1, 5, 5)]
    allowed = oracle.allowed_grid(2, 2, 6, 6, mask_mod=inner)
    expected = oracle.attention(q, k, v, allowed=allowed, score_mod=lambda s, b, h, i, j:
                                s - slopes.detach().double()[h] * (i - j).abs())[0]
    close(out, expected, torch.float32)
    out.sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0


# --------------------------------------------------------------------------------------------
# 3-D masks against 4-D queries
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mask", "bias"])
def test_a_per_batch_3d_mask_is_refused_when_it_would_land_on_heads(name):
    q, k, v = _qkv(2, 2, 5, 5)  # B == H: broadcasting would silently mask head b with sequence b's mask
    t = torch.rand(2, 5, 5) > 0.3
    t = t if name == "mask" else torch.zeros(2, 5, 5).masked_fill(~t, -1.0)
    with pytest.raises(ValueError, match=rf"{name} of shape \(2, 5, 5\) against 4-D queries is ambiguous: its first "
                                         rf"dim would align with the 2 heads.*pass {name}\[:, None\]"):
        attnkit.attention(q, k, v, **{name: t})
    # The fix the message names gives the per-batch mask the caller meant; shapes that cannot be
    # misread still go through: no batch/head dim, a leading 1, 4-D, and 3-D against 3-D queries.
    for fixed in (t[:, None], t[0], t[:1], t[None, :1].expand(1, 2, 5, 5)):
        kw = {name: fixed}
        close(attnkit.attention(q, k, v, **kw), attention_oracle(q, k, v, **kw), torch.float32)
    per_head = t[:1].expand(2, 5, 5)  # [H, Lq, Lk] with [H, L, E] queries
    close(attnkit.attention(q[0], k[0], v[0], **{name: per_head}),
          attention_oracle(q[:1], k[:1], v[:1], **{name: per_head})[0], torch.float32)


# --------------------------------------------------------------------------------------------
# MultiHeadAttention: empty inputs, dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b, lq, lk", [(2, 0, 0), (0, 3, 3), (2, 3, 0), (2, 0, 3)])
def test_module_with_no_rows_returns_empty_outputs(b, lq, lk):
    mha = attnkit.MultiHeadAttention(8, 2, num_kv_heads=1)
    out, w = mha(torch.randn(b, lq, 8), torch.randn(b, lk, 8), need_weights=True)
    assert out.shape == (b, lq, 8) and w.shape == (b, 2, lq, lk)
    if lk == 0 and lq:  # no key to attend: zeros through the output projection (its bias, zero-initialised)
        close(out, torch.zeros_like(out), torch.float32)


@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_module_names_a_dtype_mismatch_and_the_fix(name):
    mha = attnkit.MultiHeadAttention(8, 2)
    args = {"query": torch.randn(2, 3, 8), "key": torch.randn(2, 3, 8), "value": torch.randn(2, 3, 8)}
    args[name] = args[name].half()
    with pytest.raises(TypeError, match=rf"{name} dtype torch.float16 does not match the module's parameter dtype "
                                        rf"torch.float32: pass {name}.to\(torch.float32\), or convert the module "
                                        r"with .to\(torch.float16\)"):
        mha(**args)
    with torch.autocast("cpu", dtype=torch.float16):  # autocast casts inputs itself: mixed dtypes are its job
        assert mha(**args).dtype == torch.float16
