"""A banded attention kernel in C++ for masks whose rows are a few intervals of keys, on CPU, compiled at install.

Under a window, causal, prefix-LM, padding or packed-documents mask the keys a query sees are one
contiguous range; under a window plus global tokens, a dilated or strided pattern or a block
layout, a few. The mask plan (:mod:`attnkit.maskplan`) gives each row's intervals, and a block of 64
query rows needs exactly the union of its rows' intervals: 576 keys for a 64-row block of a
513-wide band, 89% of them visible. :mod:`._fused` hands PyTorch's flash kernel such tiles too,
but that kernel works on 32-row slices below 192 rows, splits keys at 512 and goes through Python
between batches; the kernel (``csrc/band/``) does the whole call in one parallel loop, with the rows' exact key
ranges, over the BLAS that torch links. Forward and a FlashAttention-2 backward (recomputing
probabilities from the saved log-sum-exp, each key block owning its dK/dV, dQ rows added under
locks; under `torch.use_deterministic_algorithms(True)` dQ comes from a row-owned pass instead,
bitwise repeatable at a given thread count). Scores may be soft-capped, ``c * tanh(t / c)`` after
the scale and bias (Gemma 2's attention logit capping), forward and backward. Rows that see every
d-th key of their own class of positions mod d (a dilated window) are folded, each class a batch
element of its own where the mask is a plain band (:func:`_dilation`), which skips the gaps instead of walking
them (``attnkit bench blockwise`` has the dilated row).

The sources (one translation unit per role: ``csrc/band/kernel.h`` lists them) are compiled when attnkit is
installed (``setup.py``, against the torch installed then: ``pip install --no-build-isolation``) into
``attnkit.backends._band_kernel``, beside its build record; a process loads that module once the record names
this process's sources, torch version, CPU capability and flags (:mod:`._band_sources`) and the module's bytes
match the record's SHA-256. Where it is missing (installed without a compiler, or by an isolated build) or was
built for another torch, the kernel is compiled on first use instead, once per sources, torch version and CPU
capability (minutes: a :class:`._build.BuildWarning` says so first; one process builds while others wait) into
``$ATTNKIT_CACHE`` (default ``~/.cache/attnkit``, which must be private to the user) and loaded from there
afterwards once its recorded SHA-256 matches; :mod:`._build` does the loading and caching and says how.
``ATTNKIT_BUILD=0`` forbids compiling (a cached build is still used); a failed build is not retried for an
hour unless ``ATTNKIT_BUILD=1``. If anything fails (no compiler, a cache folder others may write to, a torch
without the BLAS symbols, a self-check against the formula that does not match), :func:`available` is False,
the reason is in :func:`unavailable_reason` (and in one warning), and the blockwise backend uses its other
paths. The module is loaded and self-checked once per process, under a lock (:func:`._build.once`): threads
making their first call together wait for that one load and all get the module (or the same reason).

Both operators check every argument before touching memory and name the one that does not fit
("What they check", above the operators below).

bfloat16 and float16 inputs can go through products of their own type (:func:`half_products`): bfloat16 through
oneDNN's batch-reduce GEMM micro-kernel as torch exports it (``at::native::cpublas::brgemm``, where it runs:
AVX512-BF16 without AMX), else through MKL's ``cblas_gemm_bf16bf16f32`` and ``cblas_gemm_f16f16f32`` where torch
exports them: the kernel reads q, k and v (and, in the backward, the output's gradient) as they are stored, and
every product of a tile (two in the forward, five in the backward) takes half operands into float32 sums (a
product of two such numbers is exact in float32); the softmax, the accumulator and the gradients' sums stay
float32, and the weights (and in the backward dS) are rounded to the half type for the products that take them,
as FlashAttention does on a GPU. That is for a CPU that multiplies the type natively (AVX512-BF16 or AMX-BF16;
AVX512-FP16 or AMX-FP16), which runs the products at their speed (MKL's bfloat16 product did not on an AMD CPU
with AVX512-BF16; oneDNN's does); elsewhere the operands are widened inside the product and the float32 products
are faster (``attnkit bench dtypes`` times both). So each type's products are on, once their own self-check
passes, where the CPU's flags say it has them (:mod:`attnkit._cpu`); ``ATTNKIT_BF16_PRODUCTS`` and
``ATTNKIT_FP16_PRODUCTS`` (``1`` or ``0``, read then) turn them on or off anyway, and so does
:func:`set_half_products`. Without them a half-precision call is exactly the float32 kernel on the same values,
rounded once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _cpu
from .._tracing import assume_constant_result, real_tensors
from ..call import Call
from ..dtypes import HALF, compute_dtype
from . import _band_sources, _build

#: Where ``setup.py`` puts the module it builds at install, and its build record.
INSTALLED = Path(__file__).with_name(f"{_band_sources.MODULE}{_build.SUFFIX}")
INSTALLED_RECORD = Path(__file__).with_name(_band_sources.RECORD)
#: Forward: query rows per block and most keys per chunk. Backward: keys per block and most
#: queries per chunk. Chosen on this 2-core machine (window 256, n = 8192): 32-64 rows within 3%,
#: 128 rows 5-10% slower (more of the band's corners computed).
Q_ROWS, KV_CHUNK = 64, 1024
KV_ROWS, Q_CHUNK = 64, 1024
DTYPES = (torch.float32, torch.float64)

logger = logging.getLogger(__name__)
_reason: str | None = None
_reports = False  # reports_nonfinite(): set once by _checked()
#: Per half type, how its products are named: the compiled module's tag (``set_<tag>_products``,
#: ``<tag>_products``, ``has_<tag>_gemm``), the environment variable that forces them on or off, whether the CPU
#: multiplies that type natively, and the flags that say so.
_HALF_PRODUCTS = {torch.bfloat16: ("bf16", "ATTNKIT_BF16_PRODUCTS", _cpu.has_bf16_products, "AVX512-BF16 or AMX-BF16"),
                  torch.float16: ("f16", "ATTNKIT_FP16_PRODUCTS", _cpu.has_fp16_products, "AVX512-FP16 or AMX-FP16")}
_f32_products = "BLAS sgemm"  # float32_products(): set once by _checked()
_products_ok: dict[torch.dtype, bool] = {}  # a half type's products exist and passed their self-check (_checked())
_products_reason: dict[torch.dtype, str | None] = {}  # why half_products(dtype) is False, once _checked() ran


class BandInputs(NamedTuple):
    """What the kernel needs beyond q, k, v: each query row's keys as intervals (``starts``,
    ``ends``: int64 ``[P, Lq, K]``, ``P`` 1, B or B*H, the convention of :mod:`attnkit.maskplan`), the
    score_mod's table per head and diagonal (``diagonal_table``: ``[1 or H, Lq + Lk - 1]``, added to the score
    of query i and key j at column ``j - i + Lq - 1``, with autograd; None without a score_mod; not a call's
    dense ``bias``, which this kernel refuses) and the soft-cap ``c`` of the scores (``t -> c * tanh(t / c)``
    after scale and the table; 0 for none)."""

    starts: Tensor
    ends: Tensor
    diagonal_table: Tensor | None
    softcap: float = 0.0


@assume_constant_result  # asked once while tracing, not traced (it builds and self-checks)
def available() -> bool:
    """Whether the kernel is built (building it now if needed) and passed its self-check."""
    return _checked() is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or was not asked yet)."""
    return _reason


def attention(req: Call, inputs: BandInputs) -> Tensor:
    """The request's output through the kernel (differentiable in q, k, v and the bias's tensors).

    ``inputs``: what the band backend worked out for ``req``.
    """
    return run(req.query, req.key, req.value, inputs.starts, inputs.ends, inputs.diagonal_table, req.scale,
               inputs.softcap)


def reports_nonfinite() -> bool:
    """Whether a forward's statistics tell a non-finite input apart (see :func:`attention_if_finite`): the
    kernel sees every score and output row it makes, and the self-check found that the BLAS carries a
    non-finite value through a product with 0 (``0 * inf`` is NaN), as the kernel relies on for ``v``."""
    return available() and _reports


def half_products(dtype: torch.dtype) -> bool:
    """Whether the kernel computes ``dtype`` (bfloat16 or float16) inputs with products of that type (see the
    module docstring): torch exports MKL's product for it, the self-check of that path passed, and the CPU
    multiplies that type natively or ``ATTNKIT_BF16_PRODUCTS=1`` (``ATTNKIT_FP16_PRODUCTS=1``) asked for them,
    unless that variable is ``0`` or :func:`set_half_products` turned them off. Why not:
    :func:`half_products_reason`."""
    tag = _tag(dtype)
    return available() and getattr(_module(), f"{tag}_products")()


@assume_constant_result  # asked once while tracing, not traced (it reads the CPU's flags and may build the kernel)
def native_bf16_products() -> bool:
    """Whether bfloat16 calls run on the CPU's own bfloat16 products here: the CPU has them (its flags, read
    before anything is built), and the kernel's bfloat16 products are on and go through oneDNN's brgemm (not
    MKL's product, which did not use them on an AMD CPU that has them). There the kernel outruns SDPA's CPU
    kernel on bfloat16 attention with no mask as well as under a causal one (``attnkit bench dtypes`` times
    both), and :meth:`attnkit.backends.band.BandBackend.prefers` puts it first."""
    return (_cpu.has_bf16_products() and half_products(torch.bfloat16)
            and _module().bf16_gemm() == "oneDNN brgemm")


def half_products_reason(dtype: torch.dtype) -> str | None:
    """Why :func:`half_products` is False for ``dtype`` (None when it is True, or before the kernel was loaded)."""
    if half_products(dtype):
        return None
    return _products_reason.get(dtype) if available() else _reason


def set_half_products(dtype: torch.dtype, on: bool) -> None:
    """Turn ``dtype``'s products on or off for every later call in this process (off: such a call is the
    float32 kernel's, rounded once). Turning them on needs them to have passed the self-check.

    Raises:
        TypeError: ``dtype`` is not bfloat16 or float16, or ``on`` is not a bool.
        ValueError: on, where :func:`half_products` could not be (the reason is in the message).
    """
    tag = _tag(dtype)
    if not isinstance(on, bool):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    mod = _checked()
    if on and not _products_ok.get(dtype):
        raise ValueError(f"{dtype_name(dtype)} products are not available here: {half_products_reason(dtype)}")
    if mod is not None:
        getattr(mod, f"set_{tag}_products")(on)
        if _products_ok.get(dtype):
            _products_reason[dtype] = None if on else f"turned off by set_half_products({dtype_name(dtype)}, False)"


@contextlib.contextmanager
def half_products_set(dtype: torch.dtype, on: bool) -> Iterator[None]:
    """:func:`set_half_products` for the block, then the products as they were, and the reason for them
    (to compare the two settings in one process; process-wide, like the switch itself)."""
    before, reason = half_products(dtype), _products_reason.get(dtype)
    set_half_products(dtype, on)
    try:
        yield
    finally:
        set_half_products(dtype, before)
        _products_reason[dtype] = reason


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _tag(dtype: torch.dtype) -> str:
    if dtype not in _HALF_PRODUCTS:
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16 (the half types with products), got {dtype!r}")
    return _HALF_PRODUCTS[dtype][0]


def attention_if_finite(req: Call, inputs: BandInputs) -> Tensor | None:
    """:func:`attention` without a gradient, or None when the kernel met a non-finite value: a NaN or an
    infinity in a row of ``q``, ``k`` or ``v`` it read (which a row's mask may or may not allow), or a score
    that overflowed. Its statistics mark such rows NaN, so one look at them replaces reading ``q``, ``k``
    and ``v`` once more before the call. Rows of the inputs the kernel never read (keys no row sees,
    queries that see nothing) may hold anything: they change no output."""
    out, stats = _run(req.query, req.key, req.value, inputs.starts, inputs.ends, inputs.diagonal_table, req.scale,
                      inputs.softcap)
    return None if bool(torch.isnan(stats[0]).any()) else out


def run(query: Tensor, key: Tensor, value: Tensor, starts: Tensor, ends: Tensor, bias: Tensor | None, scale: float,
        softcap: float = 0.0) -> Tensor:
    """Attention through the kernel without a Call; differentiable in query, key, value and bias.

    ``query [..., H, Lq, E]``, ``key [..., Hkv, Lk, E]``, ``value [..., Hkv, Lk, Ev]`` (H a multiple of
    Hkv, the same leading dims, float32 or float64 after :func:`attnkit.dtypes.compute_dtype`); ``starts``,
    ``ends``: int64 CPU ``[P, Lq, K]`` with B the leading dims flattened and ``P`` 1, B or B*H
    (shared, per batch element, or per batch element and head at ``b * H + h``), each row's intervals
    sorted and disjoint, empty ones ``(Lk, Lk)`` last (the caller's to guarantee; the kernel checks
    only shapes and ``0 <= start <= end <= Lk``); ``bias``: ``[1 or H, Lq + Lk - 1]`` added to the
    score of query i and key j at column ``j - i + Lq - 1``, or None; ``softcap``: ``c > 0`` turns a
    score t (after scale and bias) into ``c * tanh(t / c)``, 0 leaves it. Rows with nothing to
    attend give zeros. Call :func:`available` first: this builds the kernel if needed but does not
    fall back.
    """
    return _run(query, key, value, starts, ends, bias, scale, softcap)[0]


def _run(query: Tensor, key: Tensor, value: Tensor, starts: Tensor, ends: Tensor, bias: Tensor | None,
         scale: float, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """:func:`run`, and the kernel's statistics ``[2, B', H, Lq']`` (of the folded batch for a dilated mask)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float (0 for none), got {type(softcap).__name__}")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 for none), got {softcap}")
    for name, t in (("starts", starts), ("ends", ends)):
        if not isinstance(t, Tensor) or t.dtype != torch.int64 or t.dim() != 3 or t.device.type != "cpu":
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an int64 CPU tensor [P, Lq, K] (P 1, B or B*H), got {got}")
    compute = compute_dtype(query.dtype)
    # Half types go to the kernel as they are: its forward and backward convert a tile at a time.
    stored = query.dtype if query.dtype in HALF and key.dtype == value.dtype == query.dtype else compute
    q, k, v = (t.to(stored).reshape(math.prod(t.shape[:-3]), *t.shape[-3:]) for t in (query, key, value))
    table = query.new_empty(0, 0, dtype=compute) if bias is None else bias.to(compute)
    d, rows = _dilated(starts, ends, *q.shape[:3], k.shape[2])
    if d:  # every d-th key: each class of positions mod d is a plain band of its own (see _dilation)
        (q, k, v), (starts, ends) = (_fold(t, d) for t in (q, k, v)), rows
        table = table[:, d - 1::d]  # diagonal x of a class is x * d of the positions: column y -> d * y + d - 1
    if _plain_call(q, k, v, table):  # the operator's own work without its dispatch (see _plain_call)
        out, stats = _forward(q, k, v, starts, ends, table, float(scale), float(softcap))
    else:
        out, stats = torch.ops.attnkit.band_forward(q, k, v, starts, ends, table, float(scale), float(softcap))
    if d:
        out = _unfold(out, d)
    return out.reshape(*query.shape[:-1], value.shape[-1]).to(query.dtype), stats


# id(starts) -> (weak references to starts and ends, their versions and the sizes, then what _dilated found).
# Both tensors are held weakly and compared by identity, so an id recycled by a new tensor never
# returns another tensor's result; threads read it freely and change it one at a time.
_DILATED: dict[int, tuple] = {}
_DILATED_LOCK = threading.Lock()


def _dilated(starts: Tensor, ends: Tensor, batch: int, heads: int, q_len: int, kv_len: int
             ) -> tuple[int, tuple[Tensor, Tensor] | None]:
    """:func:`_dilation` and, when it finds one, :func:`_folded_rows`: worked out once per intervals
    (a plan is reused from call to call; its tables are not written to, and a write is seen)."""
    if torch.compiler.is_compiling() or starts.shape[-1] < 2 or starts.shape[0] not in (1, batch, batch * heads):
        return 0, None  # (one interval per row, as every call with no plan of its own: nothing kept)
    if starts.is_inference() or ends.is_inference():  # no version counter to see a write by: not kept
        d = _dilation(starts, ends, batch, heads, q_len, kv_len)
        return d, _folded_rows(starts, ends, d, batch, heads, kv_len) if d else None
    key = (starts._version, ends._version, batch, heads, q_len, kv_len)
    hit = _DILATED.get(id(starts))
    if hit is None or hit[0]() is not starts or hit[1]() is not ends or hit[2] != key:
        d = _dilation(starts, ends, batch, heads, q_len, kv_len)
        hit = (weakref.ref(starts), weakref.ref(ends), key, d,
               _folded_rows(starts, ends, d, batch, heads, kv_len) if d else None)
        with _DILATED_LOCK:
            if len(_DILATED) >= 64:  # plans come and go: keep the live ones
                for gone in [i for i, h in _DILATED.items() if h[0]() is None or h[1]() is None]:
                    del _DILATED[gone]
            _DILATED[id(starts)] = hit
    return hit[3], hit[4]


def _dilation(starts: Tensor, ends: Tensor, batch: int, heads: int, q_len: int, kv_len: int) -> int:
    """``d >= 2`` when every row's keys are single keys ``d`` apart, each row's in its own class of
    positions mod ``d`` (query ``i`` sees keys ``j = i (mod d)``; ``d`` divides both lengths); else 0.
    ``starts``: ``[P, Lq, K >= 2]`` with ``P`` 1, B or B*H (:func:`_dilated` asks only then).

    A dilated window is such a mask. Computed as it is, a block of rows spans ``d`` times the keys
    it sees and each row walks one interval per key: 3x a plain band of the same span. Folding each
    class into the batch makes every row one interval of its class, a plain band with no masked
    cells between its keys (the same keys and scores, so the same results up to rounding)."""
    first, second = starts[..., 0], starts[..., 1]
    pairs = second < kv_len
    if not bool(pairs.any()):
        return 0
    d = int((second - first)[pairs][0])
    if d < 2 or q_len % d or kv_len % d:
        return 0
    empty = starts == kv_len
    rows = torch.arange(q_len)
    single = bool(((ends - starts == 1) | empty).all())
    return d if single and bool(((starts[..., 1:] - starts[..., :-1] == d) | empty[..., 1:]).all()) and bool(
        (((first - rows) % d == 0) | empty[..., 0]).all()) else 0


def _fold(x: Tensor, d: int) -> Tensor:
    """``[B, H, L, E]`` -> ``[B * d, H, L / d, E]``: position ``c + d * t`` of batch element b goes to
    row t of batch element ``b * d + c``."""
    b, h, n, e = x.shape
    return x.reshape(b, h, n // d, d, e).permute(0, 3, 1, 2, 4).reshape(b * d, h, n // d, e).contiguous()


def _unfold(out: Tensor, d: int) -> Tensor:
    """The kernel's output of the folded batch back to positions (the inverse of :func:`_fold`), in
    one copy and laid out as the kernel lays out its own (``[B, L, H, Ev]`` in memory)."""
    bd, h, m, e = out.shape
    rows = out.transpose(1, 2).reshape(bd // d, d, m, h, e)  # the memory as written: [B, d, L / d, H, Ev]
    return rows.transpose(1, 2).reshape(bd // d, m * d, h, e).transpose(1, 2)


def _folded_rows(starts: Tensor, ends: Tensor, d: int, batch: int, heads: int, kv_len: int) -> tuple[Tensor, Tensor]:
    """The rows of :func:`_dilation`'s mask after :func:`_fold`, one interval each, in the kernel's
    convention for the folded batch: ``[B * d, Lq / d, 1]``, or ``[B * d * H, ...]`` per head
    (intervals shared by every batch element are given to each, per class)."""
    p, q_len, _ = starts.shape
    seen = starts < kv_len
    first = torch.where(seen[..., 0], starts[..., 0] // d, kv_len // d)
    last = torch.where(seen[..., 0], first + seen.sum(-1), kv_len // d)
    out = []
    for t in (first, last):  # [P, Lq] -> per class, in the folded batch's order
        t = t.reshape(p, q_len // d, d).transpose(1, 2)  # [P, d, Lq / d]
        if p == batch * heads and heads > 1:
            t = t.reshape(batch, heads, d, q_len // d).transpose(1, 2)
        out.append(t.expand(batch, *t.shape[1:]) if p == 1 else t)
    return tuple(t.reshape(-1, q_len // d, 1).contiguous() for t in out)


def partial_forward(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, ends: Tensor, scale: float,
                    bias: Tensor | None = None, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    """The kernel's forward on one block of keys, for callers that merge blocks (ring attention).

    ``q [B, H, Lq, E]``, ``k [B, Hkv, Lk, E]``, ``v [B, Hkv, Lk, Ev]`` already in a kernel dtype
    (:data:`DTYPES`); ``starts``/``ends``, ``bias`` (this block's diagonals) and ``softcap`` as in
    :func:`run`. Returns ``(out, lse)``: the block's normalised output and each row's log-sum-exp
    (``-inf`` for a row with no key), no autograd.
    """
    out, stats = torch.ops.attnkit.band_forward(q, k, v, starts, ends, _table(bias, q), scale, softcap)
    return out, stats[0] + stats[1]


def partial_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, starts: Tensor,
                     ends: Tensor, scale: float, bias: Tensor | None = None,
                     softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dbias)`` of one block of keys given the rows' *merged* ``out`` and ``lse`` (all
    blocks): each block's share of the gradients of attention over all of them (FlashAttention's
    backward); ``dbias`` is None without a bias."""
    stats = torch.stack([lse, torch.zeros_like(lse)])  # row "maximum" lse, log of row sum 0
    dq, dk, dv, dbias = torch.ops.attnkit.band_backward(dout, q, k, v, out, stats, starts, ends, _table(bias, q),
                                                         scale, softcap, torch.are_deterministic_algorithms_enabled(),
                                                         bias is not None)
    return dq, dk, dv, None if bias is None else dbias


def _table(bias: Tensor | None, like: Tensor) -> Tensor:
    """A diagonal bias as the kernel reads it: in ``like``'s dtype, no autograd; none is ``[0, 0]``."""
    return like.new_empty(0, 0) if bias is None else bias.detach().to(like.dtype)


def _rows(x: Tensor) -> Tensor:
    """``x [B, H, L, E]`` with rows the BLAS can read: unit stride along E, rows at least E apart
    (a tensor of another shape is passed as it is, for the kernel to refuse by name)."""
    return x if x.dim() < 2 or (x.stride(-1) == 1 and x.stride(-2) >= x.shape[-1]) else x.contiguous()


# The kernel as two PyTorch operators (``torch.ops.attnkit.band_forward`` / ``band_backward``): a
# shape-only ("fake") version of each lets torch.compile and torch.export trace through a call
# without running it, and the forward's gradient is the backward operator, registered with autograd.
# Inputs: ``q [B, H, Lq, E]``, ``k [B, Hkv, Lk, E]``, ``v [B, Hkv, Lk, Ev]`` in one kernel dtype,
# ``starts``/``ends`` as in :func:`run`, ``bias`` ``[1 or H, Lq + Lk - 1]`` or ``[0, 0]`` for none.
# Outputs: ``out [B, H, Lq, Ev]`` (laid out as ``[B, Lq, H, Ev]``: merging heads after it is a view)
# and ``stats [2, B, H, Lq]`` (each row's maximum and log row sum).
#
# What they check. Both operators, and the compiled module's ``forward``/``backward`` under them,
# check every argument before any memory is touched and raise a RuntimeError that names the
# argument, what came and what was expected (the checks are in ``csrc/band/checks.cpp``, O(1) but for one
# pass over the intervals):
# - band_forward: q float32, float64, bfloat16 or float16, 4-D; k, v 4-D in its dtype (half types are computed in
#   float32: queries and outputs converted a row at a time, keys and values once per call, or a chunk at a
#   time where few blocks of rows read each key); k's batch and head size
#   q's, v's batch, heads and length k's, q's heads a multiple of k's; every tensor dense and on the CPU; lengths and
#   head sizes below 2^31; starts and ends contiguous int64 ``[P, Lq, K]`` of one shape, P 1, B or B*H, K >= 1, each
#   ``0 <= start <= end <= Lk``; bias 2-D in the compute dtype, ``[0, 0]`` or contiguous ``[1 or H, Lq + Lk - 1]``;
#   scale finite, softcap finite and >= 0 (in q's dtype); unless q, k or v is empty (zeros and -inf statistics then),
#   q, k and v with unit stride along the last dim and rows at least a row apart (what the BLAS reads in place; the
#   operator makes them so, the module's forward refuses them otherwise). The module's own block sizes (q_rows,
#   kv_chunk) must be in [1, 2^20].
# - band_backward: all of that (a half type without its products read as stored and widened a tile at a
#   time), and
#   dout and out ``[B, H, Lq, Ev]`` (q's B, H, Lq, v's Ev) with rows as q's, stats the forward's contiguous
#   ``[2, B, H, Lq]``, all in q's dtype (stats in the compute dtype); kv_rows, q_chunk in [1, 2^20].
# Statistics are in the compute dtype (float32 for half q).
# What is not checked: that each row's intervals are sorted and disjoint (the plan builds them
# so; out of order they give wrong sums, never a read out of bounds).

def _plain_call(*tensors: Tensor) -> bool:
    """Whether the forward can skip the operator's dispatch and call the module directly: plain CPU
    tensors (no subclass, no functorch transform, no dispatch mode such as make_fx's, nothing being
    traced) with no gradient to record.
    The dispatch of a ``torch.library.custom_op`` costs tens of microseconds per call (a decode step
    calls the kernel once per layer) and its first call imports ``torch._dynamo`` (seconds); the
    module computes the same thing either way."""
    return (not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)) and all(
        type(t) is Tensor for t in tensors) and not torch._C._are_functorch_transforms_active() and (
        not torch.compiler.is_compiling()) and torch._C._len_torch_dispatch_stack() == 0  # no mode records ops


def _forward(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, ends: Tensor, bias: Tensor, scale: float,
             softcap: float) -> tuple[Tensor, Tensor]:
    return _module().forward(_rows(q), _rows(k), _rows(v), starts.contiguous(), ends.contiguous(),
                             bias.contiguous(), scale, softcap, Q_ROWS, KV_CHUNK)


@torch.library.custom_op("attnkit::band_forward", mutates_args=(), device_types="cpu")
def _forward_impl(q: Tensor, k: Tensor, v: Tensor, starts: Tensor, ends: Tensor, bias: Tensor, scale: float,
                  softcap: float) -> tuple[Tensor, Tensor]:
    out, stats = _forward(q, k, v, starts, ends, bias, scale, softcap)
    return out, stats


@_forward_impl.register_fake
def _(q, k, v, starts, ends, bias, scale, softcap):
    return _new_out(q, v), q.new_empty(2, *q.shape[:-1], dtype=compute_dtype(q.dtype))


def _new_out(q: Tensor, v: Tensor) -> Tensor:
    """An uninitialised output ``[B, H, Lq, Ev]`` laid out as ``[B, Lq, H, Ev]``, as the kernel writes it."""
    b, h, lq, _ = q.shape
    return q.new_empty(b, lq, h, v.shape[-1]).transpose(1, 2)


@torch.library.custom_op("attnkit::band_backward", mutates_args=(), device_types="cpu")
def _backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, stats: Tensor, starts: Tensor,
                   ends: Tensor, bias: Tensor, scale: float, softcap: float, deterministic: bool,
                   bias_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(_module().backward(_rows(dout), _rows(q), _rows(k), _rows(v), _rows(out), stats.contiguous(),
                                    starts.contiguous(), ends.contiguous(), bias.contiguous(), scale, softcap,
                                    KV_ROWS, Q_CHUNK, deterministic, bias_grad))


@_backward_impl.register_fake
def _(dout, q, k, v, out, stats, starts, ends, bias, scale, softcap, deterministic, bias_grad):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), bias.new_empty(bias.shape)  # contiguous


def _save_for_backward(ctx, inputs, output):
    q, k, v, starts, ends, bias, scale, softcap = inputs
    ctx.save_for_backward(q, k, v, *output, starts, ends, bias)
    ctx.scale, ctx.softcap = scale, softcap


def _gradient(ctx, dout, _dstats):
    q, k, v, out, stats, starts, ends, bias = ctx.saved_tensors
    bias_grad = ctx.needs_input_grad[5]  # a learned table; a constant one (fixed ALiBi slopes) skips the sum
    # a half type goes as it is (the kernel takes its products, or widens a tile at a time); the gradients come
    # back in q's dtype
    dq, dk, dv, dbias = torch.ops.attnkit.band_backward(dout, q, k, v, out, stats, starts, ends, bias, ctx.scale,
                                                         ctx.softcap, torch.are_deterministic_algorithms_enabled(),
                                                         bias_grad)
    return dq, dk, dv, None, None, dbias if bias_grad else None, None, None


_forward_impl.register_autograd(_gradient, setup_context=_save_for_backward)


@_build.once  # threads making their first call together wait for one load and self-check
def _checked():
    """The compiled module once it has matched the formula, else None (reason in ``_reason``)."""
    global _reason
    try:
        mod = _module()
    except Exception as e:  # _build.BuildError: no compiler, a refused cache folder, ... in one line
        _reason = f"could not build the banded kernel: {e}"
        _warn(f"{_reason}; the blockwise backend uses its tile schedule instead")
        return None
    try:
        if not mod.has_blas():
            _reason = "this torch does not export the BLAS functions (sgemm_/dgemm_) the kernel calls"
            return None
        # (the first caller may be under no_grad)
        with real_tensors(), torch.inference_mode(False), torch.enable_grad(), _cpu.one_thread():
            err = _self_check(mod)
    except Exception as e:  # a module that raises where it should compute is not used either
        err = f"{type(e).__name__}: {e}"
    if err is not None:
        _reason = f"self-check against the formula failed: {err}"
        _warn(f"banded kernel {_reason}; not used")
        return None
    global _reports
    with real_tensors(), torch.inference_mode(False), _cpu.one_thread():
        _reports = all(_reports_in(mod, dtype) for dtype in DTYPES)
        for dtype in _HALF_PRODUCTS:
            _use_half_products(mod, dtype)
        _use_f32_brgemm(mod)
    return mod


def float32_products() -> str:
    """Which product the kernel's float32 products take here: ``"oneDNN brgemm"`` (the transposed ones, q k^T and
    the backward's, from transposed copies of the keys, values, queries and output gradient, each made once for
    all the products that read it) or
    ``"BLAS sgemm"``, with why (chosen once per process by timing both on the kernel's tile shapes, after a
    self-check; ``ATTNKIT_F32_BRGEMM=1`` or ``0`` decides instead). ``attnkit bench dtypes`` prints it."""
    return _f32_products if available() else "none (the kernel is not available)"


def _use_f32_brgemm(mod) -> None:
    """float32 products through brgemm where torch has its float32 micro-kernel, ``ATTNKIT_F32_BRGEMM`` allows, it
    timed faster than sgemm here (by a tenth at least) and the float32 self-check passes with it."""
    global _f32_products
    asked = os.environ.get("ATTNKIT_F32_BRGEMM")
    if not mod.has_f32_brgemm():
        _f32_products = "BLAS sgemm (this torch or CPU has no float32 brgemm)"
        return
    if asked == "0":
        _f32_products = "BLAS sgemm (ATTNKIT_F32_BRGEMM=0)"
        return
    sgemm_s, brgemm_s = mod.f32_product_times(20)
    if asked != "1" and not brgemm_s < 0.9 * sgemm_s:
        _f32_products = f"BLAS sgemm (timed here: brgemm {sgemm_s / brgemm_s:.2f}x its speed)"
        return
    mod.set_f32_brgemm(True)
    try:
        err = _half_self_check(mod, torch.float32)
        if err is None and _reports and not _reports_in(mod, torch.float32):
            err = "its statistics do not mark a non-finite value (0 * inf through the product)"
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    if err is not None:
        mod.set_f32_brgemm(False)
        _f32_products = f"BLAS sgemm (brgemm's float32 self-check failed: {err})"
        _warn(f"banded kernel's float32 products through brgemm failed their self-check: {err}; it uses sgemm")
        return
    _f32_products = ("oneDNN brgemm (ATTNKIT_F32_BRGEMM=1)" if asked == "1"
                     else f"oneDNN brgemm (timed here: {sgemm_s / brgemm_s:.2f}x sgemm's speed)")


def _use_half_products(mod, dtype: torch.dtype) -> None:
    """Turn ``dtype``'s products on when torch has them, its environment variable allows, and their self-check
    passes; else leave them off with the reason in ``_products_reason``."""
    tag, variable, native, flags = _HALF_PRODUCTS[dtype]
    name, symbol = dtype_name(dtype), f"cblas_gemm_{tag}{tag}f32"
    if not getattr(mod, f"has_{tag}_gemm")():
        _products_reason[dtype] = (f"this torch has no {name} product the kernel can call ("
                                   + ("oneDNN's brgemm or " if tag == "bf16" else "") + f"MKL's {symbol})")
        return
    switch = getattr(mod, f"set_{tag}_products")
    switch(True)
    try:
        err = _half_self_check(mod, dtype)
        if err is None and _reports and not _reports_in(mod, dtype):
            err = f"its statistics do not mark a non-finite value (0 * inf through the {name} product)"
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    if err is not None:
        switch(False)
        _products_reason[dtype] = f"their self-check against the formula failed: {err}"
        _warn(f"banded kernel's {name} products {_products_reason[dtype]}; it computes {name} in float32")
        return
    _products_ok[dtype] = True
    asked = os.environ.get(variable)
    if asked == "0":
        switch(False)
        _products_reason[dtype] = f"turned off by {variable}=0"
    elif asked != "1" and not native():
        switch(False)
        _products_reason[dtype] = (f"this CPU has no {name} products (no {flags} flag), where float32 products are "
                                   f"faster; {variable}=1 turns them on")


def _half_self_check(mod, dtype: torch.dtype) -> str | None:
    """The forward and the backward with ``dtype``'s products (bfloat16, float16, or float32 through brgemm) against
    the formula in float64 on the same (``dtype``)
    values, on the cases of :func:`_self_check` (windows, documents, several intervals per row, GQA, a bias,
    soft-capping, a scale that is a power of two and one that is not, dQ under locks and from its own pass): each
    result within 2^-5 of its largest magnitude (the values', for the output), far above the rounding of the
    weights, dS and the results (about 2^-9 each) and far below a wrong product."""
    gen = torch.Generator().manual_seed(1)
    cases = (_window(70, 70, 5, 3), _window(50, 83, 200, 0), _documents((0, 17, 40, 41, 66), (0, 9, 9, 50, 61)),
             _scattered(75, 80), _window(150, 150, 70, 70))
    for n, (lq, lk, starts, ends) in enumerate(cases):
        q, k, v, dout = (torch.randn(*shape, generator=gen, device="cpu").to(dtype)
                         for shape in ((2, 4, lq, 16), (2, 2, lk, 16), (2, 2, lk, 24), (2, 4, lq, 24)))
        heads = (0, 4, 1)[n % 3]
        bias = torch.randn(heads, lq + lk - 1 if heads else 0, generator=gen, device="cpu")
        scale, softcap = (0.25, 0.3)[n % 2], 2.0 if n == 3 else 0.0
        out, stats = mod.forward(q, k, v, starts, ends, bias, scale, softcap, 16, 32)
        grads = mod.backward(dout, q, k, v, out, stats, starts, ends, bias, scale, softcap, 16, 24, n % 2 == 0, True)
        want_out, want_grads = _formula(*(t.double() for t in (q, k, v, dout)), starts, ends, bias.double(), scale,
                                        softcap)
        got = (out, *grads)
        want = (want_out, *want_grads)
        for name, g, w, size in zip(("out", "dq", "dk", "dv", "dbias"), got, want, (v, *want_grads), strict=True):
            if not w.numel():  # no bias: no bias gradient
                continue
            err = (g.double() - w).abs().max().item()
            if not err <= 2 ** -5 * size.double().abs().max().item():
                return (f"{name} differs by {err:.3g} (Lq={lq}, Lk={lk}, intervals per row={starts.shape[-1]}, "
                        f"deterministic={n % 2 == 0})")
    return None


def _reports_in(mod, dtype: torch.dtype) -> bool:
    """Whether the forward's statistics mark the rows a non-finite input reaches (reports_nonfinite), in
    ``dtype``: an infinity in a row of v whose weight is exactly 0 (the BLAS must carry ``0 * inf``), a NaN
    in v and an infinity in k at keys the row may not see but the kernel reads beside those it may, and a
    clean call that marks nothing. 12 rows, 1 head, a window of one key on each side."""
    n, nan, inf = 12, float("nan"), float("inf")
    starts, ends = _window(n, n, 1, 1)[2:]
    q = torch.zeros(1, 1, n, 4, dtype=dtype)
    q[..., 0] = 1.0
    k, v = torch.zeros_like(q), torch.ones_like(q)
    k[0, 0, 5, 0] = -4000.0  # row 4..6 give key 5 a weight of exactly 0
    table = torch.empty(0, 0, dtype=compute_dtype(dtype))
    clean = not bool(torch.isnan(mod.forward(q, k, v, starts, ends, table, 1.0, 0.0, 16, 32)[1][0]).any())
    marked = []
    for t, at, value in ((v, 5, inf), (v, 9, nan), (k, 1, -inf)):
        poisoned = t.clone()
        poisoned[0, 0, at, 1] = value
        args = (q, poisoned, v) if t is k else (q, k, poisoned)
        marked.append(bool(torch.isnan(mod.forward(*args, starts, ends, table, 1.0, 0.0, 16, 32)[1][0]).any()))
    return clean and all(marked)


def _self_check(mod) -> str | None:
    """Outputs and gradients against the formula in float64: windows, a causal row offset, packed
    documents, several intervals per row in no order down the rows (global rows and keys, a
    dilated window, rows with nothing to attend between others), GQA, ``Lq != Lk``, odd sizes,
    bounds shared or per batch, a diagonal bias per head or shared, soft-capping with and without bias."""
    gen = torch.Generator().manual_seed(0)
    cases = (_window(70, 70, 5, 3), _window(50, 83, 200, 0), _window(83, 30, 2, 0), _window(66, 66, 0, 0),
             _documents((0, 17, 40, 41, 66), (0, 9, 9, 50, 61)), _scattered(75, 80), _scattered(75, 80),
             _window(70, 70, 5, 3))
    for n, (lq, lk, starts, ends) in enumerate(cases):
        q, k, v, dout = (torch.randn(*shape, generator=gen, dtype=torch.float64, device="cpu")
                         for shape in ((2, 4, lq, 12), (2, 2, lk, 12), (2, 2, lk, 5), (2, 4, lq, 5)))
        heads = (0, 4, 1)[n % 3]  # no bias, one per head, one shared
        bias = torch.randn(heads, lq + lk - 1 if heads else 0, generator=gen, dtype=torch.float64, device="cpu")
        softcap = 1.5 if n >= 6 else 0.0  # the last two: capped, one with a bias, one without
        out, stats = mod.forward(q, k, v, starts, ends, bias, 0.3, softcap, 16, 32)
        deterministic = n % 2 == 0  # dQ from the key blocks under locks, or from its own pass over query blocks
        grads = mod.backward(dout, q, k, v, out, stats, starts, ends, bias, 0.3, softcap, 16, 24, deterministic, True)
        want_out, want_grads = _formula(q, k, v, dout, starts, ends, bias, 0.3, softcap)
        names = ("out", "dq", "dk", "dv", "dbias")
        for name, got, want in zip(names, (out, *grads), (want_out, *want_grads), strict=True):
            if not torch.allclose(got, want, rtol=1e-9, atol=1e-10):
                err = (got - want).abs().max().item()
                return (f"{name} differs by {err:.3g} (Lq={lq}, Lk={lk}, intervals per row={starts.shape[-1]}, "
                        f"bias heads={heads}, softcap={softcap}, deterministic={deterministic})")
    return None


def _window(lq: int, lk: int, left: int, right: int) -> tuple[int, int, Tensor, Tensor]:
    pos = torch.arange(lq, device="cpu").view(1, -1) + lk - lq
    lo = (pos - left).clamp(0, lk)
    hi = (pos + right + 1).clamp(0, lk)
    empty = hi <= lo
    return lq, lk, lo.masked_fill(empty, lk)[..., None], hi.masked_fill(empty, lk)[..., None]


def _documents(q_starts: tuple, kv_starts: tuple) -> tuple[int, int, Tensor, Tensor]:
    """Per batch element: element 0 keeps the documents, element 1 their first half only."""
    lq, lk = q_starts[-1], kv_starts[-1]
    allowed = torch.zeros(2, lq, lk, dtype=torch.bool)
    for d in range(len(q_starts) - 1):
        a, e = kv_starts[d], kv_starts[d + 1]
        allowed[0, q_starts[d]:q_starts[d + 1], a:e] = True
        allowed[1, q_starts[d]:q_starts[d + 1], a:a + (e - a) // 2] = True
    return lq, lk, *_intervals(allowed)


def _scattered(lq: int, lk: int) -> tuple[int, int, Tensor, Tensor]:
    """Several intervals per row, in no order down the rows: a window of +-4, keys 0-2 and 40 seen
    by every row, rows 0 and 33 that see every key, a dilated window on the rows 50-59, and rows
    20 and 21 that see nothing (shared by the batch)."""
    i, j = torch.arange(lq).view(-1, 1) + lk - lq, torch.arange(lk).view(1, -1)
    allowed = ((i - j).abs() <= 4) | (j < 3) | (j == 40)
    allowed[[0, 33]] = True
    allowed[50:60] = ((i - j).abs() <= 12)[50:60] & ((i - j) % 3 == 0)[50:60]
    allowed[20:22] = False
    return lq, lk, *_intervals(allowed[None])


def _intervals(allowed: Tensor) -> tuple[Tensor, Tensor]:
    """``[P, Lq, K]`` intervals of a small bool ``[P, Lq, Lk]`` grid, by loops (the self-check's own
    reading of the convention, independent of attnkit.maskplan)."""
    lk = allowed.shape[-1]
    rows = [[[] for _ in range(allowed.shape[1])] for _ in range(allowed.shape[0])]
    for p in range(allowed.shape[0]):
        for i in range(allowed.shape[1]):
            cells = allowed[p, i].tolist() + [False]
            j = 0
            while j < lk:
                if cells[j]:
                    e = j
                    while cells[e]:
                        e += 1
                    rows[p][i].append((j, e))
                    j = e
                j += 1
    k = max(1, max(len(r) for batch in rows for r in batch))
    padded = torch.tensor([[row + [(lk, lk)] * (k - len(row)) for row in batch] for batch in rows],
                          dtype=torch.long).view(allowed.shape[0], allowed.shape[1], k, 2)
    return padded[..., 0].contiguous(), padded[..., 1].contiguous()


def _formula(q, k, v, dout, starts, ends, bias, scale, softcap=0.0):
    q, k, v, bias = (t.detach().requires_grad_() for t in (q, k, v, bias))
    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    i, j = torch.arange(q.shape[2], device="cpu"), torch.arange(k.shape[2], device="cpu")
    allowed = ((j >= starts[..., None]) & (j < ends[..., None])).any(-2)[:, None]  # [B|1, 1, Lq, Lk]
    s = q @ ke.transpose(-1, -2) * scale
    if bias.numel():
        s = s + bias[:, j[None, :] - i[:, None] + q.shape[2] - 1]  # [H|1, Lq, Lk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    out = p @ ve
    out.backward(dout)
    dbias = bias.grad if bias.grad is not None else torch.zeros_like(bias)
    return out.detach(), (q.grad, k.grad, v.grad, dbias)


def _warn(message: str) -> None:
    """A reason the kernel (or a path of it) is not used, which a user can act on: once per process, as the
    load is (:func:`_checked`)."""
    warnings.warn(f"attnkit: {message}", RuntimeWarning, stacklevel=_build._outside_attnkit())


@_build.once  # one load per process; a failure is remembered with its reason (a BuildError each call)
def _module():
    """The kernel built at install (:data:`INSTALLED`, once its build record matches), else compiled now or taken
    from the cache (:func:`._build.load`, which warns before it blocks; raises its BuildError)."""
    name, cflags, _ = _target()
    try:
        return _build.load_installed(INSTALLED, INSTALLED_RECORD, build_key())
    except _build.BuildError as e:
        why = f"the banded attention kernel built at install is not used: {e}"
    logger.info("%s; loading it from the cache or compiling it", why)
    return _build.load(name, _band_sources.sources(), cflags, _band_sources.LDFLAGS, "the banded attention kernel",
                       f"{why} (`pip install --no-build-isolation .` builds it at install)")


def build_key() -> str:
    """What this process needs the kernel built from, hashed (:func:`._band_sources.key`): sources, torch
    version, CPU capability and flags. The installed module's build record must name it."""
    cap = torch.backends.cpu.get_cpu_capability()
    return _band_sources.key(torch.__version__, cap, _band_sources.cflags(cap, _cpu.flags()))


def _target() -> tuple[str, list[str], Path]:
    """Module name, compiler flags and cache path of the fallback's build; the name carries :func:`build_key`."""
    cap = torch.backends.cpu.get_cpu_capability()
    name = _band_sources.module_name(build_key())
    return name, _band_sources.cflags(cap, _cpu.flags()), _build.entry(name)
