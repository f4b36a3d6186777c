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
``is_causal`` (or nothing), as transformers does for SDPA.

Honoured: ``scaling``, ``dropout``, ``softcap`` (Gemma 2, through ``attnkit.scores.softcap``),
GQA (no ``repeat_kv``), ``output_attentions`` (weights from ``backend="reference"``, as eager).
Attention sinks (``s_aux``/``sinks``) and ``position_bias`` are refused with a ValueError naming
the model class and the argument, never served inexactly.
"""

from __future__ import annotations

import torch

import attnkit
from attnkit import scores
from attnkit.maskplan import MaskPlan

NAME = "attnkit"
_SUPPORTED_MAJOR = 5


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
    for argument in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(argument) is not None:
            _refuse(module, argument, type(kwargs[argument]).__name__)
    if isinstance(attention_mask, MaskPlan):  # attnkit_mask's: the layer's whole mask, worked out once
        causal = False
    else:
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            _refuse(module, "attention_mask", f"dtype {attention_mask.dtype}")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        causal = bool(is_causal) and attention_mask is None and query.shape[2] > 1
    cap = kwargs.get("softcap")
    want_weights = bool(kwargs.get("output_attentions", False))
    result = attnkit.attention(
        query, key, value,
        mask=attention_mask,
        is_causal=causal,
        score_mod=scores.softcap(float(cap)) if cap is not None else None,
        scale=scaling,
        dropout_p=dropout if module.training else 0.0,
        return_weights=want_weights,
        backend="reference" if want_weights else "auto",
    )
    out, weights = result if want_weights else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def attnkit_mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None, q_offset: int = 0,
                 kv_offset: int = 0, mask_function=None, attention_mask: torch.Tensor | None = None,
                 allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False, device="cpu",
                 cache_position: torch.Tensor | None = None, use_vmap: bool = False, **_) -> MaskPlan | None:
    """transformers' mask interface for ``"attnkit"``: the layer's mask as a :class:`attnkit.MaskPlan`.

    ``mask_function(b, h, q_idx, kv_idx)`` is transformers' composed predicate on absolute
    positions (query ``q_offset + i``, or ``cache_position[i]`` as transformers before 5.x's later
    releases passes them; key ``kv_offset + j``), ``attention_mask`` the 2-D padding mask. Returns
    None where no mask is needed (causal without padding, with the queries at the end of the keys,
    or full attention), as ``sdpa_mask`` does.
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
