"""Next-item recommendation with causal self-attention (SASRec, Kang and McAuley 2018).

Data, generated with a known structure: a catalogue of items and a set of *themes*; a theme is a
fixed path through the catalogue (say, the episodes of a series, or the steps of a recipe). A
session follows one theme: mostly the next item on the path, sometimes it skips one, sometimes
it wanders to a popular item and comes back. Every item lies on several themes' paths, so the
last item alone leaves the next one ambiguous; the earlier items of the session tell which theme
it is. That is what self-attention over the whole session can use and a transition table cannot.

Model: item embeddings + learned positions, causal Transformer encoder layers (a position sees
only the items before it), and scores for every item as the dot product with the item embeddings
(shared input/output embeddings, as in SASRec). Trained to predict each next item of a session.

Evaluation: hit rate@10 on held-out sessions (is the true last item among the ten highest
scored?), against two baselines fitted on the same training sessions: the ten most popular
items, and the ten most frequent successors of the last item (a first-order transition table).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..analysis.record import recorded_weights
from ..modules import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer
from ..viz.report import Section
from . import _common
from ._common import Result, Timer, save_png

PAD = 0  # item ids are 1..num_items
K = 10  # hit rate@K
# The catalogue, themes and sessions are fixed (not the run's seed): different seeds train
# different models on the same data and are scored on the same held-out sessions.
DATA_SEED = 2024

DEFAULTS: dict = {
    "steps": 1000, "lr": 3e-3, "warmup": 100, "batch_size": 128, "embed_dim": 64, "num_heads": 2,
    "num_layers": 2, "ffn_dim": 128, "dropout": 0.1,
    "num_items": 300, "num_themes": 100, "path_len": 24, "max_len": 20,
    "train_sessions": 20000, "test_sessions": 2000,
}
# A few seconds: a smaller catalogue, fewer sessions, one small layer.
QUICK: dict = {"steps": 150, "warmup": 15, "embed_dim": 32, "num_layers": 1, "ffn_dim": 64,
               "num_items": 60, "num_themes": 12, "path_len": 12, "max_len": 12,
               "train_sessions": 2000, "test_sessions": 500}


# --------------------------------------------------------------------------- data

def make_world(num_items: int, num_themes: int, path_len: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Themes and popularities.

    Returns:
        ``paths [num_themes, path_len]``: each theme's path of distinct item ids;
        ``theme_p [num_themes]``: how often each theme is chosen (Zipf-like: a few are common);
        ``item_p [num_items + 1]``: the weights of detours (Zipf-like, ``PAD`` gets 0).
    """
    paths = torch.stack([torch.randperm(num_items, generator=gen)[:path_len] + 1 for _ in range(num_themes)])
    theme_p = 1.0 / torch.arange(1, num_themes + 1) ** 0.5
    # Detours by popularity 1 / rank, the ranks shuffled over the items; PAD is never drawn.
    rank = torch.randperm(num_items, generator=gen) + 1  # (num_items,), rank of items 1..num_items
    item_p = torch.cat([torch.zeros(1), 1.0 / rank.float()])
    return paths, theme_p / theme_p.sum(), item_p


def make_sessions(n: int, paths: Tensor, theme_p: Tensor, item_p: Tensor, max_len: int,
                  gen: torch.Generator) -> Tensor:
    """``[n, max_len]`` sessions, right-padded with ``PAD``, each 6 to ``max_len`` items long.

    A session picks a theme and a start on its path, then at each step: the next item on the path
    (80%), the one after it (10%), or a detour to an item drawn by popularity (10%, the path
    position stays where it was).
    """
    path_len = paths.shape[1]
    out = torch.full((n, max_len), PAD, dtype=torch.long)
    themes = torch.multinomial(theme_p, n, replacement=True, generator=gen)
    lengths = torch.randint(6, max_len + 1, (n,), generator=gen)
    for s in range(n):
        path, pos = paths[themes[s]], int(torch.randint(path_len, (1,), generator=gen))
        out[s, 0] = path[pos]
        for t in range(1, int(lengths[s])):
            u = float(torch.rand(1, generator=gen))
            if u < 0.1:
                out[s, t] = torch.multinomial(item_p, 1, generator=gen)
                continue
            pos = (pos + (1 if u < 0.9 else 2)) % path_len
            out[s, t] = path[pos]
    return out


def lengths_of(sessions: Tensor) -> Tensor:
    """Items per session ``[n]``."""
    return (sessions != PAD).sum(1)


# --------------------------------------------------------------------------- model

class SASRec(nn.Module):
    """Item + position embeddings -> causal Transformer encoder -> scores for every item.

    Shape notation: ``B`` sessions, ``L`` positions, ``E`` = ``embed_dim``, ``N`` items.
    Sessions are right-padded: with causal attention no real position ever sees the padding.
    """

    def __init__(self, *, num_items: int, max_len: int, embed_dim: int, num_heads: int, num_layers: int,
                 ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.item = nn.Embedding(num_items + 1, embed_dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.encoder = TransformerEncoder(
            [TransformerEncoderLayer(embed_dim, num_heads, ffn_dim=ffn_dim, dropout=dropout, norm_first=True)
             for _ in range(num_layers)], norm=nn.LayerNorm(embed_dim))
        # Small embeddings: the scores are dot products of a layer-normed state with them, so
        # std E^-1/2 starts them near 1 (nn.Embedding's N(0, 1) would start them near sqrt(E)).
        for table in (self.item, self.pos):
            nn.init.normal_(table.weight, std=embed_dim**-0.5)
        with torch.no_grad():
            self.item.weight[PAD].zero_()

    def forward(self, sessions: Tensor) -> Tensor:
        """``sessions [B, L]`` -> scores ``[B, L, N + 1]`` for the item after each position
        (column ``PAD`` is never a right answer; it is scored like the rest and ignored)."""
        positions = torch.arange(sessions.shape[1], device=sessions.device)
        x = self.dropout(self.item(sessions) + self.pos(positions))  # (B, L, E)
        h = self.encoder(x, is_causal=True)
        return h @ self.item.weight.T  # (B, L, N + 1)


def build(config: dict) -> SASRec:
    """The model described by a checkpoint's ``config.json``."""
    return SASRec(**{k: config[k] for k in ("num_items", "max_len", "embed_dim", "num_heads", "num_layers",
                                             "ffn_dim", "dropout")})


#: What :func:`load` checks in ``config.json`` against the weights before building.
FIELDS = {
    "num_items": _common.size("item.weight", 0, lambda n: n + 1),  # row 0 is PAD
    "max_len": _common.size("pos.weight", 0),
    "embed_dim": _common.size("item.weight", 1),
    "num_heads": _common.heads("embed_dim"),
    "num_layers": _common.layers("encoder.layers"),
    "ffn_dim": _common.size("encoder.layers.0.ff.linear1.weight", 0),
    "dropout": _common.probability(),
}


def load(dir: str | Path) -> SASRec:
    """The model saved by :func:`run` into ``dir`` (checked first: :func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, FIELDS)


@contextmanager
def recorded_attention(model: nn.Module):
    """Within the block, every :class:`MultiHeadAttention` of ``model`` also records its weights
    ``[B, H, Lq, Lk]`` into the yielded list, in call order (:func:`attnkit.analysis.recorded_weights`
    keeps one list per module; a forward pass calls each module once, so they are joined in order)."""
    maps: list[Tensor] = []
    with recorded_weights(m for m in model.modules() if isinstance(m, MultiHeadAttention)) as rec:
        yield maps
    maps.extend(w for calls in zip(*rec, strict=True) for w in calls)


# --------------------------------------------------------------------------- evaluation

def split_last(sessions: Tensor) -> tuple[Tensor, Tensor]:
    """Held-out sessions -> (the session without its last item, the last item)."""
    n = lengths_of(sessions)
    rows = torch.arange(len(sessions))
    prefix = sessions.clone()
    prefix[rows, n - 1] = PAD
    return prefix, sessions[rows, n - 1]


@torch.no_grad()
def model_top_k(model: SASRec, prefix: Tensor, k: int = K) -> Tensor:
    """The model's ``k`` best next items after each prefix ``[n, k]``."""
    scores = model(prefix)[torch.arange(len(prefix)), lengths_of(prefix) - 1]  # (n, N + 1)
    scores[:, PAD] = -torch.inf
    return scores.topk(k, dim=-1).indices


def popular_top_k(train: Tensor, n: int, k: int = K) -> Tensor:
    """The ``k`` most frequent items of the training sessions, for every one of ``n`` prefixes."""
    counts = torch.bincount(train.flatten(), minlength=int(train.max()) + 1).float()
    counts[PAD] = -1
    return counts.topk(k).indices.expand(n, k)


def transition_top_k(train: Tensor, prefix: Tensor, num_items: int, k: int = K) -> Tensor:
    """The ``k`` most frequent successors of each prefix's last item in the training sessions
    (ties and items never seen after it broken by popularity)."""
    pairs = torch.stack([train[:, :-1].flatten(), train[:, 1:].flatten()])
    pairs = pairs[:, (pairs != PAD).all(0)]
    table = torch.zeros(num_items + 1, num_items + 1)
    table.index_put_((pairs[0], pairs[1]), torch.ones(pairs.shape[1]), accumulate=True)
    popularity = torch.bincount(train.flatten(), minlength=num_items + 1).float()
    # Popularity as a tie-break below one count: it never outranks a transition that was seen.
    table += popularity / (popularity.max() + 1)
    table[:, PAD] = -1
    last = prefix[torch.arange(len(prefix)), lengths_of(prefix) - 1]
    return table[last].topk(k, dim=-1).indices


def hit_rate(top: Tensor, target: Tensor) -> float:
    """Fraction of rows whose ``target`` is among ``top [n, k]``."""
    return float((top == target[:, None]).any(1).float().mean())


# --------------------------------------------------------------------------- picture

def draw_session(weights: Tensor, session: list[int], theme_items: set[int], layer: int):
    """The causal attention of one session (mean over heads): rows are positions predicting the
    next item, columns the items they read; detours (items off the theme's path) are marked."""
    from ..viz.heatmap import heatmap

    labels = [f"{item}*" if item not in theme_items else str(item) for item in session]
    causal = torch.ones(len(session), len(session), dtype=torch.bool).tril()
    return heatmap(weights, labels, labels, mask=causal,
                   title=f"Layer {layer + 1} attention over a held-out session (* = detour off the theme's path)")


# --------------------------------------------------------------------------- run

def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True) -> Result:
    """Generate the sessions, train SASRec from scratch, compare hit rate@10 with the baselines,
    save the checkpoint and the attention picture into ``out``."""
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    out = Path(out)
    with Timer() as total:
        data_gen = torch.Generator().manual_seed(DATA_SEED)
        paths, theme_p, item_p = make_world(cfg["num_items"], cfg["num_themes"], cfg["path_len"], data_gen)
        sessions = make_sessions(cfg["train_sessions"] + cfg["test_sessions"], paths, theme_p, item_p,
                                 cfg["max_len"], data_gen)
        train, test = sessions[:cfg["train_sessions"]], sessions[cfg["train_sessions"]:]

        gen = _common.seed_all(seed)
        config = {k: cfg[k] for k in ("num_items", "max_len", "embed_dim", "num_heads", "num_layers", "ffn_dim",
                                      "dropout")}
        model = build(config)

        def batch(step: int) -> Tensor:
            return train[torch.randint(len(train), (cfg["batch_size"],), generator=gen)]

        def loss_fn(m: nn.Module, b: Tensor) -> Tensor:
            # Every position predicts the item after it; positions with no next item are ignored.
            targets = torch.cat([b[:, 1:], torch.full_like(b[:, :1], PAD)], dim=1)
            return F.cross_entropy(m(b).flatten(0, 1), targets.flatten(), ignore_index=PAD)

        with Timer() as train_time:
            losses = _common.fit(model, batch, loss_fn, steps=cfg["steps"], lr=cfg["lr"], warmup=cfg["warmup"],
                                 desc="recommend", progress=progress)
        prefix, target = split_last(test)
        hr = {"SASRec (causal self-attention)": hit_rate(model_top_k(model, prefix), target),
              "most popular": hit_rate(popular_top_k(train, len(prefix)), target),
              "last-item transitions": hit_rate(transition_top_k(train, prefix, cfg["num_items"]), target)}
        _common.save(out, model, config)
        picture = _session_picture(model, test, paths, out / "recommend_attention.png")

    metrics = {
        "items": cfg["num_items"], "themes": cfg["num_themes"], "train sessions": len(train),
        "test sessions": len(test), **{f"HR@{K} {name}": v for name, v in hr.items()},
        "chance HR@10": K / cfg["num_items"], "first loss": losses[0],
        "last loss (mean of 50)": float(np.mean(losses[-50:])), "steps": cfg["steps"],
        "train seconds": train_time.seconds,
    }
    sections = [
        Section("Data and hit rate",
                f"{len(train):,} training and {len(test):,} held-out sessions over {cfg['num_items']} items, generated "
                f"from {cfg['num_themes']} themes (fixed paths of {cfg['path_len']} items; each item lies on several "
                "paths). A session follows its theme's path, sometimes skipping an item or taking a detour to a "
                f"popular one. Hit rate@{K}: how often the held-out last item is among the ten recommended.",
                table=[{"Model": name, f"Hit rate@{K}": v} for name, v in hr.items()]),
        Section("Attention over a session",
                "Each row is a position of one held-out session predicting the next item; the columns are the "
                "earlier items it reads (causal: nothing to the right of the diagonal). Detours are starred.",
                images=[picture]),
    ]
    labels = {"items": "Items", "themes": "Themes", "train sessions": "Training sessions",
              "test sessions": "Held-out sessions",
              **{f"HR@{K} {name}": f"Hit rate@{K}, {name}" for name in hr},
              "chance HR@10": "Hit rate@10 by chance", "first loss": "First training loss (nats per item)",
              "last loss (mean of 50)": "Last training loss (nats per item, mean of the last 50 steps)",
              "steps": "Training steps", "train seconds": "Training seconds"}
    return Result("recommend", metrics, total.seconds, sections, labels)


def _session_picture(model: SASRec, test: Tensor, paths: Tensor, path: Path) -> Path:
    """The last layer's attention over the first held-out session that is long and has a detour."""
    n = lengths_of(test)
    on_path = [set(p.tolist()) for p in paths]

    def theme_of(session: list[int]) -> set[int]:
        return max(on_path, key=lambda items: sum(i in items for i in session))

    pick = next((s for s in range(len(test)) if n[s] >= 10 and
                 not set(test[s, :n[s]].tolist()) <= theme_of(test[s, :n[s]].tolist())), int(n.argmax()))
    session = test[pick, :n[pick]]
    with torch.no_grad(), recorded_attention(model) as maps:
        model(session[None])
    weights = maps[-1][0].mean(0)  # (L, L), mean over heads
    items = session.tolist()
    return save_png(draw_session(weights, items, theme_of(items), len(maps) - 1), path)
