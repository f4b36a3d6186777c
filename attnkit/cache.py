"""A static key/value cache for incremental (token-by-token) decoding.

The buffers are allocated once, at their full size ``max_len``; each step writes the new keys and
values in place and hands back views of the filled prefix. Nothing is reallocated per token, so
the memory footprint is known up front and the cache is friendly to ``torch.compile`` and CUDA
graphs (the torchtune layout: ``cache_pos`` is a 0-d tensor advanced in place).

Shape notation: ``B`` batch, ``Hkv`` key/value heads, ``L`` new tokens, ``D``/``Dv`` key/value
head sizes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ._text import describe

__all__ = ["KVCache", "make_caches"]


def make_caches(attentions: Iterable[nn.Module], batch_size: int, max_len: int, *, dtype=None,
                device=None) -> list[KVCache]:
    """One empty :class:`KVCache` per :class:`~attnkit.MultiHeadAttention`, sized from it.

    ``dtype``/``device`` default to each module's parameters'.
    """
    caches = []
    for a in attentions:
        w = a.q_proj.weight
        caches.append(KVCache(batch_size, max_len, a.num_kv_heads, a.head_dim, a.v_head_dim,
                              dtype=dtype or w.dtype, device=device or w.device))
    return caches


class KVCache(nn.Module):
    """Preallocated keys ``[B, Hkv, max_len, D]`` and values ``[B, Hkv, max_len, Dv]``.

    Pass one per self-attention layer to ``MultiHeadAttention(..., cache=)``: the module projects
    the new tokens, applies any rotary transform at absolute positions ``seq_len ...``, appends
    them here and attends over everything cached so far (causal masks align bottom-right).

    Args:
        batch_size: ``B``.
        max_len: the most tokens the cache can hold.
        num_kv_heads: ``Hkv``.
        head_dim: ``D``.
        v_head_dim: ``Dv`` (default ``head_dim``).
        dtype, device: of the buffers; ``update`` requires the same dtype.

    Raises:
        ValueError: a size that is not a positive int.

    Example::

        cache = KVCache(1, 128, num_kv_heads=4, head_dim=16)
        k_all, v_all = cache.update(k_new, v_new)   # [1, 4, cache.seq_len, 16]
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: int | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
    ) -> None:
        super().__init__()
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        for name, val in (("batch_size", batch_size), ("max_len", max_len), ("num_kv_heads", num_kv_heads),
                          ("head_dim", head_dim), ("v_head_dim", v_head_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        self.batch_size, self.max_len, self.num_kv_heads = batch_size, max_len, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        # Not persistent: a cache is run-time state, not part of a model's checkpoint.
        self.register_buffer("k", torch.zeros(batch_size, num_kv_heads, max_len, head_dim, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("v", torch.zeros(batch_size, num_kv_heads, max_len, v_head_dim, dtype=dtype,
                                              device=device), persistent=False)
        self.register_buffer("cache_pos", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        # A host-side mirror of cache_pos: slicing needs a Python int, and reading the tensor would
        # synchronise with the device on every token.
        self._len = 0

    @property
    def seq_len(self) -> int:
        """How many positions are filled (the absolute position of the next token)."""
        return self._len

    def reset(self) -> None:
        """Forget everything cached (the buffers keep their memory; stale entries are never read)."""
        self._len = 0
        self.cache_pos.zero_()

    def reorder(self, index: Tensor) -> None:
        """Row ``i`` takes row ``index[i]``'s cached keys and values, in place (beam search: each
        hypothesis continues the one it extends; rows may repeat).

        Raises:
            ValueError: ``index`` is not an int64 tensor ``[B]`` with entries in ``[0, B)``.
        """
        b = self.batch_size
        if not isinstance(index, Tensor) or index.shape != (b,) or index.dtype != torch.long:
            raise ValueError(f"index must be an int64 tensor of shape [{b}] (batch_size), got {describe(index)}")
        if bool(((index < 0) | (index >= b)).any()):
            raise ValueError(f"index entries must be in [0, {b}), got {index.tolist()}")
        n = self._len  # only the filled prefix: stale positions are never read
        index = index.to(self.k.device)
        self.k[:, :, :n].copy_(self.k[:, :, :n].index_select(0, index))
        self.v[:, :, :n].copy_(self.v[:, :, :n].index_select(0, index))

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``L`` new positions and return the filled prefix.

        Args:
            k: ``[B, Hkv, L, D]`` new keys (already position-transformed, e.g. rotated).
            v: ``[B, Hkv, L, Dv]`` new values.

        Returns:
            ``(k_all, v_all)``: views ``[B, Hkv, seq_len, D]`` and ``[B, Hkv, seq_len, Dv]`` of the
            buffers, ``seq_len`` counting the new tokens.

        Raises:
            ValueError: shapes that do not match the cache, or more tokens than ``max_len`` holds.
            TypeError: a dtype other than the cache's.
        """
        for name, t, d, buf in (("k", k, self.head_dim, self.k), ("v", v, self.v_head_dim, self.v)):
            if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[0] != self.batch_size or \
                    t.shape[1] != self.num_kv_heads or t.shape[3] != d:
                got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{name} must be [B, Hkv, L, {'D' if name == 'k' else 'Dv'}] = "
                                 f"[{self.batch_size}, {self.num_kv_heads}, L, {d}], got {got}")
            if t.dtype != buf.dtype:
                raise TypeError(f"{name} dtype {t.dtype} does not match the cache dtype {buf.dtype}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(f"k and v must hold the same number of new tokens, got k {tuple(k.shape)}, "
                             f"v {tuple(v.shape)}")
        pos, n = self._len, k.shape[2]
        if pos + n > self.max_len:
            raise ValueError(f"KVCache overflow: {pos} cached + {n} new tokens > max_len {self.max_len}; "
                             "allocate a longer cache or call reset()")
        self.k[:, :, pos:pos + n].copy_(k)
        self.v[:, :, pos:pos + n].copy_(v)
        self._len = pos + n
        self.cache_pos.add_(n)
        return self.k[:, :, :pos + n], self.v[:, :, :pos + n]

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, max_len={self.max_len}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, dtype={self.k.dtype}")
