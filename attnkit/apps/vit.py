"""A Vision Transformer on handwritten digits, beside a CNN of about the same size.

Images as sequences (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words"): each 8x8 digit
of scikit-learn's bundled set (1,797 images, 10 classes) is cut into 2x2-pixel patches, each patch
becomes a token, a learned class token is put in front, learned positions are added, and a stack
of pre-norm Transformer encoder layers reads the 17 tokens; the class token's final state is
classified. The images are not augmented: shifting them by a pixel (tried) moves the digit
across the 2x2 patch grid and cost the ViT 8 points of test accuracy, while the digits are centred alike.

Self-attention has no built-in notion of "neighbouring pixels", which a convolution has: it must
learn locality from the data, and the usual claim is that it therefore needs more data than a CNN
to get as good. To test that, both models (about the same number of parameters, the same
optimiser, steps and batches) are trained on 10%, 30% and 100% of the training split, the test
accuracies are plotted, and :func:`trend` says in words how the CNN's lead moved with the data.
Over several seeds: ``attnkit bench apps`` (the table in ``bench/results/apps.md``).

Finally, attention rollout (Abnar & Zuidema 2020, :func:`attnkit.analysis.rollout`) shows which
patches the class token drew on, drawn over the digit.
"""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..modules import TransformerEncoderLayer
from ..viz.report import Section
from . import _common
from ._common import Result, Timer, fit, save, save_png, seed_all

DEFAULTS = {
    "steps": 600,  # per model and training fraction
    "lr": 3e-3,
    "warmup": 50,
    "batch_size": 64,
    "embed_dim": 64,
    "num_heads": 4,
    "num_layers": 3,
    "ffn_dim": 128,
    "patch": 2,
    "dropout": 0.1,
    "cnn_width": 32,
    "fractions": [0.1, 0.3, 1.0],
}
#: A few seconds: for tests and CI.
QUICK = {"steps": 60, "warmup": 5, "embed_dim": 32, "num_heads": 2, "num_layers": 2, "ffn_dim": 64,
         "cnn_width": 16}

#: The test split is fixed (not drawn with the run's seed), so runs with different seeds are
#: measured on the same images.
TEST_SHARE = 0.2
SPLIT_SEED = 0
SIDE = 8  # pixels per side of a digit
N_CLASSES = 10


# ---------------------------------------------------------------- data

def digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(x_train, y_train, x_test, y_test)``: images ``[N, 8, 8]`` in ``[0, 1]``, labels ``[N]``.

    A stratified split of scikit-learn's digits: 1,437 training and 360 test images.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(data.target, dtype=torch.long)
    tr, te = train_test_split(np.arange(len(y)), test_size=TEST_SHARE, stratify=data.target,
                              random_state=SPLIT_SEED)
    return x[tr], y[tr], x[te], y[te]


def subset(y: Tensor, fraction: float, g: torch.Generator) -> Tensor:
    """Indices of ``fraction`` of the examples, the same share of every class."""
    picks = []
    for c in range(N_CLASSES):
        idx = (y == c).nonzero().flatten()
        keep = max(1, round(fraction * len(idx)))
        picks.append(idx[torch.randperm(len(idx), generator=g)[:keep]])
    return torch.cat(picks).sort().values


# ---------------------------------------------------------------- models

class ViT(nn.Module):
    """Patches -> tokens, a class token, learned positions, pre-norm encoder layers, a linear head.

    Shape notation: ``B`` batch, ``P`` patches (16 for 2x2 patches of 8x8), ``L = P + 1``, ``E`` width.
    """

    def __init__(self, *, embed_dim: int, num_heads: int, num_layers: int, ffn_dim: int, patch: int,
                 dropout: float) -> None:
        super().__init__()
        if SIDE % patch:
            raise ValueError(f"patch must divide the image side {SIDE}, got {patch}")
        self.patch = patch
        n_patches = (SIDE // patch) ** 2
        self.embed = nn.Linear(patch * patch, embed_dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, embed_dim) * 0.02)
        self.layers = nn.ModuleList(
            TransformerEncoderLayer(embed_dim, num_heads, ffn_dim=ffn_dim, dropout=dropout, activation="gelu",
                                    norm_first=True) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, N_CLASSES)

    def tokens(self, images: Tensor) -> Tensor:
        """``[B, 8, 8] -> [B, L, E]``: patch embeddings after the class token, positions added."""
        p = self.patch
        b = images.shape[0]
        patches = images.unfold(1, p, p).unfold(2, p, p).reshape(b, -1, p * p)  # (B, P, p*p), row-major
        x = torch.cat([self.cls.expand(b, -1, -1), self.embed(patches)], dim=1)  # (B, L, E)
        return x + self.pos

    def forward(self, images: Tensor) -> Tensor:
        """``[B, 8, 8] -> [B, 10]`` class logits."""
        x = self.tokens(images)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))

    @torch.no_grad()
    def attention_maps(self, images: Tensor) -> list[Tensor]:
        """Each layer's attention weights ``[B, H, L, L]``, first layer first.

        A pre-norm layer attends over ``norm1(x)``; asking its attention for the weights of that
        same input gives exactly the weights the forward pass used.
        """
        x = self.tokens(images)
        maps = []
        for layer in self.layers:
            maps.append(layer.self_attn(layer.norm1(x), need_weights=True)[1])
            x = layer(x)
        return maps


class CNN(nn.Module):
    """Three 3x3 convolutions (8x8 -> 4x4 -> 2x2 by max-pooling) and a small MLP head: the usual
    small image classifier, sized by ``width`` to about the ViT's parameter count."""

    def __init__(self, *, width: int, dropout: float) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.GELU(),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),       # (B, 2w, 4, 4)
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.GELU(), nn.MaxPool2d(2),   # (B, 2w, 2, 2)
            nn.Flatten(), nn.Dropout(dropout),
            nn.Linear(8 * w, 5 * w), nn.GELU(), nn.Linear(5 * w, N_CLASSES))

    def forward(self, images: Tensor) -> Tensor:
        return self.features(images[:, None])


def build(config: dict) -> nn.Module:
    """The model a checkpoint's ``config.json`` describes (``{"model": "vit" | "cnn", ...}``)."""
    if config.get("model") == "cnn":
        return CNN(width=config["cnn_width"], dropout=config["dropout"])
    keys = ("embed_dim", "num_heads", "num_layers", "ffn_dim", "patch", "dropout")
    return ViT(**{k: config[k] for k in keys})


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- train and evaluate

def train(kind: str, cfg: dict, x: Tensor, y: Tensor, *, seed: int, progress: bool, desc: str):
    """Build a ``kind`` model (``"vit"`` or ``"cnn"``) and train it on ``(x, y)`` with the shared recipe.

    Seeded here, so every (model, fraction) run is reproducible on its own, whatever ran before.

    Returns:
        ``(model, losses)``.
    """
    g = seed_all(seed)
    model = build({**cfg, "model": kind})
    batch = min(cfg["batch_size"], len(y))

    def batch_fn(step: int) -> tuple[Tensor, Tensor]:
        idx = torch.randint(0, len(y), (batch,), generator=g)
        return x[idx], y[idx]

    def loss_fn(m: nn.Module, b: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(m(b[0]), b[1])

    losses = fit(model, batch_fn, loss_fn, steps=cfg["steps"], lr=cfg["lr"], warmup=cfg["warmup"],
                 desc=desc, progress=progress)
    return model, losses


@torch.no_grad()
def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    return (model(x).argmax(-1) == y).float().mean().item()


# ---------------------------------------------------------------- pictures

def plot_data_efficiency(curves: dict[str, list[tuple[int, float]]], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.8), dpi=110)
    ax = fig.add_subplot()
    for name, pts in curves.items():
        n, acc = zip(*pts, strict=True)
        ax.plot(n, [100 * a for a in acc], marker="o", label=name)
        for xi, a in pts:
            ax.annotate(f"{100 * a:.1f}", (xi, 100 * a), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=8)
    ax.set_xscale("log")
    sizes = [n for n, _ in next(iter(curves.values()))]
    ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    ax.minorticks_off()
    ax.set_xlabel("training images (log scale)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Data efficiency: ViT vs CNN of about the same size")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_png(fig, path)


def plot_rollout(model: ViT, images: Tensor, labels: Tensor, path: Path) -> Path:
    """Each digit, and beside it the rollout share of the class token's state that flows from each
    patch, upsampled to pixels and drawn over the digit."""
    from matplotlib.figure import Figure

    from ..analysis import rollout

    flow = rollout(model.attention_maps(images))[:, 0, 1:]  # (B, P): class token <- each patch
    grid = SIDE // model.patch
    flow = flow.reshape(-1, grid, grid).repeat_interleave(model.patch, 1).repeat_interleave(model.patch, 2)
    pred = model(images).argmax(-1)
    n = len(images)
    fig = Figure(figsize=(1.3 * n, 2.9), dpi=110)
    axes = fig.subplots(2, n, squeeze=False)
    for i in range(n):
        axes[0, i].imshow(images[i].numpy(), cmap="gray_r", vmin=0, vmax=1)
        axes[0, i].set_title(f"label {labels[i].item()}\npred {pred[i].item()}", fontsize=8)
        # The rollout as the picture and the digit as an outline over it, so neither hides the other.
        axes[1, i].imshow(flow[i].numpy(), cmap="magma")
        axes[1, i].contour(images[i].numpy(), levels=[0.35], colors="#33ddff", linewidths=1.2)
        for ax in axes[:, i]:
            ax.set_xticks([])
            ax.set_yticks([])
    axes[1, 0].set_ylabel("rollout", fontsize=8)
    fig.suptitle("Attention rollout: which patches the class token draws on", fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)


def plot_losses(losses: dict[str, list[float]], path: Path) -> Path:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 3.4), dpi=110)
    ax = fig.add_subplot()
    for name, ls in losses.items():
        window = max(1, len(ls) // 50)  # smoothed: one batch's loss is noisy
        smooth = np.convolve(ls, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(len(smooth)) + window, smooth, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_title("Training on the full training split")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return save_png(fig, path)


# ---------------------------------------------------------------- the task

def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False,
        progress: bool = True) -> Result:
    """Train the ViT and the CNN at each training fraction, evaluate, draw, save the full-data ViT.

    Args:
        out: folder for the checkpoint (the ViT trained on all training images) and the PNGs.
        steps: training steps per model and fraction (default ``DEFAULTS["steps"]``).
        seed: model initialisation, the training subsets and the data order (the test split is fixed).
        quick: the tiny :data:`QUICK` sizes.
        progress: draw progress bars on stderr.
    """
    t0 = time.perf_counter()
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    x_tr, y_tr, x_te, y_te = digits()

    curves: dict[str, list[tuple[int, float]]] = {"ViT": [], "CNN": []}
    rows = []
    train_seconds = 0.0
    for fraction in cfg["fractions"]:
        idx = subset(y_tr, fraction, torch.Generator().manual_seed(seed))
        for kind, name in (("vit", "ViT"), ("cnn", "CNN")):
            with Timer() as timer:
                model, losses = train(kind, cfg, x_tr[idx], y_tr[idx], seed=seed, progress=progress,
                                      desc=f"{name} on {fraction:.0%} ({len(idx)} images)")
            train_seconds += timer.seconds
            acc = accuracy(model, x_te, y_te)
            curves[name].append((len(idx), acc))
            rows.append({"Model": name, "Share of the training images": f"{fraction:.0%}", "Training images": len(idx),
                         "Parameters": n_params(model), "Test accuracy": acc})
            if fraction == 1.0:
                if kind == "vit":
                    vit, vit_losses = model, losses
                else:
                    cnn_losses = losses

    save(out, vit, {**cfg, "model": "vit"})
    pictures = [plot_data_efficiency(curves, out / "vit_data_efficiency.png"),
                plot_rollout(vit, x_te[:8], y_te[:8], out / "vit_rollout.png"),
                plot_losses({"ViT": vit_losses, "CNN": cnn_losses}, out / "vit_losses.png")]

    share = "Share of the training images"
    full = {r["Model"]: r for r in rows if r[share] == "100%"}
    metrics = {"vit_acc": full["ViT"]["Test accuracy"], "cnn_acc": full["CNN"]["Test accuracy"]}
    labels = {"vit_acc": "ViT test accuracy", "cnn_acc": "CNN test accuracy"}
    for r in rows:
        if r[share] != "100%":
            key = f"{r['Model'].lower()}_acc_{r[share]}"
            metrics[key] = r["Test accuracy"]
            labels[key] = f"{r['Model']} test accuracy, {r[share]} of the training images"
    metrics |= {"vit_params": full["ViT"]["Parameters"], "cnn_params": full["CNN"]["Parameters"],
                "train_images": len(y_tr), "test_images": len(y_te), "steps": cfg["steps"],
                "train_seconds": round(train_seconds, 1), "first_loss": vit_losses[0],
                "last_loss": float(np.mean(vit_losses[-20:]))}
    labels |= {"vit_params": "ViT parameters", "cnn_params": "CNN parameters", "train_images": "Training images",
               "test_images": "Test images", "steps": "Training steps per model",
               "train_seconds": "Training seconds, all models",
               "first_loss": "ViT first training loss (nats per image)",
               "last_loss": "ViT last training loss (nats per image, mean of the last 20 steps)"}
    sections = [
        Section("Data", f"scikit-learn's handwritten digits: 8x8 images, 10 classes; {len(y_tr)} training and "
                        f"{len(y_te)} test images (a fixed stratified split)."),
        Section("ViT against a CNN of about the same size",
                f"Both trained the same way: AdamW, {cfg['steps']} steps of {cfg['batch_size']} images, "
                f"warmup then cosine decay, peak learning rate {cfg['lr']}, on 10%, 30% and 100% of the "
                "training split. Self-attention must learn from the data which pixels are neighbours, which "
                "a convolution knows from its shape. In this run " + trend(leads(rows)),
                table=rows, images=pictures[:1]),
        Section("Attention rollout",
                "The share of the class token's final state that flows from each 2x2 patch, following the "
                "attention down through the layers with the residual connection counted (Abnar & Zuidema "
                "2020): bright = more; the digit is outlined.", images=pictures[1:2]),
        Section("Training loss", images=pictures[2:]),
    ]
    return Result("vit", metrics, time.perf_counter() - t0, sections, labels)


def leads(rows: list[dict]) -> dict[float, list[float]]:
    """The CNN's lead over the ViT in test accuracy (points), by share of the training images, from
    :func:`run`'s table rows (one value per share; several runs' leads are lists of several)."""
    acc = {(r["Model"], r["Share of the training images"]): r["Test accuracy"] for r in rows}
    shares = sorted({share for _, share in acc}, key=lambda share: float(share.rstrip("%")))
    return {float(share.rstrip("%")) / 100: [100 * (acc["CNN", share] - acc["ViT", share])] for share in shares}


def trend(by_share: dict[float, list[float]]) -> str:
    """How the CNN's lead over the ViT moves as the training data shrinks, in one sentence, from the leads
    (test accuracy points, CNN minus ViT) of each run at each share of the training images.

    "Grows as the data shrinks" means the lead is larger at every smaller share than at the next larger
    one: in every run (then said so), or only in the means over runs; otherwise it does not grow steadily.
    """
    shares = sorted(by_share, reverse=True)  # most data first
    runs = {len(v) for v in by_share.values()}
    if len(runs) != 1 or len(shares) < 2 or 0 in runs:
        raise ValueError(f"by_share must hold the same number of runs at two or more shares, got {by_share!r}")
    (n,) = runs
    means = {f: sum(v) / n for f, v in by_share.items()}

    def grows(values: dict[float, float]) -> bool:
        return all(values[small] > values[big] for big, small in pairwise(shares))

    every = all(grows({f: by_share[f][i] for f in shares}) for i in range(n))
    said = ", ".join(f"{means[f]:+.1f} points at {f:.0%}" for f in shares)
    where = f"mean of {n} runs" if n > 1 else "one run"
    if every:
        how = "grows as the training data shrinks" + (", in every run" if n > 1 else "")
    elif grows(means):
        how = "grows as the training data shrinks on average, but not in every run"
    else:
        how = "does not grow steadily as the training data shrinks"
    return f"the CNN's lead over the ViT {how}: {said} of the training images ({where})."


def fields(config: dict) -> dict[str, _common.Field]:
    """What :func:`load` checks in ``config.json`` against the weights before building (the ViT's
    fields, or the CNN's when ``model`` is ``"cnn"``)."""
    if config.get("model") == "cnn":
        return {"cnn_width": _common.size("features.0.weight", 0), "dropout": _common.probability()}
    return {
        "model": _common.one_of("vit", "cnn", default="vit"),
        "embed_dim": _common.size("embed.weight", 0),
        "patch": _common.size("embed.weight", 1, lambda p: p * p),
        "num_heads": _common.heads("embed_dim"),
        "num_layers": _common.layers("layers"),
        "ffn_dim": _common.size("layers.0.ff.linear1.weight", 0),
        "dropout": _common.probability(),
    }


def load(dir: str | Path) -> nn.Module:
    """The ViT saved by :func:`run` into ``dir``, in eval mode (checked first: :func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, fields)
