"""Bad input raises ValueError/TypeError naming the argument, what came and what was expected."""

from __future__ import annotations

import pytest
import torch

import attnkit

Q = torch.randn(2, 4, 5, 8)
K = torch.randn(2, 2, 7, 8)
V = torch.randn(2, 2, 7, 6)


@pytest.mark.parametrize("args, kwargs, exc, pattern", [
    ((Q.numpy(), K, V), {}, TypeError, r"query must be a torch.Tensor, got ndarray"),
    ((Q.long(), K, V), {}, TypeError, r"query must be a floating-point tensor, got dtype torch.int64"),
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
     r"backend 'sdpa' cannot serve this call: fused SDPA kernels do not return attention weights"),
    ((Q, K, V), {"return_weights": "yes"}, TypeError, r"return_weights must be a bool, got str"),
])
def test_bad_input(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        attnkit.attention(*args, **kwargs)


def test_forced_backend_lists_every_reason():
    with pytest.raises(ValueError) as info:
        attnkit.attention(Q, K, V, backend="sdpa", return_weights=True, score_mod=lambda s, *i: s)
    assert "do not return attention weights" in str(info.value) and "score_mod" in str(info.value)


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
