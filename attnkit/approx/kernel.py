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

Causal attention keeps running sums of ``phi(k_j) v_j^T`` (an RNN state, :class:`LinearState`);
here it runs chunk by chunk: exact quadratic attention inside a chunk, the carried state across
chunks, so memory is O(chunk^2 + F * Ev) per head rather than O(L * F * Ev). Decoding one token
at a time is the same step with chunks of one (:func:`scan_step`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .._text import describe

__all__ = ["elu_feature_map", "relu_feature_map", "random_feature_map", "orthogonal_features", "favor_feature_map",
           "linear_attention", "LinearState"]

FeatureMap = Callable[[Tensor], Tensor]


def elu_feature_map(x: Tensor) -> Tensor:
    """``elu(x) + 1``, positive everywhere (Katharopoulos et al. 2020)."""
    return F.elu(x) + 1.0


def relu_feature_map(x: Tensor) -> Tensor:
    """``relu(x)``; rows that map to all zeros attend nothing and give zeros."""
    return F.relu(x)


def memory_limit(device: torch.device | str | None = None) -> int | None:
    """Bytes of memory a tensor on ``device`` can have at most: the GPU's for CUDA, else the machine's
    RAM (or its container's limit, when lower); ``None`` where this is not known."""
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu" or not hasattr(os, "sysconf"):
        return None
    try:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text.isdigit():
            limit = min(limit, int(text))
    except OSError:
        pass
    return limit


def check_fits(need: int, what: str, device: torch.device | str | None = None) -> None:
    """Refuse ``need`` bytes beyond :func:`memory_limit`, naming ``what`` needs them and both sizes.

    Raises:
        ValueError: ``need`` exceeds the memory of ``device``.
    """
    limit = memory_limit(device)
    if limit is not None and need > limit:
        where = "this GPU" if torch.device("cpu" if device is None else device).type == "cuda" else "this machine"
        raise ValueError(f"performer: {what} needs {_size(need)}, more than the {_size(limit)} of memory "
                         f"{where} has; use fewer features")


def _size(n: int) -> str:
    return next(f"{n / 2**e:.1f} {unit}" for e, unit in ((50, "PiB"), (40, "TiB"), (30, "GiB"), (20, "MiB"), (0, "B"))
                if n >= 2**e or e == 0)


def _check_feature_count(num_features, head_dim) -> None:
    for name, val in (("num_features", num_features), ("head_dim", head_dim)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"performer: {name} must be an int >= 1, got {val!r}")


def orthogonal_features(num_features: int, head_dim: int, *, generator: torch.Generator | None = None) -> Tensor:
    """``[num_features, head_dim]`` float64 Gaussian rows, orthogonal within each block of ``head_dim``.

    FAVOR+'s orthogonal random features (Choromanski et al. 2021, section 2.4): QR of a Gaussian
    matrix gives orthonormal directions; each row is rescaled by the norm of an independent
    Gaussian vector so that every row is still marginally ``N(0, I)`` (the estimator stays
    unbiased) while orthogonality lowers its variance.

    Raises:
        ValueError: ``num_features`` or ``head_dim`` not a positive int, or the draw (the features
            and the Gaussian rows of their norms, ``2 * num_features * head_dim`` float64) larger
            than the machine's memory.
    """
    _check_feature_count(num_features, head_dim)
    blocks = math.ceil(num_features / head_dim)
    check_fits(2 * blocks * head_dim * head_dim * 8,
               f"num_features={num_features:,} with head_dim={head_dim} ([{num_features:,}, {head_dim}] float64 "
               f"features, drawn beside as many Gaussian numbers)")
    w = torch.empty(blocks * head_dim, head_dim, dtype=torch.float64)
    for i in range(blocks):
        g = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        qr = torch.linalg.qr(g)
        # signs fixed by R's diagonal make Q uniformly (Haar) distributed, not biased by the algorithm
        w[i * head_dim:(i + 1) * head_dim] = (qr.Q * qr.R.diagonal().sign()).transpose(0, 1)  # rows orthonormal
    w = w[:num_features]
    norms = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return w.mul_(norms[:, None])


def favor_feature_map(w: Tensor, scale: float, *, shift: bool = True) -> FeatureMap:
    """Positive random features from projections ``w [m, E]``: ``E[phi(q) . phi(k)] = exp(scale * q . k)``.

    ``phi(x) = exp(w x - |x|^2 / 2) / sqrt(m)`` with ``x = x * sqrt(scale)``. ``shift=False`` for
    keys fed in several calls (decoding): a shift per call would weigh each call's keys differently.
    """
    m = w.shape[0]

    def phi(x: Tensor) -> Tensor:
        x = x * math.sqrt(scale)
        proj = x @ w.to(x.dtype).transpose(0, 1)  # [..., L, m]
        sq = 0.5 * (x * x).sum(-1, keepdim=True)
        # one shift for the whole tensor cancels in the normalisation and keeps exp() finite
        # (a per-row shift would not cancel for keys: it would reweight them)
        top = proj.detach().amax() if shift and proj.numel() else 0.0
        return torch.exp(proj - sq - top) / math.sqrt(m)

    return phi


def random_feature_map(head_dim: int, num_features: int, *, generator: torch.Generator | None = None,
                       scale: float | None = None, dtype=torch.float32, device=None) -> FeatureMap:
    """FAVOR+ with i.i.d. Gaussian projections (see :func:`favor_feature_map`).

    With ``scale`` defaulting to ``1 / sqrt(head_dim)`` the estimate targets softmax attention's weights.
    """
    _check_feature_count(num_features, head_dim)
    check_fits(num_features * head_dim * 8, f"num_features={num_features:,} with head_dim={head_dim}", device)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    w = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)
    return favor_feature_map(w, scale)


@dataclass(frozen=True)
class LinearState:
    """The recurrent state of causal kernel attention after some keys.

    Attributes:
        kv: ``sum_j phi(k_j) v_j^T``, ``[..., H, F, Ev]``.
        z: ``sum_j phi(k_j)``, ``[..., H, F]``.
    """

    kv: Tensor
    z: Tensor


def scan_step(state: LinearState | None, fq: Tensor, fk: Tensor, v: Tensor, *,
              eps: float) -> tuple[Tensor, LinearState]:
    """Causal kernel attention for a chunk of ``c`` new tokens after ``state`` (features already applied).

    ``fq``, ``fk`` ``[..., H, c, F]``, ``v`` ``[..., H, c, Ev]``; token ``i`` of the chunk sees the
    state and the chunk's tokens ``<= i``. Returns ``(out [..., H, c, Ev], state after the chunk)``.
    """
    if state is None:
        state = LinearState(fk.new_zeros(fk.shape[:-2] + (fk.shape[-1], v.shape[-1])),
                            fk.new_zeros(fk.shape[:-2] + fk.shape[-1:]))
    local = (fq @ fk.transpose(-2, -1)).tril()  # [..., c, c]: causal inside the chunk
    num = fq @ state.kv + local @ v
    den = (fq @ state.z.unsqueeze(-1)).squeeze(-1) + local.sum(-1)
    out = normalise(num, den.unsqueeze(-1), eps)
    return out, LinearState(state.kv + fk.transpose(-2, -1) @ v, state.z + fk.sum(-2))


def favor_attention(q: Tensor, k: Tensor, v: Tensor, w: Tensor, scale: float, *, key_column: Tensor | None,
                    chunk_size: int, eps: float) -> Tensor:
    """Non-causal FAVOR+ in chunks along the sequence; equals ``kernel_attention`` on ``favor_feature_map(w, scale)``.

    Written out, the features ``[..., L, m]`` of all keys and all queries are each built (and
    shifted, and exponentiated) as whole tensors: past a few thousand tokens they leave the cache
    and the cost per token grows with ``n``. Here the features of ``chunk_size`` keys at a time go
    straight into the sums ``phi(K)^T V`` and ``phi(K)^T 1``; the shift that keeps ``exp`` finite
    is a running maximum per head (the sums so far are rescaled when it rises, as in flash
    attention), and each query row gets its own shift. Every shift is a common factor of a row's
    numerator and denominator and cancels (exactly, with ``eps = 0``); ``1 / sqrt(m)`` cancels too.
    ``key_column`` ``[..., Lk, 1]`` (or ``[..., 1, 1]``) zeroes padded keys' features.
    """
    if not q.shape[-2] or not k.shape[-2]:  # no queries, or no keys to attend: zeros
        return q.new_zeros(q.shape[:-1] + v.shape[-1:])
    wt = w.to(q.dtype).transpose(0, 1) * math.sqrt(scale)  # [E, m]: phi's input scaling folded into w

    def exponent(x: Tensor) -> Tensor:
        return x @ wt - 0.5 * scale * (x * x).sum(-1, keepdim=True)  # [..., c, m]

    kv = z = top = None
    for k_c, v_c, col in _key_chunks(k, v, key_column, chunk_size):
        p = exponent(k_c)
        peak = p.detach().amax((-2, -1))  # [...]: this chunk's largest exponent per head
        if top is not None:
            peak = torch.maximum(top, peak)
        f = torch.exp(p - peak[..., None, None])
        if col is not None:
            f = f * col
        chunk_kv, chunk_z = f.transpose(-2, -1) @ v_c, f.sum(-2)
        if top is None:
            kv, z = chunk_kv, chunk_z
        else:
            drop = torch.exp(top - peak)  # the sums so far, onto the new shift
            kv, z = kv * drop[..., None, None] + chunk_kv, z * drop[..., None] + chunk_z
        top = peak
    outs = []
    for q_c in q.split(chunk_size, dim=-2):
        p = exponent(q_c)
        fq = torch.exp(p - p.detach().amax(-1, keepdim=True))
        outs.append(normalise(fq @ kv, fq @ z.unsqueeze(-1), eps))
    return torch.cat(outs, dim=-2)


def streamed_attention(q: Tensor, k: Tensor, v: Tensor, phi: FeatureMap, *, key_column: Tensor | None,
                       chunk_size: int, eps: float) -> Tensor:
    """Non-causal kernel attention with the features built ``chunk_size`` rows at a time.

    Equals ``kernel_attention(phi(q), phi(k), v, is_causal=False)``; written whole, ``phi(q)`` and
    ``phi(k)`` are tensors of the sequence's length, which leave the cache past a few thousand
    tokens (measured: 4x the time from n = 8192 to 16384), so the cost per token grew with ``n``.
    Here each key chunk's features go straight into ``phi(K)^T V`` and ``phi(K)^T 1``, then each
    query chunk's into its rows of the output. ``key_column`` as in :func:`favor_attention`.
    """
    if not q.shape[-2] or not k.shape[-2]:
        return q.new_zeros(q.shape[:-1] + v.shape[-1:])
    kv = z = None
    for k_c, v_c, col in _key_chunks(k, v, key_column, chunk_size):
        f = phi(k_c) if col is None else phi(k_c) * col
        kv = f.transpose(-2, -1) @ v_c if kv is None else kv + f.transpose(-2, -1) @ v_c
        z = f.sum(-2) if z is None else z + f.sum(-2)
    outs = []
    for q_c in q.split(chunk_size, dim=-2):
        fq = phi(q_c)
        outs.append(normalise(fq @ kv, fq @ z.unsqueeze(-1), eps))
    return torch.cat(outs, dim=-2)


def _key_chunks(k: Tensor, v: Tensor, key_column: Tensor | None, chunk_size: int):
    """``(keys, values, key_column)`` of each run of ``chunk_size`` keys; the column is None, or the
    same ``[..., 1, 1]`` for every chunk, or the chunk's rows of ``[..., Lk, 1]``.

    split, not slices: a slice's backward writes its gradient into a zero tensor of the full length,
    n / chunk_size times over; split's backward concatenates once.
    """
    keys, values = k.split(chunk_size, dim=-2), v.split(chunk_size, dim=-2)
    shared = key_column is None or key_column.shape[-2] == 1
    columns = [key_column] * len(keys) if shared else key_column.split(chunk_size, dim=-2)
    return zip(keys, values, columns, strict=True)


def normalise(num: Tensor, den: Tensor, eps: float) -> Tensor:
    """``num / (den + eps)``, and zeros where that is ``0 / 0`` (a query with nothing to attend).

    FAVOR+'s features are positive but may be tiny (they are shifted to keep ``exp`` finite), so
    it runs with ``eps = 0``: any eps would bias its estimate, and this guard keeps empty rows at zero.
    """
    den = den + eps
    return num / torch.where(den == 0, torch.ones_like(den), den)


def kernel_attention(fq: Tensor, fk: Tensor, v: Tensor, *, is_causal: bool, chunk_size: int, eps: float) -> Tensor:
    """The core on features: ``fq [..., H, Lq, F]``, ``fk [..., H, Lk, F]`` (masked keys zeroed), ``v``.

    Causal is bottom-right: keys ``[0, Lk - Lq)`` are visible to every query, then a chunked scan.
    """
    if not is_causal:
        kv = fk.transpose(-2, -1) @ v  # [..., H, F, Ev]
        z = fk.sum(-2)  # [..., H, F]
        return normalise(fq @ kv, fq @ z.unsqueeze(-1), eps)
    offset = fk.shape[-2] - fq.shape[-2]
    state = LinearState(fk[..., :offset, :].transpose(-2, -1) @ v[..., :offset, :], fk[..., :offset, :].sum(-2))
    fk, v = fk[..., offset:, :], v[..., offset:, :]
    outs = []
    for s in range(0, fq.shape[-2], chunk_size):
        e = min(s + chunk_size, fq.shape[-2])
        out, state = scan_step(state, fq[..., s:e, :], fk[..., s:e, :], v[..., s:e, :], eps=eps)
        outs.append(out)
    if not outs:
        return fq.new_zeros(fq.shape[:-1] + v.shape[-1:])
    return torch.cat(outs, dim=-2)


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
    """Kernel attention ``phi(Q) phi(K)^T V``, row-normalised, in linear time, with any feature map.

    :func:`attnkit.approx.attention` serves the named maps (``kind="elu"``, ``"relu"``,
    ``"performer"``) with attnkit's mask arguments; this function takes your own ``phi``.

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
    check_causal_lengths(is_causal, lq, lk)
    check_chunk_size(chunk_size)
    fq = feature_map(query)  # [B, H, Lq, F]
    fk = feature_map(key)  # [B, Hkv, Lk, F]
    if key_mask is not None:
        fk = fk * key_mask[:, None, :, None].to(fk.dtype)
    if h != hkv:
        fk = fk.repeat_interleave(h // hkv, dim=1)
        value = value.repeat_interleave(h // hkv, dim=1)
    return kernel_attention(fq, fk, value, is_causal=is_causal, chunk_size=chunk_size, eps=eps)


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size!r}")


def check_causal_lengths(is_causal: bool, lq: int, lk: int) -> None:
    if is_causal and lq > lk:
        raise ValueError(f"is_causal with Lq ({lq}) > Lk ({lk}) leaves the first queries without keys; "
                         "pad the keys or drop is_causal")
