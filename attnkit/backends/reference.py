"""The reference backend: the formula written out, exact in any dtype, returns the weights.

``softmax(q @ k^T * scale + bias, masked) @ v`` with every mask materialised. It is always
registered, serves every request, and is the only backend that returns attention weights.
Half-precision inputs are computed in float32 and rounded once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import scores
from ..call import Call
from ..dtypes import compute_dtype
from ..memory import check_dense_fits, check_fits_once
from ..ops import masked_softmax


def expand_kv(x: Tensor, heads: int) -> Tensor:
    """Repeat each of the ``Hkv`` heads of ``x [..., Hkv, L, D]`` ``H // Hkv`` times (GQA)."""
    groups = heads // x.shape[-3]
    return x if groups == 1 else x.repeat_interleave(groups, dim=-3)


def apply_score_mod(req: Call, s: Tensor) -> Tensor:
    """Apply ``req.score_mod`` to scores ``s [B, H, Lq, Lk]`` on the full index grid."""
    b = torch.arange(s.shape[0], device=s.device).view(-1, 1, 1, 1)
    h = torch.arange(s.shape[1], device=s.device).view(1, -1, 1, 1)
    q = torch.arange(s.shape[2], device=s.device).view(1, 1, -1, 1)
    kv = torch.arange(s.shape[3], device=s.device).view(1, 1, 1, -1)
    return scores.apply(req.score_mod, s, b, h, q, kv)


class ReferenceBackend:
    name = "reference"

    def not_supported_reasons(self, req: Call) -> list[str]:
        return []

    def check_fits(self, req: Call) -> None:
        """Refuse ``req`` when its scores, exponentials and weights would not fit (:mod:`attnkit.memory`); asked
        while the call is checked (:func:`attnkit.functional.checked`), before a KV cache is written."""
        check_fits_once(req, self.name, check_dense_fits, "the reference backend (scores, exponentials, weights)",
                        req.scores_shape, compute_dtype(req.query.dtype), 3)

    def __call__(self, req: Call) -> tuple[Tensor, Tensor | None]:
        self.check_fits(req)  # for a caller that runs the backend itself (checked: a look-up)
        dtype = req.query.dtype
        compute = compute_dtype(dtype)
        q = req.query.to(compute)
        k = expand_kv(req.key, req.heads).to(compute)
        v = expand_kv(req.value, req.heads).to(compute)
        s = torch.matmul(q, k.transpose(-2, -1)) * req.scale  # [..., H, Lq, Lk]
        if req.bias is not None:
            s = s + req.bias.to(compute)
        allowed = req.dense_mask()
        if req.score_mod is not None:
            s = apply_score_mod(req, s)
            # What the mod makes -inf is masked too; masked cells are selected out (never -inf added), and
            # zero in a row the mod made NaN, so that its NaN reaches the allowed keys' gradients only.
            allowed = ~torch.isneginf(s) if allowed is None else allowed & ~torch.isneginf(s)
        weights = masked_softmax(s, allowed)
        if req.score_mod is not None:
            # A +inf the mod makes gives its cell NaN (inf / inf) and the row's other cells 0 (x / inf): the row is
            # poisoned (attnkit.nonfinite), so every allowed cell of a row holding a NaN is NaN, and the gradient
            # reaches every key the row allows, as in the tile and band kernels.
            poisoned = weights.isnan().any(-1, keepdim=True) & allowed
            weights = weights.masked_fill(poisoned, float("nan")).masked_fill(~allowed, 0.0)
        p = F.dropout(weights, req.dropout_p) if req.dropout_p > 0 else weights
        out = torch.matmul(p, v)  # [..., H, Lq, Ev]
        # A row with no visible key has all-zero weights and gives 0, even against a NaN value (0 * NaN);
        # a NaN score leaves its weights NaN, never all zero, so NaN still comes out.
        out = out.masked_fill(~(weights != 0).any(-1, keepdim=True), 0.0).to(dtype)
        return out, (weights.to(dtype) if req.return_weights else None)
