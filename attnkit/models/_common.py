"""Pieces the model files share: activations by config name, backend checks, weights on demand."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn.functional as F
from torch import Tensor

from .. import backends as _backends
from ..modules import MultiHeadAttention

#: Hugging Face ``hidden_act`` / ``activation_function`` names -> functions.
ACTIVATIONS = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def real_tokens(attention_mask, b: int, n: int, what: str = "[B, L]") -> Tensor | None:
    """Hugging Face's 0/1 ``attention_mask`` ``[B, n]`` -> bool ``[B, n]`` (``True`` = real token).

    ``None`` when every token is real, so callers keep the unmasked fast path.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (b, n):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be {what} = {(b, n)} with 1 = real token, 0 = padding, got {got}")
    keep = attention_mask != 0
    return None if bool(keep.all()) else keep


def check_backend(backend: str) -> None:
    """``backend`` must be ``"auto"`` or a registered backend name."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto":
        _backends.get(backend)  # raises ValueError listing the registered names


@contextmanager
def weights_backend(attn: MultiHeadAttention) -> Iterator[None]:
    """Within the block, ``attn`` runs on a backend that returns weights.

    Only the reference backend returns attention weights: ``"auto"`` already finds it when weights
    are asked for, while a forced fused backend (``"sdpa"``) would refuse the call, so for that
    call the layer is switched to ``"reference"`` and switched back afterwards.
    """
    saved = attn.backend
    if saved != "auto":
        attn.backend = "reference"
    try:
        yield
    finally:
        attn.backend = saved
