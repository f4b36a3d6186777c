"""What every application shares: seeding, the training loop, checkpoints, pictures, tables.

Kept small on purpose: a task module should read top to bottom with only these few helpers
taken for granted.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .._io import atomic_write
from ..viz.report import Section

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def settings(defaults: dict, quick_overrides: dict, *, quick: bool, steps: int | None) -> dict:
    """A task's settings: its ``DEFAULTS``, with its ``QUICK`` sizes for a smoke run, and ``steps`` if given."""
    cfg = {**defaults, **(quick_overrides if quick else {})}
    if steps is not None:
        cfg["steps"] = steps
    return cfg


def seed_all(seed: int) -> torch.Generator:
    """Seed torch, ``random`` and numpy; return a generator seeded with ``seed`` for the data.

    With the same thread count, a task run twice with one seed gives the same numbers to the
    last digit (CPU kernels are deterministic at a fixed thread count).
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def fit(model: nn.Module, batch_fn: Callable[[int], Any], loss_fn: Callable[[nn.Module, Any], Tensor], *,
        steps: int, lr: float, desc: str, warmup: int = 0, clip: float = 1.0, weight_decay: float = 0.01,
        progress: bool = True) -> list[float]:
    """Train ``model`` with AdamW: linear warmup, cosine decay, gradient clipping.

    Args:
        model: trained in place; in ``train()`` mode during, ``eval()`` mode after.
        batch_fn: ``batch_fn(step) -> batch`` for step ``0 .. steps-1``.
        loss_fn: ``loss_fn(model, batch) -> scalar Tensor``.
        steps: number of optimiser steps, at least 1.
        lr: peak learning rate.
        desc: label of the progress bar.
        warmup: steps of linear warmup before the cosine decay; at most ``steps`` are used, so a
            task's default warmup does not refuse a short run asked for with ``--steps``.
        clip: largest gradient norm (``torch.nn.utils.clip_grad_norm_``).
        progress: draw a tqdm bar on stderr with the running loss and it/s.

    Returns:
        The loss of every step, in order.

    Raises:
        ValueError: ``steps < 1``, ``lr <= 0`` or ``warmup < 0``.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    warmup = min(warmup, steps)
    from tqdm.auto import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, warmup))
    losses: list[float] = []
    model.train()
    with tqdm(range(steps), desc=desc, disable=not progress, leave=False, dynamic_ncols=True) as bar:
        for step in bar:
            loss = loss_fn(model, batch_fn(step))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            losses.append(loss.item())
            # A running mean: one batch's loss jumps too much to read.
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}", refresh=False)
    model.eval()
    return losses


def save(dir: str | Path, model: nn.Module, config: dict) -> Path:
    """Write ``model.safetensors`` and ``config.json`` into ``dir`` (created); return ``dir``.

    ``config`` holds what ``build(config)`` needs to rebuild the model (see :func:`load`); it must
    be JSON-serialisable.
    """
    from safetensors.torch import save as to_bytes

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2, sort_keys=True).encode("utf-8")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    weights = to_bytes(tensors)
    atomic_write(dir / WEIGHTS, lambda f: f.write(weights))
    atomic_write(dir / CONFIG, lambda f: f.write(text))
    return dir


def load(dir: str | Path, build: Callable[[dict], nn.Module]) -> nn.Module:
    """Rebuild a model saved by :func:`save`: ``build(config)``, then its weights (strict), in eval mode.

    Weights are read with safetensors only, never pickle.

    Raises:
        ValueError: a file is missing or unreadable, or the weights do not fit the model built
            from the config; the message names the file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    dir = Path(dir)
    cfg_path, w_path = dir / CONFIG, dir / WEIGHTS
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise ValueError(f"{p}: no such file (a checkpoint folder holds {CONFIG} and {WEIGHTS})")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None
    model = build(config)
    try:
        state = load_file(w_path)
    except SafetensorError as e:
        raise ValueError(f"{w_path}: not a readable safetensors file ({e})") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{w_path}: weights do not fit the model built from {CONFIG}: "
                         f"{' '.join(str(e).split())}") from None
    return model.eval()


@dataclass
class Result:
    """What a task's ``run`` returns.

    Attributes:
        task: the task's name.
        metrics: the evaluation, name -> value (printed with :func:`table`).
        seconds: wall time of the whole run (data, training, evaluation, pictures).
        sections: the report's sections; pictures are PNG paths inside them.
    """

    task: str
    metrics: dict[str, float | int | str]
    seconds: float
    sections: list[Section] = field(default_factory=list)


class Timer:
    """``with Timer() as t: ...`` then ``t.seconds``."""

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0


def save_png(fig, path: str | Path) -> Path:
    """Write a matplotlib figure as PNG (whole or not at all) and release it; return the path."""
    from ..viz.heatmap import save as save_figure

    try:
        return save_figure(fig, path)
    finally:
        fig.clear()


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def table(rows: list[dict]) -> str:
    """An aligned plain-text table: columns are the union of the rows' keys, in first-seen order;
    numbers right-aligned, floats to 4 significant digits."""
    if not rows:
        return ""
    cols = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_fmt(row.get(c, "")) for c in cols] for row in rows]
    numeric = [all(isinstance(row.get(c), int | float) or c not in row for row in rows) for c in cols]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, cells)])
