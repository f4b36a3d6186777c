"""attnkit as a Hugging Face transformers attention implementation named ``"attnkit"``.

Importing this module (or calling :func:`register`, which is idempotent) registers
``"attnkit"`` with transformers' public ``AttentionInterface`` and ``AttentionMaskInterface``,
so ``from_pretrained(..., attn_implementation="attnkit")``, ``config._attn_implementation =
"attnkit"`` and ``model.set_attn_implementation("attnkit")`` all work.

Supported: transformers 5.x (tested on 5.0.0 and 5.24.0); other versions raise at registration.

Masks arrive as structure, never as an n x n tensor: transformers hands every mask interface
the mask *function* it composed for the layer type (causal, a sliding window, Gemma's
alternating local/global layers, padding, packed sequences whose position ids restart) with the
query and key offsets. :func:`attnkit_mask` turns it into an :class:`attnkit.MaskPlan` once per
forward and mask type (each row's allowed keys as intervals, found by evaluating the function once,
see :mod:`attnkit.maskplan`), and every layer of that type reuses it: windowed and padded layers run on
the banded kernel. A plain causal mask without padding, or no mask at all, is passed as
``is_causal`` (or nothing), as transformers does for SDPA. A decode step (one query) is the exception: its
mask is one row per sequence, evaluated cell by cell as ``sdpa_mask`` does (cheaper than a plan there), and
the step reads only the keys from the first that a row may see to the last (:func:`_few_queries`).

Honoured: ``scaling``, ``dropout``, ``softcap`` (Gemma 2, through ``attnkit.scores.softcap``),
GQA (no ``repeat_kv``: grouped heads are read in place), ``output_attentions`` (weights from
``backend="reference"``, as eager).

``position_bias`` (T5, mT5, UMT5, LongT5 and the like: a dense ``[1, H, Lq, Lk]`` term that eager adds
to the scaled scores) is served exactly, in one of three ways:

* all zeros and not requiring grad (T5's cross-attention): dropped, nothing is added;
* Toeplitz, one value per head and ``kv - q`` in every batch row (T5's bucketed relative bias): an
  :class:`attnkit.scores.DiagonalBias` score_mod, whose table ``[H, Lq + Lk - 1]`` is read from the
  tensor's first column and first row, so the banded kernel serves it (and flex and the tiles call it
  cell by cell); gradients reach the tensor summed along each diagonal, which is what eager gives
  whatever the bias is computed from as a function of head and ``kv - q`` (T5's bucket embedding). A
  leaf tensor that requires grad keeps its per-cell gradient: it goes the dense way;
* anything else (a per-batch bias, another model's): the dense ``bias=`` of :func:`attnkit.attention`.

Whether a tensor is zeros or Toeplitz is checked exactly (every cell) once per tensor and version:
T5 hands the same tensor to every layer of a stack. Under ``torch.compile`` nothing is decided on
values: the tensor is passed as the dense ``bias=``.

Attention sinks (``s_aux``/``sinks``), and a ``softcap`` together with a ``position_bias`` (no model
has both, and eager gives no order for them), are refused with a ValueError naming the model class and
the argument, never served inexactly.
"""

from __future__ import annotations

import threading

import torch
from torch.utils.weak import WeakIdKeyDictionary

import attnkit
from attnkit import scores
from attnkit.maskplan import MaskPlan

NAME = "attnkit"
_SUPPORTED_MAJOR = 5
#: A call with this many queries or fewer (a decode step) gets a dense mask, over the keys it may see only.
FEW_QUERIES = 1


def _check_version() -> None:
    """Refuse transformers versions outside the 5.x range this adapter was written against."""
    import transformers

    version = transformers.__version__
    major = int(version.split(".")[0])
    if major != _SUPPORTED_MAJOR:
        raise ImportError(
            f"attnkit.integrations.transformers supports transformers 5.x; "
            f"installed transformers is {version}"
        )


def _refuse(module: torch.nn.Module, argument: str, value) -> None:
    raise ValueError(
        f"attnkit cannot serve {type(module).__name__} exactly: argument {argument!r} "
        f"got {value!r}; expected it absent (use attn_implementation='eager' for this model)"
    )


def attnkit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention signature over :func:`attnkit.attention`; returns ``[B, Lq, H, E]``."""
    for argument in ("s_aux", "sinks"):
        if kwargs.get(argument) is not None:
            _refuse(module, argument, type(kwargs[argument]).__name__)
    cap, position_bias = kwargs.get("softcap"), kwargs.get("position_bias")
    if cap is not None and position_bias is not None:  # no model has both, nor an eager order for them
        _refuse(module, "softcap", f"{cap!r} together with a position_bias")
    position_mod, dense_bias = (None, None) if position_bias is None else _position_bias_terms(
        position_bias, query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if isinstance(attention_mask, MaskPlan):  # attnkit_mask's: the layer's whole mask, worked out once
        causal = False
    else:
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            _refuse(module, "attention_mask", f"dtype {attention_mask.dtype}")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        causal = bool(is_causal) and attention_mask is None and query.shape[2] > 1
        if attention_mask is not None and query.shape[2] <= FEW_QUERIES and not torch.compiler.is_compiling():
            key, value, attention_mask = _few_queries(attention_mask, key, value)
    score_mod = position_mod if cap is None else scores.softcap(float(cap))
    want_weights = bool(kwargs.get("output_attentions", False))
    result = attnkit.attention(
        query, key, value,
        mask=attention_mask,
        bias=dense_bias,
        is_causal=causal,
        score_mod=score_mod,
        scale=scaling,
        dropout_p=dropout if module.training else 0.0,
        return_weights=want_weights,
        backend="reference" if want_weights else "auto",
    )
    out, weights = result if want_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _few_queries(mask: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """A decode step's dense mask (``[B|1, H|1, Lq, Lk]`` bool, :func:`attnkit_mask`'s for a few queries) as
    ``(key, value, mask)`` over the keys from the first that a row may see to the last: views, and the mask's
    columns for them (None when it allows every one). A windowed layer's step then reads its window only; the
    keys left out are masked for every row, so the answer is the same. A mask that allows nothing is kept whole
    (its rows are dead: zeros)."""
    seen = mask.flatten(0, -2).any(0)  # [Lk]: keys some row may see
    used = seen.nonzero()
    if not used.numel():
        return key, value, mask
    lo, hi = int(used[0]), int(used[-1]) + 1
    if lo or hi < mask.shape[-1]:
        key, value, mask = key[..., lo:hi, :], value[..., lo:hi, :], mask[..., lo:hi]
    return key, value, None if bool(mask.all()) else mask


def _position_bias_terms(position_bias: torch.Tensor | None, batch: int, heads: int, q_len: int,
                         kv_len: int) -> tuple[scores.DiagonalBias | None, torch.Tensor | None]:
    """A model's ``position_bias`` (added to the scaled scores, as eager does) as ``(score_mod, bias)``
    for :func:`attnkit.attention`: ``(None, None)`` for zeros that do not require grad,
    ``(DiagonalBias, None)`` for a Toeplitz ``[1 or B, H, Lq, Lk]`` tensor, else ``(None, position_bias)``.

    Shape notation: ``B`` batch, ``H`` query heads, ``Lq``/``Lk`` query/key lengths.

    Args:
        position_bias: a float tensor broadcastable to ``[B, H, Lq, Lk]``, or None.
        batch, heads, q_len, kv_len: the call's sizes.

    Raises:
        TypeError: ``position_bias`` is not a floating-point tensor (a shape that does not broadcast
            is :func:`attnkit.attention`'s to refuse).
    """
    if position_bias is None:
        return None, None
    if not isinstance(position_bias, torch.Tensor) or not position_bias.is_floating_point():
        is_tensor = isinstance(position_bias, torch.Tensor)
        got = f"dtype {position_bias.dtype}" if is_tensor else type(position_bias).__name__
        raise TypeError(f"position_bias must be a floating-point tensor [1 or B, H, Lq, Lk] added to the scores, "
                        f"got {got}")
    if torch.compiler.is_compiling():  # a traced graph cannot branch on the tensor's values
        return None, position_bias
    full = position_bias.dim() == 4 and tuple(position_bias.shape) in ((1, heads, q_len, kv_len),
                                                                       (batch, heads, q_len, kv_len))
    if not full or 0 in position_bias.shape:
        return None, position_bias
    kind = _kind(position_bias)
    if kind == "zeros" and not position_bias.requires_grad:
        return None, None
    if kind == "other" or (position_bias.requires_grad and position_bias.is_leaf):
        return None, position_bias  # a leaf's own gradient is per cell, not per diagonal
    return _diagonal_bias(position_bias), None


#: The verdict on each position_bias tensor seen, ``tensor -> (version, kind)``, held weakly (by identity),
#: so that the stack's later layers, handed the same tensor, do not check it again. Touched under _KINDS_LOCK.
_KINDS = WeakIdKeyDictionary()
_KINDS_LOCK = threading.Lock()


def _kind(t: torch.Tensor) -> str:
    """``"zeros"``, ``"toeplitz"`` (each head's cells depend only on ``kv - q``, and every batch row is the
    first) or ``"other"``: checked on every cell, once per tensor and version (an inference tensor, which
    has no version counter, on every call)."""
    version = None if t.is_inference() else t._version
    if version is not None:
        with _KINDS_LOCK:
            seen = _KINDS.get(t)
        if seen is not None and seen[0] == version:
            return seen[1]
    kind = _classify(t)
    if version is not None:
        with _KINDS_LOCK:
            _KINDS[t] = (version, kind)
    return kind


def _classify(t: torch.Tensor) -> str:
    """:func:`_kind`'s check itself, on every cell of ``t`` ``[1 or B, H, Lq, Lk]``."""
    with torch.no_grad():
        if not bool(t.any()):
            return "zeros"
        same_rows = t.shape[0] == 1 or torch.equal(t, t[:1].expand_as(t))
        # each cell equals the one up and to the left of it: compared as two views, nothing is copied
        return "toeplitz" if same_rows and torch.equal(t[..., 1:, 1:], t[..., :-1, :-1]) else "other"


def _diagonal_bias(position_bias: torch.Tensor) -> scores.DiagonalBias:
    """A Toeplitz ``position_bias`` ``[1 or B, H, Lq, Lk]`` as a :class:`attnkit.scores.DiagonalBias` that
    reads its first batch row: cell by cell, or as the table ``[H, Lq + Lk - 1]`` (column
    ``kv - q + Lq - 1``) of the first column reversed (``kv - q < 0``) and the first row."""
    first = position_bias[0]  # [H, Lq, Lk]; the other batch rows are equal to it

    def bias(dtype, b, h, q_idx, kv_idx):
        return scores.like_score(first[h, q_idx, kv_idx], dtype)

    def table(heads, q_len, kv_len, dtype=None):
        if (heads, q_len, kv_len) != tuple(first.shape):
            return None
        diagonals = torch.cat([first[:, 1:, 0].flip(-1), first[:, 0, :]], dim=-1)  # [H, Lq - 1 + Lk]
        return scores.like_score(diagonals, dtype or diagonals.dtype)

    return scores.DiagonalBias((bias, table))


def attnkit_mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None, q_offset: int = 0,
                 kv_offset: int = 0, mask_function=None, attention_mask: torch.Tensor | None = None,
                 allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False, device="cpu",
                 cache_position: torch.Tensor | None = None, use_vmap: bool = False, **_) -> MaskPlan | None:
    """transformers' mask interface for ``"attnkit"``: the layer's mask as a :class:`attnkit.MaskPlan`.

    ``mask_function(b, h, q_idx, kv_idx)`` is transformers' composed predicate on absolute
    positions (query ``q_offset + i``, or ``cache_position[i]`` as transformers before 5.x's later
    releases passes them; key ``kv_offset + j``), ``attention_mask`` the 2-D padding mask. Returns
    None where no mask is needed (causal without padding, with the queries at the end of the keys,
    or full attention), as ``sdpa_mask`` does, and for a decode step (:data:`FEW_QUERIES`) the dense bool
    mask ``[B, 1, Lq, Lk]`` itself, evaluated on broadcasting indices.
    """
    from transformers.masking_utils import (
        and_masks,
        bidirectional_mask_function,
        causal_mask_function,
        padding_mask_function,
        prepare_padding_mask,
    )

    # Under torch.compile nothing is decided on values (a graph cannot branch on them): the positions
    # are read through cache_position and a padding term is kept even where every key is real.
    compiling = torch.compiler.is_compiling()
    if cache_position is not None:  # the query positions themselves
        q_length, device = cache_position.numel(), cache_position.device
        q_offset = int(cache_position[0]) if q_length and not compiling else 0
        contiguous = not compiling and torch.equal(
            cache_position, torch.arange(q_offset, q_offset + q_length, device=device))
    else:
        contiguous = True
    mask_function = causal_mask_function if mask_function is None else mask_function
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    padding = None if padding is None else padding.bool()  # models pass bool; a 0/1 mask means the same
    if padding is not None and not compiling and bool(padding[:, kv_offset:kv_offset + kv_length].all()):
        padding = None  # every key real: no padding term
    if padding is None and contiguous:
        aligned = q_offset - kv_offset == kv_length - q_length  # attnkit's bottom-right causal
        if allow_is_causal_skip and mask_function is causal_mask_function and aligned:
            return None
        if allow_is_bidirectional_skip and mask_function is bidirectional_mask_function:
            return None
    whole = mask_function if padding is None else and_masks(mask_function, padding_mask_function(padding))

    # transformers evaluates its mask functions on broadcasting indices unless told to vmap them
    at_positions = _AtPositions(whole, q_offset, kv_offset, None if contiguous else cache_position,
                                broadcasts=not use_vmap)
    if q_length <= FEW_QUERIES and not use_vmap and not compiling:
        # A decode step: its few rows evaluated cell by cell cost less than working out a plan (whose intervals
        # only pay where a kernel walks many rows), as transformers' sdpa_mask does.
        b, q, kv = (torch.arange(n, device=device) for n in (batch_size, q_length, kv_length))
        grid = at_positions(b.view(-1, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device),
                            q.view(1, 1, -1, 1), kv.view(1, 1, 1, -1))
        return grid.expand(batch_size, 1, q_length, kv_length)
    return attnkit.mask_plan(at_positions, q_len=q_length, kv_len=kv_length, batch=batch_size, device=device)


class _AtPositions:
    """A transformers mask function read at attnkit's indices: query ``i`` at the model's position
    ``q_offset + i`` (or ``cache_position[i]`` when the positions are not contiguous), key ``j`` at
    ``kv_offset + j``. ``broadcasts``: whether the function is written for broadcasting indices
    (:func:`attnkit.per_element.broadcasts`); transformers vmaps the others."""

    def __init__(self, whole, q_offset: int, kv_offset: int, cache_position: torch.Tensor | None, *, broadcasts: bool):
        self.whole, self.q_offset, self.kv_offset, self.cache_position = whole, q_offset, kv_offset, cache_position
        self.broadcasts = broadcasts

    def __call__(self, b, h, q_idx, kv_idx):
        q_pos = q_idx + self.q_offset if self.cache_position is None else self.cache_position[q_idx]
        return self.whole(b, h, q_pos, kv_idx + self.kv_offset)


def register() -> None:
    """Register ``"attnkit"`` with transformers' attention and mask interfaces (idempotent)."""
    _check_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # The mask first: a thread that finds "attnkit" among the attention functions finds its mask too.
    # (Each register is one dict update; calling this from several threads writes the same values.)
    AttentionMaskInterface.register(NAME, attnkit_mask)
    AttentionInterface.register(NAME, attnkit_attention_forward)


register()
