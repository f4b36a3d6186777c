"""Text rules shared by error messages and the pages attnkit writes."""

from __future__ import annotations

from torch import Tensor


def utf8_safe(s: str) -> str:
    """``s`` as text UTF-8 can hold: surrogate pairs joined, lone surrogates as U+FFFD.

    Token strings from byte-level or JavaScript-born vocabularies can hold halves of a pair,
    which no UTF-8 file can store.
    """
    return s.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def describe(x) -> str:
    """What came, for an error message: a tensor's shape and dtype, or any other object's type."""
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)} dtype {x.dtype}"
    return type(x).__name__
