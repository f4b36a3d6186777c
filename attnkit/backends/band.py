"""The ``"band"`` backend: the banded C++ kernel (:mod:`._band`) for masks whose rows are intervals.

It serves a call when the call's mask plan (:mod:`attnkit.maskplan`) gives each query row its keys
as intervals (causal, window, prefix-LM, padding, packed documents, the sparse patterns, or any
predicate or dense bool mask whose plan finds that form), there is no dense ``bias``, the
``score_mod``, if any, is an additive bias per head and diagonal (ALiBi, relative-position tables;
``attnkit.scores``' or a user's own, see :func:`attnkit.scores.diagonal_bias`) and/or tanh
soft-capping (``attnkit.scores.softcap``, or a user's own alone, see :func:`attnkit.scores.soft_cap`),
on CPU in float32/float64, bfloat16/float16 (read as they are; bfloat16 through bfloat16 products where torch
has them, see :mod:`._band`), once the kernel is built and has passed its self-check. ``"auto"`` tries it before
SDPA for plain causal calls (:meth:`BandBackend.prefers`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import nonfinite, scores
from ..call import Call
from ..dtypes import compute_dtype
from ..intervals import row_bounds
from . import _band, refusals
from .refusals import Refusal


class BandBackend:
    name = "band"

    REFUSALS = (
        refusals.weights("band"),
        refusals.dropout("band"),
        Refusal(lambda c: c.bias is not None, "a dense bias is not a bias per head and diagonal (use score_mod)"),
        Refusal(lambda c: c.query.shape[-1] == 0,
                "head size 0 (every score is 0, each row the mean of its values): the kernel needs q and k columns"),
        Refusal(lambda c: c.query.device.type != "cpu" or compute_dtype(c.query.dtype) not in _band.DTYPES,
                lambda c: f"the banded kernel runs on CPU tensors of a float type, got {c.query.dtype} on "
                          f"{c.query.device}"),
    )

    def prefers(self, req: Call) -> bool:
        """Whether ``"auto"`` should try this backend before SDPA: a plain call (no mask, window, bias or
        score_mod) with more than one query on the CPU that is causal, which the kernel serves faster than
        SDPA's own causal kernel, forward and backward, in every dtype it takes; or bfloat16, causal or not,
        where the kernel runs the CPU's own bfloat16 products (:func:`._band.native_bf16_products`) and SDPA's
        CPU kernel does not (``attnkit bench core`` and ``attnkit bench dtypes`` time these; the margin shrinks
        with length). One query (a decode step) stays with SDPA, which needs no mask for it and is faster
        there. Whether the kernel can serve the call (its dtype, dropout, weights, the kernel built) is
        :meth:`not_supported_reasons`' to say: refused, the call goes on down the order."""
        plain = (req.q_len > 1 and req.query.is_cpu and req.mask is None and req.window is None
                 and req.mask_mod is None and req.score_mod is None and req.bias is None)
        return plain and (req.is_causal or (req.query.dtype == torch.bfloat16 and _band.native_bf16_products()))

    def not_supported_reasons(self, req: Call) -> list[str]:
        reasons = refusals.reasons(self.REFUSALS, req)
        if reasons:
            return reasons
        why = _kernel_inputs(req).why
        if why is None and not _band.available():
            why = f"the banded kernel is not available ({_band.unavailable_reason()})"
        return [why] if why is not None else []

    def __call__(self, req: Call) -> tuple[Tensor, None]:
        inputs = self._inputs(req)
        table = inputs.diagonal_table
        if table is not None and not torch.compiler.is_compiling():  # compiled: no check (attnkit.nonfinite)
            # The score_mod's table is the kernel's input: a NaN in it (or +inf, uncapped) is kept to the rows that
            # allow its diagonal like a NaN in q, k or v (attnkit.nonfinite), not left to the kernel's vectorised exp.
            bad = _bad_table(inputs)
            if bool(bad.any()):
                return _bad_diagonals(req, inputs, bad)
        return _band.attention(req, inputs), None

    def sees_nonfinite(self, req: Call) -> bool:
        """Whether :meth:`if_finite` can serve ``req``: a call that records no gradient (the backward reads
        key blocks whole, keys the forward never read among them) and whose score_mod table, if any, holds
        no -inf under uncapped scores, on a kernel whose statistics report a non-finite input
        (:func:`._band.reports_nonfinite`)."""
        inputs = _kernel_inputs(req).inputs
        if torch.is_grad_enabled() and (any(t.requires_grad for t in (req.query, req.key, req.value)) or (
                inputs.diagonal_table is not None and inputs.diagonal_table.requires_grad)):
            return False
        table = inputs.diagonal_table
        if table is not None and not inputs.softcap and bool(torch.isneginf(table).any()):
            return False  # uncapped, the kernel sees scores after the table: its -inf (a mask) would look like poison
        return _band.reports_nonfinite()

    def if_finite(self, req: Call) -> tuple[Tensor, None] | None:
        """``self(req)``, or None when the kernel met a NaN or an infinity in ``q``, ``k`` or ``v`` on its way
        (:func:`._band.attention_if_finite`): :mod:`attnkit.nonfinite` then takes its exact path. For calls
        :meth:`sees_nonfinite` accepts; what the score_mod's table holds is checked as by ``self(req)``."""
        inputs = self._inputs(req)
        if inputs.diagonal_table is not None and bool(_bad_table(inputs).any()):
            return None
        out = _band.attention_if_finite(req, inputs)
        return None if out is None else (out, None)

    def _inputs(self, req: Call) -> _band.BandInputs:
        reasons = self.not_supported_reasons(req)
        if reasons:  # select() asks first; this is a direct call
            raise refusals.refused("band", req, reasons)
        return _kernel_inputs(req).inputs


def _bad_table(inputs: _band.BandInputs) -> Tensor:
    """The score_mod table's entries that poison a row: NaN, and +inf unless the scores are capped."""
    table = inputs.diagonal_table
    return torch.isnan(table) if inputs.softcap else torch.isnan(table) | torch.isposinf(table)


def _bad_diagonals(req: Call, inputs: _band.BandInputs, bad: Tensor) -> tuple[Tensor, None]:
    """The kernel with the table's ``bad`` diagonals (``[1 or H, Lq + Lk - 1]``) at 0 and the rows that allow
    one of them poisoned (:func:`attnkit.nonfinite.exact`); the table's gradient is NaN once a row is."""
    b, h, lq = math.prod(req.batch_shape), req.heads, req.q_len
    starts, ends = (_per_head(t, req) for t in (inputs.starts, inputs.ends))  # [B|1, H|1, Lq, K]
    cum = torch.nn.functional.pad(bad.cumsum(-1), (1, 0))  # bad diagonals before each column
    cum = cum.view(1, bad.shape[0], 1, -1)
    bx, hx = starts.shape[0], max(starts.shape[1], bad.shape[0])
    cum = cum.expand(bx, hx, lq, cum.shape[-1])
    first = lq - 1 - torch.arange(lq, device=starts.device).view(-1, 1)  # column of key 0 in row i
    at = (bx, hx, lq, starts.shape[-1])
    seen = cum.gather(-1, (ends + first).expand(at)) - cum.gather(-1, (starts + first).expand(at))
    rows = (seen.sum(-1) > 0).expand(b, h, lq)
    table = nonfinite.sanitized(inputs.diagonal_table, ~bad, rows.any().expand(inputs.diagonal_table.shape))
    clean = inputs._replace(diagonal_table=table)
    return nonfinite.exact(lambda r: (_band.attention(r, clean), None), req, rows)


def _per_head(t: Tensor, req: Call) -> Tensor:
    """The kernel's intervals ``[P, Lq, K]`` (``P`` 1, B or B*H) as ``[B|1, H|1, Lq, K]``."""
    per_head = t.shape[0] > 1 and req.mask_plan is not None and req.mask_plan.heads is not None
    return t.view(-1, req.heads if per_head else 1, *t.shape[1:])


class _Plan(NamedTuple):
    """The band kernel's plan for one call: its inputs, or None and why not."""

    inputs: _band.BandInputs | None
    why: str | None


def _kernel_inputs(req: Call) -> _Plan:
    """The kernel's inputs for ``req``, or None and why not (worked out once per call)."""
    return req.derived.plan(_Plan, _work_out, req)


def _work_out(req: Call) -> _Plan:
    bias, cap = None, 0.0
    if req.score_mod is not None:
        # In the scores' compute dtype (the attnkit.scores dtype rule), so float32 tables add up in float64 for
        # float64 inputs; the kernel sends the gradient back in each captured tensor's own dtype.
        terms = scores.kernel_terms(req.score_mod, batch=math.prod(req.batch_shape), heads=req.heads,
                                    q_len=req.q_len, kv_len=req.kv_len, dtype=compute_dtype(req.query.dtype),
                                    device=req.query.device)
        if terms is None:
            return _Plan(None, scores.NOT_KERNEL_TERMS)
        bias, cap = terms
    plan = req.mask_plan
    if plan is None and req.mask is not None:
        return _Plan(None, "a dense mask has an interval form only with 4-D inputs [B, H, L, E]")
    if plan is None:  # no mask: every row sees every key
        return _Plan(_band.BandInputs(*row_bounds(req.q_len, req.kv_len), bias, cap), None)
    if plan.starts is None:
        return _Plan(None, "the mask has no interval form (a row has too many runs of keys)")
    return _Plan(_band.BandInputs(plan.starts, plan.ends, bias, cap), None)
