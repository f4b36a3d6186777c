"""Attention rollout (Abnar & Zuidema, "Quantifying Attention Flow in Transformers", ACL 2020).

Raw attention at layer l says which layer-(l-1) states a token mixes, not which *input* tokens it
depends on. Rollout follows the mixing down through the layers: each layer's heads are fused into
one matrix ``A_l``, the residual connection is modelled by adding the identity,
``A_l' = (1 - r) * A_l + r * I`` with rows renormalised, and the layers are chained::

    R = A_L' @ ... @ A_2' @ A_1'

``R[b, i, j]`` is the share of output token ``i`` (after the last layer) that flows from input
token ``j``. The paper uses ``r = 0.5`` and the mean over heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

HEAD_FUSIONS = ("mean", "max", "min")


def fuse_heads(attn: Tensor, how: str = "mean") -> Tensor:
    """Fuse the heads of one layer's attention weights.

    Args:
        attn: ``[B, H, L, L]`` weights of one layer.
        how: ``"mean"`` (the paper), ``"max"`` or ``"min"`` over heads.

    Returns:
        ``[B, L, L]``.

    Raises:
        ValueError: ``attn`` is not 4-D or ``how`` is unknown.
    """
    if attn.dim() != 4:
        raise ValueError(f"attn must be [B, H, L, L], got shape {tuple(attn.shape)}")
    if how == "mean":
        return attn.mean(dim=1)
    if how == "max":
        return attn.amax(dim=1)
    if how == "min":
        return attn.amin(dim=1)
    raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}, got {how!r}")


def rollout(attentions: Sequence[Tensor] | Tensor, *, head_fusion: str = "mean",
            residual: float = 0.5) -> Tensor:
    """Attention rollout from the first layer to the last.

    Args:
        attentions: one ``[B, H, L, L]`` tensor per layer, first layer first (what
            ``output_attentions=True`` returns), or one ``[layers, B, H, L, L]`` tensor.
        head_fusion: how heads are fused per layer: ``"mean"``, ``"max"`` or ``"min"``.
        residual: weight ``r`` of the identity that models the residual connection, in ``[0, 1]``;
            ``0`` multiplies the raw (fused) attention matrices.

    Returns:
        ``[B, L, L]`` in float32 or float64 (float64 inputs stay float64); every row that carries
        weight sums to 1. Rows that are entirely zero (fully masked queries, with ``residual=0``)
        stay zero.

    Raises:
        ValueError: no layers, layers of different shapes, non-square maps, or ``residual``
            outside ``[0, 1]``.
    """
    layers = list(attentions.unbind(0)) if isinstance(attentions, Tensor) else list(attentions)
    if not layers:
        raise ValueError("attentions must hold at least one layer, got none")
    if not 0.0 <= float(residual) <= 1.0:
        raise ValueError(f"residual must be in [0, 1], got {residual}")
    shape = tuple(layers[0].shape)
    if len(shape) != 4 or shape[-1] != shape[-2]:
        raise ValueError(f"each layer must be [B, H, L, L] with square maps, got shape {shape}")
    dtype = torch.float64 if layers[0].dtype == torch.float64 else torch.float32
    eye = torch.eye(shape[-1], dtype=dtype, device=layers[0].device)
    result = None
    for i, attn in enumerate(layers):
        if tuple(attn.shape) != shape:
            raise ValueError(f"attentions[{i}] has shape {tuple(attn.shape)}, expected {shape} like layer 0")
        a = fuse_heads(attn.to(dtype), head_fusion)                       # (B, L, L)
        a = (1.0 - residual) * a + residual * eye
        total = a.sum(dim=-1, keepdim=True)
        a = torch.where(total > 0, a / total.clamp_min(torch.finfo(dtype).tiny), a)
        result = a if result is None else a @ result
    return result
