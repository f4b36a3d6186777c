"""Attention on a graph: node classification with graph attention (GAT, Velickovic et al. 2018).

Data: Zachary's karate club (Zachary 1977), as networkx ships it (``networkx.karate_club_graph``):
34 members of a university karate club, an edge where two met outside the club, and for each
member the side they took when the club split in two ("Mr. Hi" or "Officer"). It is the graph
Kipf and Welling's graph-convolution paper demonstrates on, it is real, small enough to draw every
edge of, and its labels follow the friendships without being the same thing (a few members sided
against most of their friends). A node's only feature is its identity (a one-hot vector), so
whatever a model knows of an unlabelled member it must get from the edges. A fixed set of
:data:`TRAIN_PER_CLASS` members per side is labelled for training; the rest are the test nodes.

Three models, two layers each, trained the same way (:func:`attnkit.apps._common.fit`, full
batch) and scored over several seeds (each seed a new initialisation, the split fixed):

* ``mlp``: ignores the edges: a node's own features through two linear layers. With identity
  features it can only memorise the training nodes; on the test nodes it is at chance. It is what
  the features alone are worth.
* ``mean``: neighbour averaging (GCN-style): each node takes the mean of its own and its
  neighbours' projected features. Written as attention with every score equal: the adjacency is
  the mask, and a softmax over equal scores is the mean over what the mask lets through.
* ``gat``: graph attention: the same layer, but each head scores every edge
  ``e_ij = LeakyReLU(a_dst . W h_i + a_src . W h_j)`` (the GAT paper's additive score), and the
  softmax over a node's neighbours weighs them. Several heads, concatenated in the first layer.

Both graph models run through :func:`attnkit.attention` with the adjacency (self-loops added) as
its boolean mask, ``True`` = may attend. The score is the whole logit (passed as ``bias``, with
``scale=0`` so that the dot product plays no part), as in :mod:`attnkit.apps._rnn`. A friendship
graph has no band or tile structure for the banded and tiled kernels to use (who is friends with
whom does not follow the node numbers), and the picture needs the weights: the reference backend,
the one that returns them, runs every call.

The picture is the trained graph-attention model's first layer on the graph: each edge drawn as
wide as the weight its two ends give each other over what the plain mean would give (mean over
heads and both directions), so that equal widths are averaging.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._cpu import one_thread
from ..functional import attention
from ..viz.report import Section
from . import _common
from ._common import Result, Timer, save_png

MODELS = ("mlp", "mean", "gat")
#: What the reports call each model.
MODEL_NAMES = {"mlp": "MLP (ignores the edges)", "mean": "neighbour averaging (GCN-style)",
               "gat": "graph attention (GAT)"}
CLASSES = ("Mr. Hi", "Officer")
#: Labelled members per side; drawn once with :data:`DATA_SEED`, the same for every run.
TRAIN_PER_CLASS = 4
DATA_SEED = 2026

DEFAULTS: dict = {"steps": 200, "lr": 1e-2, "weight_decay": 5e-3, "hidden_dim": 8, "num_heads": 4,
                  "dropout": 0.5, "seeds": 10}
QUICK: dict = {"steps": 60, "seeds": 2}

# --------------------------------------------------------------------------------------- data


def karate() -> tuple[Tensor, Tensor]:
    """Zachary's karate club: ``(adjacency [N, N] bool with self-loops, labels [N])``; label 0 is
    "Mr. Hi", 1 "Officer" (:data:`CLASSES`). Needs networkx."""
    import networkx as nx

    g = nx.karate_club_graph()
    n = g.number_of_nodes()
    adj = torch.eye(n, dtype=torch.bool)
    for i, j in g.edges():
        adj[i, j] = adj[j, i] = True
    labels = torch.tensor([CLASSES.index(g.nodes[i]["club"]) for i in range(n)])
    return adj, labels


def split(labels: Tensor, per_class: int = TRAIN_PER_CLASS) -> tuple[Tensor, Tensor]:
    """``(train nodes, test nodes)``: ``per_class`` nodes of each class for training, drawn with
    :data:`DATA_SEED`; every other node for testing."""
    g = torch.Generator().manual_seed(DATA_SEED)
    train = torch.cat([idx[torch.randperm(len(idx), generator=g)[:per_class]]
                       for idx in (torch.nonzero(labels == c).flatten() for c in range(len(CLASSES)))])
    test = torch.tensor([i for i in range(len(labels)) if i not in set(train.tolist())])
    return train.sort().values, test

# -------------------------------------------------------------------------------------- model


class GraphAttention(nn.Module):
    """One graph layer: each node gathers its neighbours' projected features, weighted per head.

    Shape notation: ``N`` nodes, ``Din`` input features, ``H`` heads, ``D`` = ``out_dim`` per head.

    Args:
        in_dim: ``Din``.
        out_dim: ``D``.
        num_heads: ``H``.
        learn_scores: ``True``: GAT's additive score per edge and head; ``False``: every score 0,
            so that the softmax over the mask is the plain mean over a node's neighbours.
        concat: ``True``: the heads' outputs side by side (``[N, H * D]``); ``False``: their mean.

    Plain PyTorch, for a reader::

        h = (x @ W).view(N, H, D)
        e = leaky_relu(h @ a_dst + (h @ a_src).T[:, None], 0.2)        # e[h, i, j], edge j -> i
        w = e.masked_fill(~adj, float("-inf")).softmax(-1)             # (H, N, N)
        out = w @ h.transpose(0, 1)                                   # (H, N, D)
    """

    def __init__(self, in_dim: int, out_dim: int, num_heads: int, *, learn_scores: bool, concat: bool) -> None:
        super().__init__()
        self.num_heads, self.out_dim, self.concat = num_heads, out_dim, concat
        self.proj = nn.Linear(in_dim, num_heads * out_dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(num_heads * out_dim if concat else out_dim))
        if learn_scores:
            bound = 1.0 / math.sqrt(out_dim)
            self.att_dst = nn.Parameter(torch.empty(num_heads, out_dim).uniform_(-bound, bound))
            self.att_src = nn.Parameter(torch.empty(num_heads, out_dim).uniform_(-bound, bound))
        else:
            self.att_dst = self.att_src = None

    def forward(self, x: Tensor, adj: Tensor) -> tuple[Tensor, Tensor]:
        """``x [N, Din]``, ``adj [N, N]`` bool (``adj[i, j]``: node ``i`` may read node ``j``) ->
        ``(out [N, H * D] or [N, D], weights [H, N, N])``."""
        n = x.shape[0]
        h = self.proj(x).view(n, self.num_heads, self.out_dim).transpose(0, 1)  # (H, N, D)
        if self.att_dst is not None:
            dst = (h * self.att_dst[:, None]).sum(-1)  # (H, N): the reading node's part
            src = (h * self.att_src[:, None]).sum(-1)  # (H, N): the read node's part
            scores = F.leaky_relu(dst[:, :, None] + src[:, None, :], 0.2)  # (H, N, N)
        else:
            scores = h.new_zeros(self.num_heads, n, n)
        # The score is the whole logit: scale 0 drops the dot product of the empty (size-1) q and k.
        zero = h.new_zeros(self.num_heads, n, 1)
        out, weights = attention(zero, zero, h, bias=scores, mask=adj[None], scale=0.0, return_weights=True)
        out = out.transpose(0, 1).reshape(n, -1) if self.concat else out.mean(0)  # (N, H*D) or (N, D)
        return out + self.bias, weights


class NodeClassifier(nn.Module):
    """Two layers from node features to class scores: two graph layers (``kind`` ``"gat"`` or
    ``"mean"``) or, for ``"mlp"``, two linear layers that never look at the edges.

    Args:
        kind: one of :data:`MODELS`.
        in_dim: node features (here the number of nodes: identity features).
        hidden_dim: per head, in the first layer.
        num_heads: heads of the first layer (the second has one).
        num_classes: output scores.
        dropout: on the inputs of both layers while training.
    """

    def __init__(self, kind: str, *, in_dim: int, hidden_dim: int, num_heads: int, num_classes: int,
                 dropout: float) -> None:
        super().__init__()
        if kind not in MODELS:
            raise ValueError(f"kind must be one of {', '.join(MODELS)}, got {kind!r}")
        self.kind, self.dropout = kind, dropout
        if kind == "mlp":
            self.layers = nn.ModuleList([nn.Linear(in_dim, num_heads * hidden_dim), nn.Linear(num_heads * hidden_dim,
                                                                                              num_classes)])
        else:
            learn = kind == "gat"
            self.layers = nn.ModuleList([
                GraphAttention(in_dim, hidden_dim, num_heads, learn_scores=learn, concat=True),
                GraphAttention(num_heads * hidden_dim, num_classes, 1, learn_scores=learn, concat=False)])

    def forward(self, x: Tensor, adj: Tensor) -> tuple[Tensor, list[Tensor]]:
        """``(scores [N, C], each graph layer's weights [H, N, N])`` (no weights for the MLP)."""
        weights = []
        for i, layer in enumerate(self.layers):
            x = F.dropout(x, self.dropout, self.training)
            if self.kind == "mlp":
                x = layer(x)
            else:
                x, w = layer(x, adj)
                weights.append(w)
            if i == 0:
                x = F.elu(x)
        return x, weights


def build(config: dict) -> NodeClassifier:
    """The model a checkpoint's ``config.json`` describes."""
    return NodeClassifier(config["kind"], **{k: config[k] for k in ("in_dim", "hidden_dim", "num_heads",
                                                                    "num_classes", "dropout")})


#: What :func:`load` checks in ``config.json`` against the (graph-attention) weights before building.
FIELDS = {
    "kind": _common.one_of("gat"),
    "in_dim": _common.size("layers.0.proj.weight", 1),
    "num_heads": _common.size("layers.0.att_dst", 0),
    "hidden_dim": _common.size("layers.0.att_dst", 1),
    "num_classes": _common.size("layers.1.att_dst", 1),
    "dropout": _common.probability(),
}


def load(dir: str | Path) -> NodeClassifier:
    """The graph-attention model saved by :func:`run` into ``dir`` (checked first:
    :func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, FIELDS)

# ------------------------------------------------------------------------------ train, evaluate


def train(kind: str, cfg: dict, adj: Tensor, labels: Tensor, train_nodes: Tensor, seed: int) -> NodeClassifier:
    """One model of ``kind`` trained full-batch on the labels of ``train_nodes``."""
    _common.seed_all(seed)
    n = len(labels)
    model = NodeClassifier(kind, in_dim=n, hidden_dim=cfg["hidden_dim"], num_heads=cfg["num_heads"],
                           num_classes=len(CLASSES), dropout=cfg["dropout"])
    x = torch.eye(n)

    def loss_fn(m: NodeClassifier, _batch) -> Tensor:
        return F.cross_entropy(m(x, adj)[0][train_nodes], labels[train_nodes])

    _common.fit(model, lambda step: None, loss_fn, steps=cfg["steps"], lr=cfg["lr"],
                weight_decay=cfg["weight_decay"], desc=f"graph ({kind}, seed {seed})", progress=False)
    return model


@torch.no_grad()
def accuracy(model: NodeClassifier, adj: Tensor, labels: Tensor, nodes: Tensor) -> float:
    """Share of ``nodes`` whose highest score is their label."""
    scores, _ = model(torch.eye(len(labels)), adj)
    return float((scores[nodes].argmax(-1) == labels[nodes]).float().mean())


@torch.no_grad()
def evenness(weights: Tensor, adj: Tensor) -> float:
    """How close attention weights ``[H, N, N]`` are to the plain mean: each node's entropy over
    its neighbours divided by the entropy of the uniform weights (``log`` of its degree), averaged
    over nodes with more than one neighbour and the heads; 1 is exactly the mean."""
    w = weights.double()
    entropy = -(w * w.clamp_min(1e-300).log()).sum(-1)  # (H, N)
    degree = adj.sum(-1).double()  # self-loop included
    keep = degree > 1
    return float((entropy[:, keep] / degree[keep].log()).mean())


def _spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.1%} ± {sd:.1%}"


def verdict(acc: dict[str, list[float]], n_test: int) -> str:
    """What attention added over averaging in these runs, in words; a difference counts only
    when it exceeds two standard errors of the difference of the two means over seeds."""
    gat, mean = acc["gat"], acc["mean"]
    diff = statistics.mean(gat) - statistics.mean(mean)
    se = math.sqrt(sum(statistics.variance(a) / len(a) for a in (gat, mean))) if len(gat) > 1 else 0.0
    where = f"over {len(gat)} seeds on {n_test} test nodes"
    if abs(diff) <= 2 * se:
        return (f"Graph attention and neighbour averaging are not told apart {where}: the difference of the means, "
                f"{diff:+.1%}, is within two standard errors ({2 * se:.1%}). On this graph attention adds nothing "
                "measurable over averaging.")
    better = "graph attention" if diff > 0 else "neighbour averaging"
    return (f"{better[0].upper() + better[1:]} classified more test nodes right {where}: the difference of the "
            f"means, {diff:+.1%}, exceeds two standard errors ({2 * se:.1%}).")

# -------------------------------------------------------------------------------------- picture


def draw(adj: Tensor, labels: Tensor, train_nodes: Tensor, weights: Tensor, predicted: Tensor):
    """The graph with each edge as wide as its attention (``weights [H, N, N]``: mean over heads and
    the two directions) over the plain mean's; nodes coloured by their side, labelled nodes drawn as squares, wrongly
    predicted test nodes ringed in red."""
    import networkx as nx
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    n = len(labels)
    g = nx.Graph((i, j) for i in range(n) for j in range(i + 1, n) if adj[i, j])
    g.add_nodes_from(range(n))
    pos = nx.spring_layout(g, seed=DATA_SEED)
    # Each weight over the plain mean's (1 / the reader's degree): 1 wherever attention only averages.
    w = weights.mean(0) * adj.sum(-1, keepdim=True)
    strength = {(i, j): float(w[i, j] + w[j, i]) / 2 for i, j in g.edges()}
    top = max(strength.values())
    fig = Figure(figsize=(8, 6.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_axis_off()
    nx.draw_networkx_edges(g, pos, ax=ax, edgelist=list(strength), width=[0.3 + 6 * s / top for s in strength.values()],
                           edge_color="#555555", alpha=0.7)
    colours = ["#1f77b4", "#ff7f0e"]
    train = set(train_nodes.tolist())
    for shape, nodes in (("s", [i for i in range(n) if i in train]), ("o", [i for i in range(n) if i not in train])):
        nx.draw_networkx_nodes(g, pos, ax=ax, nodelist=nodes, node_shape=shape, node_size=260,
                               node_color=[colours[int(labels[i])] for i in nodes])
    wrong = [i for i in range(n) if i not in train and predicted[i] != labels[i]]
    if wrong:
        nx.draw_networkx_nodes(g, pos, ax=ax, nodelist=wrong, node_size=520, node_color="none", edgecolors="red",
                               linewidths=2)
    nx.draw_networkx_labels(g, pos, ax=ax, font_size=7)
    handles = [Line2D([], [], marker="o", ls="", color=c, label=name) for c, name in zip(colours, CLASSES, strict=True)]
    handles += [Line2D([], [], marker="s", ls="", color="grey", label="labelled for training"),
                Line2D([], [], marker="o", ls="", mfc="none", mec="red", label="test node predicted wrong")]
    ax.legend(handles=handles, loc="lower left", fontsize=8, frameon=False)
    ax.set_title("Karate club: first-layer graph attention. Edge width = weight / the plain mean's\n"
                 f"(mean over heads and both directions; widest {top:.2f}x the mean)", fontsize=9)
    return fig

# ------------------------------------------------------------------------------------------ run


def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True) -> Result:
    """Train the three models with seeds ``seed .. seed + seeds - 1``, compare their test accuracy,
    save the graph-attention model of ``seed`` and the picture of its weights into ``out``."""
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    out = Path(out)
    from tqdm.auto import tqdm

    with Timer() as total, one_thread():
        adj, labels = karate()
        train_nodes, test_nodes = split(labels)
        seeds = range(seed, seed + cfg["seeds"])
        acc: dict[str, list[float]] = {k: [] for k in MODELS}
        first = None
        for s in tqdm(seeds, desc="graph", disable=not progress, leave=False):
            for kind in MODELS:
                model = train(kind, cfg, adj, labels, train_nodes, s)
                acc[kind].append(accuracy(model, adj, labels, test_nodes))
                if kind == "gat" and first is None:
                    first = model
        config = {"kind": "gat", "in_dim": len(labels), "hidden_dim": cfg["hidden_dim"],
                  "num_heads": cfg["num_heads"], "num_classes": len(CLASSES), "dropout": cfg["dropout"]}
        _common.save(out, first, config)
        with torch.no_grad():
            scores, weights = first(torch.eye(len(labels)), adj)
        even = evenness(weights[0], adj)
        png = save_png(draw(adj, labels, train_nodes, weights[0], scores.argmax(-1)), out / "graph_attention.png")
    n_test = len(test_nodes)
    words = verdict(acc, n_test)
    metrics: dict = {"nodes": len(labels), "edges": int((adj.sum() - len(labels)) // 2),
                     "train nodes": len(train_nodes), "test nodes": n_test, "seeds": cfg["seeds"]}
    for kind in MODELS:
        metrics[f"{kind} accuracy"] = statistics.mean(acc[kind])
        metrics[f"{kind} accuracy sd"] = statistics.stdev(acc[kind]) if len(acc[kind]) > 1 else 0.0
    metrics["evenness"] = even
    labels_ = {"nodes": "Members (nodes)", "edges": "Friendships (edges)", "train nodes": "Labelled nodes (training)",
               "test nodes": "Test nodes", "seeds": "Seeds (initialisations; the split is fixed)",
               "evenness": f"Evenness of the first layer's attention, seed {seed} (1 = the plain mean)"}
    for kind in MODELS:
        labels_[f"{kind} accuracy"] = f"Test accuracy, {MODEL_NAMES[kind]} (mean over seeds)"
        labels_[f"{kind} accuracy sd"] = f"Test accuracy, {MODEL_NAMES[kind]} (standard deviation over seeds)"
    rows = [{"Model": MODEL_NAMES[k], "Test accuracy (mean ± sd over seeds)": _spread(acc[k]),
             "Lowest": min(acc[k]), "Highest": max(acc[k])} for k in MODELS]
    sections = [
        Section("Node classification on Zachary's karate club",
                f"{len(labels)} members, {metrics['edges']} friendships; {len(train_nodes)} members labelled with "
                f"their side for training ({TRAIN_PER_CLASS} per side), {n_test} test members. A node's only feature "
                f"is its identity. {cfg['seeds']} initialisations per model, the split fixed.\n\n{words}",
                table=rows),
        Section("Where the attention goes",
                f"The first layer of the graph-attention model of seed {seed}: each edge as wide as the weight its two "
                f"ends give each other divided by the plain mean's (1 / degree), mean over {cfg['num_heads']} heads. "
                f"Its evenness, {even:.3f}, is the entropy "
                "of each node's weights over its neighbours divided by that of the plain mean (1 would be "
                "neighbour averaging exactly).",
                images=[png]),
    ]
    return Result("graph", metrics, total.seconds, sections, labels_)
