"""Translate between two natural languages with a sequence-to-sequence Transformer: numbers written in
French into German, or (the first task, kept beside it) English dates in words into ISO dates.

Two sets of pairs (:data:`PAIRS`, ``pairs=`` of :func:`run`):

* ``"fr-de"`` (the default): every whole number from 1 to 9,999 as French words -> the same number
  in German, both from num2words' grammars (:mod:`attnkit.apps._numbers`): "quatre-vingt-dix-sept"
  -> "siebenundneunzig". The German puts units before tens and has one word where the French
  adds several, so the alignment crosses.
* ``"dates"``: "twenty third of november two thousand twenty six" (or "november twenty third two
  thousand twenty six") -> "2026-11-23", for every day from 1900-01-01 to 2099-12-31.

A tenth of the items are held out: the model never sees them while training, and exact match and a
character-level score (:func:`char_similarity`) are measured on them. Source tokens are words,
target tokens characters.

Read top to bottom: data -> model (an encoder-decoder :class:`attnkit.modules.Transformer`) ->
decoding (greedy and beam search, both with one :class:`attnkit.cache.KVCache` per decoder layer)
-> training -> evaluation -> the cross-attention alignment drawn with both token sequences on the
axes. :class:`Seq2Seq`, :func:`greedy` and :func:`recording_cross_attention` do not depend on the
task; ``caption`` reuses them with image patches as the source.

The baseline: ``model="rnn"`` trains the model attention was first built into instead, a
bidirectional GRU encoder and a GRU decoder with Bahdanau's additive attention
(:class:`attnkit.apps._rnn.RNNSeq2Seq`), on the same data, tokens, loss, schedule and metric;
:func:`compare` trains both at one step budget and says what it measured.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._cpu import one_thread
from ..analysis.record import recorded_weights
from ..cache import KVCache
from ..modules import Transformer
from ..positional import LearnedPositionalEmbedding
from ..viz.report import Section
from . import _common, _numbers
from ._rnn import RNNSeq2Seq

DEFAULTS = {"steps": 1000, "lr": 2e-3, "warmup": 100, "batch_size": 128, "embed_dim": 64, "num_heads": 4,
            "encoder_layers": 2, "decoder_layers": 2, "ffn_dim": 128, "beam": 4, "test_size": 2000, "pairs": "fr-de"}
QUICK = {"steps": 300, "batch_size": 32, "embed_dim": 32, "num_heads": 2, "encoder_layers": 1,
         "decoder_layers": 1, "ffn_dim": 64, "beam": 2, "test_size": 64}

#: The models ``run(model=...)`` trains: the Transformer (the default) or the RNN baseline.
MODELS = ("transformer", "rnn")
#: What the reports call each of them.
MODEL_NAMES = {"transformer": "Transformer", "rnn": "RNN with additive attention"}
#: The RNN's sizes, in place of the Transformer's in ``DEFAULTS`` / ``QUICK`` (the training settings
#: are shared); chosen so that it has about as many parameters as the Transformer at each size.
RNN_SIZES = {"embed_dim": 64, "hidden_dim": 80, "attn_dim": 64}
RNN_QUICK_SIZES = {"embed_dim": 32, "hidden_dim": 24, "attn_dim": 32}
_TRANSFORMER_ONLY = ("embed_dim", "num_heads", "encoder_layers", "decoder_layers", "ffn_dim", "beam")

# ------------------------------------------------------------------------------------------ data

_ONES = "zero one two three four five six seven eight nine".split()
_TEENS = "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
_ORD_ONES = ["", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth"]
_ORD_TEENS = ("tenth eleventh twelfth thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth "
              "nineteenth").split()
_ORD_TENS = {2: "twentieth", 3: "thirtieth"}
_MONTHS = ("january february march april may june july august september october november december").split()
FIRST_DAY, LAST_DAY = dt.date(1900, 1, 1), dt.date(2099, 12, 31)

PAD, BOS, EOS = 0, 1, 2  # shared by both vocabularies
SRC_VOCAB = ["<pad>", "<bos>", "<eos>", "of", "oh", "hundred", "thousand", *_ONES[1:], *_TEENS, *_TENS[2:],
             *_ORD_ONES[1:], *_ORD_TEENS, *_ORD_TENS.values(), *_MONTHS]
TGT_VOCAB = ["<pad>", "<bos>", "<eos>", *"0123456789-"]
SRC_LEN = 8  # "twenty third of september two thousand ninety nine"
TGT_LEN = 11  # "2099-09-23" and <eos>


def _cardinal(n: int) -> list[str]:
    """1..99 in words."""
    if n < 10:
        return [_ONES[n]]
    if n < 20:
        return [_TEENS[n - 10]]
    return [_TENS[n // 10]] + ([_ONES[n % 10]] if n % 10 else [])


def _ordinal(n: int) -> list[str]:
    """1..31 as an ordinal: "first", "twenty third", "thirtieth"."""
    if n < 10:
        return [_ORD_ONES[n]]
    if n < 20:
        return [_ORD_TEENS[n - 10]]
    return [_ORD_TENS[n // 10]] if n % 10 == 0 else [_TENS[n // 10], _ORD_ONES[n % 10]]


def _year(y: int) -> list[str]:
    """1900..2099 as spoken: "nineteen oh five", "nineteen eighty seven", "two thousand twenty six"."""
    if y >= 2000:
        return ["two", "thousand"] + (_cardinal(y - 2000) if y > 2000 else [])
    r = y - 1900
    return ["nineteen"] + (["hundred"] if r == 0 else ["oh", _ONES[r]] if r < 10 else _cardinal(r))


def in_words(day: dt.date, style: int) -> list[str]:
    """Style 0: "twenty third of november ..."; style 1: "november twenty third ..."."""
    month = [_MONTHS[day.month - 1]]
    head = _ordinal(day.day) + ["of"] + month if style == 0 else month + _ordinal(day.day)
    return head + _year(day.year)


def encode_words(words: list[str], vocab: list[str] = SRC_VOCAB) -> list[int]:
    return [vocab.index(w) for w in words]


def encode_chars(text: str, vocab: list[str] = TGT_VOCAB) -> list[int]:
    return [vocab.index(c) for c in text]


def detokenize(ids: list[int], vocab: list[str], sep: str = "") -> str:
    """Token ids -> text up to the first <eos>; a stray <pad>/<bos> shows as "?"."""
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(vocab[i] if i > EOS else "?")
    return sep.join(out)


def decode_chars(ids: list[int], vocab: list[str] = TGT_VOCAB) -> str:
    """Target ids -> the text (the ISO date, with the dates' vocabulary)."""
    return detokenize(ids, vocab)


@dataclass(frozen=True)
class Pairs:
    """One set of translation pairs: items ``0 .. count - 1``, each with a source phrase per style
    and one target text, and the vocabularies and lengths that hold them (``PAD``, ``BOS``, ``EOS``
    = 0, 1, 2 in both vocabularies)."""

    name: str
    description: str  # what is translated into what, for reports
    unit: str  # what one item is, plural: "dates", "numbers"
    src_vocab: list[str]
    tgt_vocab: list[str]
    src_len: int  # the longest source
    tgt_len: int  # the longest target, <eos> included
    count: int
    styles: int  # source phrasings per item
    source: Callable[[int, int], list[str]]  # (item, style) -> words
    target: Callable[[int], str]  # item -> text

    def example(self, item: int) -> list[str]:
        """The source words the alignment picture translates: the last style of ``item``."""
        return self.source(item, self.styles - 1)


DATES = Pairs("dates", "Dates written in English words -> ISO 8601 (1900-2099, two word orders)", "dates",
              SRC_VOCAB, TGT_VOCAB, SRC_LEN, TGT_LEN, (LAST_DAY - FIRST_DAY).days + 1, 2,
              lambda d, style: in_words(FIRST_DAY + dt.timedelta(days=d), style),
              lambda d: (FIRST_DAY + dt.timedelta(days=d)).isoformat())
NUMBERS = Pairs("fr-de", f"Numbers written in French -> the same numbers in German (1 to {_numbers.LAST:,}, "
                "num2words' grammars)", "numbers",
                ["<pad>", "<bos>", "<eos>", *_numbers.FRENCH_WORDS],
                ["<pad>", "<bos>", "<eos>", *_numbers.GERMAN_CHARS],
                _numbers.SRC_LEN, _numbers.TGT_LEN, _numbers.LAST, 1,
                lambda i, style: list(_numbers.pairs()[i][0]), lambda i: _numbers.pairs()[i][1])
#: The pairs ``run(pairs=...)`` trains on, by name; the first is the default.
PAIRS = {"fr-de": NUMBERS, "dates": DATES}


def _pairs(name: object) -> Pairs:
    if name not in PAIRS:
        raise ValueError(f"pairs must be one of {', '.join(map(repr, PAIRS))}, got {name!r}")
    return PAIRS[name]


def split(g: torch.Generator, pairs: Pairs = DATES) -> tuple[Tensor, Tensor]:
    """The items of ``pairs``, shuffled: 90% to train on, 10% held out."""
    perm = torch.randperm(pairs.count, generator=g)
    return perm[pairs.count // 10:], perm[:pairs.count // 10]


def split_days(g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Day numbers since :data:`FIRST_DAY`, shuffled: 90% to train on, 10% held out."""
    return split(g, DATES)


def make_batch(items: Tensor, g: torch.Generator, pairs: Pairs = DATES) -> tuple[Tensor, Tensor, Tensor]:
    """``(src [B, src_len], src_key_mask [B, src_len], tgt [B, tgt_len])`` for ``items`` of ``pairs``
    (days, by default), styles drawn from ``g``.

    ``tgt`` is the target text and <eos>; the decoder's input is it shifted right behind <bos>.
    """
    styles = torch.randint(0, pairs.styles, (len(items),), generator=g).tolist()
    src = torch.full((len(items), pairs.src_len), PAD)
    tgt = torch.full((len(items), pairs.tgt_len), PAD)
    for i, (d, s) in enumerate(zip(items.tolist(), styles, strict=True)):
        ids = encode_words(pairs.source(d, s), pairs.src_vocab)
        src[i, :len(ids)] = torch.tensor(ids)
        out = encode_chars(pairs.target(d), pairs.tgt_vocab) + [EOS]
        tgt[i, :len(out)] = torch.tensor(out)
    return src, src != PAD, tgt

# ----------------------------------------------------------------------------------------- model


class TokenEmbedding(nn.Module):
    """Token ids ``[B, L]`` -> ``[B, L, E]``: an embedding plus a learned position vector."""

    def __init__(self, vocab_size: int, max_len: int, embed_dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.pos = LearnedPositionalEmbedding(max_len, embed_dim)

    def forward(self, ids: Tensor, start: int = 0) -> Tensor:
        return self.pos(self.embed(ids), start)


class Seq2Seq(nn.Module):
    """An encoder-decoder Transformer over any source: ``src_embed`` turns the source into ``[B, Ls, E]``.

    Pre-norm layers, as in most modern models; no dropout (fresh examples every step leave nothing
    to memorise). The target side is tokens with learned positions.

    Args:
        src_embed: the source embedding, ``src -> [B, Ls, E]`` (token ids, image patches, ...).
        tgt_vocab: target vocabulary size (``PAD``, ``BOS``, ``EOS`` = 0, 1, 2).
        tgt_len: the longest target, <eos> included.
        embed_dim, num_heads, encoder_layers, decoder_layers, ffn_dim: the Transformer's sizes.
    """

    def __init__(self, src_embed: nn.Module, tgt_vocab: int, tgt_len: int, *, embed_dim: int, num_heads: int,
                 encoder_layers: int, decoder_layers: int, ffn_dim: int) -> None:
        super().__init__()
        self.tgt_len = tgt_len
        self.src_embed = src_embed
        # + 1: the decoder's input is <bos> and the target but its last token.
        self.tgt_embed = TokenEmbedding(tgt_vocab, tgt_len + 1, embed_dim)
        self.transformer = Transformer(embed_dim, num_heads, num_encoder_layers=encoder_layers,
                                       num_decoder_layers=decoder_layers, ffn_dim=ffn_dim, dropout=0.0,
                                       norm_first=True)
        self.head = nn.Linear(embed_dim, tgt_vocab)

    def encode(self, src: Tensor, src_key_mask: Tensor | None = None) -> Tensor:
        """``src`` -> memory ``[B, Ls, E]``; ``src_key_mask [B, Ls]`` is ``True`` at real tokens."""
        return self.transformer.encode(self.src_embed(src), src_key_mask=src_key_mask)

    def decode(self, tgt_in: Tensor, memory: Tensor, memory_key_mask: Tensor | None = None, *,
               caches: list[KVCache] | None = None) -> Tensor:
        """Next-token logits ``[B, Lt, V]`` for ``tgt_in [B, Lt]`` (only the new tokens with ``caches``)."""
        start = 0 if caches is None else caches[0].seq_len
        x = self.tgt_embed(tgt_in, start)
        return self.head(self.transformer.decode(x, memory, memory_key_mask=memory_key_mask, caches=caches))

    def forward(self, src: Tensor, tgt: Tensor, src_key_mask: Tensor | None = None) -> Tensor:
        """Teacher forcing: logits ``[B, Lt, V]`` predicting ``tgt [B, Lt]`` from <bos> + ``tgt[:, :-1]``."""
        tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)
        return self.decode(tgt_in, self.encode(src, src_key_mask), src_key_mask)


def loss_fn(model: Seq2Seq | RNNSeq2Seq, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Cross-entropy of every target token (padding ignored), teacher-forced; the same for both models."""
    src, src_key_mask, tgt = batch
    logits = model(src, tgt, src_key_mask)
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=PAD)

# -------------------------------------------------------------------------------------- decoding


def _next_logp(model: Seq2Seq, tok: Tensor, memory: Tensor, memory_key_mask: Tensor | None,
               caches: list[KVCache]) -> Tensor:
    """Log-probabilities ``[B, V]`` of the token after ``tok [B, 1]``; PAD is never one (it only fills
    rows after their <eos>), for greedy and beam search alike."""
    logp = model.decode(tok, memory, memory_key_mask, caches=caches)[:, -1].log_softmax(-1)
    logp[:, PAD] = float("-inf")
    return logp


@torch.no_grad()
def greedy(model: Seq2Seq | RNNSeq2Seq, src: Tensor, src_key_mask: Tensor | None = None) -> Tensor:
    """The most likely token at each step, one token per step through the KV cache (the RNN: through
    its decoder state, :func:`greedy_rnn`).

    Returns:
        ``[B, tgt_len]`` token ids; after a row's <eos> the row holds ``PAD``.
    """
    if isinstance(model, RNNSeq2Seq):
        return greedy_rnn(model, src, src_key_mask)[0]
    memory = model.encode(src, src_key_mask)
    caches = model.transformer.decoder.make_caches(memory.shape[0], model.tgt_len)
    return _greedy(lambda t, tok: _next_logp(model, tok[:, None], memory, src_key_mask, caches), memory.shape[0],
                   model.tgt_len)


def _greedy(next_scores, b: int, tgt_len: int) -> Tensor:
    """The greedy rule both models decode by: at each step the most likely token, never ``PAD``, and
    ``PAD`` after a row's <eos>. ``next_scores(t, tok [B]) -> [B, V]``: the scores of the token after
    ``tok`` at step ``t`` (the model's state kept by the caller). Returns ``[B, tgt_len]`` ids."""
    out = torch.full((b, tgt_len), PAD)
    tok = torch.full((b,), BOS)
    done = torch.zeros(b, dtype=torch.bool)
    for t in range(tgt_len):
        scores = next_scores(t, tok)
        scores[:, PAD] = float("-inf")  # PAD only fills rows after their <eos>
        tok = scores.argmax(-1)  # (B,)
        out[:, t] = tok.masked_fill(done, PAD)
        done |= tok == EOS
        if done.all():
            break
    return out


@torch.no_grad()
def beam_search(model: Seq2Seq, src: Tensor, src_key_mask: Tensor | None = None, *, beam: int = 4) -> Tensor:
    """The most likely sequence among ``beam`` kept at each step (sum of log-probabilities).

    The ``B * beam`` hypotheses decode as one batch through the KV cache; when a hypothesis is
    continued from another beam, the caches' rows are gathered to follow it.

    Returns:
        ``[B, tgt_len]`` token ids, ``PAD`` after <eos>, as :func:`greedy`.

    Raises:
        TypeError: ``model`` is the RNN (it decodes greedily only: :func:`greedy`).
        ValueError: ``beam`` is not a positive int.
    """
    if isinstance(model, RNNSeq2Seq):
        raise TypeError("beam_search decodes the Transformer (Seq2Seq) through its KV caches; for the RNN use "
                        "greedy(model, src, src_key_mask)")
    if not isinstance(beam, int) or isinstance(beam, bool) or beam < 1:
        raise ValueError(f"beam must be a positive int (hypotheses kept per step), got {beam!r}")
    memory = model.encode(src, src_key_mask)
    b, k, n = memory.shape[0], beam, model.tgt_len
    memory = memory.repeat_interleave(k, dim=0)  # (B*k, Ls, E): beam j of row i at i*k + j
    mkm = None if src_key_mask is None else src_key_mask.repeat_interleave(k, dim=0)
    caches = model.transformer.decoder.make_caches(b * k, n)
    seqs = torch.full((b * k, n), PAD)
    tok = torch.full((b * k, 1), BOS)
    # Only beam 0 is live at the start, so the k beams do not begin as k copies of one hypothesis.
    score = torch.full((b, k), float("-inf"))
    score[:, 0] = 0.0
    done = torch.zeros(b * k, dtype=torch.bool)
    for t in range(n):
        logp = _next_logp(model, tok, memory, mkm, caches)  # (B*k, V)
        # A finished hypothesis keeps its score and can only "continue" with PAD.
        logp[done] = float("-inf")
        logp[done, PAD] = 0.0
        v = logp.shape[-1]
        total = (score.reshape(-1, 1) + logp).reshape(b, k * v)
        score, flat = total.topk(k, dim=-1)  # (B, k)
        rows = (torch.arange(b)[:, None] * k + flat // v).reshape(-1)  # (B*k,) the beam each one extends
        tok = (flat % v).reshape(-1, 1)
        seqs = seqs[rows]
        seqs[:, t] = tok[:, 0]
        done = done[rows] | (tok[:, 0] == EOS)
        for c in caches:  # each hypothesis takes the cached keys/values of the one it extends
            c.reorder(rows)
        if done.all():
            break
    best = score.argmax(-1) + torch.arange(b) * k
    return seqs[best]


@torch.no_grad()
def greedy_rnn(model: RNNSeq2Seq, src: Tensor, src_key_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`greedy` for the RNN, with its attention weights: the same rule (the most likely token,
    never ``PAD``; ``PAD`` after a row's <eos>), one decoder step per token.

    Returns:
        ``(ids [B, tgt_len], weights [B, tgt_len, Ls])``: the weights of the step that wrote each
        token (rows after a row's <eos> are those of tokens it did not keep).
    """
    enc = model.encode(src, src_key_mask)
    weights = torch.zeros(src.shape[0], model.tgt_len, src.shape[1])
    state = enc.state

    def next_scores(t: int, tok: Tensor) -> Tensor:
        nonlocal state
        logits, state, weights[:, t] = model.step(tok, state, enc, src_key_mask)
        return logits

    return _greedy(next_scores, src.shape[0], model.tgt_len), weights


def recording_cross_attention(model: Seq2Seq):
    """Inside the block, every decoder layer's cross-attention weights are kept.

    Yields:
        One list per decoder layer, appended to on each call with ``[B, H, Lt, Ls]`` (``Lt`` = 1
        per step when decoding with the cache; ``torch.cat(..., dim=2)`` joins the steps).
        See :func:`attnkit.analysis.recorded_weights`.
    """
    return recorded_weights(layer.cross_attn for layer in model.transformer.decoder.layers)


# ---------------------------------------------------------------------------- train and evaluate


def _check_model(model: object) -> None:
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(map(repr, MODELS))}, got {model!r}")


def settings(model: str = "transformer", *, quick: bool = False, steps: int | None = None,
             pairs: str | None = None) -> dict:
    """The settings :func:`run` trains ``model`` with: ``DEFAULTS`` (with ``QUICK`` when ``quick``),
    the RNN's sizes in place of the Transformer's for ``"rnn"``, ``steps`` and ``pairs`` if given
    (:data:`PAIRS`), and ``model``.

    Raises:
        ValueError: ``model`` is not one of :data:`MODELS`, or ``pairs`` not one of :data:`PAIRS`.
    """
    _check_model(model)
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    if pairs is not None:
        cfg["pairs"] = _pairs(pairs).name
    if model == "rnn":
        cfg = {k: v for k, v in cfg.items() if k not in _TRANSFORMER_ONLY} | (RNN_QUICK_SIZES if quick else RNN_SIZES)
    return {**cfg, "model": model}


def pairs_of(config: dict) -> Pairs:
    """The pairs ``config`` trains on (its ``pairs`` key); the dates when it has none (a checkpoint
    written before there were two)."""
    return _pairs(config.get("pairs", "dates"))


def build(config: dict) -> Seq2Seq | RNNSeq2Seq:
    """The model for ``config`` (what :func:`load` rebuilds from ``config.json``); its ``model`` key
    picks the kind (:data:`MODELS`), the Transformer when it has none, and its ``pairs`` key the
    vocabularies and lengths (:func:`pairs_of`)."""
    kind = config.get("model", "transformer")
    _check_model(kind)
    p = pairs_of(config)
    if kind == "rnn":
        return RNNSeq2Seq(len(p.src_vocab), len(p.tgt_vocab), p.tgt_len, bos_id=BOS, embed_dim=config["embed_dim"],
                          hidden_dim=config["hidden_dim"], attn_dim=config["attn_dim"])
    return Seq2Seq(TokenEmbedding(len(p.src_vocab), p.src_len, config["embed_dim"]), len(p.tgt_vocab), p.tgt_len,
                   embed_dim=config["embed_dim"], num_heads=config["num_heads"],
                   encoder_layers=config["encoder_layers"], decoder_layers=config["decoder_layers"],
                   ffn_dim=config["ffn_dim"])


_MODEL_FIELD = _common.one_of(*MODELS, default="transformer")
_PAIRS_FIELD = _common.one_of(*PAIRS, default="dates")
#: What :func:`load` checks in ``config.json`` against the Transformer's weights before building.
FIELDS = {
    "model": _MODEL_FIELD,
    "pairs": _PAIRS_FIELD,
    "embed_dim": _common.size("src_embed.embed.weight", 1),
    "num_heads": _common.heads("embed_dim"),
    "encoder_layers": _common.layers("transformer.encoder.layers"),
    "decoder_layers": _common.layers("transformer.decoder.layers"),
    "ffn_dim": _common.size("transformer.encoder.layers.0.ff.linear1.weight", 0),
}
#: The same for the RNN's (``"model": "rnn"``).
RNN_FIELDS = {
    "model": _MODEL_FIELD,
    "pairs": _PAIRS_FIELD,
    "embed_dim": _common.size("src_embed.weight", 1),
    "hidden_dim": _common.size("decoder.weight_hh", 1),
    "attn_dim": _common.size("attention.score_vector", 0),
}


def fields(config: dict) -> dict[str, _common.Field]:
    """:data:`RNN_FIELDS` when ``config`` names the RNN, else :data:`FIELDS`."""
    return RNN_FIELDS if config.get("model") == "rnn" else FIELDS


def load(dir: str | Path) -> Seq2Seq | RNNSeq2Seq:
    """The model saved by :func:`run` into ``dir``, the Transformer or the RNN as ``config.json`` says
    (checked first: :func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, fields)


def exact_match(pred: Tensor, tgt: Tensor, vocab: list[str] = TGT_VOCAB) -> float:
    """Fraction of rows whose decoded text equals the target's."""
    return sum(decode_chars(p, vocab) == decode_chars(t, vocab)
               for p, t in zip(pred.tolist(), tgt.tolist(), strict=True)) / len(tgt)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest characters inserted, deleted or replaced to turn ``a`` into ``b``."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def char_similarity(pred: Tensor, tgt: Tensor, vocab: list[str] = TGT_VOCAB) -> float:
    """Mean character similarity of the decoded rows to their targets: ``1 - edit distance / the
    longer text's length`` (1: the same text; a wrong letter in a long word costs little, which
    exact match cannot show)."""
    total = 0.0
    for p, t in zip(pred.tolist(), tgt.tolist(), strict=True):
        a, b = decode_chars(p, vocab), decode_chars(t, vocab)
        total += 1.0 - edit_distance(a, b) / max(len(a), len(b), 1)
    return total / len(tgt)


def alignment_figure(model: Seq2Seq | RNNSeq2Seq, words: list[str], layer: int = 0, pairs: Pairs = DATES):
    """The attention of the greedy translation of ``words`` (a source of ``pairs``, the dates by
    default): output characters down the side, source words along the top. The Transformer's is one
    decoder layer's cross-attention, mean over heads; the RNN's is its one additive attention
    (``layer`` must be 0).

    The first layer is the Transformer's default: there the alignment is sharpest (in the dates
    model the "7" of "seventy" puts most of its weight on "seventy"); later layers mix in context
    the first already gathered."""
    from ..viz.heatmap import heatmap

    src = torch.tensor([encode_words(words, pairs.src_vocab)])
    if isinstance(model, RNNSeq2Seq):
        if layer != 0:
            raise ValueError(f"layer must be 0 for the RNN (it has one attention), got {layer!r}")
        pred, weights = greedy_rnn(model, src)
        weights, title = weights[0], "additive attention of the RNN decoder"  # (Lt, Ls)
    else:
        with recording_cross_attention(model) as rec:
            pred = greedy(model, src)
        weights, title = torch.cat(rec[layer], dim=2)[0].mean(0), f"cross-attention, decoder layer {layer + 1}"
    ids = pred[0].tolist()
    ids = ids[:ids.index(EOS) + 1] if EOS in ids else ids  # what was written, <eos> included
    return heatmap(weights[:len(ids)], [pairs.tgt_vocab[i] for i in ids], words, title=title)


@dataclass
class Trained:
    """A model trained by :func:`train`, and what was measured on the way."""

    model: Seq2Seq | RNNSeq2Seq
    config: dict
    losses: list[float]
    step_seconds: float  # median wall clock of a step's forward, backward and update; batch making excluded
    train_seconds: float  # the whole training loop, batch making included
    test_days: Tensor  # the held-out items (days since FIRST_DAY for the dates)
    held_out: tuple[Tensor, Tensor, Tensor]  # (src, src_key_mask, tgt) of the first test_size of them
    greedy_exact: float  # greedy exact match on held_out
    greedy_chars: float  # greedy character similarity on held_out (char_similarity)

    @property
    def pairs(self) -> Pairs:
        """The pairs it was trained on."""
        return pairs_of(self.config)

    @property
    def num_parameters(self) -> int:
        """The model's parameter count."""
        return sum(p.numel() for p in self.model.parameters())


def train(model: str = "transformer", *, steps: int | None = None, seed: int = 0, quick: bool = False,
          progress: bool = True, pairs: str | None = None) -> Trained:
    """Train ``model`` (one of :data:`MODELS`) on the training items of ``pairs`` (:data:`PAIRS`; the
    default is ``DEFAULTS["pairs"]``); measure greedy exact match and character similarity on the
    held-out items.

    For one ``seed`` both models see the same days in the same order and style (the data has its
    own generator), with the same optimiser and schedule (:func:`attnkit.apps._common.fit`), so
    their figures compare.

    Raises:
        ValueError: ``model`` is not one of :data:`MODELS`.
    """
    cfg = settings(model, quick=quick, steps=steps, pairs=pairs)
    data = pairs_of(cfg)
    g = _common.seed_all(seed)
    train_days, test_days = split(g, data)
    net = build(cfg)
    # A step is the time from one batch made to the next batch asked for; the median leaves out the
    # first steps' one-time costs and the steps another process slowed down.
    step_times: list[float] = []
    made = 0.0

    def batch_fn(step: int):
        nonlocal made
        if step:
            step_times.append(time.perf_counter() - made)
        idx = torch.randint(0, len(train_days), (cfg["batch_size"],), generator=g)
        batch = make_batch(train_days[idx], g, data)
        made = time.perf_counter()
        return batch

    with _common.Timer() as train_time, one_thread():
        losses = _common.fit(net, batch_fn, loss_fn, steps=cfg["steps"], lr=cfg["lr"],
                             desc="translate" if model == "transformer" else f"translate ({model})",
                             warmup=min(cfg["warmup"], cfg["steps"]), progress=progress)
    step_times.append(time.perf_counter() - made)
    held_out = make_batch(test_days[:cfg["test_size"]], g, data)
    pred = greedy(net, held_out[0], held_out[1])
    return Trained(net, cfg, losses, statistics.median(step_times), train_time.seconds, test_days, held_out,
                   exact_match(pred, held_out[2], data.tgt_vocab), char_similarity(pred, held_out[2], data.tgt_vocab))


def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True,
        model: str = "transformer", pairs: str | None = None) -> _common.Result:
    """Train ``model`` (:data:`MODELS`, the Transformer unless asked) on the training items of
    ``pairs`` (:data:`PAIRS`, French -> German numbers unless asked), evaluate greedy decoding (and
    the Transformer's beam search) on the held-out items, draw the alignment, save the checkpoint
    (its ``config.json`` names the model and the pairs) and pictures into ``out``.

    Raises:
        ValueError: ``model`` is not one of :data:`MODELS` or ``pairs`` not one of :data:`PAIRS`
            (before anything is trained).
    """
    out = Path(out)
    _check_model(model)
    if pairs is not None:
        _pairs(pairs)
    with _common.Timer() as total:
        trained = train(model, steps=steps, seed=seed, quick=quick, progress=progress, pairs=pairs)
        cfg, net, (src, skm, tgt) = trained.config, trained.model, trained.held_out
        data = trained.pairs
        greedy_acc = trained.greedy_exact
        decoding = [{"Decoding": "greedy", "Exact match": greedy_acc, "Character similarity": trained.greedy_chars}]
        if model == "transformer":
            beamed = beam_search(net, src, skm, beam=cfg["beam"])
            beam_acc = exact_match(beamed, tgt, data.tgt_vocab)
            decoding.append({"Decoding": f"beam search of {cfg['beam']}", "Exact match": beam_acc,
                             "Character similarity": char_similarity(beamed, tgt, data.tgt_vocab)})
        _common.save(out, net, cfg)
        png = _common.save_png(alignment_figure(net, data.example(int(trained.test_days[0])), pairs=data),
                               out / "translate_alignment.png")
    losses = trained.losses
    unit = data.unit
    metrics: dict = {"model": MODEL_NAMES[model], "pairs": data.name, "parameters": trained.num_parameters,
                     "greedy_exact": greedy_acc, "greedy_chars": trained.greedy_chars}
    labels = {"model": "Model", "pairs": "Pairs", "parameters": "Parameters",
              "greedy_exact": f"Exact match, greedy decoding (share of held-out {unit})",
              "greedy_chars": "Character similarity, greedy decoding (1 - edit distance / length, mean)"}
    if model == "transformer":
        metrics[f"beam{cfg['beam']}_exact"] = beam_acc
        labels[f"beam{cfg['beam']}_exact"] = f"Exact match, beam search of {cfg['beam']} (share of held-out {unit})"
    metrics |= {"held_out": len(tgt), "first_loss": losses[0], "final_loss": sum(losses[-20:]) / len(losses[-20:]),
                "steps": cfg["steps"], "ms_per_step": round(trained.step_seconds * 1e3, 2),
                "train_seconds": round(trained.train_seconds, 1)}
    labels |= {"held_out": f"Held-out {unit}", "first_loss": "First training loss (nats per character)",
               "final_loss": "Final training loss (nats per character, mean of the last 20 steps)",
               "steps": "Training steps",
               "ms_per_step": "Milliseconds per training step (median; forward, backward, update)",
               "train_seconds": "Training seconds (batch making included)"}
    task = f"{data.description}, on {len(tgt)} {unit} held out from training"
    short = {"fr-de": "French -> German numbers", "dates": "dates in words -> ISO"}[data.name]
    one = unit[:-1]  # "date", "number"
    if model == "transformer":
        title = f"Translation: {short}"
        text = (f"{task}. Greedy exact match {greedy_acc:.1%}, beam search of {cfg['beam']} {beam_acc:.1%}; both "
                "decode through the KV cache.\n\n"
                "The picture is the cross-attention of the first decoder layer (mean over heads) while it "
                f"writes one held-out {one}: each output character looks at the words it comes from.")
    else:
        title = f"Translation with an RNN: {short}"
        text = (f"{task}, by the baseline attention was first built into: a bidirectional GRU encoder and a GRU "
                "decoder that, before each character, attends over the encoder's states with Bahdanau's additive "
                f"score v . tanh(W s + U h). Greedy exact match {greedy_acc:.1%}.\n\n"
                f"The picture is that attention while the decoder writes one held-out {one}: each output "
                "character's weights over the source words (one attention: no layers or heads to average).")
    return _common.Result("translate", metrics, total.seconds,
                          [Section(title, text, table=decoding, images=[png])], labels)


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare` measured: one row per model, and a verdict that says on what."""

    rows: list[dict]
    verdict: str

    def __str__(self) -> str:
        return f"{_common.table(self.rows)}\n\n{self.verdict}"


def compare(*, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True,
            pairs: str | None = None) -> Comparison:
    """Train the Transformer and the RNN at one step budget on ``pairs`` (:func:`train`: same items,
    batches, optimiser, schedule and seed) and set their greedy exact match and character similarity
    on the held-out items beside their median wall-clock time per training step.

    The verdict names the steps, seed, held-out count, thread count and CPU. It calls the exact
    matches apart only when they differ by more than two standard errors of their difference (each
    a share of the held-out dates, counted with one more date right and one more wrong, so that a
    share of 0 or 1 is not taken as certain); the time per step is one run's, on a machine that
    may have been busy. At a budget where both models write every held-out date right, exact match
    cannot tell them apart: fewer ``steps`` compare how fast each learns. Print the result for a
    table and the verdict.

    Raises:
        ValueError: ``steps`` is not a positive int (:func:`attnkit.apps._common.fit`).
    """
    runs = {m: train(m, steps=steps, seed=seed, quick=quick, progress=progress, pairs=pairs) for m in MODELS}
    unit = runs["rnn"].pairs.unit
    rows = [{"Model": MODEL_NAMES[m], "Parameters": t.num_parameters, "Training steps": t.config["steps"],
             f"Exact match, greedy (share of held-out {unit})": t.greedy_exact,
             "Character similarity, greedy": t.greedy_chars,
             "Milliseconds per training step (median)": round(t.step_seconds * 1e3, 2)} for m, t in runs.items()]
    return Comparison(rows, _verdict(runs["transformer"], runs["rnn"], seed))


def _verdict(transformer: Trained, rnn: Trained, seed: int) -> str:
    from .._cpu import name as cpu_name

    n, cfg, unit = len(transformer.held_out[2]), transformer.config, transformer.pairs.unit
    where = (f"{cfg['steps']:,} training steps of {cfg['batch_size']} {unit}, seed {seed}, {n:,} held-out {unit}, "
             f"{torch.get_num_threads()} torch thread(s) on {cpu_name()}")
    a, b = transformer.greedy_exact, rnn.greedy_exact
    # Each share's variance with one item right and one wrong added, so that 0% and 100% have one too.
    smoothed = [(round(x * n) + 1) / (n + 2) for x in (a, b)]
    two_se = 2 * math.sqrt(sum(p * (1 - p) for p in smoothed) / n)
    if a == b:
        accuracy = f"greedy exact match {a:.1%} for both, so this run does not tell them apart"
    elif abs(a - b) <= two_se:
        accuracy = (f"greedy exact match {a:.1%} (Transformer) and {b:.1%} (RNN) lie within two standard errors "
                    f"of their difference ({two_se:.1%}), so this run does not tell them apart")
    else:
        ahead = "Transformer" if a > b else "RNN"
        accuracy = (f"greedy exact match {a:.1%} (Transformer) against {b:.1%} (RNN): the {ahead} wrote more of "
                    f"the held-out {unit} exactly right at this budget (the gap exceeds two standard errors, "
                    f"{two_se:.1%})")
    ms_t, ms_r = transformer.step_seconds * 1e3, rnn.step_seconds * 1e3
    timing = (f"the median training step took {ms_t:.1f} ms (Transformer) and {ms_r:.1f} ms (RNN), RNN / "
              f"Transformer {ms_r / ms_t:.2f}, one run each on this machine")
    return (f"Measured with {where}: {accuracy}; {timing}. One seed at one budget: this says which model got "
            "further in these steps here, not which is better in general.")
