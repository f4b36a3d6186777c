"""The ``"band"`` backend: the banded C++ kernel (:mod:`._band`) for masks whose rows are intervals.

It serves a call when the request's mask plan (:mod:`attnkit.plan`) gives each query row its keys
as intervals (causal, window, prefix-LM, padding, packed documents, the sparse patterns, or any
predicate or dense bool mask whose plan finds that form), there is no dense ``bias``, the
``score_mod``, if any, is an additive bias per head and diagonal (ALiBi, relative-position tables;
``attnkit.scores``' or a user's own, see :func:`attnkit.scores.diagonal_bias`) and/or tanh
soft-capping (``attnkit.scores.softcap``, or a user's own alone, see :func:`attnkit.scores.soft_cap`),
on CPU in float32/float64 (half types computed in float32), once the kernel is built
and has passed its self-check.
"""

from __future__ import annotations

import math

from torch import Tensor

from .. import scores
from ..request import Request
from . import _band
from ._fused import compute_dtype


class BandBackend:
    name = "band"

    def not_supported_reasons(self, req: Request) -> list[str]:
        reasons = []
        if req.return_weights:
            reasons.append("the band backend never forms the weights (use backend='reference')")
        if req.dropout_p > 0:
            reasons.append("dropout is not implemented in the band backend")
        if req.bias is not None:
            reasons.append("a dense bias is not a bias per head and diagonal (use score_mod)")
        if req.query.device.type != "cpu" or compute_dtype(req.query.dtype) not in _band.DTYPES:
            reasons.append(f"the banded kernel runs on CPU tensors of a float type, got {req.query.dtype} on "
                           f"{req.query.device}")
        if reasons:
            return reasons
        why = _kernel_plan(req)[1]
        if why is None and not _band.available():
            why = f"the banded kernel is not available ({_band.unavailable_reason()})"
        return [why] if why is not None else []

    def __call__(self, req: Request) -> tuple[Tensor, None]:
        reasons = self.not_supported_reasons(req)
        if reasons:  # select() asks first; this is a direct call
            raise ValueError("backend 'band' cannot serve this call: " + "; ".join(reasons))
        return _band.attention(req, _kernel_plan(req)[0]), None


def _kernel_plan(req: Request) -> tuple[_band.Plan | None, str | None]:
    """The kernel's plan for ``req``, or None and why not (worked out once per call)."""
    if "band" not in req.memo:
        req.memo["band"] = _work_out(req)
    return req.memo["band"]


def _work_out(req: Request) -> tuple[_band.Plan | None, str | None]:
    bias, cap = None, 0.0
    if req.score_mod is not None:
        # In the scores' compute dtype (the attnkit.scores dtype rule), so float32 tables add up in float64 for
        # float64 inputs; the kernel sends the gradient back in each captured tensor's own dtype.
        terms = scores.kernel_terms(req.score_mod, batch=math.prod(req.batch_shape), heads=req.heads,
                                    q_len=req.q_len, kv_len=req.kv_len, dtype=compute_dtype(req.query.dtype),
                                    device=req.query.device)
        if terms is None:
            return None, scores.NOT_KERNEL_TERMS
        bias, cap = terms
    plan = req.plan
    if plan is None and req.mask is not None:
        return None, "a dense mask has an interval form only with 4-D inputs [B, H, L, E]"
    if plan is None:  # no mask: every row sees every key
        from ..plan import row_bounds  # the plan module builds on the backends

        return _band.Plan(*row_bounds(req.q_len, req.kv_len), bias, cap), None
    if plan.starts is None:
        return None, "the mask has no interval form (a row has too many runs of keys)"
    return _band.Plan(plan.starts, plan.ends, bias, cap), None
