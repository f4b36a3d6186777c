"""The ``"flex"`` backend: PyTorch's compiled ``flex_attention`` with a ``BlockMask`` made from attnkit's plan.

Flex's ``BlockMask`` says, for each (query block, key block) pair, whether it is skipped, computed
without a mask or computed with the mask function. Here it comes from the call's mask plan
(:meth:`attnkit.MaskPlan.kinds` at Flex's block size: empty / full / partial, from each row's key
intervals, no cell evaluated) through ``BlockMask.from_kv_blocks``, not from ``create_block_mask``.
The mask function, evaluated on partial blocks only, gives the same cells as the plan:

* ``is_causal`` / ``window``: a band ``lo <= kv_idx - q_idx <= hi`` whose bounds are tensors, so
  causal, windows and key offsets of one shape share one compiled kernel;
* a ``mask_mod``: the user's own predicate (and the band where there is one);
* a dense bool ``mask`` or a :class:`attnkit.MaskPlan`: a lookup of the plan's intervals (at most
  :data:`LOOKUP_INTERVALS` per row, padded to a power of two); a plan with more (or none) uses its
  predicate, a dense mask with more its own cells.

Without a mask every block is full (a ``BlockMask`` all the same: without one, Flex on the CPU
takes all ``Lk`` keys as one block). A ``score_mod`` passes
through as Flex's score mod, its result in the score's dtype (:func:`attnkit.scores.apply`) and a
NaN it makes turned into ``+inf``, which poisons the row (Flex's softmax would drop a NaN score);
the mask is applied by selection after it, so nothing it makes at a masked cell reaches the output
(:mod:`attnkit.nonfinite`). Flex pads the last blocks and may call the mods there: they get indices
clamped into range (a mod indexing a table reads its own entries) and keys past ``Lk`` are masked.
Grouped-query heads go through ``enable_gqa``, ``scale`` as it is. Rows with no allowed key come
out as zeros. On the CPU a head dim below :data:`CPU_MIN_HEAD_DIM` gets zero columns in ``q`` and
``k`` (no score changes): at small head dims PyTorch 2.13's CPU Flex reads keys past the end of
``k``.

Compiling: one ``torch.compile(flex_attention, fullgraph=True)`` per family (device, dtype, batch,
heads and head dims, whether a gradient is needed, block size, the mask function's and the score
mod's code and plain values, the rank, dtype and device of the tensors they capture), each on a code
object of its own (TorchDynamo keeps compiled graphs, and counts recompiles against its limit, per
code object). On CUDA (:data:`DYNAMIC_DEVICES`) the lengths are not part of a family: its first call
compiles a kernel for its sizes, and the first call with other sizes one that takes them as
variables (TorchDynamo's automatic dynamic shapes), which then serves every length. So a decode
loop, whose key length grows by one every step, compiles twice, not once per step, and prompts of
every length a few times more (TorchDynamo always compiles a size of 1 in: a decode step's one
query, a mask of one block); the lengths the mods need reach them as tensors for that reason. A
family whose compile for variable lengths fails, or disagrees with the formula, goes to one family
per length, as every family does on the CPU. Each compile is logged (``logging``, logger
``attnkit.backends.flex``, level INFO: seconds a user may wonder about); threads making a
family's first call together wait for one compile. Every call that compiled is then checked on a few
rows against the formula (``_disagreement``: compiled Flex is code generated anew, and some of it is
wrong). A family that fails to compile or to match is remembered: the failing call is served by the
``fallback`` backend (with a ``UserWarning`` saying why), and from then on ``not_supported_reasons`` gives the reason,
so ``attnkit.which_backend`` lists it.

Dtypes: float32, bfloat16 and float16. On CPU (PyTorch 2.13) Flex computes forward only (no
backward: a call that needs a gradient is refused) and half types are computed in float32 and
rounded once (:func:`attnkit.dtypes.compute_dtype`); on CUDA half types go to Flex as they are (its
kernels accumulate in float32) and gradients reach ``q``, ``k``, ``v`` and the tensors a score mod
captures through Flex's own backward.

Plain PyTorch, for a reader (what one partial block computes)::

    s = score_mod(q_blk @ k_blk.T * scale, b, h, q_idx, kv_idx)
    s = torch.where(mask_fn(b, h, q_idx, kv_idx), s, -inf)   # full blocks skip this line
    # online softmax over the row's non-empty blocks, as in FlashAttention
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import warnings
from collections import OrderedDict

import torch
from torch import Tensor

from .. import closures, masks, per_element, scores
from ..call import Call
from ..dtypes import compute_dtype
from ..maskplan import MaskPlan
from ..maskplan.tile_kinds import FULL, PARTIAL
from . import refusals, tile_schedule
from .reference import ReferenceBackend
from .refusals import Refusal, reasons

#: Flex's own default sparse block (its CUDA kernels' tiles divide it): query rows and keys per block.
BLOCK_SIZE = 128
#: What Flex computes in (PyTorch 2.13, CPU: "`torch.float`, `torch.float16` and `torch.bfloat16` are
#: supported in FlexAttention for CPU device").
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEVICES = ("cpu", "cuda")
#: Most intervals per row the mask function looks up (one comparison pair each, unrolled).
LOOKUP_INTERVALS = 4
#: Devices whose families take every length (see the module docstring, on compiling). On the CPU each length
#: is a family of its own: PyTorch 2.13's CPU Flex, compiled with variable lengths, can emit C++ that does not
#: compile (``'cur_kvSplitSize1' was not declared``, with a document mask once both lengths vary), and the
#: CPU's automatic order never picks flex.
DYNAMIC_DEVICES = ("cuda",)
#: Most compiled families kept (the oldest is dropped, and compiled again if it comes back).
MAX_FAMILIES = 64
#: Keys evaluated at once when a plan has no intervals and its kinds are found from its cells.
_REFINE_CHUNK = 1024
#: Smallest head dim of ``q``/``k`` handed to Flex on the CPU; smaller ones get zero columns (no score
#: changes). PyTorch 2.13's CPU Flex computes ``q @ k.T`` with a generated micro-GEMM of 16 keys a tile.
#: Its code for a last tile of fewer keys, when that count and the head dim are multiples of the vector
#: width (8 floats under AVX2) and the head dim is below 24, loads and stores a whole tile: it reads
#: keys past the end of ``k`` and writes their scores past the row, which for a block of keys as long
#: as the score buffer's rows (``Lk`` no longer than the block size) lands on the running row maxima.
#: The rows of the last (batch element, key head) then depend on whatever memory follows ``k`` (zeros,
#: garbage or NaN, from call to call). At a head dim of 24 or more that tile takes its bounded code.
CPU_MIN_HEAD_DIM = 24

_REFERENCE = ReferenceBackend()
_log = logging.getLogger(__name__)
_PER_ELEMENT_CODE = per_element.per_element(lambda b, h, q, kv: q).__code__


def _needs_grad(req: Call) -> bool:
    if not torch.is_grad_enabled():
        return False
    if any(t.requires_grad for t in (req.query, req.key, req.value)):
        return True
    return req.score_mod is not None and bool(closures.captured_tensors(req.score_mod))


class FlexBackend:
    """``"flex"``: see the module docstring.

    Args:
        block_size: query rows and keys per block of the ``BlockMask`` (default :data:`BLOCK_SIZE`).
        fallback: ``fallback(request) -> backend``, the backend that serves a call whose family compiled
            Flex cannot serve (the registered ``flex`` is given the next one of the device's automatic
            order); None: the reference backend.

    Raises:
        ValueError: a block size that is not a positive int.
    """

    name = "flex"

    REFUSALS = (
        refusals.weights("flex"),
        refusals.dropout("flex"),
        Refusal(lambda c: c.bias is not None, "a dense bias is not served by flex (pass it as a score_mod)"),
        Refusal(lambda c: c.query.device.type not in DEVICES,
                lambda c: f"flex runs on CPU and CUDA tensors, got {c.query.device}"),
        Refusal(lambda c: c.query.dtype not in DTYPES,
                lambda c: f"FlexAttention computes in float32, bfloat16 and float16, got {c.query.dtype} "
                          "(on CPU, PyTorch 2.13: \"`torch.float`, `torch.float16` and `torch.bfloat16` are "
                          "supported in FlexAttention for CPU device\"; the tiles and reference backends serve it)"),
        Refusal(lambda c: c.query.device.type == "cpu" and _needs_grad(c),
                "FlexAttention does not support backward on CPU (PyTorch 2.13); call it under torch.no_grad(), "
                "or let the tiles backend serve the gradient"),
        Refusal(lambda c: 0 in (c.q_len, c.kv_len) or 0 in c.batch_shape,
                lambda c: f"an empty call (Lq = {c.q_len}, Lk = {c.kv_len}, batch {tuple(c.batch_shape)})"),
        Refusal(lambda c: c.mask is not None and c.query.dim() != 4,
                "a dense mask needs 4-D inputs [B, H, L, E] here (its mask plan gives the BlockMask)"),
    )

    def __init__(self, *, block_size: int | None = None, fallback=None):
        if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool)
                                       or block_size <= 0):
            raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")
        self.block_size = block_size or BLOCK_SIZE
        self.fallback = fallback or (lambda req: _REFERENCE)

    def not_supported_reasons(self, req: Call) -> list[str]:
        why = reasons(self.REFUSALS, req)
        if why or not _failed or torch.compiler.is_compiling():  # (traced: no family of attnkit's own)
            return why
        failed = _failed.get(_inputs(req, self.block_size).family)
        return [f"compiled flex_attention cannot serve this family of calls: {failed}"] if failed else []

    def __call__(self, req: Call) -> tuple[Tensor, None]:
        why = self.not_supported_reasons(req)
        if why:  # select() asks first; this is a direct call
            raise refusals.refused(self.name, req, why)
        if torch.compiler.is_compiling():
            return _traced(req, self.block_size), None
        ins = _inputs(req, self.block_size)
        try:
            out = _family(ins.family).run(ins, req)
        except CompileFailed as e:
            fallback = self.fallback(req)
            warnings.warn(f"attnkit: compiled flex_attention cannot serve this call ({e}); the {fallback.name} "
                          "backend serves it", stacklevel=2)
            return fallback(req)
        return out.reshape(*req.batch_shape, *out.shape[1:]).to(req.query.dtype), None


def _traced(req: Call, block: int) -> Tensor:
    """A call traced by ``torch.compile``: ``flex_attention`` in the caller's graph, compiled with it, and its
    BlockMask from ``create_block_mask``, traced there too (the host's mask plan cannot be). No family of
    attnkit's own and no first-call check: the caller's compile is the only one, as Flex's documentation has
    it. The mask is ``is_causal``/``window``/``mask_mod`` and a dense ``mask`` read cell by cell; a
    :class:`MaskPlan` gives the predicate it was made from."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    dev = req.query.device
    dtype = compute_dtype(req.query.dtype) if dev.type == "cpu" else req.query.dtype
    q, k, v = (t.reshape(-1, *t.shape[-3:]).to(dtype) for t in (req.query, req.key, req.value))
    q, k = _cpu_padded(q, k)
    lq, lk = req.q_len, req.kv_len
    parts = [_unwrapped(m) for m in (req.structured_mask_mod(),) if m is not None]
    # the BlockMask is worked out per batch element and head only where the mask may differ between them (a
    # mask_mod may read b and h; is_causal and window do not; a dense mask where it has those dims)
    per_b = per_h = req.mask_mod is not None
    if req.mask is not None:
        fn, (_, take), _ = _dense(req.mask, dev)
        parts.append(fn)
        per_b, per_h = per_b or take[0], per_h or take[1]
    mask_fn = _every_key if not parts else parts[0] if len(parts) == 1 else masks.and_masks(*parts)

    allowed = _in_range_mask(mask_fn, lq - 1, lk - 1)  # (the lengths as ints: they are the graph's own here)
    block_mask = create_block_mask(allowed, q.shape[0] if per_b else None, q.shape[1] if per_h else None, lq, lk,
                                   device=dev, BLOCK_SIZE=block)
    score_fn = None if req.score_mod is None else _score_function(_unwrapped(req.score_mod), lq - 1, lk - 1)
    out = flex_attention(q, k, v, score_mod=score_fn, block_mask=block_mask, scale=req.scale,
                         enable_gqa=req.heads != req.kv_heads)
    return out.reshape(*req.batch_shape, *out.shape[1:]).to(req.query.dtype)


# --------------------------------------------------------------------------------------------
# What one call hands to Flex
# --------------------------------------------------------------------------------------------


def attention_with_lse(req: Call, *, block_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Compiled Flex's output ``[B, H, Lq, Ev]`` and each row's log-sum-exp ``[B, H, Lq]`` (float32, natural
    log; ``-inf`` for a row with no allowed key, whose output is zeros), for a caller that merges partial
    results, as ring attention merges its blocks (:func:`attnkit.ops.tiles.merge_partials`).

    4-D calls only (``req.query [B, H, Lq, E]``); the caller checks first that Flex may serve the call
    (:meth:`FlexBackend.not_supported_reasons`: on the CPU, no gradient). Both results are differentiable
    where Flex is (CUDA), the log-sum-exp too. The output is in Flex's dtype (the input's on CUDA, float32
    for half inputs on the CPU).

    Raises:
        CompileFailed: compiled Flex cannot serve this family of calls (its compile failed or its first
            output disagreed with the formula; remembered, so the next call of the family raises at once; the
            caller says it and serves the call another way).
    """
    if req.query.dim() != 4:
        raise ValueError(f"attention_with_lse needs 4-D inputs [B, H, L, E], got query shape {tuple(req.query.shape)}")
    ins = _inputs(req, block_size or BLOCK_SIZE, lse=True)
    return _family(ins.family).run(ins, req)  # (a family that failed raises again from its first run)


class _Inputs:
    """Flex's arguments for one call and the family they compile to (worked out once per call)."""

    def __init__(self, args: tuple, family: tuple, what: str, lse: bool = False):
        self.args, self.family, self.what, self.lse = args, family, what, lse


def _inputs(req: Call, block: int, lse: bool = False) -> _Inputs:
    return req.derived.plan(_Inputs, _work_out, req, block, lse, key=(block, lse))


def _work_out(req: Call, block: int, lse: bool = False) -> _Inputs:
    dev = req.query.device
    dtype = compute_dtype(req.query.dtype) if dev.type == "cpu" else req.query.dtype
    grad = _needs_grad(req)
    # [B, H|Hkv, L, E]; detached where no gradient is needed (Flex on the CPU refuses inputs that require one)
    q, k, v = (t.reshape(-1, *t.shape[-3:]).to(dtype) for t in (req.query, req.key, req.value))
    if not grad:
        q, k, v = q.detach(), k.detach(), v.detach()
    what_qk = f"q {tuple(q.shape)}, k {tuple(k.shape)}"
    q, k = _cpu_padded(q, k)
    mask_fn, mask_key, mask_what, block_mask = _mask_and_blocks(req, block)
    score_fn, score_key = None, None
    if req.score_mod is not None:
        score_fn = _score_function(_unwrapped(req.score_mod), *_last_indices(req))
        score_key = _mod_key(req.score_mod)
    gqa = req.heads != req.kv_heads
    family = (dev.type, dev.index, dtype, *(_but_length(t) for t in (q, k, v)), req.scale, gqa,
              grad, torch.is_inference_mode_enabled(), block, mask_key, score_key, lse, None)
    if dev.type not in DYNAMIC_DEVICES or family in _static_only:  # one family per length instead
        family = (*family[:-1], (req.q_len, req.kv_len))
    score_what = "no score_mod" if req.score_mod is None else masks.mod_name("score_mod", _unwrapped(req.score_mod))
    what = f"{dtype} {what_qk}, {mask_what}, {score_what}"
    return _Inputs((q, k, v, score_fn, block_mask, req.scale, gqa), family, what, lse)


def _cpu_padded(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """``q`` and ``k`` with zero columns up to :data:`CPU_MIN_HEAD_DIM` on the CPU (zero columns change no
    score; see that constant for the kernel they steer around)."""
    if q.device.type == "cpu" and q.shape[-1] < CPU_MIN_HEAD_DIM:
        fill = (0, CPU_MIN_HEAD_DIM - q.shape[-1])
        q, k = torch.nn.functional.pad(q, fill), torch.nn.functional.pad(k, fill)
    return q, k


def _but_length(t: Tensor) -> tuple:
    """A ``[B, H, L, E]`` tensor's shape as a family knows it: the length is not part of it (see the module
    docstring, on compiling)."""
    return (*t.shape[:-2], t.shape[-1])


def _unwrapped(mod):
    """A mod as the user wrote it: Flex calls it per element, so attnkit's per-element wrapper
    (:func:`attnkit.per_element.per_element`) is not needed there."""
    return mod.__wrapped__ if getattr(mod, "__code__", None) is _PER_ELEMENT_CODE else mod


def _mod_key(mod) -> tuple:
    """What a compiled kernel of ``mod`` depends on: its code (or type), the plain values it reaches and
    the rank, dtype, device and ``requires_grad`` of each tensor it captures (not their values, nor their
    sizes, which may follow the length: a kernel recompiled for new sizes has them as variables)."""
    mod = _unwrapped(mod)
    tensors, values = closures.captured_state(mod)
    code = getattr(mod, "__code__", None) or type(mod)
    return (code, tuple((type(x), x) for x in values),
            tuple((t.dim(), t.dtype, t.device, t.requires_grad) for t in tensors))


def _last_indices(req: Call) -> tuple[Tensor, Tensor]:
    """``Lq - 1`` and ``Lk - 1`` as 0-d tensors on the call's device: a mod reads them as captured tensors, so a
    kernel compiled for one length serves the next (a Python int would be compiled in as a constant)."""
    return _index_tensors(req.query.device, req.q_len - 1, req.kv_len - 1)


@functools.lru_cache(maxsize=256)
def _index_tensors(dev: torch.device, *values: int) -> tuple[Tensor, ...]:
    """``values`` as 0-d int32 tensors on ``dev``, made once (never written: every layer and step of a model
    shares them, instead of copying two numbers to the GPU at every call). Made outside inference mode, so
    that a first call under ``torch.inference_mode`` leaves tensors a later backward may save."""
    with torch.inference_mode(False):
        return tuple(torch.tensor(x, dtype=torch.int32, device=dev) for x in values)


def _score_function(mod, q_last: Tensor | int, kv_last: Tensor | int):
    """``mod`` as Flex's score mod; ``q_last``, ``kv_last``: ``Lq - 1`` and ``Lk - 1``, 0-d tensors
    (:func:`_last_indices`), or ints where the lengths are the traced graph's own."""

    def score(s, b, h, q_idx, kv_idx):
        # Flex pads the last blocks and may call the mod there: indices kept in range so that a mod that
        # indexes a table with them reads its own entries (the padded cells are masked out)
        out = scores.apply(mod, s, b, h, q_idx.clamp(max=q_last), kv_idx.clamp(max=kv_last))
        # Flex's softmax would drop a NaN score; +inf at an allowed cell makes its row NaN, as the NaN
        # rule says, and at a masked cell it is selected out like anything else there.
        return torch.where(torch.isnan(out), math.inf, out)

    return score


def _in_range_mask(fn, q_last: Tensor | int, kv_last: Tensor | int):
    """``fn`` called with indices in range (see ``_score_function``, whose ``q_last`` and ``kv_last`` these
    are), keys past ``Lk`` masked."""

    def allowed(b, h, q_idx, kv_idx):
        return fn(b, h, q_idx.clamp(max=q_last), kv_idx.clamp(max=kv_last)) & (kv_idx <= kv_last)

    return allowed


def _mask_function(req: Call):
    """``(fn, key, words)``: the mask function of the partial blocks, what its compiled kernel depends
    on, and what it is, in words. Without a mask every key is allowed: a BlockMask of full blocks
    still goes to Flex (without one, Flex on the CPU takes all ``Lk`` keys as one block)."""
    plan = req.mask_plan
    if plan is None:
        return _every_key, ("every key",), "no mask"
    dev = req.query.device
    if req.mask is not None or isinstance(req.mask_mod, MaskPlan):
        if plan.starts is not None and plan.starts.shape[-1] <= LOOKUP_INTERVALS:
            return _lookup(plan, req.heads, dev)
        if req.mask is None:
            pred = _unwrapped(plan.predicate)
            return pred, ("plan", _mod_key(pred)), "the plan's predicate"
        parts = [_dense(req.mask, dev)]
    else:
        parts = []
    band = _band(req, dev)
    if band is not None:
        parts.insert(0, band)
    if req.mask_mod is not None and not isinstance(req.mask_mod, MaskPlan):
        mod = _unwrapped(req.mask_mod)
        parts.append((mod, ("mask_mod", _mod_key(mod)), masks.mod_name("mask_mod", mod)))
    fns, keys, words = zip(*parts, strict=True)
    return (fns[0] if len(fns) == 1 else masks.and_masks(*fns)), keys, " and ".join(words)


def _every_key(b, h, q_idx, kv_idx):
    return kv_idx >= 0


def _band(req: Call, dev: torch.device):
    """``is_causal``/``window`` as ``lo <= kv_idx - q_idx <= hi``, bounds in a tensor (None without either)."""
    if not req.is_causal and req.window is None:
        return None
    far = req.q_len + req.kv_len  # further than any key: no bound on that side
    left, right = req.window or (None, None)
    lo = req.offset - (far if left is None else left)
    hi = req.offset + (far if right is None else right)
    if req.is_causal:
        hi = min(hi, req.offset)
    low, high = _index_tensors(dev, lo, hi)

    def band(b, h, q_idx, kv_idx):
        d = kv_idx - q_idx
        return (d >= low) & (d <= high)

    return band, ("band",), "is_causal/window"


def _lookup(plan: MaskPlan, heads: int, dev: torch.device):
    """The plan's intervals as a predicate: row ``q`` of part ``p`` allows ``kv`` when
    ``starts[p, q, i] <= kv < ends[p, q, i]`` for some ``i``."""
    starts, ends = plan.starts, plan.ends
    k = starts.shape[-1]
    width = 1 << (k - 1).bit_length()  # padded with empty intervals (kv_len, kv_len): kernels shared
    if width > k:
        fill = (0, width - k)
        starts = torch.nn.functional.pad(starts, fill, value=plan.kv_len)
        ends = torch.nn.functional.pad(ends, fill, value=plan.kv_len)
    starts, ends = starts.to(dev, torch.int32), ends.to(dev, torch.int32)
    # part of batch element b, head h: b * H + h (per head), b (per batch element) or 0 (shared)
    per_b, per_h = (heads, 1) if plan.heads is not None else ((1, 0) if starts.shape[0] > 1 else (0, 0))

    def intervals(b, h, q_idx, kv_idx):
        p = b * per_b + h * per_h
        out = (starts[p, q_idx, 0] <= kv_idx) & (kv_idx < ends[p, q_idx, 0])
        for i in range(1, width):
            out = out | ((starts[p, q_idx, i] <= kv_idx) & (kv_idx < ends[p, q_idx, i]))
        return out

    return intervals, ("intervals", per_b, per_h, width), f"the plan's intervals ({k} per row)"


def _dense(mask: Tensor, dev: torch.device):
    """A dense bool mask ``[B|1, H|1, Lq|1, Lk|1]`` read cell by cell."""
    m = masks.as_grid(mask).to(dev)
    take = tuple(n > 1 for n in m.shape)

    def dense(b, h, q_idx, kv_idx):
        return m[tuple(ix if t else 0 for t, ix in zip(take, (b, h, q_idx, kv_idx), strict=True))]

    return dense, ("dense", take), "a dense mask"


def _mask_and_blocks(req: Call, block: int):
    """``(mask fn, its key, words, BlockMask)`` of the call. A plan passed as the mask (what the transformers
    integration hands every layer of a forward) keeps them on itself, per block size, device, heads and
    lengths: the layers that share it share one BlockMask, made once per forward. A plan's tensors do not
    change once built, so neither does what is kept."""
    plan = req.mask_mod if isinstance(req.mask_mod, MaskPlan) and req.mask is None else None
    key = (block, req.query.device, req.heads, req.q_len, req.kv_len)
    kept = None if plan is None else getattr(plan, "_flex_masks", None)
    if kept is not None and key in kept:
        return kept[key]
    mask_fn, mask_key, mask_what = _mask_function(req)
    made = (mask_fn, mask_key, mask_what, _block_mask(req, block, _in_range_mask(mask_fn, *_last_indices(req))))
    if plan is not None:
        if kept is None:  # (two threads may both make one: either is right, one is kept)
            kept = {}
            plan._flex_masks = kept
        kept[key] = made
    return made


def _block_mask(req: Call, block: int, mask_fn):
    """Flex's ``BlockMask`` from the plan's kinds at ``block`` (shared by every batch element and head)."""
    from torch.nn.attention.flex_attention import BlockMask

    kinds = _kinds(req, block)
    dev = req.query.device

    def blocks(kind: int) -> tuple[Tensor, Tensor]:
        hit = kinds == kind
        count = hit.sum(-1, dtype=torch.int32)
        order = torch.argsort((~hit).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # hits first, in order
        return count[None, None].to(dev), order[None, None].contiguous().to(dev)

    (partial, partial_at), (full, full_at) = blocks(PARTIAL), blocks(FULL)
    return BlockMask.from_kv_blocks(partial, partial_at, full, full_at, BLOCK_SIZE=block, mask_mod=mask_fn,
                                    seq_lengths=(req.q_len, req.kv_len))


def _kinds(req: Call, block: int) -> Tensor:
    """``[query blocks, key blocks]`` EMPTY/FULL/PARTIAL: the plan's; without a mask every block full;
    where the plan has no intervals, found by evaluating the mask on every block (a block cut short
    by ``Lk`` is never full)."""
    plan = req.mask_plan
    kinds = plan.kinds(block, block) if plan is not None else None
    if kinds is not None:
        return kinds
    lq, lk = req.q_len, req.kv_len
    kinds = torch.full((-(-lq // block), -(-lk // block)), FULL, dtype=torch.int8)
    if lk % block:
        kinds[:, -1] = PARTIAL
    if plan is None:
        return kinds
    pred = plan.predicate if isinstance(req.mask_mod, MaskPlan) else _cells(req)
    b = torch.arange(math.prod(req.batch_shape)).view(-1, 1, 1, 1)
    h = torch.arange(req.heads).view(1, -1, 1, 1)

    def allowed(q: Tensor, kv: Tensor) -> Tensor:
        dev = req.query.device
        inside = kv < lk
        return pred(b.to(dev), h.to(dev), q.to(dev)[None, None], kv.clamp(max=lk - 1).to(dev)[None, None]).cpu() \
            & inside

    return tile_schedule.refine_kinds(kinds, allowed, lq, block, block, max(block, _REFINE_CHUNK))


def _cells(req: Call):
    """The call's whole mask as a broadcasting predicate (``is_causal``, ``window``, ``mask_mod``, ``mask``)."""
    mod = req.structured_mask_mod()
    if req.mask is None:
        return mod
    grid = masks.as_grid(req.mask)

    def dense(b, h, q_idx, kv_idx):
        return grid[tuple(ix if n > 1 else 0 for n, ix in zip(grid.shape, (b, h, q_idx, kv_idx), strict=True))]

    return dense if mod is None else masks.and_masks(mod, dense)


# --------------------------------------------------------------------------------------------
# Compiled kernels, one per family
# --------------------------------------------------------------------------------------------


class CompileFailed(RuntimeError):
    """Compiled flex_attention cannot serve a family: its compile failed, or its first output disagreed
    with the formula (the message says why, in one line)."""


#: family -> why it could not compile (read without the lock: one dict store per failure)
_failed: dict[tuple, str] = {}
#: families of every length whose compile for variable lengths failed, or disagreed with the formula: their
#: calls go to one family per length instead (as the CPU's do), each compiled and checked on its own
_static_only: set[tuple] = set()
_families: OrderedDict[tuple, _Family] = OrderedDict()
_lock = threading.Lock()


def _family(key: tuple) -> _Family:
    with _lock:
        fam = _families.get(key)
        if fam is None:
            fam = _families[key] = _Family()
            while len(_families) > MAX_FAMILIES:
                _families.popitem(last=False)
        _families.move_to_end(key)
    return fam


class _Family:
    """One compiled ``flex_attention``: made on the first call, under its own lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.fn = None

    def run(self, ins: _Inputs, req: Call):
        fn = self.fn
        if fn is None:
            with self.lock:
                if self.fn is None:
                    return self._first(ins, req)
            fn = self.fn
        graphs, start = _graphs(fn), time.perf_counter()
        try:
            out = fn(*ins.args)
        except torch._dynamo.exc.TorchDynamoException as e:  # a recompile TorchDynamo made on its own failed
            raise self._failure(ins, e, recompile=True) from e
        if _graphs(fn) != graphs:  # TorchDynamo compiled again (new sizes, most likely): new code is checked
            wrong = _disagreement(req, ins, *(out if ins.lse else (out,)))
            if wrong is not None:
                raise self._failure(ins, ValueError(f"the recompiled kernel disagrees with the formula: {wrong}"),
                                    recompile=True)
            why = ("new sizes: the kernel now takes them as variables" if ins.family[-1] is None
                   else "TorchDynamo found its first kernel did not fit this call")
            _log.info("attnkit: compiled flex_attention again for %s, in %.0f s (%s)", ins.what,
                      time.perf_counter() - start, why)
        return out

    def _first(self, ins: _Inputs, req: Call):
        if ins.family in _failed:
            raise CompileFailed(_failed[ins.family])
        how = ("once per dtype, mod and head shape, and again the first time the lengths change"
               if ins.family[-1] is None else "once per shape, dtype and mod")
        _log.info("attnkit: compiling PyTorch's flex_attention for %s (%s)", ins.what, how)
        start = time.perf_counter()
        fn = _compile(ins.lse, dynamic=ins.family[-1] is None)
        try:
            out = fn(*ins.args)
        except Exception as e:  # noqa: BLE001 - whatever stops the compile, the next backend serves the call
            raise self._failure(ins, e) from e
        wrong = _disagreement(req, ins, *(out if ins.lse else (out,)))
        if wrong is not None:
            raise self._failure(ins, ValueError(f"the compiled kernel disagrees with the formula: {wrong}"))
        self.fn = fn
        _log.info("attnkit: compiled in %.0f s", time.perf_counter() - start)
        return out

    @staticmethod
    def _failure(ins: _Inputs, e: Exception, recompile: bool = False) -> CompileFailed:
        """The exception for the call; remembered for the family. A family of every length whose recompile (for
        variable lengths) failed goes to one family per length (``_static_only``): its first kernel, for its
        first sizes, was sound, so the kernels for fixed lengths are tried, each checked, before giving up."""
        first = (str(e).strip().splitlines() or [""])[0]
        reason = f"{type(e).__name__}: {first}"[:300]
        if recompile and ins.family[-1] is None:
            _static_only.add(ins.family)
            return CompileFailed(f"{reason}; from now on, one kernel per length")
        _failed[ins.family] = reason
        return CompileFailed(reason)


#: (batch element, head) pairs of a family's first call whose first, middle and last query rows are
#: recomputed from the formula (spread over the pairs).
CHECK_PAIRS = 16


@torch.no_grad()
def _disagreement(req: Call, ins: _Inputs, out: Tensor, lse: Tensor | None = None) -> str | None:
    """Where the first output of a family (``[B, H, Lq, Ev]``; and each row's log-sum-exp where the family
    returns it) differs from the formula on
    three rows (first, middle, last) of :data:`CHECK_PAIRS` (batch element, head) pairs, in words; None
    where it agrees.

    Compiled Flex is generated code, made anew for each family: PyTorch 2.13 on the CPU miscomputes,
    for one, a mod that gathers a row of a captured table and then picks from it
    (``row = table[ids[q_idx]]; row[0]``). So each family is checked once, like a native kernel,
    before it serves: the rows' scores, the score mod and the mask evaluated as attnkit's other backends
    do (the mask from the plan's intervals, or cell by cell), softmax, values.
    """
    q, k, v = (t.detach().float() for t in ins.args[:3])
    b_n, h_n, lq, lk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    pairs = torch.linspace(0, b_n * h_n - 1, min(CHECK_PAIRS, b_n * h_n)).round().long().unique()
    pairs = pairs.repeat_interleave(3)
    bi, hi = pairs // h_n, pairs % h_n
    qi = torch.tensor([0, lq // 2, lq - 1]).repeat(len(pairs) // 3)
    kv_heads = hi // (h_n // k.shape[1])
    s = torch.einsum("ne,nke->nk", q[bi, hi, qi], k[bi, kv_heads]) * req.scale  # [n, Lk]
    dev = q.device
    b, h, i = (x.to(dev).view(1, 1, -1, 1) for x in (bi, hi, qi))
    kv = torch.arange(lk, device=dev).view(1, 1, 1, -1)
    if req.score_mod is not None:
        s = scores.apply(req.score_mod, s.view(1, 1, -1, lk), b, h, i, kv).view(-1, lk)
    allowed = _allowed_rows(req, bi, hi, qi, b, h, i, kv)
    if allowed is not None:
        s = torch.where(allowed, s, -math.inf)
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.where(dead, 0.0, torch.softmax(s, -1))  # a dead row's softmax is NaN
    want = torch.einsum("nk,nke->ne", p, v[bi, kv_heads])
    got = out.detach().float()[bi, hi, qi]
    tol = 1e-4 if ins.args[0].dtype == torch.float32 else 3e-2
    if lse is not None:  # each row's log-sum-exp as a last column: -inf for a dead row on both sides
        got = torch.cat([got, lse.detach().float()[bi, hi, qi, None]], -1)
        want = torch.cat([want, torch.logsumexp(s, -1, keepdim=True)], -1)
    bad = (got.isnan() != want.isnan()) | ((got - want).abs() > tol * (1 + want.abs()))  # (-inf - -inf: NaN, fine)
    if not bool(bad.any()):
        return None
    at = int(bad.any(-1).nonzero()[0])
    what = "the log-sum-exp" if lse is not None and not bool(bad[at, :-1].any()) else "largest difference"
    return (f"batch {int(bi[at])}, head {int(hi[at])}, query {int(qi[at])}: {what} "
            f"{float((got[at] - want[at]).abs().nan_to_num(math.inf).max()):.3g}")


def _allowed_rows(req: Call, bi, hi, qi, b, h, i, kv) -> Tensor | None:
    """Bool ``[n, Lk]``: the keys each sampled row ``(bi, hi, qi)`` may attend (None: every key)."""
    plan = req.mask_plan
    if plan is None:
        return None
    if plan.starts is not None:
        part = bi * req.heads + hi if plan.heads is not None else (bi if plan.starts.shape[0] > 1 else 0 * bi)
        starts, ends = (t[part, qi].to(kv.device)[..., None] for t in (plan.starts, plan.ends))  # [n, K, 1]
        keys = kv.view(1, 1, -1)
        return ((starts <= keys) & (keys < ends)).any(1)
    pred = plan.predicate if isinstance(req.mask_mod, MaskPlan) else _cells(req)
    return torch.broadcast_to(pred(b, h, i, kv), (1, 1, len(bi), kv.shape[-1])).reshape(len(bi), -1)


def _compile(lse: bool = False, dynamic: bool = False):
    """``torch.compile(flex_attention)`` on a code object of its own (see the module docstring); ``lse``: it
    returns ``(out, log-sum-exp)``; ``dynamic``: sizes that change between calls become variables
    (TorchDynamo's automatic dynamic shapes), else every size is compiled in."""
    run = _flex_call(lse)
    run.__code__ = run.__code__.replace()
    return torch.compile(run, dynamic=None if dynamic else False, fullgraph=True)


def _graphs(fn) -> int:
    """How many graphs TorchDynamo keeps for the compiled ``fn`` (its cache entries for ``fn``'s code object);
    for anything else, how many it has compiled in this process so far, which another thread's compile moves
    too."""
    code = getattr(getattr(fn, "_torchdynamo_orig_callable", None), "__code__", None)
    if code is not None:
        try:
            return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))
        except (AttributeError, TypeError):  # (a PyTorch without it)
            pass
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _flex_call(lse: bool = False):
    """``run(q, k, v, score_mod, block_mask, scale, enable_gqa)``: Flex's output, or ``(out, log-sum-exp)``."""
    from torch.nn.attention import flex_attention as fa

    aux = getattr(fa, "AuxRequest", None)  # (PyTorch 2.9 on; before it, return_lse=True, deprecated since)

    def run(q, k, v, score_mod, block_mask, scale, enable_gqa):
        kw = {"score_mod": score_mod, "block_mask": block_mask, "scale": scale, "enable_gqa": enable_gqa}
        if not lse:
            return fa.flex_attention(q, k, v, **kw)
        if aux is None:
            return fa.flex_attention(q, k, v, return_lse=True, **kw)
        out, extra = fa.flex_attention(q, k, v, return_aux=aux(lse=True), **kw)
        return out, extra.lse

    return run
