"""Weight copying from ``torch.nn.Transformer*`` layers, and PyTorch's ``attn_mask`` convention."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention

__all__ = ["from_torch_attn_mask"]


def from_torch_attn_mask(attn_mask: Tensor, num_heads: int | None = None) -> tuple[Tensor | None, Tensor | None]:
    """PyTorch's ``attn_mask``/``src_mask``/``tgt_mask`` to attnkit's ``(mask, bias)``.

    PyTorch's bool mask is ``True`` = *not* allowed, ours ``True`` = may attend, so it is
    inverted; a float mask is additive (``-inf`` = not allowed) and becomes ``bias``. A 3-D
    ``[B * H, Lq, Lk]`` mask is reshaped to ``[B, H, Lq, Lk]`` (give ``num_heads``).

    Returns:
        ``(mask, None)`` for a bool mask, ``(None, bias)`` for a float one.

    Raises:
        ValueError, TypeError: a shape or dtype PyTorch would not accept either.
    """
    if not isinstance(attn_mask, Tensor) or attn_mask.dim() not in (2, 3):
        got = f"shape {tuple(attn_mask.shape)}" if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
        raise ValueError(f"attn_mask must be [Lq, Lk] or [B * num_heads, Lq, Lk], got {got}")
    if attn_mask.dim() == 3:
        if not isinstance(num_heads, int) or num_heads <= 0 or attn_mask.shape[0] % num_heads:
            raise ValueError(f"a 3-D attn_mask {tuple(attn_mask.shape)} needs num_heads dividing its first dim, "
                             f"got num_heads={num_heads!r}")
        attn_mask = attn_mask.view(-1, num_heads, *attn_mask.shape[1:])
    if attn_mask.dtype == torch.bool:
        return ~attn_mask, None
    if attn_mask.is_floating_point():
        return None, attn_mask
    raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")


def _layer_config(m) -> dict:
    attn = m.self_attn
    return {
        "ffn_dim": m.linear1.out_features,
        "dropout": m.dropout.p,
        "activation": m.activation,
        "norm_first": m.norm_first,
        "layer_norm_eps": m.norm1.eps,
        "bias": m.linear1.bias is not None,
        "device": attn.out_proj.weight.device,
        "dtype": attn.out_proj.weight.dtype,
    }


def _copy_common(ours, m) -> None:
    with torch.no_grad():
        ours.ff.linear1.load_state_dict(m.linear1.state_dict())
        ours.ff.linear2.load_state_dict(m.linear2.state_dict())
        for name in ("norm1", "norm2", "norm3"):
            if hasattr(ours, name):
                getattr(ours, name).load_state_dict(getattr(m, name).state_dict())


def encoder_layer_from_torch(cls, m: nn.TransformerEncoderLayer):
    if not isinstance(m, nn.TransformerEncoderLayer):
        raise TypeError(f"from_torch expects torch.nn.TransformerEncoderLayer, got {type(m).__name__}")
    ours = cls(m.self_attn.embed_dim, m.self_attn.num_heads, **_layer_config(m))
    ours.self_attn = MultiHeadAttention.from_torch(m.self_attn)
    _copy_common(ours, m)
    return ours


def decoder_layer_from_torch(cls, m: nn.TransformerDecoderLayer):
    if not isinstance(m, nn.TransformerDecoderLayer):
        raise TypeError(f"from_torch expects torch.nn.TransformerDecoderLayer, got {type(m).__name__}")
    ours = cls(m.self_attn.embed_dim, m.self_attn.num_heads, **_layer_config(m))
    ours.self_attn = MultiHeadAttention.from_torch(m.self_attn)
    ours.cross_attn = MultiHeadAttention.from_torch(m.multihead_attn)
    _copy_common(ours, m)
    return ours
