"""NaN and infinity in attention: the one rule every backend keeps, enforced here, in front of them.

The rule
--------
A cell ``(i, j)`` is *allowed* when every mask of the call (``mask``, ``is_causal``, ``window``,
``mask_mod``, a :class:`~attnkit.MaskPlan`) lets query ``i`` attend key ``j`` and the ``bias``
there is not ``-inf`` (a ``-inf`` bias is a mask, not poison). A query row is *dead* when it has
no allowed cell. A row that is not dead is *poisoned* when

* its query row holds a NaN or an infinity, or
* an allowed key ``j`` holds a NaN or an infinity in ``k_j`` or ``v_j``, or
* an allowed cell's ``bias`` is NaN or ``+inf``, or
* the ``score_mod`` returns NaN or ``+inf`` at an allowed cell.

Forward, on every backend, in every dtype:

* a poisoned row is NaN, every element of it (and its row of weights);
* a dead row is zeros, whatever its query holds;
* every other row equals, bit for bit, the same call with the non-finite inputs replaced by any
  finite values: a masked cell contributes exactly 0, whatever sits there.

Backward, for a finite output gradient:

* ``dq``: NaN in poisoned rows, zeros in dead rows, the clean call's elsewhere;
* ``dk``, ``dv``: NaN in the rows of keys that a poisoned row allows, the clean call's elsewhere
  (a non-finite key that no live row allows is read by nothing: its gradient is 0);
* ``dbias``: NaN at the allowed cells of poisoned rows, the clean call's elsewhere;
* a tensor that a ``score_mod`` captures (an ALiBi slope, a relative-position table): not finite
  once a row is poisoned. Where the mod's own arithmetic makes the NaN (the tile and reference
  backends) it reaches the entries the poisoned cells use; otherwise (poison from ``q``, ``k``,
  ``v`` or ``bias``, or from the banded kernel's table) the whole gradient is NaN: which rows an
  entry shaped is not traced.

Scores that overflow (finite inputs whose product is infinite) are outside the rule: at an allowed
cell they poison the row as a score_mod's infinity does; at a masked cell the kernels that add the
mask (SDPA, PyTorch's flash kernel) may still carry them into the row.

How it is kept
--------------
:func:`call` runs the backend ``attnkit.attention`` chose. First one cheap check
(:func:`all_finite`): a sum of each of ``q``, ``k``, ``v`` (finite unless an element is not, or the
sum overflowed), or for a KV cache's buffers the flag the cache keeps of what it wrote
(:func:`vouch`: a decode step reads its one query token and that flag, not the buffers), and the
bias's maximum (NaN or ``+inf``; ``-inf`` is a mask); on a device, one host sync. A backend that
reads every input it uses in its own pass may answer instead: the banded kernel, for a call that
records no gradient, marks in its statistics each row whose scores or output met a non-finite value,
and a look at those replaces the sums (``sees_nonfinite``/``if_finite``, see :func:`call`); the SDPA
backend, for a few queries on the CPU (a decode step over a Hugging Face cache or a user's tensors, not
vouched for), adds to its one call a probe row of zeros whose output is finite only if every key and value is
(:mod:`attnkit.backends.sdpa`), so such a step reads its cache once, not twice. The exact path vouches for
its sanitized keys and values when the call's were vouched for, so that the backend computes them as it does
the clean call. When the
check passes, the backend runs on the inputs as they are. Otherwise the same backend runs on sanitized inputs
(non-finite entries of ``q``, ``k``, ``v`` and the NaN/``+inf`` entries of ``bias`` replaced by 0),
so that every row that sees no poison is the clean call's, and the poisoned rows are made NaN
afterwards. Which rows are poisoned comes from the mask plan's intervals (a prefix sum of the bad
keys over each interval, ``O(Lq * K)``, no ``[Lq, Lk]`` tensor), or from the dense mask when there
is no interval form or a bias. Small autograd functions put NaN into the gradients the rule names
and let the backend's clean gradients through everywhere else. A false alarm (a sum that overflows) only costs the exact
path, which then changes nothing.

A ``score_mod`` is a function, so it cannot be sanitized up front: the backends that call it (the
tiles, the reference) apply the mask by selection after the mod (``where(allowed, score, -inf)``,
never by adding ``-inf``) and mask the probabilities and score gradients of a NaN row the same
way, so a NaN the mod makes at a masked cell goes nowhere and one at an allowed cell poisons its
row in the backend's own arithmetic. The banded kernel takes a score_mod as a table per diagonal,
small enough to check on every call: its bad diagonals go through :func:`exact` like bad keys.

Under ``torch.compile`` the check is skipped and the backend runs on the inputs as they are: a
check read on the host would break the graph, and the exact path taken on every call (it has no
branch on the data, and compiles) would cost every finite call its sanitizing and bookkeeping.
So compiled code keeps the rule for finite inputs only; a non-finite input there gets the
backend's own arithmetic, which may hide a NaN row as zeros or carry a NaN into rows that do not
see it. Check inputs outside the compiled region where that matters
(:func:`all_finite` takes a request: ``attnkit.call.validate_call``).

Plain PyTorch, for a reader (``allowed`` the dense mask; ``bad_k`` the bad key rows)::

    live = allowed.any(-1)
    poisoned = live & (~q.isfinite().all(-1) | (allowed & bad_k[..., None, :]).any(-1))
    out = attention(q.nan_to_num(0, 0, 0), k.nan_to_num(0, 0, 0), v.nan_to_num(0, 0, 0), allowed)
    out = out.masked_fill(poisoned[..., None], float("nan"))
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .call import Call
from .closures import captured_tensors

__all__ = ["call", "all_finite", "finite", "vouch", "is_vouched", "exact", "sanitized"]

_NAN = float("nan")


def call(backend, req: Call) -> tuple[Tensor, Tensor | None]:
    """``backend(req)`` under the rule of the module docstring: the backend alone when every input
    is finite (and under ``torch.compile``), its exact path otherwise.

    A backend whose own pass over the inputs tells whether one is not finite says so by two methods:
    ``sees_nonfinite(req)``, whether it can tell for this call, and ``if_finite(req)``, its result, or None
    when it met a non-finite input. Then that pass replaces :func:`all_finite`'s read of ``q``, ``k`` and
    ``v``, and a call it finds non-finite runs twice (once to find out, once on the exact path)."""
    if torch.compiler.is_compiling():
        return backend(req)
    sees = getattr(backend, "sees_nonfinite", None)
    if sees is not None and req.bias is None and sees(req):
        result = backend.if_finite(req)
        return result if result is not None else exact(backend, req)
    if all_finite(req):
        return backend(req)
    return exact(backend, req)


def all_finite(req: Call) -> bool:
    """True when ``q``, ``k`` and ``v`` are finite and ``bias`` holds no NaN or ``+inf`` (False also
    when a sum overflows: a false alarm, which only sends the call to :func:`exact`).

    ``q`` is read (a sum); so are ``k`` and ``v``, once each and not again when one is ``q``, except a
    tensor :func:`vouch` answers for: its flag is read instead, once however many tensors share it
    (a KV cache's keys and values). On the CPU each number is read as it comes and the first bad one
    ends the check; on a device the answers are combined there and read in one host sync. Work:
    ``O(numel)`` of the tensors read, plus a fixed cost of a reduction and a read per tensor, which
    is all a decode step over a cache's buffers pays (measured: ``bench/results/core.md``).
    """
    q, k, v, bias = req.query, req.key, req.value, req.bias
    if not q.is_cpu:
        return _all_finite_one_sync(q, k, v, bias)
    # A CPU number is read without a sync: Python floats, the fewest ops, and the first bad one ends it.
    if not math.isfinite(_sum(q).item()):
        return False
    flag = None  # the vouched flag read last: a cache's keys and values share one
    for t in (k,) if k is v else (k, v):
        if t is not q:
            seen = _vouched(t)
            if seen is None:
                if not math.isfinite(_sum(t).item()):
                    return False
            elif seen is not flag:
                if not seen.item():
                    return False
                flag = seen
    return bias is None or not bias.numel() or _max(bias).item() < math.inf  # NaN < inf is False; -inf masks


def _all_finite_one_sync(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> bool:
    """:func:`all_finite` for tensors on a device: every answer combined there, one host sync."""
    ok = torch.isfinite(_sum(q))
    flag = None
    for t in (k,) if k is v else (k, v):
        if t is not q:
            seen = _vouched(t)
            if seen is None:
                ok = ok & torch.isfinite(_sum(t))
            elif seen is not flag:
                ok = ok & seen
                flag = seen
    if bias is not None and bias.numel():
        ok = ok & (_max(bias) < math.inf)
    return bool(ok)


def finite(x: Tensor) -> Tensor:
    """0-d bool tensor, True when every element of ``x`` is finite (or what :func:`vouch` recorded for
    ``x`` as it is now). One read of ``x``, no host sync: a sum is finite unless an element is not (or
    it overflows)."""
    seen = _vouched(x)
    return seen if seen is not None else torch.isfinite(_sum(x))


def is_vouched(x: Tensor) -> bool:
    """Whether :func:`vouch` answers for ``x`` as it is now (a KV cache's buffers, or a view of them): a backend
    whose own pass could tell finiteness (:mod:`attnkit.backends.sdpa`'s probe) leaves it to the flag then."""
    return _vouched(x) is not None


def _vouched(x: Tensor) -> Tensor | None:
    """What :func:`vouch` recorded for ``x`` as it is now, else None."""
    seen = getattr(x, "_attnkit_finite", None)
    if seen is None and x._base is not None:
        # A view of a tensor vouched for (a cache's written keys): its elements are among the base's, and
        # it shares the base's version counter, so the base's flag holds for it as long as it holds for the base.
        seen = getattr(x._base, "_attnkit_finite", None)
    # Read only when set: vouch() sets it on tensors with a version counter (inference tensors have none).
    return seen[1] if seen is not None and seen[0] == x._version else None


def _sum(x: Tensor) -> Tensor:
    # Not detached: a sum records no tensor for its backward, so under autograd it costs one small node,
    # which is dropped at once, and no hook runs; detaching would cost every call an op.
    # float16 sums in float32: its own range (65504) would overflow on ordinary inputs. bfloat16 has
    # float32's range and PyTorch accumulates its sum in float32: summed as it is, without a copy.
    return x.sum(dtype=torch.float32) if x.dtype == torch.float16 else x.sum()


def _max(x: Tensor) -> Tensor:
    # Detached: amax would save x for its backward (a user's saved-tensor hooks would see it).
    return (x.detach() if x.requires_grad else x).amax()


def vouch(is_finite: Tensor, *xs: Tensor) -> None:
    """Let :func:`finite` and :func:`all_finite` answer ``is_finite`` (a 0-d bool tensor, copied now) for
    each of ``xs`` instead of reading it, until that tensor (or a view of its storage) is next changed
    in place; a view of one (the written part of a cache's buffers) takes the same answer. For tensors
    kept and written between calls whose finiteness follows from what was written
    (:class:`attnkit.cache.KVCache`'s buffers, where each step then checks its new tokens only, not
    the whole buffers). The tensors share one copy, which :func:`all_finite` reads once."""
    flag = None
    for x in xs:
        version = _version(x)
        if version is not None:
            flag = is_finite.clone() if flag is None else flag
            x._attnkit_finite = (version, flag)


def _version(x: Tensor) -> int | None:
    try:
        return x._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return None


def exact(backend, req: Call, extra_rows: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``backend`` on the sanitized request, its poisoned rows made NaN, the gradients as the rule
    says.

    ``extra_rows``: bool ``[B, H, Lq]`` (batch dims flattened), rows poisoned by what only the backend sees
    (the banded kernel's table of a score_mod, which it has already sanitized): counted like the
    rows the inputs poison.
    """
    q, k, v, bias = req.query, req.key, req.value, req.bias
    shape = req.batch_shape
    b, h, hkv, lq, lk = math.prod(shape), req.heads, req.kv_heads, req.q_len, req.kv_len
    fq, fk, fv = torch.isfinite(q), torch.isfinite(k), torch.isfinite(v)
    bad_q = ~fq.all(-1).reshape(b, h, lq)
    bad_kv = ~(fk.all(-1) & fv.all(-1)).reshape(b, hkv, lk).repeat_interleave(h // hkv, 1)  # [B, H, Lk]
    allowed = _Allowed(req, b)
    hit = bad_q | allowed.rows_seeing(bad_kv)
    if extra_rows is not None:
        hit = hit | extra_rows
    bias_ok = None
    if bias is not None:
        bias_ok = ~(torch.isnan(bias) | torch.isposinf(bias))
        hit = hit | (allowed.dense & ~_to4d(bias_ok, shape)).any(-1)
    poisoned = hit & allowed.live()  # [B, H, Lq]
    rows = poisoned.reshape(*shape, h, lq, 1)

    grad = torch.is_grad_enabled()
    keys = None
    if grad and (k.requires_grad or v.requires_grad):
        keys = allowed.keys_seen_by(poisoned).view(b, hkv, h // hkv, lk).any(2).reshape(*shape, hkv, lk, 1)
    cells = None
    if grad and bias is not None and bias.requires_grad:
        cells = (allowed.dense & poisoned.unsqueeze(-1)).reshape(*shape, h, lq, -1)
        cells = cells.expand(*shape, h, lq, lk).to(bias.dtype).sum_to_size(bias.shape) > 0
    clean_k, clean_v = sanitized(k, fk, keys), sanitized(v, fv, keys)
    if is_vouched(k) and is_vouched(v):
        # The clean call a vouched cache makes is vouched too: the backend then computes as it does there (the
        # SDPA backend's decode call leaves out its probe row, which would change the rounding of the others).
        vouch(torch.ones((), dtype=torch.bool, device=k.device), clean_k, clean_v)
    clean = dataclasses.replace(
        req, query=sanitized(q, fq, rows if grad else None), key=clean_k, value=clean_v,
        bias=None if bias is None else sanitized(bias, bias_ok, cells))
    out, weights = backend(clean)
    captured = []
    if grad and req.score_mod is not None:
        captured = captured_tensors(req.score_mod)
    out = _Poisoned.apply(out, rows, *captured)
    if weights is not None:
        weights = weights.masked_fill(rows, _NAN)
    return out, weights


def sanitized(x: Tensor, keep: Tensor, nan_grad: Tensor | None) -> Tensor:
    """``x`` with the entries outside ``keep`` replaced by 0; its gradient NaN where ``nan_grad``."""
    if nan_grad is None or not x.requires_grad:
        return torch.where(keep, x, 0)
    return _Sanitize.apply(x, keep, nan_grad)


class _Sanitize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, keep: Tensor, nan_grad: Tensor) -> Tensor:
        ctx.save_for_backward(nan_grad)
        return torch.where(keep, x, 0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (nan_grad,) = ctx.saved_tensors
        return grad.masked_fill(nan_grad, _NAN), None, None


class _Poisoned(torch.autograd.Function):
    """The poisoned ``rows`` of ``out`` made NaN; their gradient is not passed on (the backend
    computes the clean gradients of the other rows); a captured tensor's gradient is NaN when a
    row is poisoned."""

    @staticmethod
    def forward(ctx, out: Tensor, rows: Tensor, *captured: Tensor) -> Tensor:
        ctx.save_for_backward(rows)
        ctx.captured = [(t.shape, t.dtype, t.device) for t in captured]
        return out.masked_fill(rows, _NAN)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        spoilt = torch.where(rows.any(), _NAN, 0.0)
        return (grad.masked_fill(rows, 0.0), None,
                *(spoilt.to(dtype).expand(shape).to(device) for shape, dtype, device in ctx.captured))


def _to4d(t: Tensor, batch_shape: torch.Size) -> Tensor:
    """``t`` broadcastable to ``[*batch_shape, H, Lq, Lk]`` as ``[B|1, H|1, Lq|1, Lk|1]``."""
    nd = len(batch_shape) + 3
    t = t.reshape((1,) * (nd - t.dim()) + tuple(t.shape))
    lead = t.shape[: len(batch_shape)]
    if all(n == 1 for n in lead):
        return t.reshape(1, *t.shape[-3:])
    return t.expand(*batch_shape, *t.shape[-3:]).reshape(-1, *t.shape[-3:])


class _Allowed:
    """Which keys each query row may attend, in the cheapest form the call has: the mask plan's
    intervals (``starts``/``ends`` ``[B|1, H|1, Lq, K]``), a dense bool ``[B|1, H|1, Lq|1, Lk|1]``
    (with a bias, or a mask without an interval form), or every key (no mask)."""

    def __init__(self, req: Call, batch: int):
        self.b, self.h, self.lq, self.lk = batch, req.heads, req.q_len, req.kv_len
        self.device = req.query.device
        self.starts = self.ends = self.dense = None
        plan = req.mask_plan if req.bias is None else None  # with a bias, cells count: dense
        if plan is not None and plan.starts is not None:
            self.starts, self.ends = (self._per_head(t, plan.heads is not None) for t in (plan.starts, plan.ends))
            return
        mask = req.dense_mask()
        if mask is not None:
            self.dense = _to4d(mask, req.batch_shape)
        if req.bias is not None:
            ok = _to4d(~torch.isneginf(req.bias), req.batch_shape)
            self.dense = ok if self.dense is None else self.dense & ok

    def _per_head(self, t: Tensor, per_head: bool) -> Tensor:
        """Plan intervals ``[1, B or B*H, Lq, K]`` as ``[B|1, H|1, Lq, K]``."""
        return t.view(-1, self.h if per_head else 1, self.lq, t.shape[-1])

    def live(self) -> Tensor:
        """Bool ``[B, H, Lq]``: rows with at least one allowed key."""
        full = (self.b, self.h, self.lq)
        if self.starts is not None:
            return ((self.ends - self.starts).sum(-1) > 0).expand(full)
        if self.dense is not None:
            return self.dense.any(-1).expand(full)
        return torch.full(full, self.lk > 0, dtype=torch.bool, device=self.device)

    def rows_seeing(self, bad: Tensor) -> Tensor:
        """Bool ``[B, H, Lq]``: rows that allow a key where ``bad [B, H, Lk]``."""
        full = (self.b, self.h, self.lq)
        if self.starts is not None:
            cum = torch.nn.functional.pad(bad.cumsum(-1), (1, 0)).unsqueeze(2)  # [B, H, 1, Lk + 1]
            cum = cum.expand(self.b, self.h, self.lq, self.lk + 1)
            idx = (*full, self.starts.shape[-1])
            seen = cum.gather(-1, self.ends.expand(idx)) - cum.gather(-1, self.starts.expand(idx))
            return seen.sum(-1) > 0
        if self.dense is not None:
            return (self.dense & bad.unsqueeze(-2)).any(-1).expand(full)
        return bad.any(-1, keepdim=True).expand(full)

    def keys_seen_by(self, rows: Tensor) -> Tensor:
        """Bool ``[B, H, Lk]``: keys that one of ``rows [B, H, Lq]`` allows."""
        full = (self.b, self.h, self.lk)
        if self.starts is not None:
            idx = (self.b, self.h, self.lq, self.starts.shape[-1])
            weight = rows.unsqueeze(-1).expand(idx).to(torch.int64).reshape(self.b, self.h, -1)
            delta = torch.zeros(self.b, self.h, self.lk + 1, dtype=torch.int64, device=rows.device)
            delta.scatter_add_(-1, self.starts.expand(idx).reshape(self.b, self.h, -1), weight)
            delta.scatter_add_(-1, self.ends.expand(idx).reshape(self.b, self.h, -1), -weight)
            return delta.cumsum(-1)[..., : self.lk] > 0
        if self.dense is not None:
            return (self.dense & rows.unsqueeze(-1)).any(-2).expand(full)
        return rows.any(-1, keepdim=True).expand(full)
