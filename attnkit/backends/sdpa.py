"""PyTorch's fused ``scaled_dot_product_attention`` behind attnkit's conventions.

What this adapter adds: bottom-right causal alignment when ``Lq != Lk`` (SDPA's ``is_causal``
is top-left), ``mask`` and ``bias`` together, grouped-query heads, and zeros for entirely masked
rows on every PyTorch version (such rows are unmasked for the kernel and zeroed afterwards, so
no NaN they would make can reach the output or the gradient). A NaN in the inputs still comes out
in the rows that see it, as on every backend: only rows whose mask is all ``False`` (bias all
``-inf``) are zeroed, and on CPU, where the kernel's own causal mode returns 0 for a NaN row, a
causal call with a NaN in its inputs takes an explicit mask.

Grouped-query heads are read in place, never repeated: SDPA's own ``enable_gqa`` (PyTorch 2.5 and
later; before, the keys and values are repeated per query head), and for a few queries on the CPU
(a decode step) the groups folded into the query rows: the ``G`` query heads that share a key/value
head become ``G * Lq`` rows of one call on that head, so the kernel streams each key and value once
(SDPA's own ``enable_gqa`` path on the CPU is slower for a few queries, markedly so in bfloat16; transformers'
``"sdpa"`` takes it for an unpadded batch, and ``attnkit bench hf`` times the two in a model's decode steps).

Such a folded call also answers whether its keys and values are finite, in the same pass
(:meth:`SDPABackend.if_finite`, which :mod:`attnkit.nonfinite` uses instead of a second read of the
cache): one probe row rides along on each key/value head, a query of zeros allowed every key that a row of
its head may see (every key, unless the mask is one row per batch element, which the probe shares). Its score
against ``k_j`` is ``0 * k_j``, which is 0 when ``k_j`` is finite and NaN when it holds a NaN or an
infinity (``0 * inf`` is NaN), and then the probe's row is NaN; its probabilities, uniform, meet every
``v_j`` in the product (``p * inf`` is not finite for any ``p``, zero included). So a finite probe row and
a finite ``q`` mean every input is finite, with no false alarm from large finite keys; anything else
sends the call to the exact path. Keys and values vouched for (:func:`attnkit.nonfinite.vouch`, attnkit's own
KV cache) need no probe: their flag answers, and the call carries none. (A row of ones would not do: a key
of ``-inf`` scores ``-inf``, a weight of 0, and the row stays finite.) This leans on the kernel's products
being IEEE arithmetic that skips no zero, as PyTorch's are; ``tests/backends/test_sdpa.py`` checks it for
every kind of bad key and value, in every dtype and in the kernel's later key blocks.

Plain PyTorch, for a reader (``q [B, H, Lq, D]``, ``k``/``v [B, Hkv, Lk, D]``, ``G = H // Hkv``)::

    rows = torch.cat([q.reshape(B, Hkv, G * Lq, D), q.new_zeros(B, Hkv, 1, D)], 2)
    out = F.scaled_dot_product_attention(rows, k, v)
    out, probe = out[:, :, :-1].reshape(B, H, Lq, -1), out[:, :, -1]

float16 on a CPU without float16 products (:func:`attnkit._cpu.has_fp16_products`) is computed in
float32 and rounded back: PyTorch's CPU kernel accumulates half types in float32 anyway, and its
float16 path is slower than its float32 one there (``attnkit bench dtypes``), for one query too, where the
conversion reads the whole cache: measured over a decode step's cache, the float16 kernel alone still took
longer than converting and running in float32. bfloat16 stays bfloat16, whose CPU path is not slower.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.torch_version import TorchVersion

from .. import _cpu, masks, nonfinite
from ..call import Call
from ..memory import check_dense_fits, check_fits_once
from .reference import expand_kv
from .refusals import Refusal, reasons

#: Whether the torch in use takes ``enable_gqa`` (2.5 and later); tests set it False to run the fallback.
NATIVE_GQA = TorchVersion(torch.__version__) >= (2, 5)
#: The most queries a call folds its query-head groups into (a decode step has one; speculative decoding a few).
FOLD_MAX_QUERIES = 8


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
        return self._run(req)[0], None

    def sees_nonfinite(self, req: Call) -> bool:
        """Whether :meth:`if_finite` can answer for ``req``: a folded call with its probe row (see the module
        docstring)."""
        return _folds(req) and _probes(req)  # _folds first: it is the cheaper question

    def if_finite(self, req: Call) -> tuple[Tensor, None] | None:
        """``self(req)``, or None when ``q`` or the probe row of the same call is not finite (so an input is
        not): :mod:`attnkit.nonfinite` then takes its exact path."""
        out, probe = self._run(req)
        seen = _total(req.query) + _total(probe)
        return (out, None) if math.isfinite(seen.item()) else None

    def check_fits(self, req: Call) -> None:
        """Refuse ``req`` when the attn_mask it would combine (mask, bias and a causal mask) would not fit
        (:mod:`attnkit.memory`); asked while the call is checked (:func:`attnkit.functional.checked`), before a
        KV cache is written."""
        check_fits_once(req, self.name, _check_fits, req)

    def _run(self, req: Call) -> tuple[Tensor, Tensor | None]:
        """The output, and the probe row's output of a folded call (else None)."""
        self.check_fits(req)  # for a caller that runs the backend itself (checked: a look-up)
        plan = _plan(req)
        q, k, v = req.query, req.key, req.value
        if plan.rounded:
            q, k, v = q.float(), k.float(), v.float()
        mask = req.mask
        if plan.causal_mask:
            causal = masks.causal(req.q_len, req.kv_len, device=q.device)
            mask = causal if mask is None else mask & causal
        if plan.fold:
            out, probe = _folded(q, k, v, mask, req, plan.probes)
            return (out.to(torch.float16) if plan.rounded else out), probe
        attn_mask, dead = mask, None
        if req.bias is not None:
            bias = req.bias.to(q.dtype)
            attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
            dead = torch.isneginf(attn_mask).all(dim=-1, keepdim=True)  # a NaN bias is not a mask
            attn_mask = attn_mask.masked_fill(dead, 0.0)
        elif mask is not None:
            dead = ~mask.any(dim=-1, keepdim=True)
            attn_mask = mask | dead
        gqa = {}
        if req.heads != req.kv_heads:
            if NATIVE_GQA:
                gqa = {"enable_gqa": True}
            else:
                k, v = expand_kv(k, req.heads), expand_kv(v, req.heads)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=req.dropout_p,
                                             is_causal=plan.is_causal, scale=req.scale, **gqa)
        if dead is not None:
            out = out.masked_fill(dead, 0.0)
        if plan.is_causal and q.device.type == "cpu":
            # PyTorch's CPU causal kernel returns 0, not NaN, for a query row holding a NaN (a NaN key or
            # value does reach the rows that see it); NaN in, NaN out, in one pass and without a sync
            out = out.masked_fill(q.isnan().any(-1, keepdim=True), float("nan"))
        return (out.to(torch.float16) if plan.rounded else out), None


class _Plan(NamedTuple):
    """How :meth:`SDPABackend._run` runs a call, decided before anything is computed: :meth:`SDPABackend.check_fits`
    sizes what it forms."""

    rounded: bool  #: float16 computed in float32 (the module docstring)
    probes: bool  #: folded, with the probe row
    fold: bool  #: the query-head groups folded into the rows
    is_causal: bool  #: the kernel's own causal mode
    causal_mask: bool  #: causality as an explicit [Lq, Lk] mask instead


def _plan(req: Call) -> _Plan:
    rounded = _rounded(req)
    probes = _folds(req) and _probes(req)
    fold = probes or (_folds(req) and req.heads != req.kv_heads)  # one head each, vouched: nothing to fold
    # One query aligned bottom-right sits after every key: causal masks nothing (a decode step).
    is_causal = req.is_causal and req.q_len > 1
    causal_mask = is_causal and (req.mask is not None or req.bias is not None or req.q_len != req.kv_len or fold)
    return _Plan(rounded, probes, fold, is_causal and not causal_mask, causal_mask)


def _rounded(req: Call) -> bool:
    """Whether ``req`` is float16 computed in float32 (the module docstring)."""
    return req.query.dtype == torch.float16 and req.query.device.type == "cpu" and not _cpu.has_fp16_products()


def _check_fits(req: Call) -> None:
    """Refuse the attn_mask that :meth:`SDPABackend._run` would combine for ``req`` (and its copy) beyond the memory
    limit. Asked of every call SDPA serves, a decode step's included: the plan is worked out only where it decides."""
    shapes = [t.shape for t in (req.mask, req.bias) if t is not None]
    # With a mask or a bias, causality is always one more mask (_plan)
    if req.is_causal and req.q_len > 1 and (shapes or _plan(req).causal_mask):
        shapes.append((req.q_len, req.kv_len))
    if shapes:
        dtype = torch.bool if req.bias is None else torch.float32 if _rounded(req) else req.query.dtype
        shape = shapes[0] if len(shapes) == 1 else masks.broadcast_shape(*shapes)
        check_dense_fits("the SDPA backend's combined attn_mask", shape, dtype, 2)


def _total(x: Tensor) -> Tensor:
    """The sum of ``x``: finite unless an element is not (or it overflows); float16 summed in float32."""
    return x.sum(dtype=torch.float32) if x.dtype == torch.float16 else x.sum()


def _folds(req: Call) -> bool:
    """Whether ``req`` runs folded (module docstring): a few queries on the CPU, 4-D, no bias or dropout."""
    return (req.q_len <= FOLD_MAX_QUERIES and req.query.is_cpu and req.query.dim() == 4 and req.bias is None
            and req.dropout_p == 0.0)


def _probes(req: Call) -> bool:
    """Whether a folded call carries the probe row: unless its keys and values are vouched for
    (:func:`attnkit.nonfinite.vouch`, a KV cache's buffers), whose flag answers for them at no cost. The choice
    follows the tensors, not their values, so a call and its exact path's clean call (vouched alike,
    :func:`attnkit.nonfinite.exact`) compute alike: the probe row changes the rounding of the others."""
    return torch.compiler.is_compiling() or not (nonfinite.is_vouched(req.key) and nonfinite.is_vouched(req.value))


def _folded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, req: Call,
            probe: bool) -> tuple[Tensor, Tensor | None]:
    """SDPA over each key/value head with its query heads' rows and, with ``probe`` (:func:`_probes`), a probe
    row of zeros: ``(out [B, H, Lq, Ev], probe [B, Hkv, 1, Ev] or None)``. ``mask`` (bool, broadcastable to
    ``[B, H, Lq, Lk]``) is the whole mask."""
    b, h, hkv, lq, lk, d = q.shape[0], req.heads, req.kv_heads, req.q_len, req.kv_len, q.shape[-1]
    rows = h // hkv * lq
    probes = int(probe)
    qf = q.reshape(b, hkv, rows, d)
    if probes:
        qf = torch.cat([qf, q.new_zeros(1, 1, 1, 1).expand(b, hkv, 1, d)], 2)  # [B, Hkv, G * Lq + 1, D]
    attn_mask = dead = None
    if mask is not None and mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1:
        # One row per batch element, shared by every head and query (a decode step's padding): the probe takes it
        # as it is, since a key it masks is masked for every row the probe answers for.
        dead = ~mask.any(-1, keepdim=True)
        attn_mask = mask | dead
    elif mask is not None:
        mask = mask.expand(b, h, lq, lk).reshape(b, hkv, rows, lk)
        dead = ~mask.any(-1, keepdim=True)
        attn_mask = torch.cat([mask | dead, mask.new_ones(1, 1, 1, 1).expand(b, hkv, probes, lk)], 2)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False,
                                         scale=req.scale)
    real = out[:, :, :rows]
    if dead is not None:
        real = real.masked_fill(dead, 0.0)
    return real.reshape(b, h, lq, out.shape[-1]), out[:, :, rows:] if probes else None
