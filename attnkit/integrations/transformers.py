"""attnkit as a Hugging Face transformers attention implementation named ``"attnkit"``.

Importing this module (or calling :func:`register`, which is idempotent) registers
``"attnkit"`` with transformers' public ``AttentionInterface`` and ``AttentionMaskInterface``,
so ``from_pretrained(..., attn_implementation="attnkit")``, ``config._attn_implementation =
"attnkit"`` and ``model.set_attn_implementation("attnkit")`` all work.

Supported: transformers 5.x (checked on 5.24.0); other versions raise at registration.

Masks: this first version registers transformers' own ``sdpa_mask`` for ``"attnkit"``.
When that skips the mask (pure causal or no mask) the attention call gets ``is_causal``
and no tensor; otherwise it gets transformers' exact dense bool mask (True = may attend),
which attnkit reads back into row intervals for the banded kernel where the mask has that
form. Reading the mask functions' structure directly (sliding window, padding, packed
sequences) without the dense tensor is left to do.

Honoured: ``scaling``, ``dropout``, ``softcap`` (Gemma 2, through ``attnkit.scores.softcap``),
GQA (no ``repeat_kv``), ``output_attentions`` (weights from ``backend="reference"``, as eager).
Attention sinks (``s_aux``/``sinks``) and ``position_bias`` are refused with a ValueError naming
the model class and the argument, never served inexactly.
"""

from __future__ import annotations

import torch

import attnkit
from attnkit import scores

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


def register() -> None:
    """Register ``"attnkit"`` with transformers' attention and mask interfaces (idempotent)."""
    _check_version()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attnkit_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
