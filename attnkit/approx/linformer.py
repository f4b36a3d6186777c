"""Linformer (Wang et al. 2020): keys and values projected along the sequence to ``k`` rows.

Plain PyTorch, for a reader (``E``, ``F`` learned ``[k, max_len]``, sliced to ``n`` columns)::

    out = softmax(s Q (E K)^T) (F V)       # [n, k] scores instead of [n, n]

The projections are parameters of a given maximum length; they are trained with the model, so a
trained network swapped to Linformer without retraining sees random projections.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..functional import attention as exact


class LinformerProjection(nn.Module):
    """The two sequence projections ``E``, ``F`` ``[k, max_len]``, initialised ``N(0, 1/k)`` as in the paper.

    Args:
        max_len: the longest key sequence it serves.
        k: projected length.
    """

    def __init__(self, max_len: int, k: int, *, device=None, dtype=None) -> None:
        super().__init__()
        for name, val in (("max_len", max_len), ("k", k)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"linformer: {name} must be an int >= 1, got {val!r}")
        self.max_len, self.k = max_len, k
        self.e = nn.Parameter(torch.randn(k, max_len, device=device, dtype=dtype) / k ** 0.5)
        self.f = nn.Parameter(torch.randn(k, max_len, device=device, dtype=dtype) / k ** 0.5)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, k={self.k}"


def check_projection(projection, n: int) -> None:
    """Raise unless ``projection`` is a :class:`LinformerProjection` that serves ``n`` keys."""
    if not isinstance(projection, LinformerProjection):
        raise TypeError(f"linformer: projection must be a LinformerProjection, got {type(projection).__name__}")
    if n > projection.max_len:
        raise ValueError(f"linformer: key length {n} exceeds the projections' max_len {projection.max_len}; "
                         "build LinformerProjection with a larger max_len")


def linformer_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, projection: LinformerProjection) -> Tensor:
    """``q [..., H, Lq, E]``, ``k``/``v`` ``[..., H, Lk, *]`` -> ``[..., H, Lq, Ev]``."""
    n = k.shape[-2]
    check_projection(projection, n)
    e, f = projection.e[:, :n].to(k.dtype), projection.f[:, :n].to(v.dtype)
    return exact(q, e @ k, f @ v, scale=scale)  # (E K), (F V): [..., H, k, *]
