"""A decode step on the CPU: a few queries over a long cache, each key and value read once.

One query (or a few: speculative decoding) against thousands of keys is a pass over memory, not a product:
PyTorch's CPU SDPA kernel and the band kernel's tiles are built for many queries, and for one they pay set-ups
(packing, per-block products, the scratch of a tile) that a single row cannot amortise. This backend runs
``csrc/band/decode.cpp`` (built with the band kernel, :mod:`._band`): for each batch element and key/value head,
the query heads that share it and their queries are the rows of one pass that streams the keys once, in blocks,
scoring 16 keys against a row at a time (bfloat16 keys as stored where the CPU multiplies bfloat16 pairs, float16
widened to float32), and folding the block into each row's running maximum, sum and accumulator (online softmax in
float32), then the values likewise. Grouped-query heads are
read in place. With too few batch elements and key/value heads for the threads, the keys are split in chunks
merged afterwards (split softmax).

What it serves: CPU, float32, bfloat16 or float16, 4-D tensors, ``Lq <= 8``, no bias, dropout, ``mask_mod`` or
weights, no ``score_mod`` but tanh soft-capping alone (:func:`attnkit.scores.softcap`, as Gemma 2 has), and no
gradient (it is forward only). Causal (bottom-right) and a window become each row's key range ``[lo, hi)``; a
boolean mask is read as it is (one row per batch element, head or query, or shared). Rows that see no key are 0.

The NaN rule (:mod:`attnkit.nonfinite`): the same pass tells whether the call's inputs are finite, with no second
read of the cache. The query rows are summed as ``q * 0``; every key read is scored against the first row, masked
or not, and a key with a NaN or an infinity scores NaN or an infinity (``0 * inf`` is NaN, so a zero in the query
hides nothing); and every value read is added into that row's accumulator times its weight, even a weight of 0.
So :meth:`DecodeBackend.if_finite` answers from what the pass computed anyway (keys outside every row's range are
not read, and change no output; a score that overflows is a false alarm, which costs only the exact path).
Anything non-finite sends the call to the exact path.

The lane (:meth:`DecodeBackend.step`): a plain decode step, one query and nothing but ``is_causal`` and ``scale``
set, is what a model asks for once per layer and token, and for it the checks of
:func:`attnkit.call.validate_call`, the walk of :func:`attnkit.backends.select` and the NaN rule's dispatch cost
more than the kernel does over a short cache (the more so inside a model, whose weights have pushed that Python
out of the CPU's caches by the time it runs). So when the decode backend is what ``"auto"`` would pick for such a
call (:func:`attnkit.backends.registry.step_leader`), :func:`attnkit.attention` first offers it to
:meth:`DecodeBackend.step`, which checks the tensors' Python types and the scale, and hands the rest to one native
call (``decode_step``: dtype, device, shapes and gradients checked in C++, the kernel, its finiteness flag read),
answering when every input read was finite; anything else it hands back (None), and the call takes the whole path,
which checks it, refuses it or applies the NaN rule.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .. import scores
from ..call import Call
from . import _band, refusals
from .refusals import Refusal

#: The most queries a call may have (the kernel's own bound: ``MAX_DECODE_QUERIES`` in ``decode.h``).
MAX_QUERIES = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NO_MASK = torch.empty(0, 0, 0, 0, dtype=torch.bool)


def _grad(c: Call) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (c.query, c.key, c.value))


class DecodeBackend:
    name = "decode"

    REFUSALS = (
        refusals.weights("decode"),
        refusals.dropout("decode"),
        Refusal(lambda c: c.query.device.type != "cpu" or c.query.dtype not in DTYPES,
                lambda c: f"the decode kernel runs on CPU tensors of float32, bfloat16 or float16, got "
                          f"{c.query.dtype} on {c.query.device}"),
        Refusal(lambda c: c.q_len > MAX_QUERIES,
                lambda c: f"the decode kernel takes at most {MAX_QUERIES} queries, got {c.q_len}"),
        Refusal(lambda c: c.query.dim() != 4, lambda c: f"the decode kernel takes 4-D tensors, got {c.query.dim()}-D"),
        Refusal(lambda c: c.bias is not None, "the decode kernel takes no bias"),
        Refusal(lambda c: c.mask_mod is not None, "the decode kernel takes no mask_mod"),
        Refusal(lambda c: c.score_mod is not None and _cap(c) is None,
                "the decode kernel takes no score_mod but tanh soft-capping alone (attnkit.scores.softcap)"),
        Refusal(lambda c: c.kv_len == 0, "empty key sequence (Lk = 0)"),
        Refusal(_grad, "the decode kernel is forward only (an input requires grad)"),
        Refusal(lambda c: torch.compiler.is_compiling(), "the decode kernel is not traced by torch.compile"),
    )

    def not_supported_reasons(self, req: Call) -> list[str]:
        reasons = refusals.reasons(self.REFUSALS, req)
        if not reasons and not _band.available():
            reasons = [f"the decode kernel (built with the banded kernel) is not available "
                       f"({_band.unavailable_reason()})"]
        return reasons

    def __call__(self, req: Call) -> tuple[Tensor, None]:
        return _run(req)[0], None

    def sees_nonfinite(self, req: Call) -> bool:
        """Always: the kernel's pass tells whether the keys and values it read were finite (module docstring)."""
        return True

    def if_finite(self, req: Call) -> tuple[Tensor, None] | None:
        """``self(req)``, or None when a query, key or value the kernel read is not finite."""
        out, finite = _run(req)
        return (out, None) if bool(finite.all()) else None

    def step(self, query, key, value, is_causal, scale) -> Tensor | None:
        """The lane (module docstring): ``attention(query, key, value, is_causal=is_causal, scale=scale)`` for a
        plain step, ``query [B, H, 1, E]`` and ``key``/``value [B, Hkv, Lk, E|Ev]`` dense CPU tensors of one
        dtype the kernel takes, no gradient asked for, when every input is finite; None for any other call
        (which :func:`attnkit.attention` then takes the whole way). What it accepts is what
        :func:`attnkit.call.validate_call` accepts and this backend serves (``tests/backends/test_decode.py``
        checks the two agree)."""
        if (type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor
                or (is_causal is not False and is_causal is not True)):
            return None  # subclasses (and anything else) take the whole path
        if scale is None:
            scale = math.nan  # the kernel's 1 / sqrt(E)
        elif not ((type(scale) is float and math.isfinite(scale)) or (type(scale) is int and -1e38 < scale < 1e38)):
            return None  # (an int too large for a float, too: the whole path says what it makes of it)
        mod = _band._checked()
        if mod is None or torch.compiler.is_compiling():
            return None
        # the rest (dtype, device, shapes, gradients, finiteness) in one native call: cold, between two layers of
        # a model, each Python check and tensor op here cost microseconds (bench/decode_ab.py's cold table)
        return mod.decode_step(query, key, value, float(scale))


def _run(req: Call) -> tuple[Tensor, Tensor]:
    """``(out [B, H, Lq, Ev], finite [B, Hkv])`` from the kernel."""
    q, k, v = req.query, req.key, req.value
    lo, hi = _ranges(req)
    mask = _NO_MASK if req.mask is None else _mask(req.mask, req.kv_len)
    return tuple(_band._checked().decode(_unit_last(q), _unit_last(k), _unit_last(v), mask, lo, hi, float(req.scale),
                                         _cap(req) or 0.0))


def _cap(req: Call) -> float | None:
    """The soft cap of a call whose score_mod is tanh soft-capping alone (0.0 with no score_mod); None otherwise."""
    if req.score_mod is None:
        return 0.0
    terms = scores.parts(req.score_mod)
    return float(terms[1]) if terms is not None and terms[0] is None and terms[1] is not None else None


def _unit_last(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _ranges(req: Call) -> tuple[Tensor, Tensor]:
    """Each query's key range ``[lo, hi)`` (int64 ``[1, Lq]``) under causal (bottom-right) and the window."""
    return _key_ranges(req.q_len, req.kv_len, req.is_causal, None if req.window is None else tuple(req.window))


@functools.lru_cache(maxsize=256)  # a decode loop asks for the same few; the kernel only reads them
def _key_ranges(lq: int, lk: int, causal: bool, window: tuple[int | None, int | None] | None) -> tuple[Tensor, Tensor]:
    offset = lk - lq
    lo, hi = [], []
    for i in range(lq):
        p, a, b = offset + i, 0, lk
        if causal:
            b = min(b, p + 1)
        if window is not None:
            left, right = window
            if left is not None:
                a = max(a, p - left)
            if right is not None:
                b = min(b, p + right + 1)
        b = max(0, min(b, lk))
        lo.append(min(max(a, 0), b))
        hi.append(b)
    return torch.tensor([lo], dtype=torch.long), torch.tensor([hi], dtype=torch.long)


def _mask(mask: Tensor, kv_len: int) -> Tensor:
    """``mask`` as the kernel reads it: 4-D, its last dimension ``Lk`` with unit stride (broadcast dims kept)."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.shape[-1] != kv_len:
        mask = mask.expand(*mask.shape[:-1], kv_len)
    return _unit_last(mask)
