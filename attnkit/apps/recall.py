"""Long-range recall: torch's own ``nn.RNN`` and ``nn.LSTM`` against self-attention.

The baselines the attention literature compares against (Bahdanau et al. 2015 and Vaswani et
al. 2017 against recurrent networks), on a task made to need memory over a chosen distance.

Data: sequences of random *value* tokens holding one ``CUE`` token; the token right after the cue
is the answer. The sequence ends with a ``QUERY`` token, and ``distance`` value tokens lie between
the answer and the query::

    filler ... CUE answer v v ... v QUERY       -> answer
                          '-------'
                          distance tokens

Evaluation counts accuracy at fixed distances on held-out sequences ``max_distance + 3`` long (the
filler takes up what the distance leaves), so every model does the same work at every distance.
Training batches draw a length from ``min_len .. max_distance + 3`` and distances uniformly up to
what fits: every model also sees short sequences, where the cue is found most easily (attention
starts out spreading its weight over every position, so on long sequences alone it learns slowly).

Models, of about the same parameter count, each reading the state at the query to a classifier:
``nn.RNN`` (tanh), ``nn.LSTM``, and two pre-norm layers of attnkit's own causal self-attention with
ALiBi positions (Press et al. 2022). The answer is told apart from the other values only by where
it is (just after the cue), so a head must look one position back; ALiBi's fixed per-head decay
with distance gives it that from the start, where learned absolute positions must first learn it.
All three train the same number of steps on the same batches with the same optimiser
(:func:`attnkit.apps._common.fit`: AdamW, warmup, cosine decay, clipping); the peak learning rate is
each model's own (``lr``): at the others' 3e-3 the RNN's loss stays at chance, and of 3e-4, 1e-3
and 3e-3 it did best at 1e-3.

Also measured: wall-clock time of one training step (forward, backward, optimiser) against the
sequence length, for the three models on this machine's CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._cpu import name as cpu_name
from ..modules import TransformerEncoder, TransformerEncoderLayer
from ..positional import ALiBi
from ..viz.report import Section
from . import _common
from ._common import Result, Timer, save_png

# Held-out sequences come from this seed, not the run's: every seed is scored on the same ones.
DATA_SEED = 2025
MODELS = ("RNN", "LSTM", "attention")

DEFAULTS: dict = {
    "steps": 1000, "lr": {"RNN": 1e-3, "LSTM": 3e-3, "attention": 3e-3}, "warmup": 100, "batch_size": 32,
    "num_values": 16, "max_distance": 64, "min_len": 8,
    "embed_dim": 32, "rnn_hidden": 136, "lstm_hidden": 64, "attn_heads": 4, "attn_layers": 2, "attn_ffn": 128,
    "eval_distances": (0, 4, 8, 16, 24, 32, 48, 64), "eval_per_distance": 500,
    "time_lengths": (16, 32, 64, 128, 256, 512), "time_repeat": 5,
}
# Seconds: short sequences, few steps; the timing table at three short lengths.
QUICK: dict = {"steps": 80, "warmup": 8, "max_distance": 12, "min_len": 6, "eval_distances": (0, 6, 12),
               "eval_per_distance": 100, "time_lengths": (16, 32), "time_repeat": 2}

MODEL_KEYS = ("num_values", "max_distance", "embed_dim", "rnn_hidden", "lstm_hidden", "attn_heads", "attn_layers",
              "attn_ffn")


# --------------------------------------------------------------------------- data

def tokens(num_values: int) -> tuple[int, int]:
    """``(CUE, QUERY)``: the ids after the values ``0 .. num_values - 1``."""
    return num_values, num_values + 1


def make_batch(distance: Tensor, num_values: int, max_distance: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Sequences with their answers at the given distances.

    Args:
        distance: ``[n]`` ints in ``0 .. max_distance``: value tokens between answer and query.
        num_values: values are ``0 .. num_values - 1``; ``CUE``, ``QUERY`` follow (:func:`tokens`).
        max_distance: sets the length, ``max_distance + 3``.
        gen: draws the values.

    Returns:
        ``seq [n, max_distance + 3]`` and ``answer [n]``: ``seq[i, -distance[i] - 2]`` is the answer,
        the cue is just before it, the query is last, and no other position holds the cue or query.
    """
    if distance.dim() != 1 or distance.min() < 0 or distance.max() > max_distance:
        raise ValueError(f"distance must be [n] ints in 0 .. {max_distance}, got {distance.tolist()}")
    cue, query = tokens(num_values)
    n, length = len(distance), max_distance + 3
    seq = torch.randint(num_values, (n, length), generator=gen)
    rows = torch.arange(n)
    answer_at = length - 2 - distance
    seq[rows, answer_at - 1] = cue
    seq[:, -1] = query
    return seq, seq[rows, answer_at]


def batch_for(step: int, seed: int, cfg: dict) -> tuple[Tensor, Tensor]:
    """Training batch ``step``: the same for every model (its own generator, seeded from ``seed`` and
    ``step``). Its length is drawn from ``min_len .. max_distance + 3``, its distances uniformly from
    ``0`` to the most that length holds."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    longest = int(torch.randint(cfg["min_len"] - 3, cfg["max_distance"] + 1, (1,), generator=gen))
    distance = torch.randint(longest + 1, (cfg["batch_size"],), generator=gen)
    return make_batch(distance, cfg["num_values"], longest, gen)


# --------------------------------------------------------------------------- models

class Recurrent(nn.Module):
    """Embedding -> ``nn.RNN`` or ``nn.LSTM`` (one layer, batch-first) -> classifier on the last state."""

    def __init__(self, cell: type[nn.RNN] | type[nn.LSTM], *, vocab_size: int, embed_dim: int, hidden: int,
                 num_classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.rnn = cell(embed_dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, seq: Tensor) -> Tensor:
        """``seq [B, L]`` -> logits ``[B, num_classes]`` read at the last position."""
        out, _ = self.rnn(self.embed(seq))  # (B, L, hidden)
        return self.head(out[:, -1])


class WindowMLP(nn.Module):
    """The feed-forward network that came before recurrence (Bengio et al. 2003): the embeddings of the
    last ``window`` tokens, concatenated, -> a hidden layer -> classifier. It sees nothing farther back:
    the cue must lie in the window, so it can answer at distances up to ``window - 3``.

    Not one of the app's :data:`MODELS` (the recall run trains and saves those three); ``attnkit lab
    before_attention`` trains it beside them on the same batches.
    """

    def __init__(self, *, vocab_size: int, embed_dim: int, window: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.window = window
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.mlp = nn.Sequential(nn.Linear(window * embed_dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, seq: Tensor) -> Tensor:
        """``seq [B, L]`` -> logits ``[B, num_classes]`` from the last ``window`` tokens (zeros before the start)."""
        x = self.embed(seq[:, -self.window:])  # (B, min(L, window), E)
        x = F.pad(x, (0, 0, self.window - x.shape[1], 0))  # (B, window, E): a short sequence padded on the left
        return self.mlp(x.flatten(1))


class Attention(nn.Module):
    """Token embeddings -> pre-norm causal self-attention layers with ALiBi -> classifier at the last position.

    Causal, so that a position's closest keys are the ones before it: the token after the cue is
    the one whose nearest earlier key is the cue. Any length works (ALiBi has no position table).
    """

    def __init__(self, *, vocab_size: int, embed_dim: int, num_heads: int, num_layers: int, ffn_dim: int,
                 num_classes: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, embed_dim)
        self.encoder = TransformerEncoder(
            [TransformerEncoderLayer(embed_dim, num_heads, ffn_dim=ffn_dim, dropout=0.0, norm_first=True,
                                     position_bias=ALiBi(num_heads)) for _ in range(num_layers)],
            norm=nn.LayerNorm(embed_dim))
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self, seq: Tensor) -> Tensor:
        """``seq [B, L]`` -> logits ``[B, num_classes]`` read at the last position."""
        return self.head(self.encoder(self.tok(seq), is_causal=True)[:, -1])  # (B, L, E) -> last


def build_one(name: str, config: dict) -> nn.Module:
    """Model ``name`` (one of :data:`MODELS`, or ``"MLP"``: :class:`WindowMLP`, which needs ``mlp_window``
    and ``mlp_hidden``) with a checkpoint config's sizes."""
    vocab, classes = config["num_values"] + 2, config["num_values"]
    if name == "RNN":
        return Recurrent(nn.RNN, vocab_size=vocab, embed_dim=config["embed_dim"], hidden=config["rnn_hidden"],
                         num_classes=classes)
    if name == "LSTM":
        return Recurrent(nn.LSTM, vocab_size=vocab, embed_dim=config["embed_dim"], hidden=config["lstm_hidden"],
                         num_classes=classes)
    if name == "MLP":
        return WindowMLP(vocab_size=vocab, embed_dim=config["embed_dim"], window=config["mlp_window"],
                         hidden=config["mlp_hidden"], num_classes=classes)
    if name == "attention":
        return Attention(vocab_size=vocab, embed_dim=config["embed_dim"], num_heads=config["attn_heads"],
                         num_layers=config["attn_layers"], ffn_dim=config["attn_ffn"], num_classes=classes)
    raise ValueError(f"name must be one of {', '.join(MODELS)} or MLP, got {name!r}")


def build(config: dict) -> nn.ModuleDict:
    """The three models of a checkpoint, by name."""
    return nn.ModuleDict({name: build_one(name, config) for name in MODELS})


#: What :func:`load` checks in ``config.json`` against the weights before building.
FIELDS = {
    "num_values": _common.size("RNN.head.weight", 0),
    "embed_dim": _common.size("RNN.embed.weight", 1),
    "rnn_hidden": _common.size("RNN.head.weight", 1),
    "lstm_hidden": _common.size("LSTM.head.weight", 1),
    "attn_heads": _common.heads("embed_dim"),
    "attn_layers": _common.layers("attention.encoder.layers"),
    "attn_ffn": _common.size("attention.encoder.layers.0.ff.linear1.weight", 0),
}


def load(dir: str | Path) -> nn.ModuleDict:
    """The three models saved by :func:`run` into ``dir``, by name (``models["LSTM"]``...), checked
    first (:func:`attnkit.apps._common.load`)."""
    return _common.load(dir, build, FIELDS)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- evaluation

def test_set(cfg: dict) -> dict[int, tuple[Tensor, Tensor]]:
    """``eval_per_distance`` held-out sequences at each distance of ``eval_distances``."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    return {d: make_batch(torch.full((cfg["eval_per_distance"],), d), cfg["num_values"], cfg["max_distance"], gen)
            for d in cfg["eval_distances"]}


@torch.no_grad()
def accuracy(model: nn.Module, seq: Tensor, answer: Tensor) -> float:
    return float((model(seq).argmax(-1) == answer).float().mean())


def step_seconds(models: dict[str, nn.Module], length: int, batch_size: int, num_values: int, *,
                 repeat: int) -> dict[str, float]:
    """Median wall-clock seconds of one training step (forward, backward, AdamW) of each model on
    ``[batch_size, length]`` sequences, measured round-robin so a busy moment hits all alike."""
    from ..bench._util import interleaved_medians

    seq = torch.randint(num_values + 2, (batch_size, length), generator=torch.Generator().manual_seed(0))
    answer = torch.randint(num_values, (batch_size,), generator=torch.Generator().manual_seed(1))

    def step_of(model: nn.Module):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # the rate does not change the time

        def step() -> None:
            loss = F.cross_entropy(model(seq), answer)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    return interleaved_medians({name: step_of(m.train()) for name, m in models.items()}, repeat=repeat, warmup=2)


# --------------------------------------------------------------------------- pictures

_STYLES = ({"marker": "o", "lw": 4, "ms": 9, "alpha": 0.6}, {"marker": "s", "lw": 3, "ms": 7, "alpha": 0.8},
           {"marker": "^", "lw": 1.5, "ms": 5, "ls": "--"})


def draw_accuracy(acc: dict[str, dict[int, float]], chance: float, steps: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # Wide solid lines under thin dashed ones: equal curves (two models at 100%) stay both visible.
    for (name, by_d), style in zip(acc.items(), _STYLES, strict=False):
        ax.plot(list(by_d), [100 * a for a in by_d.values()], label=name, **style)
    ax.axhline(100 * chance, color="grey", ls=":", label=f"chance ({chance:.0%})")
    ax.set_xlabel("distance (tokens between the answer and the query)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"Recall after {steps} training steps")
    ax.legend(fontsize=8)
    return fig


def draw_step_time(times: dict[int, dict[str, float]], cpu: str, threads: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lengths = list(times)
    for name, style in zip(MODELS, _STYLES, strict=True):
        ax.plot(lengths, [1e3 * times[n][name] for n in lengths], label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("ms per training step")
    ax.set_title(f"{cpu}, {threads} thread(s)", fontsize=9)
    ax.legend(fontsize=8)
    return fig


# --------------------------------------------------------------------------- run

def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True) -> Result:
    """Train the RNN, the LSTM and the attention model on the same batches, score each at every
    distance, time a training step at each length; save the three models and the plots in ``out``."""
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    out = Path(out)
    config = {k: cfg[k] for k in MODEL_KEYS}
    with Timer() as total:
        tests = test_set(cfg)
        models, losses, train_seconds = {}, {}, {}
        for i, name in enumerate(MODELS):
            _common.seed_all(seed * len(MODELS) + i)  # each model's own initialisation
            models[name] = build_one(name, config)

            def loss_fn(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
                seq, answer = batch
                return F.cross_entropy(m(seq), answer)

            with Timer() as t:
                losses[name] = _common.fit(models[name], lambda step: batch_for(step, seed, cfg), loss_fn,
                                           steps=cfg["steps"], lr=cfg["lr"][name], warmup=cfg["warmup"],
                                           desc=f"recall {name}", progress=progress)
            train_seconds[name] = t.seconds
        acc = {name: {d: accuracy(m, *tests[d]) for d in cfg["eval_distances"]} for name, m in models.items()}
        _common.save(out, nn.ModuleDict(models), config)

        threads, cpu = torch.get_num_threads(), cpu_name()
        times = {}
        for n in cfg["time_lengths"]:
            fresh = {name: build_one(name, config) for name in MODELS}
            times[n] = step_seconds(fresh, n, cfg["batch_size"], cfg["num_values"], repeat=cfg["time_repeat"])
        pictures = [save_png(draw_accuracy(acc, 1 / cfg["num_values"], cfg["steps"]), out / "recall_accuracy.png"),
                    save_png(draw_step_time(times, cpu, threads), out / "recall_step_time.png")]

    params = {name: param_count(m) for name, m in models.items()}
    near, far = cfg["eval_distances"][0], cfg["eval_distances"][-1]
    metrics: dict = {"steps": cfg["steps"], "sequence length": cfg["max_distance"] + 3,
                     "chance accuracy": 1 / cfg["num_values"]}
    for name in MODELS:
        metrics[f"{name} parameters"] = params[name]
        metrics[f"{name} accuracy at distance {near}"] = acc[name][near]
        metrics[f"{name} accuracy at distance {far}"] = acc[name][far]
        metrics[f"{name} final loss (mean of 50)"] = float(np.mean(losses[name][-50:]))
        metrics[f"{name} train seconds"] = train_seconds[name]
    metrics["final_loss"] = sum(float(np.mean(losses[name][-50:])) for name in MODELS)
    labels = {"steps": "Training steps", "sequence length": "Sequence length (tokens)",
              "chance accuracy": "Chance accuracy",
              "final_loss": "Final training loss, the three models summed (nats, each a mean of the last 50 steps)"}
    shown = {name: name[:1].upper() + name[1:] for name in MODELS}  # as a label or column starts
    for name in MODELS:
        labels |= {f"{name} train seconds": f"{shown[name]} training seconds",
                   f"{name} final loss (mean of 50)": f"{shown[name]} final training loss (nats, mean of the last "
                                                      "50 steps)",
                   **{f"{name} {what}": f"{shown[name]} {what}" for what in (
                       "parameters", f"accuracy at distance {near}", f"accuracy at distance {far}")}}
    acc_rows = [{"Distance": d, **{shown[name]: acc[name][d] for name in MODELS}} for d in cfg["eval_distances"]]
    time_rows = [{"Length": n, **{f"{shown[name]} (ms)": 1e3 * times[n][name] for name in MODELS},
                  "Attention / LSTM": times[n]["attention"] / times[n]["LSTM"]} for n in cfg["time_lengths"]]
    sections = [
        Section("Accuracy against distance",
                f"{cfg['eval_per_distance']} held-out sequences per distance, {cfg['num_values']} values (chance "
                f"{1 / cfg['num_values']:.1%}), {cfg['max_distance'] + 3} tokens long. Each model trained "
                f"{cfg['steps']} steps of {cfg['batch_size']} sequences ({cfg['min_len']} to "
                f"{cfg['max_distance'] + 3} tokens long), the same batches, AdamW at peak learning rates "
                + ", ".join(f"{name} {cfg['lr'][name]:g}" for name in MODELS) + ". Parameters: "
                + ", ".join(f"{name} {params[name]:,}" for name in MODELS)
                + f".\n\n{_verdict(acc, cfg)}",
                table=acc_rows, images=[pictures[0]]),
        Section("Time per training step against length",
                f"Median wall-clock time of one training step (forward, backward, AdamW) on {cfg['batch_size']} "
                f"sequences, on {cpu} with {threads} thread(s), {cfg['time_repeat']} timed steps per cell after 2 "
                "warm-up steps, the three models in turn. A benchmark of this run on this machine, not a "
                "guarantee: other work on the machine slows every cell.",
                table=time_rows, images=[pictures[1]]),
    ]
    return Result("recall", metrics, total.seconds, sections, labels)


def _verdict(acc: dict[str, dict[int, float]], cfg: dict) -> str:
    near, far = cfg["eval_distances"][0], cfg["eval_distances"][-1]
    said = "; ".join(f"{name} {acc[name][near]:.0%} at distance {near}, {acc[name][far]:.0%} at {far}"
                     for name in MODELS)
    # "Falls": more than 10 points lower at the farthest distance than at the nearest.
    lstm_falls, attn_falls = (acc[name][far] < acc[name][near] - 0.1 for name in ("LSTM", "attention"))
    found = {(True, False): "The LSTM's accuracy falls with distance where attention's does not.",
             (False, False): "Neither the LSTM's nor attention's accuracy falls with distance.",
             (True, True): "Both the LSTM's and attention's accuracy fall with distance.",
             (False, True): "Attention's accuracy falls with distance and the LSTM's does not."}[lstm_falls, attn_falls]
    return (f"Held-out accuracy: {said}. {found} This is what {cfg['steps']} steps at these sizes reached, "
            "one seed; a longer budget moves every curve (\"falls\": more than 10 points lower at the "
            "farthest distance than at the nearest).")
