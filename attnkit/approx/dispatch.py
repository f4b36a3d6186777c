"""One calling convention over the approximate kinds: :func:`attention` checks a call, refuses a mask
its ``kind`` cannot honour (:data:`SUPPORTS`) and runs the kind's implementation from the modules
beside this one (``kernel``, ``nystrom``, ``linformer``, ``scores``); :func:`checked` is its first half
(every check, nothing computed), for a caller that changes state between the two (a KV cache's write);
:func:`step` decodes the kernel kinds one token at a time. The kinds and their arguments are tabled in
``attnkit.approx``'s docstring.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

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
from .linformer import check_projection, linformer_attention
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


Compute = Callable[[Tensor, Tensor, Tensor], Tensor]
"""``compute(q, k, v)``: a kind's computation, its arguments bound and checked (``k``/``v`` with ``H`` heads)."""


def _kernel(phi_name):
    def prepare(q, k, v, *, key_column, is_causal, scale, chunk_size: int = 128, eps: float | None = None,
                num_features: int = 256, seed: int = 0, projection: Tensor | None = None) -> Compute:
        eps = (0.0 if phi_name == "performer" else 1e-6) if eps is None else eps  # see kernel.normalise
        check_causal_lengths(is_causal, q.shape[-2], k.shape[-2])
        check_chunk_size(chunk_size)
        if phi_name == "performer":
            w = _performer_projection(num_features, q.shape[-1], seed, projection)
            _check_features_fit(q, k, v, w.shape[0], is_causal, chunk_size)
            if not is_causal:
                return functools.partial(favor_attention, w=w, scale=scale, key_column=key_column,
                                         chunk_size=chunk_size, eps=eps)
            phi = favor_feature_map(w, scale)
        else:
            phi = elu_feature_map if phi_name == "elu" else relu_feature_map
            if not is_causal:
                return functools.partial(streamed_attention, phi=phi, key_column=key_column, chunk_size=chunk_size,
                                         eps=eps)

        def causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            fq, fk = phi(q), phi(k)
            if key_column is not None:
                fk = fk * key_column
            return kernel_attention(fq, fk, v, is_causal=True, chunk_size=chunk_size, eps=eps)
        return causal
    return prepare


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


def _nystrom(q, k, v, *, mask, scale, num_landmarks: int = 64, exact_pinv: bool = False,
             pinv_iterations: int = 6) -> Compute:
    for name, val in (("num_landmarks", num_landmarks), ("pinv_iterations", pinv_iterations)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"nystrom: {name} must be an int >= 1, got {val!r}")
    return functools.partial(nystrom_attention, mask=mask, scale=scale, num_landmarks=num_landmarks,
                             exact_pinv=exact_pinv, pinv_iterations=pinv_iterations)


def _linformer(q, k, v, *, scale, projection) -> Compute:
    check_projection(projection, k.shape[-2])
    return functools.partial(linformer_attention, scale=scale, projection=projection)


def _score(run):
    """The score kinds' ``prepare``: they are exact attention, whose arguments :func:`checked` has validated."""
    @functools.wraps(run)  # the signature, for kind_arguments
    def prepare(q, k, v, **args) -> Compute:
        return functools.partial(run, **args)
    return prepare


#: kind -> ``prepare(q, k, v, *, ..., **kind_args) -> compute``: the kind's arguments checked against the call, nothing
#: computed (its signature lists the kind's arguments).
_PREPARE = {"elu": _kernel("elu"), "relu": _kernel("relu"), "performer": _kernel("performer"), "nystrom": _nystrom,
            "linformer": _linformer, "dot": _score(dot_attention), "multiplicative": _score(multiplicative_attention),
            "additive": _score(additive_attention)}
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
    return [name for name, p in inspect.signature(_PREPARE[kind]).parameters.items()
            if name not in _FIXED and p.kind is p.KEYWORD_ONLY and p.default is p.empty]


def kind_arguments(kind: str) -> list[str]:
    """The keyword arguments ``kind`` takes besides the common ones."""
    check_kind(kind)
    return [p for p in inspect.signature(_PREPARE[kind]).parameters if p not in _FIXED and p != "masks"]


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
    return checked(query, key, value, kind=kind, mask=mask, is_causal=is_causal, scale=scale, **kind_args)()


def checked(query: Tensor, key: Tensor, value: Tensor, *, kind: str, mask: Tensor | None = None,
            is_causal: bool = False, scale: float | None = None, **kind_args) -> Callable[[], Tensor]:
    """:func:`attention`'s first half: the call checked and every error of it raised, nothing computed; returns
    the computation, which reads ``key`` and ``value`` only when it is called. A caller that changes state for a
    call (a KV cache's write, into the buffers ``key`` and ``value`` view) runs this first, then the change,
    then what it returns, so a refused call changes nothing."""
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
    if kind in _SCORES:
        compute = _PREPARE[kind](query, key, value, mask=mask, is_causal=is_causal, scale=req.scale, **kind_args)
    else:
        _check_masks(kind, mask, is_causal)
        if kind == "linformer":
            compute = _linformer(query, key, value, scale=req.scale, **kind_args)
        elif kind == "nystrom":
            compute = _nystrom(query, key, value, mask=mask, scale=req.scale, **kind_args)
        else:
            key_column = None if mask is None else _key_column(mask).to(query.dtype)
            compute = _PREPARE[kind](query, key, value, key_column=key_column, is_causal=is_causal, scale=req.scale,
                                     **kind_args)
    groups = req.heads // req.kv_heads

    def run() -> Tensor:
        # repeated here, not in the check: key and value may be views that the caller fills in between
        k, v = (t.repeat_interleave(groups, dim=-3) if groups > 1 else t for t in (key, value))
        return compute(query, k, v)
    return run


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

