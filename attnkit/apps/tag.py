"""Per-token tagging: the syntactic role of every token of Python's own standard-library source.

The output type beside a sequence (``translate``) and a single label (``classify``): one label per
input token, as a part-of-speech tagger gives. The corpus ships with Python: the source files of
a fixed list of pure-Python standard-library modules (:data:`FILES`; the text is this Python
version's, so the figures are too). :mod:`tokenize` splits each file into tokens and :mod:`ast`
says what each name is, so the labels are the language's own, not hand-made:

* from the token's type alone: ``keyword``, ``operator``, ``number``, ``string``;
* for the other names, their role in the syntax tree: ``variable read`` and ``variable assigned``
  (an :class:`ast.Name` loaded or stored/deleted), ``attribute`` (after a dot), ``function name``
  and ``class name`` (being defined), ``parameter``, ``keyword argument`` (``f(x=1)``),
  ``imported name`` and ``other name`` (the rest: ``global`` names, ``from`` modules, soft
  keywords...).

The first four follow from the token's text; the roles of names mostly do not (``x`` is read in
``f(x)``, assigned in ``x = 1``, a parameter in ``def f(x)``, a keyword argument in ``g(x=x)``):
the tagger has to read the context, on both sides. Comments are dropped; line ends and
indentation stay in the input (they mark statements) but are not scored.

Model: token embeddings (the :data:`VOCAB_SIZE` commonest token texts of the training files; a
rarer one becomes one of a few "rare name / number / string" tokens) + learned positions ->
bidirectional Transformer encoder layers (:class:`attnkit.modules.TransformerEncoderLayer`) -> a
tag per token, over windows of ``window`` tokens of one file. Every fifth file is held out whole.

Baselines, fitted on the training files: the majority tag (the commonest tag of all), and the
per-token majority (each token text's commonest tag in training; a text never seen gets its rare
class's commonest). The second is a strong one: most tokens have one role wherever they stand.
"""

from __future__ import annotations

import ast
import io
import keyword
import sysconfig
import tokenize
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._cpu import one_thread
from ..analysis.record import recorded_weights
from ..modules import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer
from ..viz.report import Section
from . import _common
from ._common import Result, Timer, save_png

#: Standard-library source files read, relative to the library's folder, in this order.
FILES: tuple[str, ...] = (
    "argparse.py", "ast.py", "calendar.py", "configparser.py", "csv.py", "dataclasses.py", "difflib.py",
    "enum.py", "fractions.py", "functools.py", "gettext.py", "heapq.py", "inspect.py", "ipaddress.py",
    "json/decoder.py", "logging/__init__.py", "pathlib.py", "pprint.py", "queue.py", "random.py", "shlex.py",
    "statistics.py", "string.py", "tarfile.py", "textwrap.py", "threading.py", "tokenize.py", "typing.py",
    "zipfile.py", "copy.py", "contextlib.py", "datetime.py", "fnmatch.py", "glob.py", "graphlib.py", "gzip.py",
    "hmac.py", "numbers.py", "operator.py", "optparse.py", "pickle.py", "sched.py", "smtplib.py",
    "socketserver.py", "traceback.py", "weakref.py", "cmd.py", "bdb.py", "trace.py", "timeit.py", "wave.py",
    "netrc.py", "plistlib.py", "reprlib.py", "selectors.py", "shutil.py", "tempfile.py", "uuid.py",
)
#: A few small files: the quick run's corpus.
QUICK_FILES: tuple[str, ...] = ("bisect.py", "copy.py", "fnmatch.py", "glob.py", "graphlib.py", "heapq.py",
                                "queue.py", "reprlib.py", "sched.py", "shlex.py")

TAGS = ("keyword", "operator", "number", "string", "variable read", "variable assigned", "attribute",
        "function name", "class name", "parameter", "keyword argument", "imported name", "other name")
IGNORE = -100  # the label of tokens that are input only (line ends, indentation): cross_entropy skips it
PAD, LAYOUT = "<pad>", ("<newline>", "<indent>", "<dedent>")
RARE = {tokenize.NAME: "<rare name>", tokenize.NUMBER: "<rare number>", tokenize.STRING: "<rare string>",
        tokenize.OP: "<rare operator>"}
VOCAB_SIZE = 2000

DEFAULTS: dict = {"steps": 1500, "lr": 2e-3, "warmup": 100, "batch_size": 32, "window": 96, "embed_dim": 64,
                  "num_heads": 4, "num_layers": 2, "ffn_dim": 128, "dropout": 0.1, "quick": False}
QUICK: dict = {"steps": 120, "warmup": 10, "window": 48, "embed_dim": 32, "num_heads": 2, "num_layers": 1,
               "ffn_dim": 64, "quick": True}

# ----------------------------------------------------------------------------------------- data


def _name_roles(tree: ast.AST) -> dict[tuple[int, int], str]:
    """(line, column) of a name token -> its role, from the syntax tree."""
    roles: dict[tuple[int, int], str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            roles[node.lineno, node.col_offset] = "variable read" if isinstance(node.ctx, ast.Load) \
                else "variable assigned"
        elif isinstance(node, ast.Attribute):
            roles[node.end_lineno, node.end_col_offset - len(node.attr)] = "attribute"
        elif isinstance(node, ast.arg):
            roles[node.lineno, node.col_offset] = "parameter"
        elif isinstance(node, ast.keyword) and node.arg is not None:
            roles[node.lineno, node.col_offset] = "keyword argument"
        elif isinstance(node, ast.alias):
            roles[node.lineno, node.col_offset] = "imported name"
    return roles


def tag_source(text: str) -> list[tuple[str, int, str | None]]:
    """Python source -> ``(token text, tokenize type, tag or None)`` for each token, comments and
    blank-line ends left out; line ends and indentation come as :data:`LAYOUT` texts with tag ``None``.

    Raises:
        SyntaxError: ``text`` is not Python this interpreter parses.
    """
    roles = _name_roles(ast.parse(text))
    out: list[tuple[str, int, str | None]] = []
    before = ""  # the previous significant token's text
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        kind = tok.type
        if kind in (tokenize.COMMENT, tokenize.NL, tokenize.ENDMARKER):
            continue
        if kind in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            out.append((LAYOUT[(tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT).index(kind)], kind, None))
            continue
        if kind == tokenize.NAME and keyword.iskeyword(tok.string):
            tag = "keyword"
        elif kind == tokenize.NAME:
            tag = {"def": "function name", "class": "class name"}.get(before) or roles.get(tok.start, "other name")
        elif kind == tokenize.OP:
            tag = "operator"
        elif kind == tokenize.NUMBER:
            tag = "number"
        elif kind == tokenize.STRING:
            tag = "string"
        else:  # FSTRING_* (3.12+), ERRORTOKEN: not in the files read here
            continue
        out.append((tok.string, kind, tag))
        before = tok.string
    return out


def read_files(files: tuple[str, ...]) -> list[list[tuple[str, int, str | None]]]:
    """:func:`tag_source` of each of ``files`` (relative to this Python's standard library)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [tag_source((root / f).read_text(encoding="utf-8")) for f in files]


def split(files: list) -> tuple[list, list]:
    """``(train, test)``: every fifth file (the 5th, 10th, ...) held out whole."""
    return [f for i, f in enumerate(files) if i % 5 != 4], [f for i, f in enumerate(files) if i % 5 == 4]


def vocabulary(train: list[list[tuple[str, int, str | None]]], size: int = VOCAB_SIZE) -> list[str]:
    """``<pad>``, the layout and rare-class tokens, then the ``size`` commonest token texts of ``train``."""
    counts = Counter(text for f in train for text, _, tag in f if tag is not None)
    fixed = [PAD, *LAYOUT, *RARE.values()]
    return fixed + [t for t, _ in counts.most_common(size) if t not in fixed]


def key(text: str, kind: int, index: dict[str, int]) -> str:
    """The vocabulary entry a token reads as: its text, or its rare class."""
    return text if text in index else RARE.get(kind, RARE[tokenize.OP])


def encode(files: list, vocab: list[str]) -> tuple[Tensor, Tensor]:
    """All ``files`` as one stream: ``(token ids [T], tag ids [T])``, tags :data:`IGNORE` on layout.
    Each file starts at a line end, so that a window never reads one file's end as the next's start
    without a break."""
    index = {t: i for i, t in enumerate(vocab)}
    ids, tags = [], []
    for f in files:
        ids.append(index[LAYOUT[0]])
        tags.append(IGNORE)
        for text, kind, tag in f:
            ids.append(index[key(text, kind, index)])
            tags.append(IGNORE if tag is None else TAGS.index(tag))
    return torch.tensor(ids), torch.tensor(tags)

# ---------------------------------------------------------------------------------------- model


class Tagger(nn.Module):
    """Token ids ``[B, L]`` -> tag scores ``[B, L, len(TAGS)]``: embeddings and learned positions,
    bidirectional (unmasked) Transformer encoder layers, a linear map per token."""

    def __init__(self, *, vocab_size: int, window: int, embed_dim: int, num_heads: int, num_layers: int,
                 ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.pos = nn.Embedding(window, embed_dim)
        self.encoder = TransformerEncoder(
            [TransformerEncoderLayer(embed_dim, num_heads, ffn_dim=ffn_dim, dropout=dropout, norm_first=True)
             for _ in range(num_layers)], norm=nn.LayerNorm(embed_dim))
        self.head = nn.Linear(embed_dim, len(TAGS))

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        return self.head(self.encoder(x))


def build(config: dict) -> Tagger:
    """The model a checkpoint's ``config.json`` describes (its ``vocab`` gives the vocabulary size)."""
    return Tagger(vocab_size=len(config["vocab"]), **{k: config[k] for k in (
        "window", "embed_dim", "num_heads", "num_layers", "ffn_dim", "dropout")})


#: What :func:`load` checks in ``config.json`` against the weights before building.
FIELDS = {
    "vocab": _common.words("embed.weight"),
    "window": _common.size("pos.weight", 0),
    "embed_dim": _common.size("embed.weight", 1),
    "num_heads": _common.heads("embed_dim"),
    "num_layers": _common.layers("encoder.layers"),
    "ffn_dim": _common.size("encoder.layers.0.ff.linear1.weight", 0),
    "dropout": _common.probability(),
}


def load(dir: str | Path) -> Tagger:
    """The tagger saved by :func:`run` into ``dir`` (checked first: :func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, FIELDS)

# ----------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def predict(model: Tagger, ids: Tensor, window: int) -> Tensor:
    """A tag for every token of the stream ``ids [T]``: windows of ``window`` tokens, each token
    scored in the window where it lies farthest from an edge (windows overlap by half), so that
    every token but the stream's first and last few has context on both sides."""
    t, half = len(ids), window // 2
    starts = list(range(0, max(t - window, 0) + 1, half))
    if starts[-1] + window < t:
        starts.append(t - window)
    best = torch.full((t,), -1)
    edge = torch.full((t,), -1)
    batch = torch.stack([ids[s:s + window] for s in starts])
    pred = torch.cat([model(batch[i:i + 64]).argmax(-1) for i in range(0, len(batch), 64)])
    for row, s in enumerate(starts):
        n = min(window, t - s)
        pos = torch.arange(n)
        room = torch.minimum(pos, n - 1 - pos)  # distance to the window's nearer edge
        better = room > edge[s:s + n]
        best[s:s + n][better] = pred[row, :n][better]
        edge[s:s + n][better] = room[better]
    return best


def per_token_majority(train_ids: Tensor, train_tags: Tensor, vocab_size: int) -> Tensor:
    """Each token id's commonest tag in training ``[vocab_size]``; an id never tagged there gets
    the commonest tag of all."""
    keep = train_tags != IGNORE
    counts = torch.zeros(vocab_size, len(TAGS))
    counts.index_put_((train_ids[keep], train_tags[keep]), torch.ones(int(keep.sum())), accumulate=True)
    overall = counts.sum(0).argmax()
    return torch.where(counts.sum(1) > 0, counts.argmax(1), overall)


def per_tag_accuracy(pred: Tensor, tags: Tensor) -> dict[str, tuple[int, float]]:
    """tag -> (test tokens with it, share predicted right), for the tags present."""
    out = {}
    for i, name in enumerate(TAGS):
        at = tags == i
        if at.any():
            out[name] = (int(at.sum()), float((pred[at] == i).float().mean()))
    return out

# -------------------------------------------------------------------------------------- picture


def draw(model: Tagger, text: str, vocab: list[str], layer: int):
    """Layer ``layer``'s attention (mean over heads) over the tokens of ``text``."""
    from ..viz.heatmap import heatmap

    index = {t: i for i, t in enumerate(vocab)}
    toks = tag_source(text)
    ids = torch.tensor([[index[key(t, k, index)] for t, k, _ in toks]])
    with torch.no_grad(), recorded_weights(m for m in model.modules() if isinstance(m, MultiHeadAttention)) as rec:
        pred = model(ids).argmax(-1)[0]
    names = ["⏎" if k == tokenize.NEWLINE else t for t, k, _ in toks]
    rows = [f"{n}: {TAGS[int(p)]}" if tag is not None else n for n, p, (_, _, tag) in zip(names, pred, toks,
                                                                                         strict=True)]
    return heatmap(rec[layer][0][0].mean(0), rows, names,
                   title=f"Layer {layer + 1} attention (mean over heads); rows: each token and the tag it was given")

# ------------------------------------------------------------------------------------------ run

EXAMPLE = "def scale(x, factor=2):\n    y = x * factor\n    return round(y, ndigits=factor)\n"


def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True) -> Result:
    """Read and tag the corpus, train the tagger, score it per tag against the two baselines on the
    held-out files, save the checkpoint and the attention picture into ``out``."""
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    out = Path(out)
    with Timer() as total, one_thread():
        train_files, test_files = split(read_files(QUICK_FILES if cfg["quick"] else FILES))
        vocab = vocabulary(train_files)
        train_ids, train_tags = encode(train_files, vocab)
        test_ids, test_tags = encode(test_files, vocab)
        gen = _common.seed_all(seed)
        config = {"vocab": vocab, **{k: cfg[k] for k in ("window", "embed_dim", "num_heads", "num_layers", "ffn_dim",
                                                         "dropout")}}
        model = build(config)
        w = cfg["window"]

        def batch(step: int) -> tuple[Tensor, Tensor]:
            starts = torch.randint(len(train_ids) - w, (cfg["batch_size"],), generator=gen)
            rows = starts[:, None] + torch.arange(w)
            return train_ids[rows], train_tags[rows]

        def loss_fn(m: Tagger, b: tuple[Tensor, Tensor]) -> Tensor:
            return F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten(), ignore_index=IGNORE)

        with Timer() as train_time:
            losses = _common.fit(model, batch, loss_fn, steps=cfg["steps"], lr=cfg["lr"], warmup=cfg["warmup"],
                                 desc="tag", progress=progress)
        scored = test_tags != IGNORE
        tags = test_tags[scored]
        pred = predict(model, test_ids, w)[scored]
        table = per_token_majority(train_ids, train_tags, len(vocab))
        by_token = table[test_ids][scored]
        majority = int(torch.bincount(train_tags[train_tags != IGNORE], minlength=len(TAGS)).argmax())
        acc = {"Transformer tagger": float((pred == tags).float().mean()),
               "per-token majority": float((by_token == tags).float().mean()),
               "majority tag": float((tags == majority).float().mean())}
        per_tag = {name: (n, a, per_tag_accuracy(by_token, tags)[name][1])
                   for name, (n, a) in per_tag_accuracy(pred, tags).items()}
        _common.save(out, model, config)
        png = save_png(draw(model, EXAMPLE, vocab, cfg["num_layers"] - 1), out / "tag_attention.png")

    files = QUICK_FILES if cfg["quick"] else FILES
    n_test = int(scored.sum())
    metrics: dict = {"train files": len(train_files), "test files": len(test_files),
                     "train tokens": int((train_tags != IGNORE).sum()), "test tokens": n_test,
                     **{f"accuracy {k}": v for k, v in acc.items()}, "majority": TAGS[majority],
                     "first loss": losses[0], "last loss": sum(losses[-50:]) / len(losses[-50:]),
                     "steps": cfg["steps"], "train seconds": train_time.seconds}
    labels = {"train files": "Training files", "test files": "Held-out files",
              "train tokens": "Training tokens (scored)", "test tokens": "Held-out tokens (scored)",
              **{f"accuracy {k}": f"Per-token accuracy, {k}" for k in acc},
              "majority": "The majority tag", "first loss": "First training loss (nats per token)",
              "last loss": "Last training loss (nats per token, mean of the last 50 steps)",
              "steps": "Training steps", "train seconds": "Training seconds"}
    held = ", ".join(f for i, f in enumerate(files) if i % 5 == 4)
    sections = [
        Section("Per-token accuracy on held-out files",
                f"Every token of {len(files)} standard-library source files of this Python, tagged by tokenize and "
                f"ast; {n_test:,} tokens of the held-out files ({held}) are scored. The per-token majority gives "
                "each token text its commonest tag in the training files.",
                table=[{"Model": k, "Per-token accuracy": v} for k, v in acc.items()]),
        Section("Accuracy per tag",
                "How many held-out tokens carry each tag, and the share of them tagged right.",
                table=[{"Tag": name, "Tokens": n, "Transformer tagger": a, "Per-token majority": b}
                       for name, (n, a, b) in per_tag.items()]),
        Section("Attention over a short function",
                "The last layer's attention while tagging a few lines that are not in the corpus; each row names the "
                "token and the tag the model gave it.", images=[png]),
    ]
    return Result("tag", metrics, total.seconds, sections, labels)
