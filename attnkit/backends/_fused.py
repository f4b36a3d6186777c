"""PyTorch's fused CPU attention kernel as the inner step of the "fused_tiles" backend.

When no ``score_mod`` needs the scores as a tensor, a batch of chunks is one call of the CPU
flash-attention kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``): it forms
``softmax(q k^T + mask) v`` and the log-sum-exp block by block in cache, where the plain path
makes a matmul, a mask pass, a softmax and two reductions over a tile bigger than the cache. The
tile schedule still decides which keys each tile sees, so empty tiles stay skipped; the kernel
only replaces the arithmetic inside a chunk.

Its backward takes a row's output and log-sum-exp and recomputes the probabilities from them.
Handed the *merged* output and log-sum-exp of the whole row, it returns exactly this chunk's
share of the gradients (FlashAttention-2's backward over a subset of keys), so chunks of a row
need no extra bookkeeping.

The kernel is private to PyTorch, so :func:`available` checks it once against the formula on a
case that exercises what the backend relies on (a fully masked row, a mask broadcast over heads,
strided key views, the backward from given statistics, the causal mode on a square block) and
the backend falls back to the plain path if anything differs. A row with nothing to attend
gives log-sum-exp 0 from the kernel (torch 2.13); callers pass ``dead`` rows and get
``(0, -inf)``, like the plain path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._tracing import assume_constant_result, real_tensors
from ._build import once

_NEG_INF = float("-inf")


def _op(name: str):
    try:  # some torch versions raise RuntimeError, not AttributeError, for a missing op
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


_FWD = _op("_scaled_dot_product_flash_attention_for_cpu")
_BWD = _op("_scaled_dot_product_flash_attention_for_cpu_backward")
DTYPES = (torch.float32, torch.float64)


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernel serves tensors of this device and (compute) dtype."""
    return device.type == "cpu" and dtype in DTYPES and available()


def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dead: Tensor | None,
            scale: float, causal: bool = False) -> tuple[Tensor, Tensor]:
    """``softmax(q k^T * scale + mask) v`` and its log-sum-exp (``causal``: top-left, L == S).

    ``q [N, M, L, E]``, ``k [N, M, S, E]``, ``v [N, M, S, Ev]``; ``mask`` additive ``0/-inf``
    broadcasting to ``[N, M, L, S]``; ``dead`` (``[N|1, M|1, L]``) rows that attend nothing.
    """
    if k.shape[-2] == 0:  # the kernel divides by the key length (SIGFPE): nothing to attend
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_full(q.shape[:-1], _NEG_INF)
    out, lse = _FWD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    if dead is not None:
        out = out.masked_fill(dead.unsqueeze(-1), 0.0)
        lse = lse.masked_fill(dead, _NEG_INF)
    return out, lse


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             mask: Tensor | None, scale: float, causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """This chunk's ``(dq, dk, dv)`` given the row's merged ``out`` and finite ``lse``."""
    if k.shape[-2] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _BWD(dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def dead_rows(mask: Tensor | None) -> Tensor | None:
    """Rows of an additive mask with every column ``-inf``, or None when there are none."""
    if mask is None:
        return None
    dead = torch.isneginf(mask).all(-1)
    return dead if bool(dead.any()) else None


@assume_constant_result  # asked once while tracing, not traced (it runs a self-check)
def available() -> bool:
    """True when this torch has the kernel and it agrees with the formula (checked once)."""
    return _checked()


@once  # threads asking first together wait for one self-check
def _checked() -> bool:
    if _FWD is None or _BWD is None:
        return False
    try:
        with real_tensors():
            return _self_check()
    except Exception:  # noqa: BLE001 - any failure of a private op means: use the plain path
        return False


def _self_check() -> bool:
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=f64)
    base = torch.randn(2, 3, 9, 4, generator=g, dtype=f64)
    k = base.as_strided((2, 3, 6, 4), base.stride(), 4)  # a strided view, like a chunk's keys
    v = torch.randn(2, 3, 6, 4, generator=g, dtype=f64)
    mask = torch.zeros(2, 1, 5, 6, dtype=f64)
    mask[0, :, 1] = _NEG_INF  # a dead row
    mask[1, :, :, 2:] = _NEG_INF
    dead = dead_rows(mask)
    out, lse = forward(q, k, v, mask, dead, 1.0)
    s = q @ k.transpose(-2, -1) + mask
    want_lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
    if not (torch.allclose(out, p @ v, atol=1e-12) and torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
            and torch.allclose(lse[~dead.expand_as(lse)], want_lse[~dead.expand_as(lse)], atol=1e-12)):
        return False
    dout = torch.randn(out.shape, generator=g, dtype=f64)
    kc = k.contiguous()
    dq, dk, dv = backward(dout, q, kc, v, out, torch.where(torch.isfinite(lse), lse, 0.0), mask, 1.0)
    dp = dout @ v.transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True))
    if not (torch.allclose(dq, ds @ kc, atol=1e-10) and torch.allclose(dk, ds.transpose(-2, -1) @ q, atol=1e-10)
            and torch.allclose(dv, p.transpose(-2, -1) @ dout, atol=1e-10)):
        return False
    # The kernel's own causal mask on a square block is the additive one with -inf above the diagonal.
    square = torch.zeros(5, 5, dtype=f64).masked_fill_(torch.ones(5, 5, dtype=torch.bool).triu_(1), _NEG_INF)
    got, got_lse = forward(q, v[:, :, :5], v[:, :, :5], None, None, 0.5, causal=True)
    want, want_lse = forward(q, v[:, :, :5], v[:, :, :5], square, None, 0.5)
    gq = backward(dout, q, v[:, :, :5], v[:, :, :5], want, want_lse, None, 0.5, causal=True)
    wq = backward(dout, q, v[:, :, :5], v[:, :, :5], want, want_lse, square, 0.5)
    return (torch.allclose(got, want, atol=1e-12) and torch.allclose(got_lse, want_lse, atol=1e-12)
            and all(torch.allclose(a, b, atol=1e-10) for a, b in zip(gq, wq, strict=True)))
