"""Pieces the model files share: activations by config name, padding, the backend choice."""

from __future__ import annotations

from torch import Tensor

from .. import backends as _backends
from ..modules import MultiHeadAttention
from ..modules.transformer import ACTIVATIONS

__all__ = ["ACTIVATIONS", "BackendChoice", "check_backend", "real_tokens", "weights_backend"]


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


def weights_backend(need_weights: bool) -> str | None:
    """The per-call backend of a pass: ``"reference"`` when weights are asked for, else ``None``.

    Only the reference backend returns attention weights: ``"auto"`` would find it, but a
    model-wide fused choice (``"sdpa"``) would refuse the call. ``None`` keeps each layer's own
    backend; nothing on the modules changes either way.
    """
    return "reference" if need_weights else None


class BackendChoice:
    """``set_backend`` / ``backend`` for a model whose attention modules all run one backend."""

    def set_backend(self, backend: str):
        """Run every attention module on ``backend`` (``"auto"`` or a registered name); returns self.

        With ``output_attentions=True`` a pass calls the reference backend instead, since fused
        kernels do not return weights (see :func:`weights_backend`).
        """
        check_backend(backend)
        for m in self.modules():
            if isinstance(m, MultiHeadAttention):
                m.backend = backend
        return self

    @property
    def backend(self) -> str:
        """The attention backend of the first attention module (``"auto"`` when there is none)."""
        return next((m.backend for m in self.modules() if isinstance(m, MultiHeadAttention)), "auto")
