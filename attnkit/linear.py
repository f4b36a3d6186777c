"""Linearised (kernel) attention: ``phi(Q) (phi(K)^T V)`` in O(n d^2) instead of O(n^2 d).

Softmax attention weighs key ``j`` for query ``i`` by ``exp(q_i . k_j)``. Kernel attention
replaces that by ``phi(q_i) . phi(k_j)`` for a positive feature map ``phi``; matrix products
then associate the other way round and the n x n matrix never exists (Katharopoulos et al.
2020, "Transformers are RNNs"). It is a *different model*, not an approximation attnkit hides
behind ``attnkit.attention``: only the random-feature map (Performer's FAVOR+, Choromanski et
al. 2021) estimates softmax attention, and only in expectation.

Plain PyTorch, non-causal, for a reader::

    fq, fk = phi(q), phi(k)                       # [..., L, F]
    out = (fq @ (fk.transpose(-2, -1) @ v)) / (fq @ fk.sum(-2, keepdim=True).transpose(-2, -1))

Causal attention keeps running sums of ``phi(k_j) v_j^T`` (an RNN state); here it runs chunk by
chunk: exact quadratic attention inside a chunk, the carried state across chunks, so memory is
O(chunk^2 + F * Ev) per head rather than O(L * F * Ev).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._text import describe

__all__ = ["elu_feature_map", "relu_feature_map", "random_feature_map", "linear_attention"]

FeatureMap = Callable[[Tensor], Tensor]


def elu_feature_map(x: Tensor) -> Tensor:
    """``elu(x) + 1``, positive everywhere (Katharopoulos et al. 2020)."""
    return F.elu(x) + 1.0


def relu_feature_map(x: Tensor) -> Tensor:
    """``relu(x)``; rows that map to all zeros attend nothing and give zeros."""
    return F.relu(x)


def random_feature_map(head_dim: int, num_features: int, *, generator: torch.Generator | None = None,
                       scale: float | None = None, dtype=torch.float32, device=None) -> FeatureMap:
    """Positive random features whose dot products estimate ``exp(scale * q . k)`` (FAVOR+).

    ``phi(x) = exp(w x - |x|^2 / 2) / sqrt(m)`` with ``x = x * sqrt(scale)`` and ``w ~ N(0, I)``,
    ``m = num_features``: ``E[phi(q) . phi(k)] = exp(scale * q . k)``. With ``scale`` defaulting
    to ``1 / sqrt(head_dim)`` the estimate targets softmax attention's weights.
    """
    if num_features <= 0 or head_dim <= 0:
        raise ValueError(f"head_dim and num_features must be positive, got {head_dim}, {num_features}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    w = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)

    def phi(x: Tensor) -> Tensor:
        x = x * math.sqrt(scale)
        proj = x @ w.to(x.dtype).transpose(0, 1)  # [..., L, m]
        sq = 0.5 * (x * x).sum(-1, keepdim=True)
        # one shift for the whole tensor cancels in the normalisation and keeps exp() finite
        # (a per-row shift would not cancel for keys: it would reweight them)
        shift = proj.detach().amax()
        return torch.exp(proj - sq - shift) / math.sqrt(num_features)

    return phi


def linear_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    feature_map: FeatureMap = elu_feature_map,
    is_causal: bool = False,
    key_mask: Tensor | None = None,
    chunk_size: int = 128,
    eps: float = 1e-6,
) -> Tensor:
    """Kernel attention ``phi(Q) phi(K)^T V``, row-normalised, in linear time.

    Args:
        query: ``[B, H, Lq, E]``.
        key: ``[B, Hkv, Lk, E]`` (``H % Hkv == 0``).
        value: ``[B, Hkv, Lk, Ev]``.
        feature_map: ``phi``, applied to the last dim; must return non-negative features.
        is_causal: query ``i`` sees keys ``<= Lk - Lq + i`` (bottom-right, as everywhere in attnkit).
        key_mask: ``[B, Lk]`` bool, ``True`` = real token.
        chunk_size: chunk length for the causal scan.
        eps: added to the normaliser; rows with nothing to attend give zeros.

    Returns:
        ``[B, H, Lq, Ev]``.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating [B, H, L, D] tensor, got {describe(t)}")
    b, h, lq, _ = query.shape
    hkv, lk = key.shape[1], key.shape[2]
    if key.shape[0] != b or value.shape[:3] != key.shape[:3] or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"shapes do not fit: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)} (expected [B,H,Lq,E], [B,Hkv,Lk,E], [B,Hkv,Lk,Ev])")
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({hkv})")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, lk)):
        raise ValueError(f"key_mask must be a bool [B, Lk] = {(b, lk)} tensor, got {describe(key_mask)}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if is_causal and lq > lk:
        raise ValueError(f"is_causal with Lq ({lq}) > Lk ({lk}) leaves the first queries without keys; "
                         "pad the keys or drop is_causal")

    fq = feature_map(query)  # [B, H, Lq, F]
    fk = feature_map(key)  # [B, Hkv, Lk, F]
    if key_mask is not None:
        fk = fk * key_mask[:, None, :, None].to(fk.dtype)
    if h != hkv:
        fk = fk.repeat_interleave(h // hkv, dim=1)
        value = value.repeat_interleave(h // hkv, dim=1)
    if not is_causal:
        kv = fk.transpose(-2, -1) @ value  # [B, H, F, Ev]
        z = fk.sum(-2)  # [B, H, F]
        return (fq @ kv) / ((fq @ z.unsqueeze(-1)) + eps)
    return _causal_chunked(fq, fk, value, offset=lk - lq, chunk=chunk_size, eps=eps)


def _causal_chunked(fq: Tensor, fk: Tensor, v: Tensor, *, offset: int, chunk: int, eps: float) -> Tensor:
    """Keys ``[0, offset)`` are visible to every query; from there a chunked causal scan."""
    state = fk[..., :offset, :].transpose(-2, -1) @ v[..., :offset, :]  # [B, H, F, Ev]
    z = fk[..., :offset, :].sum(-2)  # [B, H, F]
    fk, v = fk[..., offset:, :], v[..., offset:, :]
    outs = []
    for s in range(0, fq.shape[-2], chunk):
        e = min(s + chunk, fq.shape[-2])
        q_c, k_c, v_c = fq[..., s:e, :], fk[..., s:e, :], v[..., s:e, :]
        local = (q_c @ k_c.transpose(-2, -1)).tril()  # [B, H, c, c]: causal inside the chunk
        num = q_c @ state + local @ v_c
        den = (q_c @ z.unsqueeze(-1)).squeeze(-1) + local.sum(-1)
        outs.append(num / (den.unsqueeze(-1) + eps))
        state = state + k_c.transpose(-2, -1) @ v_c
        z = z + k_c.sum(-2)
    return torch.cat(outs, dim=-2)

