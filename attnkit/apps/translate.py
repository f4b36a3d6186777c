"""Translate English dates written in words into ISO dates with a sequence-to-sequence Transformer.

The task is generated on the fly: "twenty third of november two thousand twenty six" (or
"november twenty third two thousand twenty six") -> "2026-11-23", for every day from 1900-01-01
to 2099-12-31. A tenth of the days are held out: the model never sees them while training, and
the exact-match rate is measured on them. Source tokens are words, target tokens are characters.

Read top to bottom: data -> model (an encoder-decoder :class:`attnkit.modules.Transformer`) ->
decoding (greedy and beam search, both with one :class:`attnkit.cache.KVCache` per decoder layer)
-> training -> evaluation -> the cross-attention alignment drawn with both token sequences on the
axes. :class:`Seq2Seq`, :func:`greedy` and :func:`recording_cross_attention` do not depend on the
task; ``caption`` reuses them with image patches as the source.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..analysis.record import recorded_weights
from ..cache import KVCache
from ..modules import Transformer
from ..positional import LearnedPositionalEmbedding
from ..viz.report import Section
from . import _common

DEFAULTS = {"steps": 1000, "lr": 2e-3, "warmup": 100, "batch_size": 128, "embed_dim": 64, "num_heads": 4,
            "encoder_layers": 2, "decoder_layers": 2, "ffn_dim": 128, "beam": 4, "test_size": 2000}
QUICK = {"steps": 300, "batch_size": 32, "embed_dim": 32, "num_heads": 2, "encoder_layers": 1,
         "decoder_layers": 1, "ffn_dim": 64, "beam": 2, "test_size": 64}

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


def encode_words(words: list[str]) -> list[int]:
    return [SRC_VOCAB.index(w) for w in words]


def encode_chars(text: str) -> list[int]:
    return [TGT_VOCAB.index(c) for c in text]


def detokenize(ids: list[int], vocab: list[str], sep: str = "") -> str:
    """Token ids -> text up to the first <eos>; a stray <pad>/<bos> shows as "?"."""
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(vocab[i] if i > EOS else "?")
    return sep.join(out)


def decode_chars(ids: list[int]) -> str:
    """Target ids -> the ISO date text."""
    return detokenize(ids, TGT_VOCAB)


def split_days(g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Day numbers since :data:`FIRST_DAY`, shuffled: 90% to train on, 10% held out."""
    n = (LAST_DAY - FIRST_DAY).days + 1
    perm = torch.randperm(n, generator=g)
    return perm[n // 10:], perm[:n // 10]


def make_batch(days: Tensor, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """``(src [B, SRC_LEN], src_key_mask [B, SRC_LEN], tgt [B, TGT_LEN])``, styles drawn from ``g``.

    ``tgt`` is the ISO date and <eos>; the decoder's input is it shifted right behind <bos>.
    """
    styles = torch.randint(0, 2, (len(days),), generator=g).tolist()
    src = torch.full((len(days), SRC_LEN), PAD)
    tgt = torch.empty(len(days), TGT_LEN, dtype=torch.long)
    for i, (d, s) in enumerate(zip(days.tolist(), styles, strict=True)):
        day = FIRST_DAY + dt.timedelta(days=d)
        ids = encode_words(in_words(day, s))
        src[i, :len(ids)] = torch.tensor(ids)
        tgt[i] = torch.tensor(encode_chars(day.isoformat()) + [EOS])
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


def loss_fn(model: Seq2Seq, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Cross-entropy of every target token (padding ignored)."""
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
def greedy(model: Seq2Seq, src: Tensor, src_key_mask: Tensor | None = None) -> Tensor:
    """The most likely token at each step, one token per step through the KV cache.

    Returns:
        ``[B, tgt_len]`` token ids; after a row's <eos> the row holds ``PAD``.
    """
    memory = model.encode(src, src_key_mask)
    b = memory.shape[0]
    caches = model.transformer.decoder.make_caches(b, model.tgt_len)
    out = torch.full((b, model.tgt_len), PAD)
    tok = torch.full((b, 1), BOS)
    done = torch.zeros(b, dtype=torch.bool)
    for t in range(model.tgt_len):
        tok = _next_logp(model, tok, memory, src_key_mask, caches).argmax(-1, keepdim=True)  # (B, 1)
        out[:, t] = tok[:, 0].masked_fill(done, PAD)
        done |= tok[:, 0] == EOS
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
        ValueError: ``beam`` is not a positive int.
    """
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


def recording_cross_attention(model: Seq2Seq):
    """Inside the block, every decoder layer's cross-attention weights are kept.

    Yields:
        One list per decoder layer, appended to on each call with ``[B, H, Lt, Ls]`` (``Lt`` = 1
        per step when decoding with the cache; ``torch.cat(..., dim=2)`` joins the steps).
        See :func:`attnkit.analysis.recorded_weights`.
    """
    return recorded_weights(layer.cross_attn for layer in model.transformer.decoder.layers)


# ---------------------------------------------------------------------------- train and evaluate


def build(config: dict) -> Seq2Seq:
    """The model for ``config`` (what :func:`load` rebuilds from ``config.json``)."""
    return Seq2Seq(TokenEmbedding(len(SRC_VOCAB), SRC_LEN, config["embed_dim"]), len(TGT_VOCAB), TGT_LEN,
                   embed_dim=config["embed_dim"], num_heads=config["num_heads"],
                   encoder_layers=config["encoder_layers"], decoder_layers=config["decoder_layers"],
                   ffn_dim=config["ffn_dim"])


#: What :func:`load` checks in ``config.json`` against the weights before building.
FIELDS = {
    "embed_dim": _common.size("src_embed.embed.weight", 1),
    "num_heads": _common.heads("embed_dim"),
    "encoder_layers": _common.layers("transformer.encoder.layers"),
    "decoder_layers": _common.layers("transformer.decoder.layers"),
    "ffn_dim": _common.size("transformer.encoder.layers.0.ff.linear1.weight", 0),
}


def load(dir: str | Path) -> Seq2Seq:
    """The model saved by :func:`run` into ``dir`` (checked first: :func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, FIELDS)


def exact_match(pred: Tensor, tgt: Tensor) -> float:
    """Fraction of rows whose decoded text equals the target's."""
    return sum(decode_chars(p) == decode_chars(t) for p, t in zip(pred.tolist(), tgt.tolist(), strict=True)) / len(tgt)


def alignment_figure(model: Seq2Seq, words: list[str], layer: int = 0):
    """The cross-attention of the greedy translation of ``words``: output characters down the side,
    source words along the top; one decoder layer, mean over heads.

    The first layer is the default: there the alignment is sharpest (in the default model the "7"
    of "seventy" puts most of its weight on "seventy"); later layers mix in context the first
    already gathered."""
    from ..viz.heatmap import heatmap

    src = torch.tensor([encode_words(words)])
    with recording_cross_attention(model) as rec:
        pred = greedy(model, src)
    ids = pred[0].tolist()
    ids = ids[:ids.index(EOS) + 1] if EOS in ids else ids  # what was written, <eos> included
    weights = torch.cat(rec[layer], dim=2)[0].mean(0)[:len(ids)]  # (Lt, Ls)
    return heatmap(weights, [TGT_VOCAB[i] for i in ids], words, title=f"cross-attention, decoder layer {layer + 1}")


def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False,
        progress: bool = True) -> _common.Result:
    """Train on the training days, evaluate greedy and beam decoding on the held-out days, draw the
    alignment, save the checkpoint and pictures into ``out``."""
    out = Path(out)
    with _common.Timer() as total:
        cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
        g = _common.seed_all(seed)
        train_days, test_days = split_days(g)
        model = build(cfg)

        def batch_fn(step: int):
            idx = torch.randint(0, len(train_days), (cfg["batch_size"],), generator=g)
            return make_batch(train_days[idx], g)

        with _common.Timer() as train_time:
            losses = _common.fit(model, batch_fn, loss_fn, steps=cfg["steps"], lr=cfg["lr"], desc="translate",
                                 warmup=min(cfg["warmup"], cfg["steps"]), progress=progress)
        src, skm, tgt = make_batch(test_days[:cfg["test_size"]], g)
        greedy_acc = exact_match(greedy(model, src, skm), tgt)
        beam_acc = exact_match(beam_search(model, src, skm, beam=cfg["beam"]), tgt)
        _common.save(out, model, cfg)
        example = FIRST_DAY + dt.timedelta(days=int(test_days[0]))
        png = _common.save_png(alignment_figure(model, in_words(example, 1)), out / "translate_alignment.png")
    metrics = {"greedy_exact": greedy_acc, f"beam{cfg['beam']}_exact": beam_acc, "held_out": len(tgt),
               "first_loss": losses[0], "final_loss": sum(losses[-20:]) / len(losses[-20:]),
               "steps": cfg["steps"], "train_seconds": round(train_time.seconds, 1)}
    text = (f"Dates written in English words -> ISO 8601, on {len(tgt)} days held out from training "
            f"(1900-2099, two word orders). Greedy exact match {greedy_acc:.1%}, beam search of "
            f"{cfg['beam']} {beam_acc:.1%}; both decode through the KV cache.\n\n"
            "The picture is the cross-attention of the first decoder layer (mean over heads) while it "
            "writes one held-out date: each output character looks at the words it comes from.")
    labels = {"greedy_exact": "Exact match, greedy decoding (share of held-out dates)",
              f"beam{cfg['beam']}_exact": f"Exact match, beam search of {cfg['beam']} (share of held-out dates)",
              "held_out": "Held-out dates", "first_loss": "First training loss (nats per character)",
              "final_loss": "Final training loss (nats per character, mean of the last 20 steps)",
              "steps": "Training steps", "train_seconds": "Training seconds"}
    return _common.Result("translate", metrics, total.seconds,
                          [Section("Translation: dates in words -> ISO", text,
                                   table=[{"Decoding": "greedy", "Exact match": greedy_acc},
                                          {"Decoding": f"beam search of {cfg['beam']}", "Exact match": beam_acc}],
                                   images=[png])], labels)
