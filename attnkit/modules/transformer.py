"""Transformer blocks on :class:`MultiHeadAttention`: encoder/decoder layers, stacks, encoder-decoder.

The layers follow ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (Vaswani et
al. 2017) sublayer by sublayer, with the same parameter names where they have one (``self_attn``,
``norm1``, ``linear1`` inside ``ff``, ...), so ``from_torch`` copies weights one to one and the
outputs agree. What differs is attnkit's conventions:

* batch-first ``[B, L, E]`` always;
* masks are bool with ``True`` = *may attend* (``mask``), ``key_mask [B, L]`` ``True`` = real token,
  additive terms go in ``bias``; :func:`from_torch_attn_mask` and
  :func:`attnkit.masks.from_key_padding_mask` convert PyTorch's opposite conventions;
* the decoder's self-attention is causal by default and accepts a :class:`~attnkit.cache.KVCache`
  per layer, so generation appends one token at a time (causal masks align bottom-right);
* positional encodings plug into the self-attention (``rotary=``, ``position_bias=``);
* what pretrained models need is a constructor argument, not a subclass: activations by their
  Hugging Face names (:data:`ACTIVATIONS`), separate dropout rates for the attention weights and
  the feed-forward hidden layer, a score ``scale``; and an encoder layer with ``is_causal`` and a
  ``cache`` is a decoder-only (GPT-style) block. :mod:`attnkit.models` builds BERT and GPT-2 from
  these layers.

Post-norm (``norm_first=False``, the paper, BERT, most tutorials) is ``x = LayerNorm(x + Dropout(Sublayer(x)))``;
pre-norm (GPT-2 and most modern models) is ``x = x + Dropout(Sublayer(LayerNorm(x)))``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor, nn

from .attention import MultiHeadAttention

if TYPE_CHECKING:
    from ..cache import KVCache

__all__ = [
    "ACTIVATIONS",
    "FeedForward",
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
]


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU by its tanh approximation (GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


#: Activations by name: PyTorch's (``relu``, ``gelu``) and Hugging Face's ``hidden_act`` /
#: ``activation_function`` names, so a model's config names its layers' activation directly.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "silu": F.silu,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
}


def _activation(activation) -> Callable[[Tensor], Tensor]:
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a callable, got {activation!r}")
        return ACTIVATIONS[activation]
    if not callable(activation):
        raise TypeError(f"activation must be a name or a callable, got {type(activation).__name__}")
    return activation


class FeedForward(nn.Module):
    """The position-wise feed-forward sublayer: ``linear2(dropout(activation(linear1(x))))``.

    Args:
        embed_dim: ``E``, in and out.
        ffn_dim: the hidden width (``dim_feedforward`` in PyTorch; 4E in the paper).
        activation: a name from :data:`ACTIVATIONS` or a callable.
        dropout: on the hidden activations, while training.
        bias: biases in both linears.
    """

    def __init__(self, embed_dim: int, ffn_dim: int, *, activation="relu", dropout: float = 0.0,
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.linear1 = nn.Linear(embed_dim, ffn_dim, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(ffn_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.activation = _activation(activation)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class _Layer(nn.Module):
    """Shared constructor arguments and the residual wiring of both layer kinds."""

    norm_first: bool

    def _residual(self, x: Tensor, norm: nn.Module, dropout: nn.Module, sublayer: Callable[[Tensor], Tensor]):
        return self._add(x, norm, dropout(sublayer(self._input(x, norm))))

    def _input(self, x: Tensor, norm: nn.Module) -> Tensor:
        """What a sublayer reads: ``norm(x)`` in pre-norm, ``x`` in post-norm."""
        return norm(x) if self.norm_first else x

    def _add(self, x: Tensor, norm: nn.Module, branch: Tensor) -> Tensor:
        """The residual sum: ``x + branch`` in pre-norm, ``norm(x + branch)`` in post-norm."""
        return x + branch if self.norm_first else norm(x + branch)


def _dropouts(dropout: float, attn_dropout: float | None, ffn_dropout: float | None) -> tuple[float, float]:
    """The attention-weight and feed-forward-hidden rates; ``None`` means ``dropout`` (PyTorch's one rate)."""
    return (dropout if attn_dropout is None else attn_dropout), (dropout if ffn_dropout is None else ffn_dropout)


class TransformerEncoderLayer(_Layer):
    """Self-attention and feed-forward, each wrapped in residual + LayerNorm.

    With ``is_causal=True`` (and a :class:`~attnkit.cache.KVCache` when decoding) it is also the
    block of a decoder-only model: GPT-2 is a stack of these with ``norm_first=True``.

    Shape notation: ``B`` batch, ``L`` length, ``E`` = ``embed_dim``, ``H`` heads.

    Args:
        embed_dim: ``E``.
        num_heads: ``H``.
        ffn_dim: feed-forward width (2048 as in PyTorch).
        dropout: on both residual branches, and on the attention weights and the FFN hidden
            layer unless ``attn_dropout`` / ``ffn_dropout`` say otherwise.
        attn_dropout: on the attention weights (BERT's ``attention_probs_dropout_prob``).
        ffn_dropout: on the FFN hidden layer (``0.0`` in BERT and GPT-2).
        activation: a name from :data:`ACTIVATIONS` (``"relu"``, ``"gelu"``, ``"gelu_new"``, ...)
            or a callable.
        norm_first: pre-norm when ``True``, post-norm (the paper's) when ``False``.
        layer_norm_eps: LayerNorm epsilon.
        bias: biases in the linears and LayerNorms.
        scale: the attention's score scale (default ``1 / sqrt(head_dim)``).
        rotary, position_bias: positional encodings of the self-attention (see
            :class:`MultiHeadAttention`).
        backend: attention backend.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, ffn_dim: int = 2048, dropout: float = 0.1,
                 attn_dropout: float | None = None, ffn_dropout: float | None = None, activation="relu",
                 norm_first: bool = False, layer_norm_eps: float = 1e-5, bias: bool = True,
                 scale: float | None = None, rotary=None, position_bias=None, backend: str = "auto",
                 device=None, dtype=None) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        attn_p, ffn_p = _dropouts(dropout, attn_dropout, ffn_dropout)
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(embed_dim, num_heads, dropout=attn_p, bias=bias, scale=scale,
                                            rotary=rotary, position_bias=position_bias, backend=backend, **fk)
        self.ff = FeedForward(embed_dim, ffn_dim, activation=activation, dropout=ffn_p, bias=bias, **fk)
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias, **fk)
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias, **fk)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    @property
    def attn(self) -> MultiHeadAttention:
        """The self-attention (``self_attn``, PyTorch's name), under the name the models' users know."""
        return self.self_attn

    def forward(self, x: Tensor, *, mask: Tensor | None = None, key_mask: Tensor | None = None,
                bias: Tensor | None = None, is_causal: bool = False, mask_mod=None, need_weights: bool = False,
                cache: KVCache | None = None, backend: str | None = None):
        """``x [B, L, E] -> [B, L, E]``, or ``(x, weights)`` with ``need_weights``.

        Args:
            x: ``[B, L, E]`` (only the new tokens when ``cache`` is given).
            mask: bool, ``True`` = may attend: ``[L, L]``, ``[B, L, L]`` or ``[B, H, L, L]``; or an
                :class:`attnkit.MaskPlan`.
            key_mask: ``[B, L]`` bool, ``True`` = real token.
            bias: float added to the scores, shapes as ``mask``.
            is_causal: look-ahead masking (aligned bottom-right).
            mask_mod: a predicate on ``(b, h, q_idx, kv_idx)``, e.g. ``attnkit.masks.padding_mod(lengths)``,
                which interval-reading backends ("band") serve without a dense mask.
            need_weights: also return the self-attention's weights ``[B, H, L, Lk]``.
            cache: a :class:`~attnkit.cache.KVCache` for the self-attention (decoding).
            backend: this call's attention backend instead of the module's (nothing on it changes).
        """
        res = self.self_attn(self._input(x, self.norm1), mask=mask, key_mask=key_mask, bias=bias,
                             is_causal=is_causal, mask_mod=mask_mod, need_weights=need_weights, cache=cache,
                             backend=backend)
        a, w = res if need_weights else (res, None)
        x = self._add(x, self.norm1, self.dropout1(a))
        x = self._residual(x, self.norm2, self.dropout2, self.ff)
        return (x, w) if need_weights else x

    @classmethod
    def from_torch(cls, m: nn.TransformerEncoderLayer) -> TransformerEncoderLayer:
        """Copy a ``torch.nn.TransformerEncoderLayer`` (same outputs; give our masks, not torch's)."""
        from .transformer_interop import encoder_layer_from_torch

        return encoder_layer_from_torch(cls, m)


class TransformerDecoderLayer(_Layer):
    """Causal self-attention, cross-attention to ``memory``, and feed-forward.

    Arguments as :class:`TransformerEncoderLayer`; ``rotary`` and ``position_bias`` apply to the
    self-attention only (the cross-attention has no relative positions).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, ffn_dim: int = 2048, dropout: float = 0.1,
                 attn_dropout: float | None = None, ffn_dropout: float | None = None, activation="relu",
                 norm_first: bool = False, layer_norm_eps: float = 1e-5, bias: bool = True,
                 scale: float | None = None, rotary=None, position_bias=None, backend: str = "auto",
                 device=None, dtype=None) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        attn_p, ffn_p = _dropouts(dropout, attn_dropout, ffn_dropout)
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(embed_dim, num_heads, dropout=attn_p, bias=bias, scale=scale,
                                            rotary=rotary, position_bias=position_bias, backend=backend, **fk)
        self.cross_attn = MultiHeadAttention(embed_dim, num_heads, dropout=attn_p, bias=bias, scale=scale,
                                             backend=backend, **fk)
        self.ff = FeedForward(embed_dim, ffn_dim, activation=activation, dropout=ffn_p, bias=bias, **fk)
        self.norm1 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias, **fk)
        self.norm2 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias, **fk)
        self.norm3 = nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias, **fk)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def forward(self, x: Tensor, memory: Tensor, *, mask: Tensor | None = None, key_mask: Tensor | None = None,
                bias: Tensor | None = None, is_causal: bool = True, memory_mask: Tensor | None = None,
                memory_key_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """``x [B, Lt, E]``, ``memory [B, Ls, E]`` -> ``[B, Lt, E]``.

        Args:
            x: the target tokens, ``[B, Lt, E]`` (only the new ones when ``cache`` is given).
            memory: the encoder output ``[B, Ls, E]``.
            mask, key_mask, bias: for the self-attention (``Lk`` = all cached tokens with a cache).
            is_causal: causal self-attention (default), aligned bottom-right.
            memory_mask: bool ``True`` = may attend, ``[Lt, Ls]``, ``[B, Lt, Ls]`` or ``[B, H, Lt, Ls]``.
            memory_key_mask: ``[B, Ls]`` bool, ``True`` = real source token.
            cache: this layer's self-attention :class:`~attnkit.cache.KVCache`.
        """
        def self_attend(h):
            return self.self_attn(h, mask=mask, key_mask=key_mask, bias=bias, is_causal=is_causal, cache=cache)

        def cross_attend(h):
            return self.cross_attn(h, memory, mask=memory_mask, key_mask=memory_key_mask)

        x = self._residual(x, self.norm1, self.dropout1, self_attend)
        x = self._residual(x, self.norm2, self.dropout2, cross_attend)
        return self._residual(x, self.norm3, self.dropout3, self.ff)

    @classmethod
    def from_torch(cls, m: nn.TransformerDecoderLayer) -> TransformerDecoderLayer:
        """Copy a ``torch.nn.TransformerDecoderLayer``."""
        from .transformer_interop import decoder_layer_from_torch

        return decoder_layer_from_torch(cls, m)


class TransformerEncoder(nn.Module):
    """A stack of encoder layers, then an optional final ``norm`` (pre-norm stacks need one).

    Args:
        layers: the layers, applied in order (build them with a comprehension; unlike PyTorch
            nothing is deep-copied, so each layer keeps its own initialisation).
        norm: applied to the output, e.g. ``nn.LayerNorm(E)``.
    """

    def __init__(self, layers: Iterable[nn.Module], *, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, x: Tensor, *, mask: Tensor | None = None, key_mask: Tensor | None = None,
                bias: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Arguments as :meth:`TransformerEncoderLayer.forward`, given to every layer."""
        for layer in self.layers:
            x = layer(x, mask=mask, key_mask=key_mask, bias=bias, is_causal=is_causal)
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, m: nn.TransformerEncoder) -> TransformerEncoder:
        """Copy a ``torch.nn.TransformerEncoder`` (layers and final norm)."""
        if not isinstance(m, nn.TransformerEncoder):
            raise TypeError(f"from_torch expects torch.nn.TransformerEncoder, got {type(m).__name__}")
        return cls([TransformerEncoderLayer.from_torch(lay) for lay in m.layers], norm=copy.deepcopy(m.norm))


class TransformerDecoder(nn.Module):
    """A stack of decoder layers, then an optional final ``norm``.

    Args:
        layers: the layers, applied in order.
        norm: applied to the output.
    """

    def __init__(self, layers: Iterable[nn.Module], *, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def make_caches(self, batch_size: int, max_len: int, *, dtype=None, device=None) -> list[KVCache]:
        """One empty :class:`~attnkit.cache.KVCache` per layer, sized from its self-attention.

        ``dtype``/``device`` default to the layer's parameters'.
        """
        from ..cache import make_caches

        return make_caches([layer.self_attn for layer in self.layers], batch_size, max_len, dtype=dtype,
                           device=device)

    def forward(self, x: Tensor, memory: Tensor, *, mask: Tensor | None = None, key_mask: Tensor | None = None,
                bias: Tensor | None = None, is_causal: bool = True, memory_mask: Tensor | None = None,
                memory_key_mask: Tensor | None = None, caches: Sequence[KVCache] | None = None) -> Tensor:
        """Arguments as :meth:`TransformerDecoderLayer.forward`; ``caches`` has one per layer."""
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(f"caches must hold one KVCache per layer ({len(self.layers)}), got {len(caches)}")
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, mask=mask, key_mask=key_mask, bias=bias, is_causal=is_causal,
                      memory_mask=memory_mask, memory_key_mask=memory_key_mask,
                      cache=None if caches is None else caches[i])
        return x if self.norm is None else self.norm(x)

    @classmethod
    def from_torch(cls, m: nn.TransformerDecoder) -> TransformerDecoder:
        """Copy a ``torch.nn.TransformerDecoder`` (layers and final norm)."""
        if not isinstance(m, nn.TransformerDecoder):
            raise TypeError(f"from_torch expects torch.nn.TransformerDecoder, got {type(m).__name__}")
        return cls([TransformerDecoderLayer.from_torch(lay) for lay in m.layers], norm=copy.deepcopy(m.norm))


class Transformer(nn.Module):
    """The encoder-decoder Transformer of Vaswani et al. (2017), as ``torch.nn.Transformer``.

    Both stacks end in a LayerNorm, as in PyTorch. Embeddings, positional encodings and the output
    projection are the caller's (see :mod:`attnkit.positional`).

    Args:
        embed_dim, num_heads, ffn_dim, dropout, activation, norm_first, layer_norm_eps, bias: as
            :class:`TransformerEncoderLayer` (PyTorch's defaults: 512, 8, 2048, 0.1, relu).
        num_encoder_layers, num_decoder_layers: stack depths (6 and 6).
        encoder, decoder: ready-made stacks instead (e.g. with positional encodings).
    """

    def __init__(self, embed_dim: int = 512, num_heads: int = 8, *, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, ffn_dim: int = 2048, dropout: float = 0.1, activation="relu",
                 norm_first: bool = False, layer_norm_eps: float = 1e-5, bias: bool = True,
                 encoder: TransformerEncoder | None = None, decoder: TransformerDecoder | None = None,
                 backend: str = "auto", device=None, dtype=None) -> None:
        super().__init__()
        kw = {"ffn_dim": ffn_dim, "dropout": dropout, "activation": activation, "norm_first": norm_first,
              "layer_norm_eps": layer_norm_eps, "bias": bias, "backend": backend, "device": device, "dtype": dtype}

        def final_norm():
            return nn.LayerNorm(embed_dim, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype)

        self.encoder = encoder if encoder is not None else TransformerEncoder(
            [TransformerEncoderLayer(embed_dim, num_heads, **kw) for _ in range(num_encoder_layers)],
            norm=final_norm())
        self.decoder = decoder if decoder is not None else TransformerDecoder(
            [TransformerDecoderLayer(embed_dim, num_heads, **kw) for _ in range(num_decoder_layers)],
            norm=final_norm())

    def encode(self, src: Tensor, *, src_mask: Tensor | None = None, src_key_mask: Tensor | None = None) -> Tensor:
        """``src [B, Ls, E]`` -> memory ``[B, Ls, E]``."""
        return self.encoder(src, mask=src_mask, key_mask=src_key_mask)

    def decode(self, tgt: Tensor, memory: Tensor, *, tgt_mask: Tensor | None = None,
               tgt_key_mask: Tensor | None = None, tgt_is_causal: bool = True, memory_mask: Tensor | None = None,
               memory_key_mask: Tensor | None = None, caches: Sequence[KVCache] | None = None) -> Tensor:
        """``tgt [B, Lt, E]`` attending to ``memory`` -> ``[B, Lt, E]`` (with ``caches``: new tokens only)."""
        return self.decoder(tgt, memory, mask=tgt_mask, key_mask=tgt_key_mask, is_causal=tgt_is_causal,
                            memory_mask=memory_mask, memory_key_mask=memory_key_mask, caches=caches)

    def forward(self, src: Tensor, tgt: Tensor, *, src_mask: Tensor | None = None,
                src_key_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                tgt_key_mask: Tensor | None = None, tgt_is_causal: bool = True, memory_mask: Tensor | None = None,
                memory_key_mask: Tensor | None = None) -> Tensor:
        """``src [B, Ls, E]``, ``tgt [B, Lt, E]`` -> ``[B, Lt, E]``.

        Masks are bool, ``True`` = may attend; key masks ``[B, L]``, ``True`` = real token. As in
        PyTorch, ``memory_key_mask`` is separate from ``src_key_mask``: pass it to hide the
        source padding from the decoder.
        """
        memory = self.encode(src, src_mask=src_mask, src_key_mask=src_key_mask)
        return self.decode(tgt, memory, tgt_mask=tgt_mask, tgt_key_mask=tgt_key_mask, tgt_is_causal=tgt_is_causal,
                           memory_mask=memory_mask, memory_key_mask=memory_key_mask)

    @classmethod
    def from_torch(cls, m: nn.Transformer) -> Transformer:
        """Copy a ``torch.nn.Transformer`` (both stacks and their final norms)."""
        if not isinstance(m, nn.Transformer):
            raise TypeError(f"from_torch expects torch.nn.Transformer, got {type(m).__name__}")
        return cls(encoder=TransformerEncoder.from_torch(m.encoder), decoder=TransformerDecoder.from_torch(m.decoder))
