"""PyTorch's fused ``scaled_dot_product_attention`` behind attnkit's conventions.

What this adapter adds: bottom-right causal alignment when ``Lq != Lk`` (SDPA's ``is_causal``
is top-left), ``mask`` and ``bias`` together, grouped-query heads, and zeros for entirely masked
rows on every PyTorch version (such rows are unmasked for the kernel and zeroed afterwards, so
no NaN they would make can reach the output or the gradient). A NaN in the inputs still comes out
in the rows that see it, as on every backend: only rows whose mask is all ``False`` (bias all
``-inf``) are zeroed, and on CPU, where the kernel's own causal mode returns 0 for a NaN row, a
causal call with a NaN in its inputs takes an explicit mask.

float16 on a CPU without float16 products (:func:`attnkit._cpu.has_fp16_products`) is computed in
float32 and rounded back: PyTorch's CPU kernel accumulates half types in float32 anyway, and its
float16 path is slower than its float32 one there (``attnkit bench dtypes``). bfloat16 stays
bfloat16, whose CPU path is not slower.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _cpu, masks
from ..call import Call
from ..memory import check_dense_fits
from .reference import expand_kv
from .refusals import Refusal, reasons


class SDPABackend:
    name = "sdpa"

    REFUSALS = (
        Refusal(lambda c: c.return_weights, "fused SDPA kernels do not return attention weights"),
        Refusal(lambda c: c.window is not None or c.mask_mod is not None,
                "window/mask_mod would have to be materialised as a dense mask"),
        Refusal(lambda c: c.score_mod is not None, "score_mod is not expressible in SDPA"),
        Refusal(lambda c: c.kv_len == 0, "empty key sequence (Lk = 0)"),
    )

    def not_supported_reasons(self, req: Call) -> list[str]:
        return reasons(self.REFUSALS, req)

    def __call__(self, req: Call) -> tuple[Tensor, None]:
        q, k, v = req.query, req.key, req.value
        rounded = q.dtype == torch.float16 and q.device.type == "cpu" and not _cpu.has_fp16_products()
        if rounded:
            q, k, v = q.float(), k.float(), v.float()
        if req.heads != req.kv_heads:
            k, v = expand_kv(k, req.heads), expand_kv(v, req.heads)
        mask = req.mask
        # One query aligned bottom-right sits after every key: causal masks nothing (a decode step).
        is_causal = req.is_causal and req.q_len > 1
        if is_causal and (mask is not None or req.bias is not None or req.q_len != req.kv_len):
            causal = masks.causal(req.q_len, req.kv_len, device=q.device)
            mask = causal if mask is None else mask & causal
            is_causal = False
        if mask is not None or req.bias is not None:
            shape = masks.broadcast_shape(*(t.shape for t in (mask, req.bias) if t is not None))
            check_dense_fits("the SDPA backend's combined attn_mask", shape,
                             torch.bool if req.bias is None else q.dtype, 2)
        attn_mask, dead = mask, None
        if req.bias is not None:
            bias = req.bias.to(q.dtype)
            attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
            dead = torch.isneginf(attn_mask).all(dim=-1, keepdim=True)  # a NaN bias is not a mask
            attn_mask = attn_mask.masked_fill(dead, 0.0)
        elif mask is not None:
            dead = ~mask.any(dim=-1, keepdim=True)
            attn_mask = mask | dead
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=req.dropout_p,
                                             is_causal=is_causal, scale=req.scale)
        if dead is not None:
            out = out.masked_fill(dead, 0.0)
        if is_causal and q.device.type == "cpu":
            # PyTorch's CPU causal kernel returns 0, not NaN, for a query row holding a NaN (a NaN key or
            # value does reach the rows that see it); NaN in, NaN out, in one pass and without a sync
            out = out.masked_fill(q.isnan().any(-1, keepdim=True), float("nan"))
        return (out.to(torch.float16) if rounded else out), None

