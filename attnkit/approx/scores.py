"""Score functions other than scaled dot product; masks and softmax stay the exact engine's.

* ``dot``: ``q . k`` without the ``1/sqrt(E)`` (the form before Vaswani et al. 2017 scaled it).
* ``multiplicative``: Luong et al. 2015's "general" score ``q^T W k``.
* ``additive``: Bahdanau et al. 2015, ``w . tanh(W_q q + W_k k)``: ``Lq * Lk * A`` tanh, which is what
  makes it costly. The ``[..., Lq, Lk, A]`` tensor of the formula below is never held whole: the
  scores are built a block of query rows at a time and the backward recomputes each block
  (:class:`AdditiveScores`), so memory is the ``[..., Lq, Lk]`` scores, as for a dot product.

Each returns ``attnkit.attention``'s result, so every mask argument, empty rows and gradients
behave as in exact attention. Plain PyTorch for the additive score, for a reader::

    s = torch.tanh((q @ w_q.T)[..., :, None, :] + (k @ w_k.T)[..., None, :, :]) @ w   # [..., Lq, Lk]
    out = s.masked_fill(~mask, -inf).softmax(-1) @ v
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..functional import attention as exact

#: elements of one block of the ``[..., rows, Lk, A]`` tanh tensor: 1 MiB in float32, so it stays in cache
#: (larger blocks spill and measured slower: ``attnkit bench approx``)
BLOCK_ELEMENTS = 1 << 18


def dot_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, **masks) -> Tensor:
    return exact(q, k, v, scale=scale, **masks)


def multiplicative_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, weight: Tensor, **masks) -> Tensor:
    """``weight`` ``[E, E]`` or per head ``[H, E, E]``: score ``q^T W k * scale``."""
    return exact(q @ weight, k, v, scale=scale, **masks)


def additive_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, score_vector: Tensor,
                       query_weight: Tensor | None = None, key_weight: Tensor | None = None, **masks) -> Tensor:
    """``score_vector`` ``[A]`` (or ``[H, A]``), ``query_weight``/``key_weight`` ``[A, E]`` (or ``[H, A, E]``;
    ``None``: identity, when q and k are already projected): score ``scale * w . tanh(W_q q + W_k k)``."""
    if query_weight is not None:
        q = q @ query_weight.transpose(-2, -1)  # [..., H, Lq, A]
    if key_weight is not None:
        k = k @ key_weight.transpose(-2, -1)  # [..., H, Lk, A]
    s = AdditiveScores.apply(q, k, score_vector)  # [..., H, Lq, Lk]
    # scale 0 drops the dot product: the scores come in whole as the bias, masked by the engine
    return exact(q.new_zeros(q.shape[:-1] + (1,)), k.new_zeros(k.shape[:-1] + (1,)), v, bias=s * scale, scale=0.0,
                 **masks)


class AdditiveScores(torch.autograd.Function):
    """``s[..., i, j] = w . tanh(q_i + k_j)`` for ``q [..., Lq, A]``, ``k [..., Lk, A]``, ``w [A]`` or ``[H, A]``.

    Forward and backward walk blocks of query rows, so the ``tanh`` tensor exists one block at a
    time (:data:`BLOCK_ELEMENTS`); the backward recomputes it from ``q``, ``k`` and ``w``::

        ds/dq_i = sum_j g_ij,  ds/dk_j = sum_i g_ij,  with g_ij = ds_ij * w * (1 - tanh(q_i + k_j)^2)
        ds/dw = sum_ij ds_ij * tanh(q_i + k_j)

    Every block is written into buffers allocated once: a fresh block-sized tensor per block, freed
    between small allocations, fragments the heap (measured: 1 GiB resident for 16 MiB of scores).
    """

    @staticmethod
    def _blocks(q: Tensor, k: Tensor, w: Tensor):
        """``(row ranges, tanh buffer, scratch buffer)`` for blocks of query rows."""
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], w.shape[:-1])
        lq, lk, a = q.shape[-2], k.shape[-2], k.shape[-1]
        rows = max(1, min(lq, BLOCK_ELEMENTS // max(1, lead.numel() * lk * a)))
        ranges = [(i, min(i + rows, lq)) for i in range(0, lq, rows)]
        return ranges, q.new_empty(lead + (rows, lk, a)), q.new_empty(lead + (rows, lk, a))

    @staticmethod
    def _tanh(q: Tensor, k: Tensor, rows: tuple[int, int], buffer: Tensor) -> Tensor:
        h = buffer[..., :rows[1] - rows[0], :, :]
        torch.add(q[..., rows[0]:rows[1], :].unsqueeze(-2), k.unsqueeze(-3), out=h)
        return h.tanh_()  # [..., rows, Lk, A]

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(q, k, w)
        ranges, buffer, _ = AdditiveScores._blocks(q, k, w)
        column = w.unsqueeze(-1).unsqueeze(-3)  # [A, 1] -> [1, A, 1]; [H, A] -> [H, 1, A, 1]
        s = q.new_empty(buffer.shape[:-3] + (q.shape[-2], k.shape[-2]))
        for r in ranges:
            s[..., r[0]:r[1], :] = (AdditiveScores._tanh(q, k, r, buffer) @ column).squeeze(-1)
        return s

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, ds: Tensor):
        q, k, w = ctx.saved_tensors
        wide = w.unsqueeze(-2).unsqueeze(-2)  # [1, 1, A] or [H, 1, 1, A]: w beside each cell's tanh
        ranges, buffer, scratch = AdditiveScores._blocks(q, k, w)
        dq, dk, dw = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(w)
        for r in ranges:
            h = AdditiveScores._tanh(q, k, r, buffer)
            ds_rows = ds[..., r[0]:r[1], :].unsqueeze(-2)  # [..., rows, 1, Lk]
            dw += (ds_rows @ h).sum((-3, -2)).sum_to_size(w.shape)  # sum_j ds_ij tanh_ij, over the rows
            g = torch.mul(h, h, out=scratch[..., :r[1] - r[0], :, :]).neg_().add_(1).mul_(wide)
            g.mul_(ds_rows.transpose(-2, -1))  # g_ij
            dq[..., r[0]:r[1], :] = g.sum(-2).sum_to_size(dq[..., r[0]:r[1], :].shape)
            dk += g.sum(-3).sum_to_size(k.shape)
        return dq, dk, dw
