"""Softmax over the last dimension that is safe for masked and entirely masked rows."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_softmax(scores: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Softmax over the last dim, ignoring cells where ``allowed`` is False.

    A row with no allowed cell (or whose scores are all ``-inf``) gives all zeros, with a zero
    gradient, instead of NaN. No ``-1e9``-style constant is used, so nothing overflows in
    float16: masked cells become ``-inf``, the row maximum is taken over what is left, and a row
    whose maximum is ``-inf`` is shifted by 0 so that ``exp`` gives exact zeros.

    Plain-PyTorch equivalent for rows that have at least one allowed cell::

        torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    """
    if scores.shape[-1] == 0:
        return scores
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    # The shift only guards exp() against overflow; softmax does not depend on it, so it is
    # detached: no gradient flows through the max.
    m = scores.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s == 0, torch.ones_like(s), s)  # a NaN sum stays NaN: the row's NaN is not hidden
