"""Multi-head attention as a module: projections, head reshapes, the core call, output projection."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._text import describe
from ..call import is_plan
from ..functional import checked, run
from ..maskplan import MaskPlan
from ..masks import check_window
from ..memory import Fits
from ..scores import compose

if TYPE_CHECKING:
    from ..cache import KVCache


class MultiHeadAttention(nn.Module):
    """Multi-head self- or cross-attention, batch-first (``[B, L, E]`` in and out).

    Heads are split with reshapes, not separate tensors (``[B, L, H*D] -> [B, H, L, D]``), as in
    BERT and most tutorials. Query/key and value head sizes may differ (``head_dim`` /
    ``v_head_dim``), keys and values may have fewer heads than queries (``num_kv_heads``: GQA,
    MQA), ``share_kv=True`` uses one projection for K and V, and ``share_qk=True`` makes K use
    Q's projection (so each head's scores ``q_i . q_j`` are symmetric in self-attention). Weights get Xavier (Glorot)
    normal initialisation and biases zeros.

    Positions enter in one of two roles (see :mod:`attnkit.positional`): ``rotary`` transforms
    queries and keys after projection (RoPE), ``position_bias`` adds to the scores through a
    score_mod (ALiBi, T5 buckets, Shaw relative keys). Query ``i`` sits at absolute position
    ``Lk - Lq + i`` and key ``j`` at ``j`` (bottom-right alignment, like ``is_causal``); with a
    :class:`~attnkit.cache.KVCache` the new tokens sit at ``cache.seq_len ...``.

    Args:
        embed_dim: query input size, and output size.
        num_heads: query heads ``H``.
        kdim, vdim: key and value input sizes (default ``embed_dim``) for cross-attention.
        num_kv_heads: key/value heads ``Hkv``, a divisor of ``num_heads`` (default ``num_heads``).
        head_dim: q/k size per head (default ``embed_dim // num_heads``).
        v_head_dim: value size per head (default ``head_dim``).
        bias: biases in the four projections.
        dropout: dropout probability on the attention weights while training.
        share_kv: one projection for keys and values (needs ``kdim == vdim``, equal head sizes).
        share_qk: keys use the query projection (needs ``kdim == embed_dim`` and
            ``num_kv_heads == num_heads``); with ``share_kv`` too, all three share it.
        backend: attention backend name, ``"auto"`` by default.
        scale: score scale, default ``1 / sqrt(head_dim)`` (T5 uses ``1.0``).
        rotary: a q/k transform ``rotary(x [B, H, L, D], start) -> x`` rotating positions
            ``start ... start + L - 1``, e.g. :class:`attnkit.positional.RotaryEmbedding`.
        position_bias: an object with ``score_mod(q, k, *, offset) -> score_mod``, e.g.
            :class:`attnkit.positional.ALiBi`, ``T5RelativeBias``, ``RelativeKeyEmbedding``; it
            is registered as a submodule when it is an ``nn.Module`` (learned tables train).
        kind: ``None`` (default) for exact attention through ``backend``, or an approximate or
            alternative method from :data:`attnkit.approx.KINDS` (``"performer"``, ``"nystrom"``,
            ...), opted into by name; see :meth:`set_kind`.
        kind_args: that method's arguments, e.g. ``{"num_features": 128}``.

    Raises:
        ValueError: sizes that do not fit together, naming them.
        TypeError: (in ``forward``) inputs whose dtype differs from the parameters' outside autocast.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        share_kv: bool = False,
        share_qk: bool = False,
        backend: str = "auto",
        scale: float | None = None,
        rotary=None,
        position_bias=None,
        kind: str | None = None,
        kind_args: dict | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                                 "or give head_dim")
            head_dim = embed_dim // num_heads
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        kdim = embed_dim if kdim is None else kdim
        vdim = embed_dim if vdim is None else vdim
        for name, val in (("head_dim", head_dim), ("v_head_dim", v_head_dim), ("kdim", kdim), ("vdim", vdim)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if share_kv and (kdim != vdim or head_dim != v_head_dim):
            raise ValueError(f"share_kv needs kdim == vdim and head_dim == v_head_dim, got kdim={kdim}, "
                             f"vdim={vdim}, head_dim={head_dim}, v_head_dim={v_head_dim}")
        if not isinstance(share_qk, bool):
            raise TypeError(f"share_qk must be a bool, got {type(share_qk).__name__}")
        if share_qk and (kdim != embed_dim or num_kv_heads != num_heads):
            raise ValueError(f"share_qk needs kdim == embed_dim and num_kv_heads == num_heads, got "
                             f"embed_dim={embed_dim}, kdim={kdim}, num_heads={num_heads}, "
                             f"num_kv_heads={num_kv_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if rotary is not None and not callable(rotary):
            raise TypeError(f"rotary must be callable as rotary(x, start), got {type(rotary).__name__}")
        if position_bias is not None and not callable(getattr(position_bias, "score_mod", None)):
            raise TypeError(f"position_bias must have a score_mod(q, k, *, offset) method, "
                            f"got {type(position_bias).__name__}")

        self.embed_dim, self.kdim, self.vdim = embed_dim, kdim, vdim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.dropout, self.share_kv, self.share_qk = dropout, share_kv, share_qk
        self.backend, self.scale = backend, scale
        self.rotary, self.position_bias = rotary, position_bias
        # Callables given (q, k) as the exact attention takes them, on every call: how
        # attnkit.analysis.recorded_qk keeps a call's queries and keys without working them out again.
        self.score_inputs_sinks: list = []
        fk = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **fk)
        self.k_proj = None if share_qk else nn.Linear(kdim, num_kv_heads * head_dim, bias=bias, **fk)
        self.v_proj = None if share_kv else nn.Linear(vdim, num_kv_heads * v_head_dim, bias=bias, **fk)
        self.out_proj = nn.Linear(num_heads * v_head_dim, embed_dim, bias=bias, **fk)
        self.reset_parameters()
        self.approx = None
        if kind is not None:
            self.set_kind(kind, **(kind_args or {}))
        elif kind_args:
            raise ValueError(f"kind_args {sorted(kind_args)} need a kind (kind=None is exact attention)")

    def set_kind(self, kind: str | None, **kind_args) -> MultiHeadAttention:
        """Attend by an approximate or alternative method from now on (``None``: exact again); returns self.

        The projections stay; the method's own parameters (:class:`attnkit.approx.ApproxAttention`)
        are created fresh on the projections' device and dtype. Such a module takes ``mask``,
        ``key_mask`` and ``is_causal`` (as far as the method honours them), no ``bias``, ``window``,
        ``mask_mod``, ``score_mod``, ``position_bias`` or ``need_weights``, and no dropout.
        """
        if kind is None:
            self.approx = None
            return self
        from ..approx import ApproxAttention  # only loaded when asked for

        w = self.q_proj.weight
        self.approx = ApproxAttention(kind, num_heads=self.num_heads, head_dim=self.head_dim, device=w.device,
                                      dtype=w.dtype, **kind_args)
        return self

    def reset_parameters(self) -> None:
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if lin is None:
                continue
            nn.init.xavier_normal_(lin.weight)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def check_inputs(self, query: Tensor, key: Tensor, value: Tensor, *, length: str = "L") -> None:
        """Raise ``ValueError`` unless query/key/value are ``[B, L, embed_dim/kdim/vdim]`` that fit together."""
        for name, t, dim in (("query", query, self.embed_dim), ("key", key, self.kdim),
                             ("value", value, self.vdim)):
            if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != dim:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{name} must be [B, {length}, {dim}], got {got}")
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(f"query, key and value must share B, and key/value share {length}: got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
        for name, t, proj in zip(("query", "key", "value"), (query, key, value), self.projections(), strict=True):
            # Under autocast the projections cast their inputs themselves; elsewhere a mismatch
            # would only surface as torch's "mat1 and mat2 must have the same dtype".
            if t.dtype != proj.weight.dtype and not torch.is_autocast_enabled(t.device.type):
                raise TypeError(f"{name} dtype {t.dtype} does not match the module's parameter dtype "
                                f"{proj.weight.dtype}: pass {name}.to({proj.weight.dtype}), or convert the module "
                                f"with .to({t.dtype})")

    def projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """The linear maps that make q, k and v, after ``share_qk`` / ``share_kv``."""
        k_proj = self.q_proj if self.share_qk else self.k_proj
        return self.q_proj, k_proj, k_proj if self.share_kv else self.v_proj

    def project_qkv(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project and split heads: ``[B, L, E] -> [B, H, L, D]`` for q, and ``Hkv`` heads for k, v."""
        q_proj, k_proj, v_proj = self.projections()
        q = split_heads(q_proj(query), self.num_heads)  # (B, H, Lq, D)
        k = split_heads(k_proj(key), self.num_kv_heads)  # (B, Hkv, Lk, D)
        v = split_heads(v_proj(value), self.num_kv_heads)  # (B, Hkv, Lk, Dv)
        return q, k, v

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        bias: Tensor | None = None,
        is_causal: bool = False,
        window=None,
        mask_mod=None,
        score_mod=None,
        need_weights: bool = False,
        cache: KVCache | None = None,
        backend: str | None = None,
    ):
        """Attend ``query`` to ``key``/``value`` (self-attention when ``key`` is omitted).

        With ``cache`` (self-attention only) the new tokens' keys and values are written to the
        cache and the queries attend to everything cached; masks then cover ``Lk = cache.seq_len``
        after the update, and ``is_causal`` aligns bottom-right so decoding one token at a time
        gives the rows of the full forward pass. Run eagerly, the attention reads the written part of
        the cache's buffers (a view, no copy), with the masks as given, as a call without a cache would.
        Under ``torch.compile`` it runs on the whole buffers (fixed shapes, one graph for every token),
        with the mask of :func:`attnkit.cache.visible` hiding the unwritten tail and carrying the causal
        alignment; given masks and biases are widened to match.

        Args:
            query: ``[B, Lq, embed_dim]``.
            key: ``[B, Lk, kdim]``; defaults to ``query``.
            value: ``[B, Lk, vdim]``; defaults to ``key``.
            mask: bool, ``True`` = may attend: ``[Lq, Lk]``, ``[B, Lq, Lk]`` or ``[B, H, Lq, Lk]``; or
                an :class:`attnkit.MaskPlan` built once and shared by every layer and step.
            key_mask: ``[B, Lk]`` bool, ``True`` = a real token (not padding).
            bias: float added to the scores, same shapes as ``mask``.
            is_causal, window, mask_mod, score_mod: as in :func:`attnkit.attention`; a
                ``position_bias`` term is applied before ``score_mod``.
            need_weights: also return per-head weights ``[B, H, Lq, Lk]``.
            cache: a :class:`~attnkit.cache.KVCache` sized for ``B``, ``num_kv_heads``, ``head_dim``.
            backend: this call's backend, instead of the module's ``backend`` (nothing on the
                module changes).

        Returns:
            ``out [B, Lq, embed_dim]``, or ``(out, weights)``.
        """
        if cache is not None and (key is not None or value is not None):
            raise ValueError("cache= is for self-attention: pass only query (the new tokens), not key/value")
        if cache is not None and is_plan(mask):
            raise ValueError("a MaskPlan mask cannot be combined with cache=: the plan is built for one key "
                             "length, a cached call attends over the cache's whole buffers; pass the mask's "
                             "mask_mod instead")
        key = query if key is None else key
        value = key if value is None else value
        self.check_inputs(query, key, value)
        if cache is not None and torch.compiler.is_compiling():
            _check_compiled_step(need_weights, key_mask, self.position_bias, self.approx)
        # Absolute position of the first new key: an int, or a 0-d tensor in a compiled cached step
        start = 0 if cache is None else cache.position()
        kv_len = start + key.shape[1]
        mask = _per_head(mask, "mask")
        bias = _per_head(bias, "bias")
        if key_mask is not None:
            if is_plan(mask):
                raise ValueError("key_mask cannot be combined with a MaskPlan mask: build the plan with "
                                 "attnkit.masks.padding_mod(lengths) in its mask_mod instead")
            if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or \
                    tuple(key_mask.shape) != (key.shape[0], kv_len):
                raise ValueError(f"key_mask must be a bool [B, Lk] = {(key.shape[0], kv_len)} tensor, "
                                 f"True = real token; got {describe(key_mask)}")
            km = key_mask[:, None, None, :]
            mask = km if mask is None else mask & km
        if cache is not None and not torch.compiler.is_compiling():
            # Checked before the cache is written: a refused call leaves it as it was.
            mask, bias = (_on_prefix(name, t, kv_len, cache.max_len) for name, t in (("mask", mask), ("bias", bias)))
        q, k, v = self.project_qkv(query, key, value)
        if self.rotary is not None:
            q = self.rotary(q, kv_len - q.shape[-2])  # bottom-right: query i at Lk - Lq + i
            k = self.rotary(k, start)
        approx_refused = {"mask_plan": mask if is_plan(mask) else None, "bias": bias, "window": window,
                          "mask_mod": mask_mod, "score_mod": score_mod, "position_bias": self.position_bias,
                          "need_weights": need_weights or None}
        new_kv, on_buffers = None, False
        if cache is not None and torch.compiler.is_compiling():
            cached = cache.update(k, v)
            on_buffers = cached.seq_len is None  # a compiled step: the length is a tensor
            k, v = cached.k, cached.v  # (B, Hkv, max_len, D): the whole buffers, fixed shapes
        elif cache is not None:
            # Nothing is written before the whole call is checked (below): a refused call leaves the cache as it
            # was. Attended: the written keys only, a view of the buffers (nothing copied) that the write fills
            # in place and that the cache's finiteness flag covers, with no mask to build or read for the
            # unwritten tail; causal and window align bottom-right as without a cache.
            cache.check_update(k, v)
            new_kv = k, v
            k, v = cache.k[:, :, :kv_len], cache.v[:, :, :kv_len]
        if self.approx is not None:
            self._check_approx(**approx_refused)
            # the method's own checks too before the write: a refused step leaves the cache as it was
            approx = self.approx.checked(q, k, v, mask=None if is_plan(mask) else mask, is_causal=is_causal,
                                         scale=self.scale)
            if new_kv is not None:
                cache.update(*new_kv)
            return self.out_proj(merge_heads(approx()))  # (B, Lq, embed_dim)
        if on_buffers:
            mask, bias, mask_mod = _on_buffers(cached, q.shape[-2], mask, bias, mask_mod, is_causal, window)
            is_causal, window = False, None  # now in mask and mask_mod, aligned to the written length
        if self.position_bias is not None:
            pos_mod = self.position_bias.score_mod(q, k, offset=kv_len - q.shape[-2])
            score_mod = pos_mod if score_mod is None else compose(pos_mod, score_mod)
        req, chosen = checked(q, k, v, mask=mask, bias=bias, is_causal=is_causal, window=window,
                              mask_mod=mask_mod, score_mod=score_mod, scale=self.scale,
                              dropout_p=self.dropout if self.training else 0.0,
                              return_weights=need_weights, backend=self.backend if backend is None else backend)
        if new_kv is not None:
            cache.update(*new_kv)
            # The call's keys now hold the new tokens: what was worked out from their values goes (a backend may
            # have kept converted copies), the mask plan and the memory check (of the sizes alone) stay.
            req.derived.forget_all_but(MaskPlan, Fits)
        for sink in self.score_inputs_sinks:
            sink(q, k)
        out, weights = run(req, chosen)
        out = self.out_proj(merge_heads(out))  # (B, Lq, embed_dim)
        return (out, weights) if need_weights else out

    def _check_approx(self, **refused) -> None:
        given = sorted(name for name, val in refused.items() if val is not None)
        if given:
            raise ValueError(f"kind {self.approx.kind!r} takes mask, key_mask and is_causal; got {given} "
                             "(exact attention, kind=None, takes them)")

    # ---------------------------------------------------------------- torch.nn interop

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy a ``torch.nn.MultiheadAttention`` (same outputs and per-head weights)."""
        from .interop import from_torch_mha

        return from_torch_mha(cls, m)

    def to_torch(self) -> nn.MultiheadAttention:
        """An equivalent ``torch.nn.MultiheadAttention(batch_first=True)``, where one exists."""
        if self.rotary is not None or self.position_bias is not None or self.scale is not None or self.share_qk \
                or self.approx is not None:
            raise ValueError("to_torch: torch.nn.MultiheadAttention has no rotary=, position_bias=, scale=, "
                             "share_qk= or kind=")
        from .interop import to_torch_mha

        return to_torch_mha(self)


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``[B, L, H*D] -> [B, H, L, D]``."""
    b, n, e = x.shape
    return x.view(b, n, heads, e // heads).transpose(1, 2)  # (B, L, H*D) -> (B, H, L, D); not -1: B or L may be 0


def merge_heads(x: Tensor) -> Tensor:
    """``[B, H, L, D] -> [B, L, H*D]``."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)  # (B, H, L, D) -> (B, L, H*D)


def _on_buffers(cached, q_len: int, mask, bias, mask_mod, is_causal: bool, window):
    """A compiled cached step's masking, moved onto the cache's whole buffers (``Lk = max_len``; the
    written length is a tensor there, so a mask's width cannot be checked against it).

    Masks and biases over the cached keys get the tail appended (masked, zero) and meet
    :func:`attnkit.cache.visible`, which hides the tail and, for ``is_causal``, aligns causality to the
    written length (the engine would align it to the buffer size); a ``window`` becomes a mask_mod
    aligned the same way.
    """
    from ..cache import visible

    buffer = cached.k.shape[-2]
    widened = []
    for t, fill in ((mask, False), (bias, 0.0)):
        # A trailing key dim of 1 broadcasts over the buffer; the tail is hidden by visible anyway.
        if t is not None and t.shape[-1] not in (1, buffer):
            t = F.pad(t, (0, buffer - t.shape[-1]), value=fill)
        widened.append(t)
    mask, bias = widened
    seen = visible(cached, q_len, causal=is_causal, window=None if window is None else check_window(window))
    mask = seen if mask is None else mask & seen
    return mask, bias, mask_mod


def _on_prefix(name: str, t: Tensor | None, kv_len: int, buffer: int) -> Tensor | None:
    """A mask or bias of an eager cached call, over the ``kv_len`` keys cached after it (new ones included): as
    given when it covers them (or broadcasts, a trailing dim of 1), cut to them when it covers the whole cache
    (``buffer`` keys)."""
    if t is None or is_plan(t) or t.shape[-1] in (1, kv_len):
        return t
    if t.shape[-1] == buffer:
        return t[..., :kv_len]
    raise ValueError(f"{name} must cover the {kv_len} cached keys (new ones included) or the whole cache "
                     f"({buffer}) along its last dim, got shape {tuple(t.shape)}")


def _check_compiled_step(need_weights: bool, key_mask, position_bias, approx) -> None:
    """What a cached step under torch.compile cannot do: it knows the cached length as a tensor only."""
    refused = [what for what, given in (("need_weights=True", need_weights), ("key_mask", key_mask is not None),
                                        ("a position_bias", position_bias is not None),
                                        ("an approximate kind", approx is not None)) if given]
    if refused:
        raise ValueError(f"a cached step under torch.compile knows the cached length only as a tensor, which "
                         f"{', '.join(refused)} would need as a number: run such steps eagerly, or pass padding "
                         "as a mask over the whole cache")


def _per_head(t: Tensor | None, name: str) -> Tensor | None:
    """Module masks come as ``[Lq, Lk]``, ``[B, Lq, Lk]`` or ``[B, H, Lq, Lk]``; make them 4-D."""
    if t is None or is_plan(t):
        return t
    if not isinstance(t, Tensor) or t.dim() not in (2, 3, 4):
        raise ValueError(f"{name} must be [Lq, Lk], [B, Lq, Lk] or [B, H, Lq, Lk], got {describe(t)}")
    return t.unsqueeze(1) if t.dim() == 3 else t

