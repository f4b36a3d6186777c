"""Wording shared by error messages."""

from __future__ import annotations

from torch import Tensor


def describe(x) -> str:
    """What came, for an error message: a tensor's shape and dtype, or any other object's type."""
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)} dtype {x.dtype}"
    return type(x).__name__
