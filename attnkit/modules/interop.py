"""Weight copying between attnkit's MultiHeadAttention and ``torch.nn.MultiheadAttention``."""

from __future__ import annotations

import torch
from torch import nn


def from_torch_mha(cls, m: nn.MultiheadAttention):
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch expects torch.nn.MultiheadAttention, got {type(m).__name__}")
    if m.bias_k is not None or m.bias_v is not None:
        raise ValueError("from_torch: add_bias_kv=True is not supported (it appends a learned key/value)")
    if m.add_zero_attn:
        raise ValueError("from_torch: add_zero_attn=True is not supported")
    e = m.embed_dim
    has_bias = m.in_proj_bias is not None
    ours = cls(e, m.num_heads, kdim=m.kdim, vdim=m.vdim, bias=has_bias, dropout=m.dropout,
               device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype)
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            wq, wk, wv = m.in_proj_weight.chunk(3, dim=0)
        else:
            wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        for lin, w in ((ours.q_proj, wq), (ours.k_proj, wk), (ours.v_proj, wv)):
            lin.weight.copy_(w)
        if has_bias:
            for lin, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), m.in_proj_bias.chunk(3), strict=True):
                lin.bias.copy_(b)
        ours.out_proj.weight.copy_(m.out_proj.weight)
        if m.out_proj.bias is not None:
            ours.out_proj.bias.copy_(m.out_proj.bias)
    return ours


def to_torch_mha(ours) -> nn.MultiheadAttention:
    if ours.num_kv_heads != ours.num_heads:
        raise ValueError(f"to_torch: torch.nn.MultiheadAttention has no grouped-query heads "
                         f"(num_kv_heads={ours.num_kv_heads}, num_heads={ours.num_heads})")
    if ours.head_dim != ours.v_head_dim or ours.head_dim * ours.num_heads != ours.embed_dim:
        raise ValueError(f"to_torch: torch.nn.MultiheadAttention needs head_dim == v_head_dim == "
                         f"embed_dim / num_heads; got head_dim={ours.head_dim}, v_head_dim={ours.v_head_dim}, "
                         f"embed_dim={ours.embed_dim}, num_heads={ours.num_heads}")
    w = ours.out_proj.weight
    m = nn.MultiheadAttention(ours.embed_dim, ours.num_heads, dropout=ours.dropout,
                              bias=ours.q_proj.bias is not None, kdim=ours.kdim, vdim=ours.vdim,
                              batch_first=True, device=w.device, dtype=w.dtype)
    v_proj = ours.k_proj if ours.share_kv else ours.v_proj
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            m.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, v_proj.weight]))
        else:
            m.q_proj_weight.copy_(ours.q_proj.weight)
            m.k_proj_weight.copy_(ours.k_proj.weight)
            m.v_proj_weight.copy_(v_proj.weight)
        if m.in_proj_bias is not None:
            m.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, v_proj.bias]))
            m.out_proj.bias.copy_(ours.out_proj.bias)
        m.out_proj.weight.copy_(ours.out_proj.weight)
    return m
