"""Context parallelism for :class:`attnkit.MultiHeadAttention`: the same module, sequence-sharded.

:class:`ContextParallelAttention` wraps an existing module (sharing its parameters): it projects
this rank's tokens with ``MultiHeadAttention.project_qkv``, runs :func:`ring_attention` over the
group, and applies the module's ``out_proj``. Everything else in a transformer block (norms,
MLPs, embeddings) is per token and runs on the shard unchanged. The parameters are replicated;
after the backward, :func:`sync_grads` sums their gradients over the group (what DDP would do).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn

from ..modules.attention import MultiHeadAttention, merge_heads
from .ring import refuse_ring_call, ring_attention
from .shard import LAYOUTS

__all__ = ["ContextParallelAttention", "sync_grads"]


class ContextParallelAttention(nn.Module):
    """Run a ``MultiHeadAttention`` over a sequence sharded across a process group.

    Input and output are this rank's shard, batch-first (``[B, L_local, E]``), sharded with
    :func:`attnkit.distributed.shard` along dim 1 in ``layout``. The result on each rank equals the
    wrapped module's output on the full sequence, at this rank's positions.

    Args:
        attn: the module to run; its parameters are shared, not copied.
        group: the process group (default: the world).
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced work under ``is_causal``).

    Raises:
        TypeError: ``attn`` is not a ``MultiHeadAttention``.
        ValueError: ``attn`` uses a feature ring attention does not implement (rotary or position
            bias, which need contiguous global positions; dropout while training).
    """

    def __init__(self, attn: MultiHeadAttention, *, group=None, layout: str = "zigzag") -> None:
        super().__init__()
        if not isinstance(attn, MultiHeadAttention):
            raise TypeError(f"attn must be an attnkit.MultiHeadAttention, got {type(attn).__name__}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        for feature in ("rotary", "position_bias"):
            if getattr(attn, feature, None) is not None:
                raise ValueError(f"ContextParallelAttention does not support attn.{feature} yet; "
                                 f"got a module with {feature} set")
        self.attn, self.group, self.layout = attn, group, layout

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        is_causal: bool = False,
        window=None,
        mask_mod=None,
    ) -> Tensor:
        """Attend this rank's ``query`` shard to the keys of every rank.

        Args:
            query: ``[B, Lq_local, embed_dim]``.
            key: ``[B, Lk_local, kdim]``; defaults to ``query`` (self-attention).
            value: ``[B, Lk_local, vdim]``; defaults to ``key``.
            is_causal, window: as in :func:`attnkit.attention`, over global positions.
            mask_mod: a predicate on global positions, as in :func:`ring_attention` (padding:
                ``attnkit.masks.padding_mod(lengths)``).

        Returns:
            ``[B, Lq_local, embed_dim]``.

        Raises:
            TypeError, ValueError: inputs the module refuses, or dropout while training. Every rank
                raises when one does, as in :func:`ring_attention`.
        """
        attn = self.attn
        key = query if key is None else key
        value = key if value is None else value
        try:
            if attn.training and attn.dropout > 0:
                raise ValueError(f"ContextParallelAttention does not implement attention dropout; got "
                                 f"attn.dropout={attn.dropout} in training mode")
            attn.check_inputs(query, key, value, length="L_local")
        except (TypeError, ValueError):
            refuse_ring_call(self.group, query)  # the other ranks raise too, rather than wait in the ring
            raise
        q, k, v = attn.project_qkv(query, key, value)  # (B, H, Lq_local, D), (B, Hkv, Lk_local, D)
        out = ring_attention(q, k, v, group=self.group, is_causal=is_causal, window=window,
                             layout=self.layout, scale=getattr(attn, "scale", None), mask_mod=mask_mod)
        return attn.out_proj(merge_heads(out))  # (B, Lq_local, embed_dim)


def sync_grads(module: nn.Module, group=None) -> None:
    """Sum the gradients of ``module``'s parameters over ``group``, in place (one all-reduce each).

    With each rank's loss a sum over its own tokens, the summed gradient is the gradient of the
    total loss. Parameters without a gradient on this rank get zeros, so every rank issues the
    same all-reduces in the same order.
    """
    for p in module.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = p.detach().new_zeros(p.shape)
        dist.all_reduce(p.grad, group=group)
