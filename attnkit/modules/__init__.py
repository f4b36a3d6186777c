"""``nn.Module`` wrappers: they own parameters, reshape ``[B, L, E] <-> [B, H, L, D]`` and call the core."""

from .attention import MultiHeadAttention
from .transformer import (
    FeedForward,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from .transformer_interop import from_torch_attn_mask

__all__ = [
    "FeedForward",
    "MultiHeadAttention",
    "Transformer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "from_torch_attn_mask",
]
