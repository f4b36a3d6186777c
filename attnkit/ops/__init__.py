"""Numerical building blocks shared by the backends (no validation: callers pass clean inputs)."""

from .softmax import masked_softmax
from .tiles import merge_partials, tile_backward, tile_forward

__all__ = ["masked_softmax", "merge_partials", "tile_backward", "tile_forward"]
