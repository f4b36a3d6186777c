"""A static key/value cache for incremental (token-by-token) decoding.

The buffers are allocated once, at their full size ``max_len``; each step writes the new keys and
values in place, at the positions the tensor ``cache_pos`` holds (``index_copy_``), and hands back
the whole buffers with the written length as a tensor. Every step therefore sees the same shapes
(``[B, Hkv, max_len, D]``) and the same storage, whatever the position; what the attention must not
read (the unwritten tail, and with causal masking the keys after each query) is a bool mask built
from that length on the device (:func:`visible`), which every backend takes. That is the compiled
path; eagerly, :class:`~attnkit.MultiHeadAttention` attends over the written part only (a view of
the buffers, which the cache's finiteness flag covers too), with no mask for the tail.

What this makes friendly to ``torch.compile`` and CUDA graphs, and what not yet:

* fixed: the buffers' shapes and addresses, the write (``index_copy_`` at a position tensor, no
  host slicing), the returned shapes, and the visibility mask (computed from the length tensor);
* on the host in eager code only: :attr:`KVCache.seq_len`, a Python mirror of ``cache_pos`` for
  the overflow check, position offsets and the slicing of returned weights. Under
  ``torch.compile`` a step reads the length as a tensor (:meth:`KVCache.position`: rotary
  offsets, the visibility mask) and leaves the mirror to be read back once afterwards, so one
  compiled graph serves every token; what needs the length as a number there (returned weights,
  a ``key_mask``, a relative-position bias, an approximate kind) is refused with a clear error, and
  a write past ``max_len`` fails in the write's bounds check instead of the overflow check.

Shape notation: ``B`` batch, ``Hkv`` key/value heads, ``L`` new tokens, ``D``/``Dv`` key/value
head sizes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from . import masks as _masks
from . import nonfinite
from ._text import describe

__all__ = ["KVCache", "Cached", "visible", "make_caches"]


class Cached(NamedTuple):
    """What :meth:`KVCache.update` returns: the whole buffers and how much of them is written."""

    k: Tensor  #: ``[B, Hkv, max_len, D]``
    v: Tensor  #: ``[B, Hkv, max_len, Dv]``
    length: Tensor  #: 0-d int64: positions ``0 ... length - 1`` are written (the new tokens included)
    seq_len: int | None  #: the same length on the host (None under ``torch.compile``: see :meth:`KVCache.position`)


def visible(cached: Cached, q_len: int, *, causal: bool, window=None) -> Tensor:
    """Bool ``[1, 1, Lq, max_len]``, ``True`` where a call on ``cached`` buffers may attend.

    The ``Lq`` new queries sit at absolute positions ``length - Lq ... length - 1`` (bottom-right
    alignment to the written length, not to the buffer size). Query ``i`` may attend key ``j`` when
    ``j < length`` and what ``causal`` and ``window`` (``(left, right)``, checked) allow at that
    offset, as :mod:`attnkit.masks`' causal and window predicates say. Built on the buffers' device
    from the length tensor, in a shape that depends on ``Lq`` and ``max_len`` only (a compiled decode
    step does not specialise on the length); a dense mask because every backend takes one (SDPA
    takes no mask_mod), and the banded kernel reads its rows as intervals.
    """
    dev = cached.k.device
    q_idx = torch.arange(q_len, device=dev).view(1, 1, -1, 1)
    kv_idx = torch.arange(cached.k.shape[-2], device=dev).view(1, 1, 1, -1)  # the whole buffer
    offset = cached.length - q_len  # 0-d: position of query 0
    allowed = (kv_idx < cached.length).expand(1, 1, q_len, -1)
    if causal:
        allowed = allowed & _masks.causal_mod(offset)(None, None, q_idx, kv_idx)
    if window is not None:
        allowed = allowed & _masks.window_mod(*window, offset=offset)(None, None, q_idx, kv_idx)
    return allowed  # (1, 1, Lq, max_len)


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
    the new tokens, applies any rotary transform at absolute positions ``seq_len ...``, checks the
    whole call, writes them here and attends over what is written (causal masks align bottom-right to
    the written length). Eagerly that is the written part of the buffers, a view, with no mask for the
    unwritten tail; under ``torch.compile`` it is the whole buffers (fixed shapes), the tail masked out
    by :func:`visible`.

    :attr:`finite` (a 0-d bool buffer) says whether everything written since the last :meth:`reset` is finite.

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
        k_all, v_all, length, _ = cache.update(k_new, v_new)   # [1, 4, 128, 16]; length = cache.seq_len
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
        # The written length, on the buffers' device: where the next write goes.
        self.register_buffer("cache_pos", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        # Its host mirror, for what needs a Python int (the overflow check, position offsets):
        # reading the tensor would synchronise with the device on every token.
        self._len = 0
        # Whether everything written since the last reset is finite: attention's finiteness check
        # (attnkit.nonfinite) then reads only each step's new tokens, not the whole buffers.
        self.register_buffer("finite", torch.ones((), dtype=torch.bool, device=device), persistent=False)
        self._vouched: tuple | None = None  # the buffers' versions when last vouched for
        self._vouch()

    @property
    def seq_len(self) -> int:
        """How many positions are filled (the absolute position of the next token)."""
        if self._len is None:  # compiled steps wrote the tensor only: read it once
            self._len = int(self.cache_pos)
        return self._len

    def position(self) -> int | Tensor:
        """The absolute position of the next token: :attr:`seq_len`, except under ``torch.compile``,
        where it is a copy of the 0-d tensor ``cache_pos``, so that a compiled step does not
        specialise on the length (one graph serves every token)."""
        return self.cache_pos.clone() if torch.compiler.is_compiling() else self.seq_len

    def reset(self) -> None:
        """Forget everything cached: the buffers keep their memory and are zeroed, so that nothing of an
        earlier sequence (a NaN token, say) stays behind them. The attention masks the unwritten tail anyway;
        zeros also keep it out of the one finiteness check each call makes (:mod:`attnkit.nonfinite`)."""
        self._len = 0
        self.cache_pos.zero_()
        self.k.zero_()
        self.v.zero_()
        self.finite.fill_(True)
        self._vouch()

    def crop(self, length: int) -> None:
        """Forget every position from ``length`` on, keeping the first ``length`` (speculative decoding taking back
        rejected tokens, or going back to a shared prompt). What is freed is zeroed, as :meth:`reset` zeroes it.

        Raises:
            ValueError: ``length`` is not an int in ``[0, seq_len]``.
        """
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= self.seq_len:
            raise ValueError(f"length must be an int in [0, {self.seq_len}] (seq_len), got {length!r}")
        if length == self.seq_len:
            return
        self._recheck()
        self.k[:, :, length:self.seq_len].zero_()
        self.v[:, :, length:self.seq_len].zero_()
        if not bool(self.finite):  # what is left may be finite again: read it
            self.finite.copy_(nonfinite.finite(self.k) & nonfinite.finite(self.v))
        self._len = length
        self.cache_pos.fill_(length)
        self._vouch()

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
        index = index.to(self.k.device)
        self._recheck()
        self.k.copy_(self.k.index_select(0, index))  # whole buffers: the unwritten tail is never read
        self.v.copy_(self.v.index_select(0, index))
        self._vouch()  # rows of finite buffers are finite

    def update(self, k: Tensor, v: Tensor) -> Cached:
        """Write ``L`` new positions at ``cache_pos`` and return the whole buffers.

        Args:
            k: ``[B, Hkv, L, D]`` new keys (already position-transformed, e.g. rotated).
            v: ``[B, Hkv, L, Dv]`` new values.

        Returns:
            :class:`Cached` ``(k, v, length, seq_len)``: the buffers ``[B, Hkv, max_len, D]`` and
            ``[B, Hkv, max_len, Dv]`` (the same shapes and storage at every step) and the written
            length counting the new tokens, as a 0-d tensor and as an int. Attend with the mask
            :func:`visible` gives, so that the unwritten tail is not read.

        Raises:
            ValueError: shapes that do not match the cache, or more tokens than ``max_len`` holds.
            TypeError: a dtype other than the cache's.
        """
        self.check_update(k, v)
        n = k.shape[2]
        if torch.compiler.is_compiling():
            # The length stays a tensor; a write past the end fails in index_copy_'s bounds check.
            self._len = None
        else:
            self._len = self.seq_len + n
        where = self.cache_pos + torch.arange(n, device=self.cache_pos.device)  # (L,) positions to write
        self._recheck()
        self.finite.logical_and_(nonfinite.finite(k) & nonfinite.finite(v))
        self.k.index_copy_(2, where, k)
        self.v.index_copy_(2, where, v)
        self._vouch()
        self.cache_pos.add_(n)
        return Cached(self.k, self.v, self.cache_pos.clone(), self._len)

    def check_update(self, k: Tensor, v: Tensor) -> None:
        """Raise what :meth:`update` would raise for ``k`` and ``v``, writing nothing (a caller that must refuse
        a step whole checks it first). Under ``torch.compile`` the room left is not checked (see :meth:`update`).
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
        if not torch.compiler.is_compiling() and self.seq_len + k.shape[2] > self.max_len:
            raise ValueError(f"KVCache overflow: {self.seq_len} cached + {k.shape[2]} new tokens > max_len "
                             f"{self.max_len}; allocate a longer cache or call reset()")

    def _vouch(self) -> None:
        """Tell attention's finiteness check what :attr:`finite` says of the buffers as they are now
        (eager only: under torch.compile the writes void it, and the next eager call reads the buffers)."""
        if not torch.compiler.is_compiling():
            nonfinite.vouch(self.finite, self.k, self.v)  # one flag for both: the check reads it once
            self._vouched = self._versions()

    def _recheck(self) -> None:
        """Work :attr:`finite` out from the whole buffers again when they were written since they were
        vouched for by anything but this cache (a hand-made write, a compiled step)."""
        if not torch.compiler.is_compiling() and self._versions() != self._vouched:
            self.finite.copy_(nonfinite.finite(self.k) & nonfinite.finite(self.v))

    def _versions(self) -> tuple | None:
        try:
            return self.k._version, self.v._version
        except RuntimeError:  # inference tensors keep no version counter: nothing was vouched for
            return self._vouched

    def extra_repr(self) -> str:
        return (f"batch_size={self.batch_size}, max_len={self.max_len}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, dtype={self.k.dtype}")
