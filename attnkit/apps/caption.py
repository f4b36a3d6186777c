"""Caption strips of handwritten digits: an image of 3 to 5 digits side by side -> "4 7 1".

The digits are scikit-learn's bundled 8x8 handwritten digits (1,797 images, no download), split
once into training and test images; strips are drawn at random from one split, so the evaluation
strips hold only digits the model never saw. A strip is cut into column patches 8 pixels high and
:data:`PATCH_W` wide, a Transformer encoder reads the patches, and a text decoder writes the
caption while attending to them (cross-attention). Nothing tells the decoder where each digit
is: the caption only says which digits, in order. That the cross-attention of each written word
lands on its digit is learned, and measured: for each generated word, is the patch with the
largest weight on that word's digit? The decoder has one layer, so the words reach the image only
through that one cross-attention (with two layers, which of them did the looking changed from
seed to seed, and the other's map was diffuse).

Read top to bottom: data -> model (the encoder-decoder of :mod:`attnkit.apps.translate` with a
patch embedding as the source) -> training -> evaluation -> the attention drawn over the strip.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..positional import LearnedPositionalEmbedding
from ..viz.report import Section
from . import _common
from .translate import EOS, PAD, Seq2Seq, detokenize, greedy, loss_fn, recording_cross_attention

DEFAULTS = {"steps": 2000, "lr": 3e-3, "warmup": 100, "batch_size": 64, "embed_dim": 64, "num_heads": 2,
            "encoder_layers": 2, "decoder_layers": 1, "ffn_dim": 256, "augment": True, "test_strips": 1000}
QUICK = {"steps": 400, "lr": 3e-3, "warmup": 30, "batch_size": 32, "embed_dim": 48, "num_heads": 2,
         "encoder_layers": 1, "decoder_layers": 1, "ffn_dim": 64, "test_strips": 64}

# ------------------------------------------------------------------------------------------ data

MIN_DIGITS, MAX_DIGITS = 3, 5
SIDE = 8  # the digits are 8x8
PATCH_W = 2  # columns per patch: 4 patches per digit
PATCHES_PER_DIGIT = SIDE // PATCH_W
NUM_PATCHES = MAX_DIGITS * PATCHES_PER_DIGIT
TGT_VOCAB = ["<pad>", "<bos>", "<eos>", *"0123456789"]
TGT_LEN = MAX_DIGITS + 1  # the digits and <eos>


def load_digits_split(g: torch.Generator, test_fraction: float = 0.25) -> tuple[tuple[Tensor, Tensor], ...]:
    """scikit-learn's digits as ``([N, 8, 8] in [0, 1], labels [N])``, shuffled into (train, test)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(labels), generator=g)
    n_test = int(len(labels) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return (images[train], labels[train]), (images[test], labels[test])


def jitter(images: Tensor, g: torch.Generator) -> Tensor:
    """Each ``[8, 8]`` image moved by -1, 0 or 1 pixel in each direction (blank where it moved away).

    1,348 training digits are few: without this the model learns them by heart (the training loss
    falls to ~1e-3 while test digits are missed).
    """
    n = len(images)
    padded = F.pad(images, (1, 1, 1, 1))  # (N, 10, 10)
    dy, dx = torch.randint(0, 3, (2, n, 1), generator=g)
    rows = (dy + torch.arange(SIDE))[:, :, None]  # (N, 8, 1)
    cols = (dx + torch.arange(SIDE))[:, None, :]  # (N, 1, 8)
    return padded[torch.arange(n)[:, None, None], rows, cols]


def make_strips(images: Tensor, labels: Tensor, n: int, g: torch.Generator, *,
                augment: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``n`` strips of 3 to 5 digits drawn from ``images`` (each digit :func:`jitter`-ed with ``augment``).

    Returns:
        ``(strips [n, 8, 8 * MAX_DIGITS], patch_mask [n, NUM_PATCHES], tgt [n, TGT_LEN], counts [n])``:
        strips are blank right of their last digit and those patches are masked (``False``); ``tgt``
        is the digits, <eos>, then padding.
    """
    counts = torch.randint(MIN_DIGITS, MAX_DIGITS + 1, (n,), generator=g)
    picks = torch.randint(0, len(labels), (n, MAX_DIGITS), generator=g)
    used = torch.arange(MAX_DIGITS)[None, :] < counts[:, None]  # (n, MAX_DIGITS)
    digits = images[picks]  # (n, MAX_DIGITS, 8, 8)
    if augment:
        digits = jitter(digits.flatten(0, 1), g).reshape(digits.shape)
    digits = digits * used[:, :, None, None]  # blanks where unused
    strips = digits.permute(0, 2, 1, 3).reshape(n, SIDE, SIDE * MAX_DIGITS)
    patch_mask = used.repeat_interleave(PATCHES_PER_DIGIT, dim=1)
    tgt = torch.where(used, labels[picks] + TGT_VOCAB.index("0"), PAD)
    tgt = torch.cat([tgt, torch.full((n, 1), PAD)], dim=1)
    tgt[torch.arange(n), counts] = EOS
    return strips, patch_mask, tgt, counts


def patches(strips: Tensor) -> Tensor:
    """``[B, 8, W]`` -> ``[B, W / PATCH_W, 8 * PATCH_W]``: column patches, left to right."""
    b, h, w = strips.shape
    return strips.reshape(b, h, w // PATCH_W, PATCH_W).permute(0, 2, 1, 3).reshape(b, w // PATCH_W, h * PATCH_W)

# ----------------------------------------------------------------------------------------- model


class PatchEmbedding(nn.Module):
    """A strip ``[B, 8, W]`` -> ``[B, W / PATCH_W, E]``: a linear map of each patch plus a learned
    position vector (the only thing that tells patches apart by place)."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(SIDE * PATCH_W, embed_dim)
        self.pos = LearnedPositionalEmbedding(NUM_PATCHES, embed_dim)

    def forward(self, strips: Tensor) -> Tensor:
        return self.pos(self.proj(patches(strips)))


def build(config: dict) -> Seq2Seq:
    """The model for ``config`` (what :func:`load` rebuilds from ``config.json``)."""
    return Seq2Seq(PatchEmbedding(config["embed_dim"]), len(TGT_VOCAB), TGT_LEN, embed_dim=config["embed_dim"],
                   num_heads=config["num_heads"], encoder_layers=config["encoder_layers"],
                   decoder_layers=config["decoder_layers"], ffn_dim=config["ffn_dim"])


#: What :func:`load` checks in ``config.json`` against the weights before building.
FIELDS = {
    "embed_dim": _common.size("src_embed.proj.weight", 0),
    "num_heads": _common.heads("embed_dim"),
    "encoder_layers": _common.layers("transformer.encoder.layers"),
    "decoder_layers": _common.layers("transformer.decoder.layers"),
    "ffn_dim": _common.size("transformer.encoder.layers.0.ff.linear1.weight", 0),
}


def load(dir: str | Path) -> Seq2Seq:
    """The model saved by :func:`run` into ``dir`` (checked first: :func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, FIELDS)

# -------------------------------------------------------------------------------------- evaluate


def caption_text(ids: list[int]) -> str:
    """Target ids -> "4 7 1", stopping at the first <eos>."""
    return detokenize(ids, TGT_VOCAB, " ")


def evaluate(model: Seq2Seq, strips: Tensor, patch_mask: Tensor, tgt: Tensor, counts: Tensor):
    """Greedy captions and where their cross-attention looks.

    Returns:
        ``(metrics, pred [B, TGT_LEN], attn [B, TGT_LEN, NUM_PATCHES])``: ``attn`` is the last
        decoder layer's cross-attention, mean over heads, one row per generated token. Metrics:
        exact caption match, per-digit accuracy (position by position), and the fraction of
        generated digits whose strongest patch lies on the digit at that position of the strip
        (a word past the strip's last digit counts as a miss).
    """
    with recording_cross_attention(model) as rec:
        pred = greedy(model, strips, patch_mask)
    attn = torch.cat(rec[-1], dim=2).mean(1)  # (B, steps, NUM_PATCHES)
    attn = torch.cat([attn, attn.new_zeros(attn.shape[0], TGT_LEN - attn.shape[1], attn.shape[2])], dim=1)
    pred_text = [caption_text(p) for p in pred.tolist()]
    tgt_text = [caption_text(t) for t in tgt.tolist()]
    exact = sum(p == t for p, t in zip(pred_text, tgt_text, strict=True)) / len(tgt)
    positions = torch.arange(MAX_DIGITS)[None, :] < counts[:, None]
    digit_acc = ((pred[:, :MAX_DIGITS] == tgt[:, :MAX_DIGITS]) & positions).sum().item() / positions.sum().item()
    # A generated word: a digit token before the row's first <eos>.
    is_digit = pred > EOS
    generated = is_digit & (torch.cumsum(pred == EOS, dim=1) == 0)
    on_digit = attn.argmax(-1) // PATCHES_PER_DIGIT == torch.arange(TGT_LEN)[None, :]
    placed = (generated & on_digit).sum().item() / max(1, generated.sum().item())
    metrics = {"exact_caption": exact, "digit_accuracy": digit_acc, "attention_on_digit": placed,
               "test_strips": len(tgt)}
    return metrics, pred, attn


def attention_figure(strips: Tensor, pred: Tensor, attn: Tensor, examples: int = 3):
    """For a few strips: the strip, then one row per generated word with its cross-attention over
    the patches drawn on top of the strip in red."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    captions = [caption_text(p).split() for p in pred[:examples].tolist()]
    rows = 1 + max(map(len, captions))
    fig = Figure(figsize=(3.2 * examples, 0.75 * rows + 0.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, examples, squeeze=False)
    for j, words in enumerate(captions):
        img = strips[j].numpy()
        axes[0, j].imshow(img, cmap="gray_r", vmin=0, vmax=1)
        axes[0, j].set_title(f"caption: {' '.join(words)}", fontsize=9)
        for r in range(1, rows):
            ax = axes[r, j]
            if r > len(words):
                ax.axis("off")
                continue
            w = attn[j, r - 1].numpy()
            heat = np.repeat(w / max(w.max(), 1e-9), PATCH_W)[None, :].repeat(SIDE, axis=0)  # (8, W)
            ax.imshow(img, cmap="gray_r", vmin=0, vmax=1)
            ax.imshow(heat, cmap="Reds", alpha=0.55, vmin=0, vmax=1)
            ax.set_ylabel(f"'{words[r - 1]}'", rotation=0, ha="right", va="center", fontsize=9)
        for ax in axes[:, j]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle("where the decoder looks while writing each word (cross-attention, mean over heads)", fontsize=10)
    return fig

# ------------------------------------------------------------------------------------------- run


def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False,
        progress: bool = True) -> _common.Result:
    """Train on strips of training digits, evaluate on strips of test digits, draw the attention,
    save the checkpoint and picture into ``out``."""
    out = Path(out)
    with _common.Timer() as total:
        cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
        g = _common.seed_all(seed)
        (train_x, train_y), (test_x, test_y) = load_digits_split(g)
        model = build(cfg)

        def batch_fn(step: int):
            strips, mask, tgt, _ = make_strips(train_x, train_y, cfg["batch_size"], g, augment=cfg["augment"])
            return strips, mask, tgt

        with _common.Timer() as train_time:
            losses = _common.fit(model, batch_fn, loss_fn, steps=cfg["steps"], lr=cfg["lr"], desc="caption",
                                 warmup=min(cfg["warmup"], cfg["steps"]), progress=progress)
        strips, mask, tgt, counts = make_strips(test_x, test_y, cfg["test_strips"], g)
        metrics, pred, attn = evaluate(model, strips, mask, tgt, counts)
        _common.save(out, model, cfg)
        png = _common.save_png(attention_figure(strips, pred, attn), out / "caption_attention.png")
    metrics |= {"first_loss": losses[0], "final_loss": sum(losses[-20:]) / len(losses[-20:]),
                "steps": cfg["steps"], "train_seconds": round(train_time.seconds, 1)}
    text = (f"Strips of {MIN_DIGITS} to {MAX_DIGITS} handwritten digits (scikit-learn's 8x8 digits; "
            f"{len(train_y)} training and {len(test_y)} test images) -> their caption. On "
            f"{len(tgt)} strips built from test images only: exact caption {metrics['exact_caption']:.1%}, "
            f"digits right {metrics['digit_accuracy']:.1%}.\n\n"
            f"For {metrics['attention_on_digit']:.1%} of the generated words, the patch the decoder's "
            "cross-attention weighs most (last layer, mean over heads) lies on the digit that word names. "
            "Nothing in training says where the digits are; the picture shows each word's attention in red.")
    labels = {"exact_caption": "Exact caption (share of test strips)",
              "digit_accuracy": "Digits right (share, position by position)",
              "attention_on_digit": "Generated words whose strongest patch lies on their digit (share)",
              "test_strips": "Test strips", "first_loss": "First training loss (nats per token)",
              "final_loss": "Final training loss (nats per token, mean of the last 20 steps)",
              "steps": "Training steps", "train_seconds": "Training seconds"}
    return _common.Result("caption", metrics, total.seconds,
                          [Section("Captioning digit strips", text, images=[png])], labels)
