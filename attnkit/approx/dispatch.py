"""One calling convention over the approximate kinds: :func:`attention` checks a call, refuses a mask
its ``kind`` cannot honour (:data:`SUPPORTS`) and runs the kind's implementation from the modules
beside this one (``kernel``, ``nystrom``, ``linformer``, ``scores``); :func:`step` decodes the kernel
kinds one token at a time. The kinds and their arguments are tabled in ``attnkit.approx``'s docstring.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import Tensor

from ..call import validate_call
from .kernel import (
    LinearState,
    check_causal_lengths,
    check_chunk_size,
    check_fits,
    elu_feature_map,
    favor_attention,
    favor_feature_map,
    kernel_attention,
    orthogonal_features,
    relu_feature_map,
    scan_step,
    streamed_attention,
)
from .linformer import linformer_attention
from .nystrom import nystrom_attention
from .scores import additive_attention, dot_attention, multiplicative_attention

#: kind -> the masks it honours exactly.
SUPPORTS = {
    "elu": ("key-padding mask", "is_causal"),
    "relu": ("key-padding mask", "is_causal"),
    "performer": ("key-padding mask", "is_causal"),
    "nystrom": ("key-padding mask",),
    "linformer": (),
    "dot": ("any mask", "is_causal"),
    "multiplicative": ("any mask", "is_causal"),
    "additive": ("any mask", "is_causal"),
}
"""Each kind -> the masks it honours exactly; any other mask raises a ``ValueError`` naming the kind."""
KINDS = tuple(SUPPORTS)
"""The names ``attention(..., kind=)`` accepts, in the order of :data:`SUPPORTS`."""
_SCORES = ("dot", "multiplicative", "additive")  # exact attention with another score: unscaled by default


def _kernel(phi_name):
    def run(q, k, v, *, key_column, is_causal, scale, chunk_size: int = 128, eps: float | None = None,
            num_features: int = 256, seed: int = 0, projection: Tensor | None = None):
        eps = (0.0 if phi_name == "performer" else 1e-6) if eps is None else eps  # see kernel.normalise
        check_chunk_size(chunk_size)
        if phi_name == "performer":
            w = _performer_projection(num_features, q.shape[-1], seed, projection)
            _check_features_fit(q, k, v, w.shape[0], is_causal, chunk_size)
            if not is_causal:
                return favor_attention(q, k, v, w, scale, key_column=key_column, chunk_size=chunk_size, eps=eps)
            phi = favor_feature_map(w, scale)
        else:
            phi = elu_feature_map if phi_name == "elu" else relu_feature_map
            if not is_causal:
                return streamed_attention(q, k, v, phi, key_column=key_column, chunk_size=chunk_size, eps=eps)
        fq, fk = phi(q), phi(k)
        if key_column is not None:
            fk = fk * key_column
        return kernel_attention(fq, fk, v, is_causal=is_causal, chunk_size=chunk_size, eps=eps)
    return run


def _check_features_fit(q: Tensor, k: Tensor, v: Tensor, m: int, is_causal: bool, chunk_size: int) -> None:
    """Refuse a call whose random features cannot fit in memory. Causal attention builds every token's
    ``m`` features at once, non-causal ``chunk_size`` tokens' at a time (with a few temporaries of that
    size each), beside the ``[m, Ev]`` sums of every head."""
    heads = math.prod(q.shape[:-2])
    tokens = q.shape[-2] + k.shape[-2] if is_causal else min(chunk_size, max(q.shape[-2], k.shape[-2]))
    how = f"all {tokens:,} tokens' at once (causal)" if is_causal else f"{tokens:,} tokens' at a time"
    check_fits(heads * m * (3 * tokens + v.shape[-1] + 1) * q.element_size(),
               f"num_features={m:,} over {heads:,} heads ({how} features, {q.dtype})", q.device)


def _performer_projection(num_features, head_dim: int, seed, projection: Tensor | None) -> Tensor:
    if projection is not None:
        if not isinstance(projection, Tensor) or projection.dim() != 2 or projection.shape[1] != head_dim:
            got = tuple(projection.shape) if isinstance(projection, Tensor) else type(projection).__name__
            raise ValueError(f"performer: projection must be [num_features, {head_dim}], got {got}")
        return projection
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
        raise ValueError(f"performer: num_features must be an int >= 1, got {num_features!r}")
    return orthogonal_features(num_features, head_dim, generator=torch.Generator().manual_seed(seed))


def _nystrom(q, k, v, *, mask, scale, num_landmarks: int = 64, exact_pinv: bool = False, pinv_iterations: int = 6):
    for name, val in (("num_landmarks", num_landmarks), ("pinv_iterations", pinv_iterations)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"nystrom: {name} must be an int >= 1, got {val!r}")
    return nystrom_attention(q, k, v, mask=mask, scale=scale, num_landmarks=num_landmarks,
                             exact_pinv=exact_pinv, pinv_iterations=pinv_iterations)


_RUN = {"elu": _kernel("elu"), "relu": _kernel("relu"), "performer": _kernel("performer"), "nystrom": _nystrom,
        "linformer": linformer_attention, "dot": dot_attention, "multiplicative": multiplicative_attention,
        "additive": additive_attention}
_FIXED = {"q", "k", "v", "key_column", "is_causal", "scale", "mask"}
#: What each kind without a default for an argument needs it to be, for the error when it is missing.
_NEEDS = {
    "projection": "a LinformerProjection(max_len, k) (or use MultiHeadAttention(kind='linformer'), which holds one)",
    "weight": "the score's matrix W, [E, E] or per head [H, E, E]",
    "score_vector": "the score's vector w, [A] or per head [H, A] (with query_weight/key_weight [A, E] or "
                    "[H, A, E] unless q and k are already projected to A features)",
}


def required_arguments(kind: str) -> list[str]:
    """The keyword arguments ``kind`` cannot do without (its parameters when called directly)."""
    check_kind(kind)
    return [name for name, p in inspect.signature(_RUN[kind]).parameters.items()
            if name not in _FIXED and p.kind is p.KEYWORD_ONLY and p.default is p.empty]


def kind_arguments(kind: str) -> list[str]:
    """The keyword arguments ``kind`` takes besides the common ones."""
    check_kind(kind)
    return [p for p in inspect.signature(_RUN[kind]).parameters if p not in _FIXED and p != "masks"]


def check_kind(kind) -> None:
    if kind not in SUPPORTS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r} (attnkit.attention is the exact engine)")


def attention(query: Tensor, key: Tensor, value: Tensor, *, kind: str, mask: Tensor | None = None,
              is_causal: bool = False, scale: float | None = None, **kind_args) -> Tensor:
    """Attention by an approximate or alternative method, named by ``kind`` (table in the module docstring).

    Args:
        query: ``[..., H, Lq, E]``.
        key: ``[..., Hkv, Lk, E]`` (``H % Hkv == 0``).
        value: ``[..., Hkv, Lk, Ev]``.
        kind: one of :data:`KINDS`.
        mask: bool, ``True`` = may attend, broadcastable to ``[..., H, Lq, Lk]``; which masks a
            kind honours is in :data:`SUPPORTS`.
        is_causal: look-ahead masking, bottom-right aligned as in ``attnkit.attention``.
        scale: score scale; default ``1 / sqrt(E)``, except for the score kinds (``dot``,
            ``multiplicative``, ``additive``), which are unscaled (``1``) by definition.
        **kind_args: the kind's own arguments (:func:`kind_arguments`).

    Returns:
        ``[..., H, Lq, Ev]``.

    Raises:
        TypeError, ValueError: bad input as in ``attnkit.attention``; an unknown kind or argument;
            a mask the kind cannot honour exactly, naming the kind and what it supports.
    """
    check_kind(kind)
    unknown = sorted(set(kind_args) - set(kind_arguments(kind)))
    if unknown:
        raise ValueError(f"{kind}: unknown argument(s) {unknown}; it takes {kind_arguments(kind)}")
    for name in required_arguments(kind):
        if kind_args.get(name) is None:
            raise ValueError(f"{kind} needs {name}=: {_NEEDS.get(name, 'see attnkit.approx.kind_arguments')}")
        if name != "projection" and not isinstance(kind_args[name], Tensor):
            raise TypeError(f"{kind}: {name} must be a torch.Tensor, got {type(kind_args[name]).__name__}")
    if kind in _SCORES and scale is None:
        scale = 1.0
    req = validate_call(query, key, value, mask=mask, is_causal=is_causal, scale=scale)
    groups = req.heads // req.kv_heads
    k, v = (t.repeat_interleave(groups, dim=-3) if groups > 1 else t for t in (key, value))
    if kind in _SCORES:
        return _RUN[kind](query, k, v, mask=mask, is_causal=is_causal, scale=req.scale, **kind_args)
    _check_masks(kind, mask, is_causal)
    if kind == "linformer":
        return linformer_attention(query, k, v, scale=req.scale, **kind_args)
    if kind == "nystrom":
        return _nystrom(query, k, v, mask=mask, scale=req.scale, **kind_args)
    check_causal_lengths(is_causal, req.q_len, req.kv_len)
    key_column = None if mask is None else _key_column(mask).to(query.dtype)
    return _RUN[kind](query, k, v, key_column=key_column, is_causal=is_causal, scale=req.scale, **kind_args)


def _check_masks(kind: str, mask: Tensor | None, is_causal: bool) -> None:
    """Refuse what ``kind`` cannot honour exactly, saying what it supports."""
    supported = SUPPORTS[kind]
    what = ", ".join(supported) if supported else "no mask"
    if is_causal and "is_causal" not in supported:
        raise ValueError(f"{kind} cannot honour is_causal exactly; it supports: {what}")
    if mask is not None and ("key-padding mask" not in supported or (mask.dim() >= 2 and mask.shape[-2] != 1)):
        raise ValueError(f"{kind} cannot honour a mask of shape {tuple(mask.shape)} exactly (it varies over queries "
                         f"or this kind takes none); it supports: {what} (a key-padding mask has size 1 in its "
                         "Lq dimension, e.g. [B, 1, 1, Lk])")


def _key_column(mask: Tensor) -> Tensor:
    """A key-padding mask ``[..., 1, Lk]`` (or ``[Lk]``) as a column ``[..., Lk, 1]`` to weigh key features."""
    return mask.unsqueeze(-1) if mask.dim() == 1 else mask.transpose(-2, -1)


def step(state: LinearState | None, query: Tensor, key: Tensor, value: Tensor, *, kind: str = "elu",
         eps: float | None = None, scale: float | None = None, projection: Tensor | None = None,
         ) -> tuple[Tensor, LinearState]:
    """One decoding step of causal kernel attention (an RNN): new tokens after ``state``.

    ``step(None, q, k, v)`` starts; feeding tokens one by one (or in chunks) gives the rows of
    ``attention(..., kind=kind, is_causal=True)``. ``performer`` needs its fixed ``projection``
    (``orthogonal_features(...)``) so every step uses the same features.

    Args:
        state: the state after the earlier tokens, or ``None``.
        query, key, value: the new tokens, ``[..., H, c, E]`` (``H`` key/value heads too).
        kind: ``elu``, ``relu`` or ``performer``.

    Returns:
        ``(out [..., H, c, Ev], state after them)``.
    """
    if kind not in ("elu", "relu", "performer"):
        raise ValueError(f"step: kind must be 'elu', 'relu' or 'performer' (the kernel kinds), got {kind!r}")
    eps = (0.0 if kind == "performer" else 1e-6) if eps is None else eps  # as in attention()
    req = validate_call(query, key, value, scale=scale)
    if req.heads != req.kv_heads or req.q_len != req.kv_len:
        raise ValueError(f"step: query and key must have the same heads and length, got {tuple(query.shape)} "
                         f"and {tuple(key.shape)}")
    if kind == "performer":
        if projection is None:
            raise ValueError("step: kind 'performer' needs projection= (orthogonal_features(...)), fixed across steps")
        w = _performer_projection(None, query.shape[-1], None, projection)
        phi, phi_k = favor_feature_map(w, req.scale), favor_feature_map(w, req.scale, shift=False)
    else:
        phi = phi_k = elu_feature_map if kind == "elu" else relu_feature_map
    return scan_step(state, phi(query), phi_k(key), value, eps=eps)

