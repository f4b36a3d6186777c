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
from ..viz.report import Section, label

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


@dataclass(frozen=True)
class Field:
    """How :func:`load` checks one ``config.json`` field before the model is built.

    Build one with :func:`size`, :func:`layers`, :func:`heads`, :func:`probability`,
    :func:`words` or :func:`one_of`. A size must equal what the weights' header stores, so a
    config can ask for no more memory than the weights file holds.
    """

    kind: str
    tensor: str = ""  # size, words: the tensor whose shape gives the value; layers: the prefix
    dim: int = 0
    stored: Callable[[int], int] = int  # size: what the tensor's dimension holds for a value
    of: str = ""  # heads: the width they divide
    choices: tuple = ()  # one_of: the values allowed
    default: object = None  # one_of: the value when absent (required when None)


def size(tensor: str, dim: int, stored: Callable[[int], int] = int) -> Field:
    """A positive int whose ``stored(value)`` is dimension ``dim`` of ``tensor`` in the weights."""
    return Field("size", tensor, dim, stored)


def layers(prefix: str) -> Field:
    """A positive int: how many ``prefix.0``, ``prefix.1``, ... the weights hold."""
    return Field("layers", prefix)


def heads(of: str) -> Field:
    """A positive int that divides the field ``of`` (the width the heads share)."""
    return Field("heads", of=of)


def probability() -> Field:
    """A number in ``[0, 1]`` (a dropout rate)."""
    return Field("probability")


def words(tensor: str) -> Field:
    """A list of strings, one per row of ``tensor`` (a vocabulary and its embedding)."""
    return Field("words", tensor)


def one_of(*choices, default=None) -> Field:
    """One of ``choices``; ``default`` when absent (required when ``None``)."""
    return Field("choice", choices=choices, default=default)


def _check_fields(config: dict, fields: dict[str, Field], cfg_path: Path, stored: dict, w_path: Path) -> None:
    from ..models import checkpoint as ckpt

    def bad(key: str, why: str) -> ValueError:
        return ValueError(f"{cfg_path}: key {key!r} {why}")

    def shape(key: str, tensor: str) -> tuple[int, ...]:
        if tensor not in stored:
            raise bad(key, f"cannot be checked: {w_path.name} has no tensor {tensor!r}")
        return stored[tensor].shape

    for key, f in fields.items():
        if f.kind == "choice":
            value = config.get(key, f.default)
            if value not in f.choices:
                raise bad(key, f"is {value!r}, expected one of {list(f.choices)}")
            continue
        if key not in config:
            raise bad(key, "is missing")
        value = config[key]
        if f.kind == "probability":
            ckpt.config_value(config, key, (int, float), cfg_path, probability=True)
            continue
        if f.kind == "words":
            if not isinstance(value, list) or not all(isinstance(w, str) for w in value):
                raise bad(key, f"must be a list of strings, got {type(value).__name__}")
            rows = shape(key, f.tensor)[0]
            if len(value) != rows:
                raise bad(key, f"has {len(value):,} entries, but {w_path.name} stores {rows:,} rows of {f.tensor!r}")
            continue
        ckpt.config_value(config, key, int, cfg_path, positive=True)  # ints only from here
        if f.kind == "heads":
            width = config.get(f.of)
            if isinstance(width, int) and width % value:
                raise bad(key, f"({value}) must divide {f.of!r} ({width})")
        elif f.kind == "layers":
            found = {int(k[len(f.tensor) + 1:].split(".", 1)[0]) for k in stored
                     if k.startswith(f.tensor + ".") and k[len(f.tensor) + 1:].split(".", 1)[0].isdigit()}
            if value != len(found):
                held = {0: "none", 1: f"1 ({f.tensor}.0)"}.get(len(found), f"{len(found)} ({f.tensor}.0 .. "
                                                                          f"{f.tensor}.{max(found)})")
                raise bad(key, f"is {value:,}, but {w_path.name} holds {held}")
        elif f.kind == "size":
            have = shape(key, f.tensor)
            if f.dim >= len(have) or f.stored(value) != have[f.dim]:
                raise bad(key, f"is {value:,}, but {f.tensor!r} in {w_path.name} has shape {tuple(have)} "
                               f"(dimension {f.dim} would be {f.stored(value):,})")


def load(dir: str | Path, build: Callable[[dict], nn.Module],
         fields: dict[str, Field] | Callable[[dict], dict[str, Field]] | None = None) -> nn.Module:
    """Rebuild a model saved by :func:`save`: ``build(config)``, then its weights (strict), in eval mode.

    Nothing is built before it is checked: ``config.json`` is read with the size and nesting limits
    of :mod:`attnkit.models.checkpoint`, each of ``fields`` is checked against the weights' header
    (so no size can ask for more than the file holds), the model is built with its parameters on the
    meta device and compared with the header tensor by tensor, and only then are the weights read,
    straight into the parameters' places. Weights are read with safetensors' format only, never pickle.

    Args:
        dir: the folder :func:`save` wrote.
        build: ``config -> module``.
        fields: ``config.json`` field -> :class:`Field`, or ``config -> that`` when the fields
            depend on the config (a task saving one of two models).

    Raises:
        ValueError: a file is missing, unreadable or too large; a field is missing, ill-typed or
            does not fit the weights; or the weights do not fit the model built from the config.
            The message names the file, and the field or tensor.
    """
    from ..models import checkpoint as ckpt

    dir = Path(dir)
    for name in (CONFIG, WEIGHTS):
        if not (dir / name).is_file():
            raise ValueError(f"{dir / name}: no such file (a checkpoint folder holds {CONFIG} and {WEIGHTS})")
    cfg_path, w_path = ckpt.member(dir, CONFIG), ckpt.member(dir, WEIGHTS)
    config = ckpt.read_json(cfg_path)
    stored = ckpt.read_headers([w_path])
    _check_fields(config, (fields(config) if callable(fields) else fields) or {}, cfg_path, stored, w_path)
    try:
        with ckpt.parameters_on_meta():
            model = build(config)
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:  # RuntimeError: a size no allocator takes
        raise ValueError(f"{cfg_path}: cannot build the model from it ({type(e).__name__}: {e})") from None
    wanted = model.state_dict()
    problems = [f"missing {k!r}" for k in wanted if k not in stored]
    problems += [f"unexpected {k!r}" for k in stored if k not in wanted]
    problems += [f"{k!r} stored {stored[k].shape}, model has {tuple(t.shape)}" for k, t in wanted.items()
                 if k in stored and stored[k].shape != tuple(t.shape)]
    problems += [f"{k!r} stored as {stored[k].dtype}, not a floating-point tensor" for k, t in wanted.items()
                 if k in stored and t.is_floating_point() and not stored[k].dtype.startswith(("F", "BF"))]
    if problems:
        raise ValueError(f"{w_path}: weights do not fit the model built from {CONFIG}: "
                         + "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    ckpt.assign(model, ckpt.load_tensors([w_path]), {k: k for k in wanted}, [w_path])
    return model.eval()


@dataclass
class Result:
    """What a task's ``run`` returns.

    Attributes:
        task: the task's name.
        metrics: the evaluation, key -> value; the keys are for code (``metrics["final_loss"]``).
        seconds: wall time of the whole run (data, training, evaluation, pictures).
        sections: the report's sections; pictures are PNG paths inside them.
        labels: what people are shown for each metric key, with its units where it has one
            (:meth:`evaluation_rows`); a key without one is shown by :func:`attnkit.viz.report.label`.
    """

    task: str
    metrics: dict[str, float | int | str]
    seconds: float
    sections: list[Section] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)

    def evaluation_rows(self) -> list[dict[str, object]]:
        """The evaluation as table rows for people (:func:`table`, a report's ``Section``): each
        metric under its label, then the seconds of the whole run."""
        return [*({"Metric": label(k, self.labels), "Value": v} for k, v in self.metrics.items()),
                {"Metric": "Seconds in all", "Value": round(self.seconds, 1)}]


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
