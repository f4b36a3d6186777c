"""Score functions other than scaled dot product; masks and softmax stay the exact engine's.

* ``dot``: ``q . k`` without the ``1/sqrt(E)`` (the form before Vaswani et al. 2017 scaled it).
* ``multiplicative``: Luong et al. 2015's "general" score ``q^T W k``.
* ``additive``: Bahdanau et al. 2015, ``w . tanh(W_q q + W_k k)``; it builds a ``[..., Lq, Lk, A]``
  tensor, which is what makes it costly.

Each returns ``attnkit.attention``'s result, so every mask argument, empty rows and gradients
behave as in exact attention. Plain PyTorch for the additive score, for a reader::

    s = torch.tanh((q @ w_q.T)[..., :, None, :] + (k @ w_k.T)[..., None, :, :]) @ w   # [..., Lq, Lk]
    out = s.masked_fill(~mask, -inf).softmax(-1) @ v
"""

from __future__ import annotations

from torch import Tensor

from ..functional import attention as exact


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
    hidden = (q.unsqueeze(-2) + k.unsqueeze(-3)).tanh()  # [..., H, Lq, Lk, A]
    s = (hidden @ score_vector.unsqueeze(-1).unsqueeze(-3)).squeeze(-1)  # [..., H, Lq, Lk]
    # scale 0 drops the dot product: the scores come in whole as the bias, masked by the engine
    return exact(q.new_zeros(q.shape[:-1] + (1,)), k.new_zeros(k.shape[:-1] + (1,)), v, bias=s * scale, scale=0.0,
                 **masks)
