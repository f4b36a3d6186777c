"""The ``"band"`` backend: the banded C++ kernel (:mod:`._band`) for masks whose rows are intervals.

It serves a call when every query row's allowed keys are a few intervals (causal, window,
prefix-LM, padding, packed documents, the sparse patterns of :mod:`attnkit.masks`, or a user's
predicate whose plan finds intervals), there is no dense ``mask``/``bias``, the ``score_mod``, if
any, is an additive bias per head and diagonal and/or tanh soft-capping, on CPU in float32/float64
(half types computed in float32), once the kernel is built and has passed its self-check.
"""

from __future__ import annotations

from torch import Tensor

from ..request import Request
from . import _band


class BandBackend:
    name = "band"

    def not_supported_reasons(self, req: Request) -> list[str]:
        reasons = []
        if req.return_weights:
            reasons.append("the band backend never forms the weights (use backend='reference')")
        if req.dropout_p > 0:
            reasons.append("dropout is not implemented in the band backend")
        if req.mask is not None or req.bias is not None:
            reasons.append("a dense mask or bias has no interval form (use mask_mod/score_mod or a mask plan)")
        if reasons:
            return reasons
        if _band.plan(req) is None:
            reasons.append("needs masks whose rows are intervals, no score_mod but an additive bias per head and "
                           "diagonal, a CPU float tensor, and the banded kernel built "
                           f"({_band.unavailable_reason() or 'it is'})")
        return reasons

    def __call__(self, req: Request) -> tuple[Tensor, None]:
        plan = _band.plan(req)
        if plan is None:  # select() asks not_supported_reasons first; this is a direct call
            raise ValueError("backend 'band' cannot serve this call: " + "; ".join(self.not_supported_reasons(req)))
        return _band.attention(req, plan), None
