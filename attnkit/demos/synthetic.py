"""The check most hand-written attention tutorials end with, done right: self- and cross-attention
on random token embeddings.

Batch of 2, embeddings of 128, 8 heads, query length 5 and key/value length 7, with a padding
mask (the second sequence has 4 real keys) and a look-ahead mask. Prints shapes, one head's
weight matrix with the masked cells exactly zero, and which backend ran; draws both heads' weights,
masked cells marked, into the output folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import attention, masks, which_backend
from ..modules import MultiHeadAttention


def _matrix(w: torch.Tensor, allowed: torch.Tensor) -> str:
    rows = []
    for i in range(w.shape[0]):
        cells = [f"{w[i, j]:.3f}" if allowed[i, j] else "  .  " for j in range(w.shape[1])]
        rows.append(f"    q{i}  " + "  ".join(cells) + f"   (sum {w[i].sum():.3f})")
    return "\n".join(rows)


def run(folder: Path) -> int:
    """Print the demo and write its two heat maps into ``folder`` (created)."""
    from ..cli.command import UserError, prepare_out
    from .real_model import show_written

    try:
        from .. import viz
    except ImportError as e:
        raise UserError(f"drawing needs {e.name}: pip install 'attnkit[viz]'") from None
    prepare_out(folder)

    torch.manual_seed(0)
    batch, embed, heads, lq, lk = 2, 128, 8, 5, 7
    x_q = torch.rand(batch, lq, embed)
    x_kv = torch.rand(batch, lk, embed)
    mha = MultiHeadAttention(embed, heads).eval()

    print(f"self-attention: x {tuple(x_q.shape)}, 8 heads of {embed // heads}, causal (look-ahead) mask")
    out, w = mha(x_q, is_causal=True, need_weights=True)
    q, k, v = mha.project_qkv(x_q, x_q, x_q)
    print(f"  output {tuple(out.shape)}, weights {tuple(w.shape)}; "
          f"backend without weights: {which_backend(q, k, v, is_causal=True)}, with weights: "
          f"{which_backend(q, k, v, is_causal=True, return_weights=True)}")
    allowed = masks.causal(lq)
    print("  head 0 of sequence 0 ('.' = masked, exactly 0):")
    print(_matrix(w[0, 0], allowed))
    written = [(viz.save(viz.heatmap(w[0, 0], mask=allowed, title="self-attention, causal mask: head 0"),
                         folder / "self_attention.png"), "self-attention with the look-ahead mask, head 0")]

    key_mask = masks.padding([lk, 4], lk)[:, 0, 0, :]  # [B, Lk], True = real token
    print(f"\ncross-attention: queries {tuple(x_q.shape)} over keys/values {tuple(x_kv.shape)}, "
          "sequence 1 has 4 real keys of 7")
    out, w = mha(x_q, x_kv, key_mask=key_mask, need_weights=True)
    print(f"  output {tuple(out.shape)}, weights {tuple(w.shape)}")
    print("  head 0 of sequence 1:")
    print(_matrix(w[1, 0], key_mask[1].expand(lq, lk)))
    written.append((viz.save(viz.heatmap(w[1, 0], mask=key_mask[1].expand(lq, lk),
                                         title="cross-attention, padding mask: sequence 1, head 0"),
                             folder / "cross_attention.png"), "cross-attention with 3 padded keys, head 0"))

    blocked = torch.ones(lq, lq, dtype=torch.bool)
    blocked[2] = False  # query 2 may attend nothing
    z = attention(q, k, v, mask=blocked)
    print(f"\nquery 2 with every key masked returns zeros, not NaN: |out[q2]| max = {z[..., 2, :].abs().max():.1f}, "
          f"any NaN: {bool(z.isnan().any())}")
    print()
    show_written(folder, written)
    return 0
