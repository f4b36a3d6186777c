"""What several experiments share: a tiny sequence task with its trainer, a log-log fit, plots."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from ..backends._build import once
from ..positional import SinusoidalPositionalEncoding

#: The tiny task: reverse a sequence of LENGTH tokens drawn from VOCAB symbols. Output ``i`` is
#: input ``LENGTH - 1 - i``, so every position must fetch a token from elsewhere by its position:
#: a task that needs attention (and positions), small enough to train on a CPU in seconds.
VOCAB, LENGTH, WIDTH = 10, 8, 32


def reverse_batch(n: int, generator: torch.Generator, length: int = LENGTH) -> tuple[Tensor, Tensor]:
    """``n`` random sequences and their reversals, ``[n, length]`` each."""
    x = torch.randint(0, VOCAB, (n, length), generator=generator)
    return x, x.flip(-1)


def shift_batch(n: int, generator: torch.Generator, length: int = LENGTH, by: int = 2) -> tuple[Tensor, Tensor]:
    """A local task: output ``i`` is input ``i - by`` (0 before the start)."""
    x = torch.randint(1, VOCAB, (n, length), generator=generator)
    y = torch.zeros_like(x)
    y[:, by:] = x[:, :-by]
    return x, y


class TinyModel(nn.Module):
    """Embedding + sinusoidal positions -> ``mixer`` (residual) -> feed-forward (residual) -> logits.

    ``mixer`` is the part under test: any module mapping ``[B, L, E] -> [B, L, E]``.
    """

    def __init__(self, mixer: nn.Module, width: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = SinusoidalPositionalEncoding(width)
        self.mixer = mixer
        self.ffn = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.ReLU(),
                                 nn.Linear(2 * width, width))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        h = self.pos(self.embed(x))
        h = h + self.mixer(h)
        h = h + self.ffn(h)
        return self.head(h)


def train(make_mixer: Callable[[], nn.Module], *, steps: int, seed: int = 0,
          task: Callable = reverse_batch, lr: float = 3e-3, batch: int = 64,
          pool: int | None = None) -> dict[str, float]:
    """Train a :class:`TinyModel` around ``make_mixer()``; return its test accuracy, loss and size.

    Each step draws a fresh batch from ``task``, so the training set is unlimited and the test
    accuracy (on sequences drawn apart) is also how well the model fits. With ``pool``, the batches
    come from ``pool`` sequences drawn once, a finite training set, and the result also holds
    ``train_accuracy`` (on those ``pool`` sequences): its gap to the test accuracy is what the
    model does not carry over to sequences it has not seen.
    """
    torch.manual_seed(seed)
    model = TinyModel(make_mixer())
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    seen = task(pool, gen) if pool is not None else None
    for _ in range(steps):
        if seen is None:
            x, y = task(batch, gen)
        else:
            rows = torch.randint(0, pool, (batch,), generator=gen)
            x, y = seen[0][rows], seen[1][rows]
        loss = loss_fn(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = task(1024, torch.Generator().manual_seed(10_000 + seed))
    with torch.no_grad():
        logits = model(x)
        fitted = None if seen is None else (model(seen[0]).argmax(-1) == seen[1]).float().mean().item()
    return {"accuracy": (logits.argmax(-1) == y).float().mean().item(),
            "loss": loss_fn(logits.flatten(0, 1), y.flatten()).item(),
            "mixer_params": sum(p.numel() for p in model.mixer.parameters()),
            **({} if fitted is None else {"train_accuracy": fitted})}


def fit_exponent(xs, ys) -> float:
    """The slope ``p`` of the least-squares line through ``(log x, log y)``: ``y ~ x^p``."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / sum((a - mx) ** 2 for a in lx)


def figure(ncols: int = 1, width: float = 4.2, height: float = 3.0):
    """A matplotlib figure and axes on the non-interactive backend (no display is needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)


def save(fig, path: Path) -> Path:
    """Write ``fig`` as a small PNG, whole or not at all (a link in its place is replaced, not written
    through: :func:`attnkit._io.atomic_write`), and close it."""
    import matplotlib.pyplot as plt

    from .._io import atomic_write

    try:
        fig.tight_layout()
        return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=80))
    finally:
        plt.close(fig)


@once
def minilm():
    """The bundled MiniLM (loaded once per process, by one thread while others wait: several
    experiments read it; a failed load is not remembered, the next call tries again)."""
    from ..models import Bert

    return Bert.from_pretrained()
