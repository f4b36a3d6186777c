"""A thin tokenizer over Hugging Face ``tokenizers``: batches of text -> padded id tensors.

Reads ``tokenizer.json`` from a model folder, or builds a BERT WordPiece tokenizer from
``vocab.txt`` (lower-casing as ``tokenizer_config.json`` says). Padding and truncation are set
per call here, not taken from the file (``tokenizer.json`` files often pin a fixed length).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from . import checkpoint as ckpt


@dataclass
class Encoded(Mapping):
    """A padded batch. A mapping of its tensors, so ``model(**encoded)`` works.

    Attributes:
        input_ids: ``[B, L]`` int64, padded on the right.
        attention_mask: ``[B, L]`` int64, 1 = real token, 0 = padding.
        token_type_ids: ``[B, L]`` int64 segment ids.
        tokens: the token strings per sequence, padding included (``[CLS]``, ``river``, ``##s`` ...).
    """

    input_ids: Tensor
    attention_mask: Tensor
    token_type_ids: Tensor
    tokens: list[list[str]]

    _KEYS = ("input_ids", "attention_mask", "token_type_ids")

    def __getitem__(self, key: str) -> Tensor:
        if key not in self._KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._KEYS)

    def __len__(self) -> int:
        return len(self._KEYS)


#: Largest ``tokenizer.json`` or ``vocab.txt`` read. Real ones are 0.2 to 35 MB (BERT's 0.7 MB,
#: XLM-R's and Gemma's the largest); a file is read whole and parsed, taking several times its size.
MAX_TOKENIZER_BYTES = 64 * 2**20


class Tokenizer:
    """Text to BERT inputs (and back), backed by a ``tokenizers.Tokenizer``.

    Args:
        backend: a ``tokenizers.Tokenizer``.
        pad_token: the padding token (must be in the vocabulary).
        max_length: default truncation length (special tokens included).
    """

    def __init__(self, backend, *, pad_token: str = "[PAD]", max_length: int = 512) -> None:
        self._tok = backend
        self._tok.no_padding()
        self._tok.no_truncation()
        pad_id = self._tok.token_to_id(pad_token)
        if pad_id is None:
            raise ValueError(f"pad_token {pad_token!r} is not in the tokenizer's vocabulary")
        self.pad_token, self.pad_token_id = pad_token, pad_id
        self.max_length = max_length

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, *, max_length: int | None = None) -> Tokenizer:
        """Load the tokenizer of a local model folder (``None``: the bundled MiniLM).

        Args:
            path: folder with ``tokenizer.json``, or ``vocab.txt`` (BERT WordPiece).
            max_length: truncation length; default ``max_seq_length`` from
                ``sentence_bert_config.json``, else ``model_max_length`` from
                ``tokenizer_config.json``, else 512.

        Raises:
            FileNotFoundError: neither file is there.
            ValueError: a file that cannot be read, or one larger than :data:`MAX_TOKENIZER_BYTES`,
                naming it.
        """
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.implementations import BertWordPieceTokenizer

        folder = ckpt.resolve_dir(path)
        tok_cfg_file = ckpt.member(folder, "tokenizer_config.json")
        tok_cfg = ckpt.read_json(tok_cfg_file) if tok_cfg_file.is_file() else {}
        tj, vocab = ckpt.member(folder, "tokenizer.json"), ckpt.member(folder, "vocab.txt")
        if tj.is_file():
            text = ckpt.read_text(tj, MAX_TOKENIZER_BYTES)
            try:
                backend = HFTokenizer.from_str(text)
            except Exception as e:  # tokenizers raises a bare Exception on bad files
                raise ValueError(f"{tj} is not a valid tokenizers file: {e}") from None
        elif vocab.is_file():
            ckpt.check_size(vocab, MAX_TOKENIZER_BYTES)
            try:
                backend = BertWordPieceTokenizer(str(vocab), lowercase=bool(tok_cfg.get("do_lower_case", True)),
                                                 strip_accents=tok_cfg.get("strip_accents"))
            except Exception as e:
                raise ValueError(f"{vocab} is not a valid WordPiece vocabulary: {e}") from None
        else:
            raise FileNotFoundError(f"{tj} not found (nor {vocab.name}): the folder has no tokenizer")
        if max_length is None:
            max_length = _default_max_length(folder, tok_cfg)
        # transformers writes the pad token as a string or as an AddedToken {"content": ...}.
        pad = ckpt.config_value(tok_cfg, "pad_token", (str, dict), tok_cfg_file, "[PAD]")
        if isinstance(pad, dict):
            pad = ckpt.config_value(pad, "content", str, tok_cfg_file, "[PAD]")
        return cls(backend, pad_token=pad, max_length=max_length)

    # ------------------------------------------------------------------ text -> ids

    def __call__(self, texts: str | list[str], *, max_length: int | None = None,
                 truncation: bool = True, add_special_tokens: bool = True) -> Encoded:
        """Tokenise a string or a batch, padding on the right to the longest sequence.

        Args:
            texts: one string or a list of strings.
            max_length: truncate to this many tokens, special tokens included (default
                ``self.max_length``).
            truncation: set False to keep every token.
            add_special_tokens: ``[CLS] ... [SEP]`` around each sequence.

        Returns:
            :class:`Encoded` with ``[B, L]`` tensors (``B = 1`` for a single string).
        """
        items = [texts] if isinstance(texts, str) else texts
        if not isinstance(items, (list, tuple)) or not items or not all(isinstance(t, str) for t in items):
            raise TypeError(f"texts must be a str or a non-empty list of str, got {type(texts).__name__}")
        max_length = self.max_length if max_length is None else max_length
        if not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(f"max_length must be a positive int, got {max_length!r}")
        if truncation:
            self._tok.enable_truncation(max_length)
        try:
            encs = self._tok.encode_batch(list(items), add_special_tokens=add_special_tokens)
        finally:
            self._tok.no_truncation()
        n = max(len(e.ids) for e in encs)
        ids = torch.full((len(encs), n), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(encs), n, dtype=torch.long)
        types = torch.zeros(len(encs), n, dtype=torch.long)
        tokens = []
        for i, e in enumerate(encs):
            k = len(e.ids)
            ids[i, :k] = torch.tensor(e.ids, dtype=torch.long)
            mask[i, :k] = 1
            types[i, :k] = torch.tensor(e.type_ids, dtype=torch.long)
            tokens.append(list(e.tokens) + [self.pad_token] * (n - k))
        return Encoded(ids, mask, types, tokens)

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[str]:
        """The token strings of ``text`` (``"river bank"`` -> ``["river", "bank"]``)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).tokens)

    # ------------------------------------------------------------------ ids -> text

    def convert_ids_to_tokens(self, ids) -> list[str]:
        """Token strings for ids (a list, or a 1-D tensor)."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        out = []
        for i in ids:
            t = self._tok.id_to_token(int(i))
            if t is None:
                raise ValueError(f"id {i} is outside the vocabulary (size {self.vocab_size})")
            out.append(t)
        return out

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        out = []
        for t in tokens:
            i = self._tok.token_to_id(t)
            if i is None:
                raise ValueError(f"token {t!r} is not in the vocabulary")
            out.append(i)
        return out

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()


def _default_max_length(folder: Path, tok_cfg: dict) -> int:
    st = ckpt.member(folder, "sentence_bert_config.json")
    if st.is_file():
        val = ckpt.read_json(st).get("max_seq_length")
        if isinstance(val, int) and val > 0:
            return val
    val = tok_cfg.get("model_max_length")
    if isinstance(val, int) and 0 < val <= 1_000_000:
        return val
    return 512
