"""``nn.Module`` wrappers: they own parameters, reshape ``[B, L, E] <-> [B, H, L, D]`` and call the core."""

from .attention import MultiHeadAttention

__all__ = ["MultiHeadAttention"]
