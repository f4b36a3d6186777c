"""GPT-2 (Radford et al. 2019) on attnkit's attention, with generation on a static KV cache.

Each block is a pre-norm :class:`attnkit.modules.TransformerEncoderLayer` run causally:
``x = x + Attn(LN(x)); x = x + MLP(LN(x))``; the LM head shares the token embedding. Weights come
from a ``transformers`` ``GPT2LMHeadModel`` (:meth:`GPT2.from_hf`) or a local Hugging Face GPT-2
folder (:meth:`GPT2.from_pretrained`, safetensors only); their names are mapped to the block's at
load time (``ln_1`` -> ``norm1``, ``mlp.c_fc`` -> ``ff.linear1``, ...), and GPT-2's fused ``c_attn``
Conv1D (``[E, 3E]``, input-major) is split and transposed into ``self_attn.q/k/v_proj``.

Shape notation: ``B`` batch, ``L`` new tokens, ``T`` tokens seen so far (cache included),
``E`` width, ``H`` heads, ``V`` vocabulary.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from itertools import chain
from pathlib import Path

import torch
from torch import Tensor, nn

from ..cache import KVCache, make_caches
from ..modules import TransformerEncoderLayer
from . import checkpoint as ckpt
from ._common import ACTIVATIONS, BackendChoice, check_backend, real_tokens, weights_backend


@dataclass(frozen=True)
class GPT2Config:
    """The GPT-2 hyper-parameters (``transformers``' ``GPT2Config`` names)."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    eos_token_id: int | None = 50256
    pad_token_id: int | None = None

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config") -> GPT2Config:
        """Build from a ``config.json``-style dict, rejecting what this implementation lacks.

        Raises:
            ValueError: an unknown ``model_type``, an ill-typed or unsupported key, naming
                ``source`` and the key.
        """
        if cfg.get("model_type", "gpt2") != "gpt2":
            raise ValueError(f"{source}: key 'model_type' is {cfg.get('model_type')!r}, expected 'gpt2'")
        if cfg.get("add_cross_attention"):
            raise ValueError(f"{source}: key 'add_cross_attention' is set; attnkit's GPT2 is decoder-only")
        if cfg.get("tie_word_embeddings") is False:
            raise ValueError(f"{source}: key 'tie_word_embeddings' is false; attnkit's GPT2 ties the LM head")
        src = Path(source)
        kw = {}
        for f in fields(cls):
            default = f.default
            if f.name in ("n_inner", "eos_token_id", "pad_token_id"):
                kind = int
            elif isinstance(default, bool):
                kind = bool
            elif isinstance(default, float):
                kind = (int, float)
            else:
                kind = type(default)
            positive = f.name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                                  "layer_norm_epsilon")
            kw[f.name] = ckpt.config_value(cfg, f.name, kind, src, default, positive=positive,
                                           probability=f.name.endswith("_pdrop"))
        if kw["activation_function"] not in ACTIVATIONS:
            raise ValueError(f"{source}: key 'activation_function' is {kw['activation_function']!r}, expected "
                             f"one of {sorted(ACTIVATIONS)}")
        if kw["n_embd"] % kw["n_head"]:
            raise ValueError(f"{source}: key 'n_embd' ({kw['n_embd']}) must be divisible by 'n_head' "
                             f"({kw['n_head']})")
        return cls(**kw)


@dataclass
class GPT2Output:
    """What :meth:`GPT2.forward` returns.

    Attributes:
        logits: ``[B, L, V]``.
        hidden_states: the final (normed) hidden states ``[B, L, E]``.
        attentions: with ``output_attentions``: one ``[B, H, L, T]`` tensor per layer.
    """

    logits: Tensor
    hidden_states: Tensor
    attentions: tuple[Tensor, ...] | None = None


def gpt2_block(cfg: GPT2Config, layer_idx: int, backend: str) -> TransformerEncoderLayer:
    """GPT-2's pre-norm block (run with ``is_causal=True``): causal self-attention and an MLP."""
    scale = (cfg.n_embd // cfg.n_head) ** -0.5 if cfg.scale_attn_weights else 1.0
    if cfg.scale_attn_by_inverse_layer_idx:
        scale /= layer_idx + 1
    return TransformerEncoderLayer(
        cfg.n_embd, cfg.n_head, ffn_dim=cfg.n_inner or 4 * cfg.n_embd, dropout=cfg.resid_pdrop,
        attn_dropout=cfg.attn_pdrop, ffn_dropout=0.0, activation=cfg.activation_function, norm_first=True,
        layer_norm_eps=cfg.layer_norm_epsilon, scale=scale, backend=backend)


class GPT2(BackendChoice, nn.Module):
    """GPT-2 language model (``transformers``' ``GPT2LMHeadModel``) on attnkit attention.

    Args:
        config: the architecture.
        backend: attention backend for every layer (``"auto"`` or a registered name).
    """

    def __init__(self, config: GPT2Config, *, backend: str = "auto") -> None:
        super().__init__()
        check_backend(backend)
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.dropout = nn.Dropout(config.embd_pdrop)
        self.blocks = nn.ModuleList(gpt2_block(config, i, backend) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_hf(cls, model: nn.Module, *, backend: str = "auto") -> GPT2:
        """Copy a ``transformers`` ``GPT2LMHeadModel`` (or ``GPT2Model``); same logits in float32.

        Raises:
            TypeError: ``model`` has no GPT-2 ``config``.
            ValueError: a config this implementation lacks, or a state dict that does not fit.
        """
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "to_dict"):
            raise TypeError(f"model must be a transformers GPT2LMHeadModel or GPT2Model, got "
                            f"{type(model).__name__}")
        name = f"<{type(model).__name__}>"
        config = GPT2Config.from_dict(cfg.to_dict(), f"{name}.config")
        tensors = {k: (v, Path(name)) for k, v in model.state_dict().items()}
        gpt = cls(config, backend=backend)
        gpt._load(tensors, [Path(name)])
        p = next(model.parameters())
        return gpt.to(dtype=p.dtype, device=p.device).eval()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, backend: str = "auto", dtype: torch.dtype = torch.float32,
                        device=None) -> GPT2:
        """Load a local Hugging Face GPT-2 folder (``config.json`` + safetensors; never pickle).

        Raises:
            FileNotFoundError: the folder, ``config.json`` or the weights are missing.
            ValueError: another architecture, a missing key or a wrong shape, naming file and key.
        """
        folder = ckpt.resolve_dir(path)
        cfg = ckpt.read_config(folder, ("gpt2",), ("GPT2",))
        config = GPT2Config.from_dict(cfg, str(folder / "config.json"))
        files = ckpt.weight_files(folder)
        stored = ckpt.read_headers(files)
        prefix = ckpt.key_prefix(stored, "wte.weight", ("transformer.",))
        # Every size in config.json meets a stored shape before anything is allocated; the last
        # layer is checked first, so a config asking for more layers than stored fails at once.
        n = config.n_layer
        ckpt.check_stored(stored, ((ours, prefix + key, shape) for ours, key, shape in
                                   _hf_layout(config, chain([n - 1], range(n)))), files)
        # Built with its parameters on the meta device, then given the checkpoint's tensors: the
        # weights are in memory once, not a random model beside them.
        with ckpt.parameters_on_meta():
            gpt = cls(config, backend=backend)
        gpt._load(ckpt.load_tensors(files), files, dtype=dtype)
        return gpt.to(dtype=dtype, device=device).eval()

    def _load(self, tensors: Mapping, files: list[Path], dtype: torch.dtype | None = None) -> None:
        prefix = ckpt.key_prefix(tensors, "wte.weight", ("transformer.",))
        e = self.config.n_embd
        names = {ours: theirs for ours, theirs, _ in _hf_layout(self.config, range(len(self.blocks)))}
        which = {"q_proj": 0, "k_proj": 1, "v_proj": 2}

        def transform(name: str, t: Tensor) -> Tensor:
            if name.startswith("blocks.") and not name.split(".")[2].startswith("norm"):
                is_w = name.endswith("weight")
                # Conv1D stores [in, out]; nn.Linear wants [out, in]. A wrong rank is left for
                # assign's shape check to report.
                if is_w and t.dim() == 2:
                    t = t.t()
                proj = name.split(".")[3]
                if proj in which and t.shape[0] == 3 * e:
                    t = t[which[proj] * e:(which[proj] + 1) * e]
            return t

        ckpt.assign(self, tensors, {k: prefix + v for k, v in names.items()}, files, transform=transform, dtype=dtype)

    # ------------------------------------------------------------------ running

    def make_cache(self, batch_size: int, max_len: int) -> list[KVCache]:
        """One preallocated :class:`~attnkit.cache.KVCache` per layer, for ``max_len`` tokens."""
        if not isinstance(max_len, int) or not 0 < max_len <= self.config.n_positions:
            raise ValueError(f"max_len must be an int in [1, n_positions={self.config.n_positions}], got "
                             f"{max_len!r}")
        return make_caches([b.self_attn for b in self.blocks], batch_size, max_len)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        *,
        cache: list[KVCache] | None = None,
        output_attentions: bool = False,
    ) -> GPT2Output:
        """Next-token logits for every position.

        Args:
            input_ids: ``[B, L]`` new tokens; with ``cache`` they sit at positions
                ``cache[0].seq_len ...``.
            attention_mask: ``[B, T]`` 1 = real token, 0 = padding (``T`` counts cached
                tokens too). With left padding pass ``position_ids`` as well (what
                :func:`positions_from_mask` gives), as ``transformers`` does.
            position_ids: ``[B, L]`` or ``[L]`` absolute positions of the new tokens (default
                ``cache_len ... cache_len + L - 1``).
            cache: from :meth:`make_cache`; updated in place.
            output_attentions: also return each layer's weights ``[B, H, L, T]``.

        Returns:
            :class:`GPT2Output`.
        """
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer [B, L] tensor, got {got}")
        b, n = input_ids.shape
        start = 0
        if cache is not None:
            if not isinstance(cache, (list, tuple)) or len(cache) != len(self.blocks):
                raise ValueError(f"cache must be a list of {len(self.blocks)} KVCache (see make_cache), got "
                                 f"{type(cache).__name__}")
            start = cache[0].seq_len
        if start + n > self.config.n_positions:
            raise ValueError(f"{start} cached + {n} new tokens exceed n_positions ({self.config.n_positions})")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), got values in "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        key_mask = real_tokens(attention_mask, b, start + n, "[B, T] (cached + new tokens)")
        if position_ids is None:
            pos = torch.arange(start, start + n, device=input_ids.device)
        else:
            if not isinstance(position_ids, Tensor) or position_ids.is_floating_point() or \
                    position_ids.shape[-1] != n or position_ids.dim() > 2 or \
                    (position_ids.dim() == 2 and position_ids.shape[0] not in (1, b)):
                got = tuple(position_ids.shape) if isinstance(position_ids, Tensor) else \
                    type(position_ids).__name__
                raise ValueError(f"position_ids must be an integer [B, L] = {(b, n)} or [L] tensor, got {got}")
            if position_ids.numel() and (int(position_ids.min()) < 0 or
                                         int(position_ids.max()) >= self.config.n_positions):
                raise ValueError(f"position_ids must lie in [0, {self.config.n_positions}), got values in "
                                 f"[{int(position_ids.min())}, {int(position_ids.max())}]")
            pos = position_ids
        x, attns = self._run(input_ids, pos, cache, key_mask=key_mask, need_weights=output_attentions,
                             backend=weights_backend(output_attentions))
        logits = x @ self.wte.weight.t()  # (B, L, V): the LM head is tied to the embedding
        return GPT2Output(logits, x, tuple(attns) if output_attentions else None)

    def _run(self, input_ids: Tensor, pos: Tensor, cache: list[KVCache] | None, *, need_weights: bool = False,
             **masking) -> tuple[Tensor, list]:
        """Embeddings, the blocks (``masking``: what each block's attention gets besides causality)
        and the final norm: the hidden states ``[B, L, E]`` and each block's weights (or Nones)."""
        x = self.dropout(self.wte(input_ids) + self.wpe(pos))  # (B, L, E)
        attns = []
        for i, block in enumerate(self.blocks):
            res = block(x, is_causal=True, cache=None if cache is None else cache[i], need_weights=need_weights,
                        **masking)
            x, w = res if need_weights else (res, None)
            attns.append(w)
        return self.ln_f(x), attns

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int = 20,
        *,
        attention_mask: Tensor | None = None,
        use_cache: bool = True,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        compile: bool | str = False,
    ) -> Tensor:
        """Extend each prompt by up to ``max_new_tokens`` tokens (greedy unless ``do_sample``).

        With ``use_cache`` the prompt runs once (prefill) into a static cache sized
        ``L + max_new_tokens`` and each step feeds one token; without it every step re-runs the
        whole sequence. Both give the same tokens. A sequence that emits ``eos_token_id`` is
        padded with ``pad_token_id`` (default: eos) until all are done, as ``transformers`` does.

        Args:
            input_ids: ``[B, L]`` prompts.
            max_new_tokens: how many tokens to add at most.
            attention_mask: ``[B, L]``, 0 = padding, for prompts of different lengths padded on
                the left; positions then count real tokens only (as in ``transformers``).
            use_cache: decode incrementally on a :class:`~attnkit.cache.KVCache`.
            do_sample: sample from ``softmax(logits / temperature)``, restricted to the ``top_k``.
            eos_token_id: stop token (default: the config's).
            generator: for reproducible sampling.
            compile: run each step after the prompt through ``torch.compile`` (with ``use_cache``;
                ``True``: its default backend, a string: that backend): one graph serves every token
                and every later call with the same batch size and cache length; the first call pays
                the compilation (seconds). The same tokens as without it.

        Returns:
            ``[B, L + new]`` int64, the prompts followed by the generated tokens.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
        if do_sample and (temperature <= 0 or (top_k is not None and top_k <= 0)):
            raise ValueError(f"temperature must be > 0 and top_k positive, got {temperature!r}, {top_k!r}")
        eos = self.config.eos_token_id if eos_token_id is None else eos_token_id
        pad = pad_token_id if pad_token_id is not None else (self.config.pad_token_id
                                                             if self.config.pad_token_id is not None else eos)
        b, n = input_ids.shape
        if n + max_new_tokens > self.config.n_positions:
            raise ValueError(f"prompt length {n} + max_new_tokens {max_new_tokens} exceed n_positions "
                             f"({self.config.n_positions})")
        out = input_ids
        if max_new_tokens == 0:
            return out
        cache = self.make_cache(b, n + max_new_tokens) if use_cache else None
        if attention_mask is not None and (not isinstance(attention_mask, Tensor) or
                                           tuple(attention_mask.shape) != (b, n)):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else \
                type(attention_mask).__name__
            raise ValueError(f"attention_mask must be [B, L] = {(b, n)} like input_ids, got {got}")
        if not isinstance(compile, bool | str):
            raise TypeError(f"compile must be a bool or a torch.compile backend name, got {type(compile).__name__}")
        if compile and not use_cache:
            raise ValueError("compile needs use_cache=True: it compiles the cached decoding step")
        mask = attention_mask
        done = torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        step_in = input_ids
        # Compiled steps see the real tokens over the whole cache (a fixed shape): the prompt's mask,
        # then every generated token.
        real = None if not compile else torch.ones(b, n + max_new_tokens, dtype=torch.bool, device=input_ids.device)
        if real is not None and attention_mask is not None:
            real[:, :n] = attention_mask != 0
        for step in range(max_new_tokens):
            pos = None if mask is None else positions_from_mask(mask)
            if use_cache and pos is not None:
                pos = pos[:, -step_in.shape[1]:]
            if compile and step > 0:
                if pos is None:  # the new token's position: after the prompt and the tokens so far
                    pos = torch.full((b, 1), n + step - 1, device=input_ids.device)
                logits = _compiled_step(self, "inductor" if compile is True else compile)(step_in, pos, real, cache)
            else:
                logits = self(step_in if use_cache else out, mask, pos, cache=cache).logits[:, -1]  # (B, V)
            nxt = self._pick(logits, do_sample, temperature, top_k, generator)
            if eos is not None:
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                done = done | (nxt == eos)
            out = torch.cat([out, nxt[:, None]], dim=1)
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step_in = nxt[:, None]
            if eos is not None and bool(done.all()):
                break
        return out

    def _next_logits(self, token: Tensor, pos: Tensor, real: Tensor, cache: list[KVCache]) -> Tensor:
        """One cached decoding step without the checks :meth:`forward` makes on values (``generate``
        made them): ``token [B, 1]`` at positions ``pos [B, 1]``, ``real [B, max_len]`` the real
        tokens over the whole cache; the next-token logits ``[B, V]``. What ``compile=True`` compiles."""
        x, _ = self._run(token, pos, cache, mask=real[:, None, None, :])  # a mask over the whole cache: a fixed shape
        return x[:, -1] @ self.wte.weight.t()

    @staticmethod
    def _pick(logits: Tensor, do_sample: bool, temperature: float, top_k: int | None, generator) -> Tensor:
        if not do_sample:
            return logits.argmax(dim=-1)
        logits = logits / temperature
        if top_k is not None:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]


#: Each model's compiled decoding step (weakly: a model is not kept alive by having generated).
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled_step(model: GPT2, backend: str):
    """``model._next_logits`` compiled with ``backend``, made once per model and backend."""
    steps = _COMPILED.setdefault(model, {})
    if backend not in steps:
        steps[backend] = torch.compile(model._next_logits, fullgraph=True, backend=backend)
    return steps[backend]


def _hf_layout(cfg: GPT2Config, layers: Iterable[int]) -> Iterator[tuple[str, str, tuple]]:
    """``(our name, Hugging Face key, stored shape)``: embeddings, final norm, then ``layers`` in that order.

    Stored shapes are Conv1D's ``[in, out]``, and ``q/k/v_proj`` all read the fused ``c_attn``.
    """
    e, inner = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd
    yield from (("wte.weight", "wte.weight", (cfg.vocab_size, e)), ("wpe.weight", "wpe.weight", (cfg.n_positions, e)),
                ("ln_f.weight", "ln_f.weight", (e,)), ("ln_f.bias", "ln_f.bias", (e,)))
    # The block's names -> (GPT-2's, stored weight shape); every bias is the weight's output (last) dimension.
    parts = {"norm1": ("ln_1", (e,)), "norm2": ("ln_2", (e,)), "self_attn.q_proj": ("attn.c_attn", (e, 3 * e)),
             "self_attn.k_proj": ("attn.c_attn", (e, 3 * e)), "self_attn.v_proj": ("attn.c_attn", (e, 3 * e)),
             "self_attn.out_proj": ("attn.c_proj", (e, e)), "ff.linear1": ("mlp.c_fc", (e, inner)),
             "ff.linear2": ("mlp.c_proj", (inner, e))}
    yield from ckpt.per_layer(layers, "blocks.{}", "h.{}", parts, bias_dim=-1)


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that count real tokens only: ``cumsum(mask) - 1``, padding at position 0.

    ``[[0, 0, 1, 1, 1]] -> [[0, 0, 0, 1, 2]]``: a left-padded prompt starts at position 0, as
    if the padding were not there (``transformers``' convention for GPT-2 generation).
    """
    m = (attention_mask != 0).long()
    return (m.cumsum(-1) - 1).clamp(min=0)
