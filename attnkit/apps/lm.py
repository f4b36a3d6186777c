"""A character-level GPT trained from scratch on the Python standard library's own docstrings.

Data: the docstrings of a fixed, sorted list of standard-library modules, read at run time with
:mod:`inspect` (:mod:`attnkit.apps._corpus`: which modules, and why the text is the same on every
machine with the same Python). Every 10th docstring is held out for validation. Tokens are
characters; a character seen fewer than ``min_char_count`` times in the training text is one
"unknown" token.

Model: token + learned position embeddings, a stack of pre-norm :class:`TransformerEncoderLayer`
blocks with causal self-attention (GPT-2's block), a final LayerNorm, and the output layer tied to
the token embeddings. Trained to predict every next character of random windows of the training text.

Evaluation, all in the same units (nats per character, and perplexity ``exp`` of it), on the same
validation characters: the GPT (every character predicted from at least ``block_size / 2``
characters before it, except at the very start), and two baselines counted on the same training
text: a smoothed bigram and trigram (:mod:`attnkit.apps._ngram`). Then samples generated through
the KV cache, and two head detectors on the trained model (:func:`previous_token_score`,
:func:`induction_score`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._io import atomic_write
from ..analysis.record import recorded_weights
from ..cache import KVCache, make_caches
from ..modules import TransformerEncoderLayer
from ..viz.report import Section
from . import _common, _corpus, _ngram
from ._common import Result, Timer, save_png

# No dropout: about two passes over the training text leave little to overfit, and on the CPU
# dropout's random masks cost a third of a step.
DEFAULTS: dict = {
    "steps": 1000, "lr": 4e-3, "warmup": 100, "batch_size": 16, "block_size": 128, "embed_dim": 96,
    "num_heads": 4, "num_layers": 3, "ffn_dim": 384, "dropout": 0.0, "min_char_count": 20,
    "modules": _corpus.MODULES, "samples": 3, "sample_chars": 240, "temperature": 0.8, "probe_batch": 16,
}
# Seconds: five small modules, a two-layer model.
QUICK: dict = {"steps": 60, "warmup": 6, "batch_size": 16, "block_size": 64, "embed_dim": 32, "num_layers": 2,
               "ffn_dim": 64, "min_char_count": 2, "modules": ("heapq", "json", "shlex", "string", "textwrap"),
               "samples": 2, "sample_chars": 80, "probe_batch": 4}

#: A head "formed" when its detector scores at least this: that share of each row's weight on
#: the one position the pattern names.
FORMED = 0.4
MODEL_KEYS = ("vocab_size", "block_size", "embed_dim", "num_heads", "num_layers", "ffn_dim", "dropout")


# --------------------------------------------------------------------------- data

class CharVocab:
    """Characters <-> ids: characters are the tokens, so the comparison with the n-gram baselines
    is per character, free of any tokenizer's choices.

    Id 0 is the unknown character; the rest are the characters seen at least
    ``min_count`` times in the text the vocabulary is built from, in code-point order.

    Args:
        chars: the known characters, in id order from 1 (see :meth:`from_text`).
    """

    UNK = 0
    UNK_TEXT = "\ufffd"  # how an unknown character prints

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars) or self.UNK_TEXT in chars:
            raise ValueError(f"chars must be distinct and without {self.UNK_TEXT!r}, got {chars!r}")
        self.chars = chars
        self._id = {c: i + 1 for i, c in enumerate(chars)}
        self._lut = np.array([self.UNK_TEXT, *chars])

    @classmethod
    def from_text(cls, text: str, *, min_count: int = 1) -> CharVocab:
        counts = Counter(text)
        return cls("".join(sorted(c for c, n in counts.items() if n >= min_count and c != cls.UNK_TEXT)))

    def __len__(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> np.ndarray:
        """``text`` -> int64 ids ``[len(text)]``; an unknown character -> :attr:`UNK`."""
        get = self._id.get
        return np.fromiter((get(c, self.UNK) for c in text), dtype=np.int64, count=len(text))

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self._lut[np.asarray(list(ids), dtype=np.int64)])


class Corpus(NamedTuple):
    """The docstring corpus as the model sees it."""

    vocab: CharVocab  #: built from the training text only
    train: np.ndarray  #: int64 ids of the training text
    val: np.ndarray  #: int64 ids of the validation text
    val_docs: list[str]  #: the held-out docstrings, in order (their first lines prompt the samples)


def corpus(modules=_corpus.MODULES, *, min_char_count: int = 20) -> Corpus:
    """The docstring corpus of ``modules``, every 10th docstring held out (:func:`attnkit.apps._corpus.split`)."""
    docs = _corpus.documents(modules)
    train_text, val_text = _corpus.split(docs, every=10)
    vocab = CharVocab.from_text(train_text, min_count=min_char_count)
    return Corpus(vocab, vocab.encode(train_text), vocab.encode(val_text), docs[9::10])


def windows(ids: Tensor, starts: Tensor, length: int) -> Tensor:
    """``[len(starts), length]``: ``ids[s : s + length]`` for each start."""
    return ids[starts[:, None] + torch.arange(length)]


# --------------------------------------------------------------------------- model

class GPT(nn.Module):
    """Decoder-only Transformer: next-character logits for every position.

    Shape notation: ``B`` batch, ``L`` positions (``<= block_size``), ``E`` = ``embed_dim``,
    ``V`` = ``vocab_size``.
    """

    def __init__(self, *, vocab_size: int, block_size: int, embed_dim: int, num_heads: int, num_layers: int,
                 ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, embed_dim)
        self.pos = nn.Embedding(block_size, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            TransformerEncoderLayer(embed_dim, num_heads, ffn_dim=ffn_dim, dropout=dropout, activation="gelu",
                                    norm_first=True) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)
        # GPT-2's 0.02: with the output tied to these, the first logits are near 0 (loss ~ ln V).
        for table in (self.tok, self.pos):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, ids: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """``ids [B, L]`` -> logits ``[B, L, V]``; with ``caches`` (one per layer) only the new ids,
        which sit after the ``caches[0].seq_len`` already cached."""
        start = 0 if caches is None else caches[0].seq_len
        if start + ids.shape[1] > self.block_size:
            raise ValueError(f"positions {start} .. {start + ids.shape[1] - 1} run past block_size "
                             f"{self.block_size}: give at most {self.block_size} ids")
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.dropout(self.tok(ids) + self.pos(positions))  # (B, L, E)
        for i, layer in enumerate(self.layers):
            x = layer(x, is_causal=True, cache=None if caches is None else caches[i])
        return self.norm(x) @ self.tok.weight.T  # (B, L, V): tied output layer

    def make_caches(self, batch_size: int) -> list[KVCache]:
        """One empty cache per layer, ``block_size`` long."""
        return make_caches((layer.self_attn for layer in self.layers), batch_size, self.block_size)


def build(config: dict) -> GPT:
    """The model described by a checkpoint's ``config.json``."""
    return GPT(**{k: config[k] for k in MODEL_KEYS})


#: What :func:`load` checks in ``config.json`` against the weights before building.
FIELDS = {
    "vocab_size": _common.size("tok.weight", 0),
    "block_size": _common.size("pos.weight", 0),
    "embed_dim": _common.size("tok.weight", 1),
    "num_heads": _common.heads("embed_dim"),
    "num_layers": _common.layers("layers"),
    "ffn_dim": _common.size("layers.0.ff.linear1.weight", 0),
    "dropout": _common.probability(),
}


def load(dir: str | Path) -> GPT:
    """The model saved by :func:`run` into ``dir`` (checked first: :func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, FIELDS)


def load_vocab(dir: str | Path) -> CharVocab:
    """The character vocabulary saved with the model in ``dir``'s ``config.json`` (read with the
    checkpoint reader's size limits; ``chars`` must be a string of distinct characters)."""
    from ..models import checkpoint as ckpt

    path = ckpt.member(Path(dir), _common.CONFIG)
    chars = ckpt.read_json(path).get("chars")
    if not isinstance(chars, str) or len(set(chars)) != len(chars):
        got = "repeated characters" if isinstance(chars, str) else type(chars).__name__
        raise ValueError(f"{path}: key 'chars' must be a string of distinct characters, got {got}")
    return CharVocab(chars)


@contextmanager
def recorded_attention(model: GPT):
    """Within the block, each layer's self-attention weights ``[B, H, L, L]`` are appended to the
    yielded list, in layer order, for every forward pass."""
    maps: list[Tensor] = []
    with recorded_weights(layer.self_attn for layer in model.layers) as rec:
        yield maps
    maps.extend(w for calls in zip(*rec, strict=True) for w in calls)


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def cross_entropy(model: GPT, ids: np.ndarray | Tensor, *, batch_size: int = 64) -> float:
    """Mean ``-log P(ids[t] | ids[:t])`` over ``t = 1 .. len(ids) - 1``, nats per character.

    Windows of ``block_size`` ids, ``block_size // 2`` apart; each id is scored once, in the first
    window where it has at least ``block_size // 2`` ids before it (in the first window, all).
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    n, block = len(ids), model.block_size
    if n < 2:
        raise ValueError(f"ids must hold at least 2 ids, got {n}")
    block = min(block, n - 1)
    half = max(block // 2, 1)
    starts = list(range(0, n - 1 - block + 1, half))
    if starts[-1] != n - 1 - block:
        starts.append(n - 1 - block)  # the tail, in a window ending at the last id
    total, count, done = 0.0, 0, 0  # done: targets 1 .. done are scored
    for i in range(0, len(starts), batch_size):
        s = torch.tensor(starts[i: i + batch_size])
        x, y = windows(ids, s, block), windows(ids, s + 1, block)
        nll = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(len(s), block)
        for row, start in zip(nll, s.tolist(), strict=True):
            first = done + 1 - (start + 1)  # the first target of this window not yet scored
            total += float(row[first:].double().sum())
            count += block - first
            done = start + block
    assert count == n - 1, (count, n)
    return total / count


@torch.no_grad()
def generate(model: GPT, prompt: Tensor, n: int, *, temperature: float = 0.8,
             generator: torch.Generator | None = None) -> Tensor:
    """``n`` ids sampled after ``prompt [L]``, one at a time through the KV cache.

    When the cache is full (``block_size`` ids), generation goes on from the last
    ``block_size // 2`` ids with fresh caches (the positions are learned up to ``block_size``).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    context = prompt[-model.block_size:].tolist()
    caches = model.make_caches(1)
    logits = model(torch.tensor([context]), caches)[0, -1]
    out: list[int] = []
    for _ in range(n):
        nxt = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))
        out.append(nxt)
        context.append(nxt)
        if caches[0].seq_len == model.block_size:
            context = context[-(model.block_size // 2):]
            caches = model.make_caches(1)
            logits = model(torch.tensor([context]), caches)[0, -1]
        else:
            logits = model(torch.tensor([[nxt]]), caches)[0, -1]
    return torch.tensor(out)


# --------------------------------------------------------------------------- heads

def _check_square(attn: Tensor) -> None:
    if attn.dim() < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attn must be [..., L, L] (self-attention), got shape {tuple(attn.shape)}")


def previous_token_score(attn: Tensor) -> Tensor:
    """How much a head attends to the position just before each query.

    ``mean over i = 1 .. L-1 of attn[..., i, i - 1]``: 1 for a head that puts all of each row's
    weight on the previous position, ``mean 1 / (i + 1)`` for uniform causal attention.

    Args:
        attn: ``[..., L, L]`` weights of self-attention, ``L >= 2``.

    Returns:
        ``[...]``, one score per map.
    """
    _check_square(attn)
    if attn.shape[-1] < 2:
        raise ValueError(f"attn needs L >= 2 for a previous position, got L = {attn.shape[-1]}")
    return attn.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)


def induction_score(attn: Tensor, period: int) -> Tensor:
    """How much a head attends to the token that followed the earlier copy of the current one.

    On a sequence that repeats with ``period`` (``x[i] = x[i - period]`` for ``i >= period``), an
    induction head at query ``i`` looks back to ``i - period + 1``: the token after the previous
    occurrence of ``x[i]``, which is the one to predict next (Olsson et al. 2022). The score is
    ``mean over i = period .. L-1 of attn[..., i, i - period + 1]``: 1 for a pure induction head.

    Args:
        attn: ``[..., L, L]`` weights of self-attention on the repeated sequence.
        period: the length of the repeated part, ``1 <= period < L``.

    Returns:
        ``[...]``, one score per map.
    """
    _check_square(attn)
    if not isinstance(period, int) or not 1 <= period < attn.shape[-1]:
        raise ValueError(f"period must be an int in [1, {attn.shape[-1]}), got {period!r}")
    return attn.diagonal(offset=-(period - 1), dim1=-2, dim2=-1)[..., 1:].mean(-1)


def uniform_causal(length: int) -> Tensor:
    """``[L, L]`` causal attention spread evenly over each row's keys: what the scores are compared with."""
    return torch.ones(length, length).tril() / torch.arange(1, length + 1)[:, None]


def repeated_random(batch: int, period: int, vocab_size: int, gen: torch.Generator) -> Tensor:
    """``[batch, 2 * period]``: random known characters (no unknown id), then the same again."""
    first = torch.randint(1, vocab_size, (batch, period), generator=gen)
    return torch.cat([first, first], dim=1)


def _repeat_probe(model: GPT, seq: Tensor, period: int) -> tuple[Tensor, Tensor, Tensor]:
    """Induction scores ``[layers, heads]`` on ``seq [B, 2 * period]`` (one repeat), and the mean loss
    on each copy, each without its first character (nothing before it tells what it will be)."""
    with recorded_attention(model) as maps:
        logits = model(seq)
    scores = torch.stack([induction_score(w, period).mean(0) for w in maps])
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), seq[:, 1:].flatten(), reduction="none").view(len(seq), -1)
    return scores, nll[:, :period - 1].mean(), nll[:, period:].mean()


@torch.no_grad()
def head_scores(model: GPT, val: Tensor, gen: torch.Generator, *, batch: int = 16) -> dict[str, Tensor]:
    """The detectors on every layer and head, means over ``batch`` inputs.

    Returns:
        ``previous [layers, heads]``: on ``batch`` validation windows of ``block_size``, evenly spaced.
        ``induction [layers, heads]``: on ``batch`` sequences of ``block_size // 2`` random known
        characters, repeated once (the usual probe: only a head that copies can predict them);
        ``induction_text``: the same on held-out snippets repeated once (text like the training text).
        ``copy_loss``: ``[2, 2]`` mean loss, nats per character, on the first and second copy
        (columns), of the random characters and of the held-out text (rows).
    """
    block = model.block_size
    starts = torch.linspace(0, len(val) - block - 1, batch).long()
    with recorded_attention(model) as maps:
        model(windows(val, starts, block))
    previous = torch.stack([previous_token_score(w).mean(0) for w in maps])
    period = block // 2
    induction, *random_loss = _repeat_probe(model, repeated_random(batch, period, model.tok.num_embeddings, gen),
                                            period)
    snippets = windows(val, starts, period)
    induction_text, *text_loss = _repeat_probe(model, torch.cat([snippets, snippets], dim=1), period)
    return {"previous": previous, "induction": induction, "induction_text": induction_text,
            "copy_loss": torch.tensor([random_loss, text_loss])}


# --------------------------------------------------------------------------- pictures

NEWLINE = "\u23ce"  # how a new line is shown where lines cannot break (labels, table cells)


def _label(ch: str) -> str:
    return {" ": "\u2423", "\n": NEWLINE}.get(ch, ch)


def _shown(text: str) -> str:
    return text.replace("\n", NEWLINE + " ")


def draw_loss(losses: list[float], baselines: dict[str, float], gpt_val: float):
    """Training loss (running mean of 20 steps) with the validation cross-entropies as lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    w = min(20, len(losses))
    smooth = np.convolve(losses, np.ones(w) / w, mode="valid")
    ax.plot(np.arange(len(smooth)) + w, smooth, color="C0", label="GPT, training batches (mean of 20 steps)")
    ax.axhline(gpt_val, color="C0", ls="--", label=f"GPT, validation ({gpt_val:.3f})")
    for (name, ce), color in zip(baselines.items(), ("C3", "C2"), strict=False):
        ax.axhline(ce, color=color, ls=":", label=f"{name}, validation ({ce:.3f})")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_ylim(0, max(5.0, float(smooth[0]) * 1.05))
    ax.legend(fontsize=8)
    ax.set_title("Character-level GPT on standard-library docstrings")
    return fig


def draw_scores(scores: dict[str, Tensor]):
    """Three panels of layer x head cells: the previous-token score and both induction scores, with their values."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers, heads = scores["previous"].shape
    fig = Figure(figsize=(2.0 + 2.4 * heads, 1.2 + 0.75 * layers), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for ax, key, title in zip(axes, ("previous", "induction", "induction_text"),
                              ("previous-token score", "induction score,\nrandom characters repeated",
                               "induction score,\nheld-out text repeated"), strict=True):
        s = scores[key].numpy()
        im = ax.imshow(s, vmin=0, vmax=1, cmap="Blues")
        for (r, c), v in np.ndenumerate(s):
            ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=8, color="white" if v > 0.6 else "black")
        ax.set_xticks(range(heads), [f"h{h}" for h in range(heads)])
        ax.set_yticks(range(layers), [f"layer {k + 1}" for k in range(layers)])
        ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8)
    return fig


def _head_picture(model: GPT, ids: Tensor, vocab: CharVocab, layer: int, head: int, title: str, path: Path):
    from ..viz.heatmap import heatmap

    with torch.no_grad(), recorded_attention(model) as maps:
        model(ids[None])
    labels = [_label(c) for c in vocab.decode(ids.tolist())]
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    return save_png(heatmap(maps[layer][0, head], labels, labels, mask=causal, title=title), path)


# --------------------------------------------------------------------------- run

def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True) -> Result:
    """Read the docstrings, count the n-gram baselines, train the GPT from scratch, evaluate it on
    the held-out docstrings, sample from it, find its heads; save checkpoint and pictures in ``out``."""
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    out = Path(out)
    with Timer() as total:
        data = corpus(cfg["modules"], min_char_count=cfg["min_char_count"])
        vocab, train_np, val_np = data.vocab, data.train, data.val
        train, val = torch.from_numpy(train_np), torch.from_numpy(val_np)
        v = len(vocab)
        ngrams = {name: _ngram.fit(train_np, v, order=k) for name, k in (("bigram", 2), ("trigram", 3))}
        baselines = {name: m.cross_entropy(val_np) for name, m in ngrams.items()}

        gen = _common.seed_all(seed)
        config = {**{k: cfg[k] for k in MODEL_KEYS if k != "vocab_size"}, "vocab_size": v, "chars": vocab.chars}
        model = build(config)
        block = cfg["block_size"]

        def batch(step: int) -> Tensor:
            return windows(train, torch.randint(len(train) - block, (cfg["batch_size"],), generator=gen), block + 1)

        def loss_fn(m: nn.Module, b: Tensor) -> Tensor:
            return F.cross_entropy(m(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())

        with Timer() as train_time:
            losses = _common.fit(model, batch, loss_fn, steps=cfg["steps"], lr=cfg["lr"], warmup=cfg["warmup"],
                                 desc="lm", progress=progress)
        gpt_val = cross_entropy(model, val)
        _common.save(out, model, config)

        samples = _samples(model, vocab, data.val_docs, cfg, gen)
        scores = head_scores(model, val, gen, batch=cfg["probe_batch"])
        pictures = _pictures(model, vocab, val, losses, baselines, gpt_val, scores, out)
        samples_txt = atomic_write(out / "lm_samples.txt", lambda f: f.write(
            "\n\n".join(f"--- prompt\n{p}--- sample\n{s}" for p, s in samples).encode("utf-8") + b"\n"))

    chance_prev = float(previous_token_score(uniform_causal(block)))
    chance_ind = float(induction_score(uniform_causal(block), block // 2))
    best = {key: _best(scores[key]) for key in ("previous", "induction", "induction_text")}
    top = {key: float(scores[key][at]) for key, at in best.items()}
    (rand_first, rand_second), (text_first, text_second) = scores["copy_loss"].tolist()
    ce = {"GPT": gpt_val, **baselines}
    metrics = {
        "modules read": len(cfg["modules"]), "train chars": len(train), "validation chars": len(val),
        "vocabulary (characters)": v,
        **{f"validation perplexity per char, {name}": _ngram.perplexity(x) for name, x in ce.items()},
        **{f"validation nats per char, {name}": x for name, x in ce.items()},
        "first_loss": losses[0], "final_loss": float(np.mean(losses[-50:])), "steps": cfg["steps"],
        "train seconds": train_time.seconds,
        "best previous-token head": _where(best["previous"]), "previous-token score": top["previous"],
        "best induction head": _where(best["induction"]), "induction score": top["induction"],
        "best induction head, held-out text repeated": _where(best["induction_text"]),
        "induction score, held-out text repeated": top["induction_text"],
        "repeat loss, random characters, 1st copy": rand_first, "repeat loss, random characters, 2nd copy": rand_second,
        "repeat loss, held-out text, 1st copy": text_first, "repeat loss, held-out text, 2nd copy": text_second,
    }
    formed = " ".join([
        _said("previous-token", top["previous"], chance_prev, best["previous"]),
        _said("induction", top["induction"], chance_ind, best["induction"], "on the random characters"),
        _said("induction", top["induction_text"], chance_ind, best["induction_text"], "on the repeated held-out text"),
        _copied("random characters", rand_first, rand_second), _copied("held-out text", text_first, text_second),
        "These scores describe this trained model, with this seed; a head below the threshold may still do part "
        "of the job."])
    sections = [
        Section("Data and validation perplexity",
                f"The docstrings of {len(cfg['modules'])} standard-library modules (Python's own, read with inspect; "
                f"{', '.join(cfg['modules'][:6])}, ...): {len(train):,} training and {len(val):,} validation "
                f"characters (every 10th docstring held out), {v} tokens (characters seen at least "
                f"{cfg['min_char_count']} times in training, and one for the rest). Every model scores the same "
                f"{len(val) - 1:,} validation characters; cross-entropy in nats per character and perplexity "
                "exp(cross-entropy), per character. The n-gram baselines are counted on the same training "
                f"text, smoothed towards the order below (Dirichlet, alpha chosen on the training text: bigram "
                f"{ngrams['bigram'].alpha:g}, trigram {ngrams['trigram'].alpha:g}).",
                table=[{"Model": name, "Nats per character": x, "Bits per character": x / np.log(2),
                        "Perplexity per character": _ngram.perplexity(x)} for name, x in ce.items()],
                images=[pictures["loss"]]),
        Section("Samples",
                f"Sampled at temperature {cfg['temperature']}, one character at a time through the KV cache, "
                f"after the first line (name and signature) of a held-out docstring; {NEWLINE} marks a new line. "
                f"As plain text in {samples_txt.name}.",
                table=[{"Prompt": _shown(p), "Sample": _shown(s)} for p, s in samples]),
        Section("Heads",
                f"Previous-token score: mean weight from each position to the one before it, on {cfg['probe_batch']} "
                f"validation windows of {block} characters (uniform causal attention scores {chance_prev:.3f}). "
                f"Induction score: on {cfg['probe_batch']} sequences of {block // 2} random characters repeated "
                "once, mean weight from each position of the second copy to the character that followed the "
                f"same character in the first copy (uniform: {chance_ind:.3f}); the same on {cfg['probe_batch']} "
                f"held-out snippets of {block // 2} characters repeated once (text like the training text, where "
                "the first copy alone already predicts much). Repeat loss: the model's cross-entropy on each "
                f"copy. A head counts as formed at a score of {FORMED} or more.\n\n{formed}",
                images=[pictures["scores"], pictures["previous"], pictures["induction"]]),
    ]
    labels = {"modules read": "Standard-library modules read", "train chars": "Training characters",
              "validation chars": "Validation characters", "vocabulary (characters)": "Vocabulary (characters)",
              **{f"validation perplexity per char, {name}": f"Validation perplexity per character, {name}"
                 for name in ce},
              **{f"validation nats per char, {name}": f"Validation cross-entropy, {name} (nats per character)"
                 for name in ce},
              "first_loss": "First training loss (nats per character)",
              "final_loss": "Final training loss (nats per character, mean of the last 50 steps)",
              "steps": "Training steps", "train seconds": "Training seconds",
              **{k: f"Repeat loss{k.removeprefix('repeat loss')} (nats per character)"
                 for k in metrics if k.startswith("repeat loss")}}  # the rest read as they are, capitalised
    return Result("lm", metrics, total.seconds, sections, labels)


def _best(score: Tensor) -> tuple[int, int]:
    layer, head = divmod(int(score.argmax()), score.shape[1])
    return layer, head


def _where(at: tuple[int, int]) -> str:
    return f"layer {at[0] + 1} head {at[1]}"


def _said(name: str, score: float, chance: float, at: tuple[int, int], probe: str = "") -> str:
    probe = f" {probe}" if probe else ""
    times = f"{score / chance:.0f} times" if score >= 2 * chance else "about" if score >= chance / 2 else "below"
    against = f"{times} uniform attention's {chance:.3f}"
    if score >= FORMED:
        article = "An" if name[0] in "aeiou" else "A"
        return f"{article} {name} head formed{probe}: {_where(at)} scores {score:.2g}, {against}."
    return f"No {name} head formed{probe}: the best, {_where(at)}, scores {score:.2g}, below {FORMED} ({against})."


def _copied(what: str, first: float, second: float) -> str:
    loss = f"{first:.2f} nats per character on the first copy, {second:.2f} on the second"
    if second < 0.8 * first:
        return f"Repeated {what}: {loss}; the model copies from earlier in its context."
    return f"Repeated {what}: {loss}; no sign of copying from earlier in the context."


def _samples(model: GPT, vocab: CharVocab, val_docs: list[str], cfg: dict,
             gen: torch.Generator) -> list[tuple[str, str]]:
    """Prompts: the first lines (name and signature) of the first held-out docstrings that fit in half a block."""
    heads = [doc.split("\n", 1)[0] + "\n" for doc in val_docs]
    heads = [h for h in heads if len(h) <= model.block_size // 2][:cfg["samples"]]
    out = []
    for prompt in heads:
        ids = generate(model, torch.from_numpy(vocab.encode(prompt)), cfg["sample_chars"],
                       temperature=cfg["temperature"], generator=gen)
        out.append((prompt, vocab.decode(ids.tolist())))
    return out


def _pictures(model: GPT, vocab: CharVocab, val: Tensor, losses: list[float], baselines: dict[str, float],
              gpt_val: float, scores: dict[str, Tensor], out: Path) -> dict[str, Path]:
    pics = {"loss": save_png(draw_loss(losses, baselines, gpt_val), out / "lm_loss.png"),
            "scores": save_png(draw_scores(scores), out / "lm_head_scores.png")}
    (pl, ph), (il, ih) = _best(scores["previous"]), _best(scores["induction_text"])
    pics["previous"] = _head_picture(
        model, val[:48], vocab, pl, ph, f"Layer {pl + 1} head {ph} on held-out text "
        f"(previous-token score {float(scores['previous'][pl, ph]):.2f})", out / "lm_previous_token_head.png")
    snippet = val[len(val) // 2:][:24]
    pics["induction"] = _head_picture(
        model, torch.cat([snippet, snippet]), vocab, il, ih, f"Layer {il + 1} head {ih} on held-out text, repeated "
        f"(induction score on such repeats {float(scores['induction_text'][il, ih]):.2f})",
        out / "lm_induction_head.png")
    return pics
