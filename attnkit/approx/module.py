""":class:`ApproxAttention`: one kind of :func:`attnkit.approx.attention` with its parameters, for modules."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .dispatch import check_kind, checked, kind_arguments
from .kernel import orthogonal_features
from .linformer import LinformerProjection


class ApproxAttention(nn.Module):
    """The attention core of :class:`attnkit.MultiHeadAttention` when it is built with ``kind=``.

    Parameters per kind (heads ``H``, head size ``D``):

    * ``performer``: a buffer ``projection [num_features, D]`` (orthogonal features drawn from
      ``seed``, shared by the heads); :meth:`redraw` draws new ones.
    * ``linformer``: ``projection`` a :class:`LinformerProjection(max_len, k)`.
    * ``multiplicative``: ``weight [H, D, D]``, starting at the identity (the dot product).
    * ``additive``: ``query_weight``, ``key_weight`` ``[H, hidden, D]`` and ``score_vector [H, hidden]``.
    * the other kinds have no parameters; their ``kind_args`` are passed on.

    Args:
        kind: one of :data:`attnkit.approx.KINDS`.
        num_heads, head_dim: the heads it serves.
        **kind_args: ``num_features``/``seed`` (performer), ``max_len``/``k`` (linformer), ``hidden``
            (additive, default ``head_dim``), or any argument :func:`attnkit.approx.attention` takes for the kind.
    """

    def __init__(self, kind: str, *, num_heads: int, head_dim: int, device=None, dtype=None, **kind_args) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        check_kind(kind)
        self.kind = kind
        args = dict(kind_args)
        if kind == "performer":
            self.num_features, self.seed = args.pop("num_features", 256), args.pop("seed", 0)
            # float64 like the draw itself: the features are then as exact as the model's dtype allows
            self.register_buffer("projection", torch.empty(0, head_dim, device=device, dtype=torch.float64),
                                 persistent=False)
            self.head_dim = head_dim
            self.redraw(self.seed)
        elif kind == "linformer":
            self.projection = LinformerProjection(args.pop("max_len", 512), args.pop("k", 64), **fk)
        elif kind == "multiplicative":
            self.weight = nn.Parameter(torch.eye(head_dim, **fk).repeat(num_heads, 1, 1))
        elif kind == "additive":
            hidden = args.pop("hidden", head_dim)
            bound = 1.0 / math.sqrt(head_dim)
            self.query_weight = nn.Parameter(torch.empty(num_heads, hidden, head_dim, **fk).uniform_(-bound, bound))
            self.key_weight = nn.Parameter(torch.empty(num_heads, hidden, head_dim, **fk).uniform_(-bound, bound))
            self.score_vector = nn.Parameter(torch.empty(num_heads, hidden, **fk).uniform_(-bound, bound))
        unknown = sorted(set(args) - set(kind_arguments(kind)))
        if unknown:
            raise ValueError(f"{kind}: unknown argument(s) {unknown}")
        self.kind_args = args

    def redraw(self, seed: int | None = None) -> None:
        """Performer: draw new random features (from ``seed``, or the next seed after the last draw)."""
        if self.kind != "performer":
            raise ValueError(f"redraw is for kind 'performer', this is {self.kind!r}")
        self.seed = self.seed + 1 if seed is None else seed
        w = orthogonal_features(self.num_features, self.head_dim, generator=torch.Generator().manual_seed(self.seed))
        self.projection = w.to(device=self.projection.device, dtype=self.projection.dtype)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, is_causal: bool = False,
                scale: float | None = None) -> Tensor:
        """``q [B, H, Lq, D]``, ``k``/``v`` ``[B, Hkv, Lk, *]`` -> ``[B, H, Lq, Dv]``."""
        return self.checked(q, k, v, mask=mask, is_causal=is_causal, scale=scale)()

    def checked(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None, is_causal: bool = False,
                scale: float | None = None) -> Callable[[], Tensor]:
        """:meth:`forward`'s call checked, nothing computed (:func:`attnkit.approx.dispatch.checked`): returns
        the computation, which reads ``k`` and ``v`` when it is called (after a KV cache's write into them)."""
        params = {name: getattr(self, name) for name in ("projection", "weight", "query_weight", "key_weight",
                                                          "score_vector") if hasattr(self, name)}
        return checked(q, k, v, kind=self.kind, mask=mask, is_causal=is_causal, scale=scale,
                       **params, **self.kind_args)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}" + "".join(f", {k}={v!r}" for k, v in self.kind_args.items())
