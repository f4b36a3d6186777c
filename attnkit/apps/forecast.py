"""Attention for time series: a causal Transformer forecasts monthly CO2 at Mauna Loa, beside an LSTM
and the seasonal-naive forecast.

Data: the weekly atmospheric CO2 readings at Mauna Loa, March 1958 to December 2001, as statsmodels
ships them (``statsmodels/datasets/co2/co2.csv``; only the file is read, statsmodels is not
imported), averaged per calendar month from May 1964 on: the first month from which no month is
missing, so nothing is filled in. A rising trend with a yearly cycle of about 6 ppm. The last
:data:`TEST_MONTHS` months are the held-out tail.

Task: from the last ``context`` months, forecast the next 12. Every month of the tail is an origin
(rolling origin): the models see the true months before it and forecast the 12 after it, as far as
the tail goes; MAE and RMSE are over every (origin, month ahead) pair, in ppm.

Models, each predicting the next month at every position of its window (teacher forcing, trained
on windows of the series before the tail) and forecasting 12 months by feeding its own forecasts
back in; the window is shifted so that its first month is 0 and scaled by the spread of the
training months' year-on-year changes (so a trend and a season look the same wherever they lie):

* a causal Transformer: each month's value and a learned position -> causal
  :class:`attnkit.modules.TransformerEncoderLayer` (a month sees only the months before it);
* ``nn.LSTM`` of about the same number of parameters, same data, loss, optimiser and schedule;
* seasonal naive: each month as the same month a year before (no training).

Does the attention find the season? The last position's weights over the context, while it
predicts the next month, averaged over heads and the tail's origins, as a function of the lag
(how many months before the predicted month the attended month lies): the weight at lags 12, 24,
36... against the mean weight at the other lags.
"""

from __future__ import annotations

import csv
import importlib.util
import statistics
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

PERIOD = 12  # months
HORIZON = 12  # months forecast from each origin
TEST_MONTHS = 120  # the held-out tail: 1992-2001
FIRST_MONTH = "196405"  # from here on no month is missing
MODELS = ("transformer", "lstm")
MODEL_NAMES = {"transformer": "causal Transformer", "lstm": "LSTM", "naive": "seasonal naive"}

DEFAULTS: dict = {"steps": 1500, "lr": 3e-3, "warmup": 100, "batch_size": 32, "context": 48, "embed_dim": 32,
                  "num_heads": 4, "num_layers": 2, "ffn_dim": 64, "dropout": 0.1, "lstm_hidden": 44, "seeds": 3}
QUICK: dict = {"steps": 80, "warmup": 10, "embed_dim": 16, "num_heads": 2, "num_layers": 1, "ffn_dim": 32,
               "lstm_hidden": 20, "seeds": 1}

# ----------------------------------------------------------------------------------------- data


def co2_monthly() -> tuple[list[str], Tensor]:
    """``(months "YYYYMM", monthly mean CO2 in ppm [N])`` from :data:`FIRST_MONTH` to December 2001.

    Raises:
        ModuleNotFoundError: statsmodels is not installed (``pip install 'attnkit[apps]'``).
    """
    spec = importlib.util.find_spec("statsmodels")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the CO2 series ships with statsmodels", name="statsmodels")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "co2" / "co2.csv"
    sums: dict[str, list[float]] = {}
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["co2"] and row["date"][:6] >= FIRST_MONTH:
                sums.setdefault(row["date"][:6], []).append(float(row["co2"]))
    months = sorted(sums)
    return months, torch.tensor([sum(v) / len(v) for v in (sums[m] for m in months)], dtype=torch.float64)


def scale_of(train: Tensor) -> float:
    """The spread (standard deviation) of the training months' changes over a year: the unit a
    window is scaled by."""
    return float((train[PERIOD:] - train[:-PERIOD]).std())


def normalise(windows: Tensor, scale: float) -> Tensor:
    """Each window ``[..., L]`` shifted so that its first value is 0, divided by ``scale``."""
    return (windows - windows[..., :1]) / scale

# ---------------------------------------------------------------------------------------- models


class Forecaster(nn.Module):
    """A causal Transformer over a window of values ``[B, L]`` -> the next value at each position ``[B, L]``."""

    def __init__(self, *, context: int, embed_dim: int, num_heads: int, num_layers: int, ffn_dim: int,
                 dropout: float) -> None:
        super().__init__()
        self.embed = nn.Linear(1, embed_dim)
        self.pos = nn.Embedding(context, embed_dim)
        self.encoder = TransformerEncoder(
            [TransformerEncoderLayer(embed_dim, num_heads, ffn_dim=ffn_dim, dropout=dropout, norm_first=True)
             for _ in range(num_layers)], norm=nn.LayerNorm(embed_dim))
        self.head = nn.Linear(embed_dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x[..., None]) + self.pos(torch.arange(x.shape[1], device=x.device))  # (B, L, E)
        return self.head(self.encoder(h, is_causal=True))[..., 0]


class LSTMForecaster(nn.Module):
    """``nn.LSTM`` over a window of values ``[B, L]`` -> the next value at each position ``[B, L]``."""

    def __init__(self, *, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(1, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x[..., None])[0])[..., 0]


def build(config: dict) -> Forecaster | LSTMForecaster:
    """The model a checkpoint's ``config.json`` describes (``kind``: ``"transformer"`` or ``"lstm"``)."""
    if config.get("kind") == "lstm":
        return LSTMForecaster(hidden=config["lstm_hidden"])
    return Forecaster(**{k: config[k] for k in ("context", "embed_dim", "num_heads", "num_layers", "ffn_dim",
                                                "dropout")})


#: What :func:`load` checks in ``config.json`` against the Transformer's weights before building.
FIELDS = {
    "kind": _common.one_of("transformer"),
    "context": _common.size("pos.weight", 0),
    "embed_dim": _common.size("pos.weight", 1),
    "num_heads": _common.heads("embed_dim"),
    "num_layers": _common.layers("encoder.layers"),
    "ffn_dim": _common.size("encoder.layers.0.ff.linear1.weight", 0),
    "dropout": _common.probability(),
}


def load(dir: str | Path) -> Forecaster:
    """The Transformer saved by :func:`run` into ``dir`` (checked first: :func:`attnkit.apps._common.load`)
    with the scale it was trained at (``model.scale``)."""
    from ..models.checkpoint import read_json

    model = _common.load(dir, build, FIELDS)
    model.scale = float(read_json(Path(dir) / _common.CONFIG)["scale"])
    return model

# -------------------------------------------------------------------------------------- forecast


@torch.no_grad()
def forecast(model: nn.Module, context: Tensor, scale: float, horizon: int = HORIZON) -> Tensor:
    """``horizon`` months after each row of ``context [B, C]`` (ppm), each forecast fed back in
    as the next month's value; the window keeps its last ``C`` months. Returns ``[B, horizon]`` ppm."""
    window = context.clone()
    out = []
    for _ in range(horizon):
        base = window[:, :1]
        nxt = model(((window - base) / scale).float())[:, -1].double() * scale + base[:, 0]
        out.append(nxt)
        window = torch.cat([window[:, 1:], nxt[:, None]], dim=1)
    return torch.stack(out, dim=1)


def origins(n: int, tail: int = TEST_MONTHS, horizon: int = HORIZON) -> range:
    """Indices of the months forecast from: every month of the tail with ``horizon`` months after it."""
    return range(n - tail, n - horizon + 1)


def errors(pred: Tensor, truth: Tensor) -> tuple[float, float]:
    """``(MAE, RMSE)`` over every entry."""
    d = (pred - truth).double()
    return float(d.abs().mean()), float(d.pow(2).mean().sqrt())


def seasonal_naive(series: Tensor, starts: range, horizon: int = HORIZON) -> Tensor:
    """Each forecast month as the same month a year before: ``[len(starts), horizon]``."""
    return torch.stack([series[o - PERIOD:o - PERIOD + horizon] for o in starts])

# -------------------------------------------------------------------------------- train, measure


def train(kind: str, cfg: dict, series: Tensor, n_train: int, scale: float, seed: int) -> nn.Module:
    """One model of ``kind`` trained on windows of the first ``n_train`` months."""
    gen = _common.seed_all(seed)
    model = build({**cfg, "kind": kind})
    c = cfg["context"]
    train = series[:n_train]

    def batch(step: int) -> Tensor:
        starts = torch.randint(len(train) - c, (cfg["batch_size"],), generator=gen)
        return normalise(train[starts[:, None] + torch.arange(c + 1)], scale).float()  # (B, C + 1)

    def loss_fn(m: nn.Module, b: Tensor) -> Tensor:
        return F.mse_loss(m(b[:, :-1]), b[:, 1:])

    _common.fit(model, batch, loss_fn, steps=cfg["steps"], lr=cfg["lr"], warmup=cfg["warmup"],
                desc=f"forecast ({kind}, seed {seed})", progress=False)
    return model


@torch.no_grad()
def lag_profile(model: Forecaster, contexts: Tensor, scale: float) -> Tensor:
    """Each layer's weight of the last position on each lag ``[layers, C]``: entry ``[l, k - 1]`` is
    the weight on the month ``k`` months before the predicted one, mean over heads and rows of
    ``contexts [B, C]``."""
    with recorded_weights(m for m in model.modules() if isinstance(m, MultiHeadAttention)) as rec:
        model(normalise(contexts, scale).float())
    # The last position (index C - 1) predicts month C; key j lies C - j months before it.
    return torch.stack([calls[0][:, :, -1].mean((0, 1)).flip(0) for calls in rec])


def season_ratio(profile: Tensor, within: int = 0) -> float:
    """Mean weight at lags within ``within`` months of 12, 24, ... over the mean weight at the other
    lags (1: no preference). The farthest lag, the window's first month, is left out of both: every
    window is shifted to make it 0, so it is a reference point whatever the season."""
    lags = torch.arange(1, len(profile))  # 1 .. C - 1
    off = lags % PERIOD
    season = (torch.minimum(off, PERIOD - off) <= within) & (lags >= PERIOD - within)
    return float(profile[:-1][season].mean() / profile[:-1][~season].mean())

# -------------------------------------------------------------------------------------- pictures


def draw_forecasts(months: list[str], series: Tensor, starts: range, preds: dict[str, Tensor]):
    """The series' last years with the forecasts from every 12th origin of the tail."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    first = starts[0] - 3 * PERIOD
    year = [int(m[:4]) + (int(m[4:]) - 0.5) / 12 for m in months]
    ax.plot(year[first:], series[first:].tolist(), color="black", lw=1.2, label="measured")
    ax.axvline(year[starts[0]], color="grey", ls=":", lw=1)
    colours = {"transformer": "#d62728", "lstm": "#1f77b4", "naive": "#2ca02c"}
    for name, pred in preds.items():
        for k, o in enumerate(list(starts)[::PERIOD]):
            ax.plot(year[o:o + HORIZON], pred[k * PERIOD].tolist(), color=colours[name], lw=1.4,
                    ls="--" if name == "naive" else "-", label=MODEL_NAMES[name] if k == 0 else None)
    ax.set_xlabel("year")
    ax.set_ylabel("CO2 (ppm)")
    ax.set_title("Mauna Loa CO2, held-out tail: 12-month forecasts from each January-to-December origin")
    ax.legend(fontsize=8, frameon=False)
    return fig


def draw_lags(profile: Tensor):
    """Bars of each layer's weight per lag; lags 12, 24, ... in red."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    layers, c = profile.shape
    fig = Figure(figsize=(10, 2.2 * layers + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    lags = torch.arange(1, c + 1)
    for i in range(layers):
        ax = fig.add_subplot(layers, 1, i + 1)
        ax.bar(lags.tolist(), profile[i].tolist(), color=["#d62728" if k % PERIOD == 0 else "#999999"
                                                          for k in lags.tolist()])
        ax.axhline(1 / c, color="black", lw=0.8, ls=":")
        ax.set_ylabel(f"layer {i + 1}\nweight")
        ax.set_xlim(0.4, c + 0.6)
    ax.set_xlabel(f"lag: months before the predicted month (red: 12, 24, ...; dotted: uniform; lag {c}: the window's "
                  "first month, shifted to 0)")
    fig.suptitle("Attention of the last position over the context, mean over heads and the tail's origins",
                 fontsize=10)
    return fig

# ------------------------------------------------------------------------------------------- run


def _spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def run(*, out: Path, steps: int | None = None, seed: int = 0, quick: bool = False, progress: bool = True) -> Result:
    """Train the Transformer and the LSTM with seeds ``seed .. seed + seeds - 1``, forecast the tail
    from every origin, compare with the seasonal-naive forecast, save the Transformer of ``seed``
    and the two pictures into ``out``."""
    cfg = _common.settings(DEFAULTS, QUICK, quick=quick, steps=steps)
    out = Path(out)
    from tqdm.auto import tqdm

    with Timer() as total, one_thread():
        months, series = co2_monthly()
        n_train = len(series) - TEST_MONTHS
        scale = scale_of(series[:n_train])
        starts = origins(len(series))
        c = cfg["context"]
        contexts = torch.stack([series[o - c:o] for o in starts])
        truth = torch.stack([series[o:o + HORIZON] for o in starts])
        err: dict[str, list[tuple[float, float]]] = {k: [] for k in MODELS}
        preds, kept = {}, None
        for s in tqdm(range(seed, seed + cfg["seeds"]), desc="forecast", disable=not progress, leave=False):
            for kind in MODELS:
                model = train(kind, cfg, series, n_train, scale, s)
                pred = forecast(model, contexts, scale)
                err[kind].append(errors(pred, truth))
                if s == seed:
                    preds[kind] = pred
                    if kind == "transformer":
                        kept = model
        preds["naive"] = seasonal_naive(series, starts)
        naive = errors(preds["naive"], truth)
        config = {"kind": "transformer", "scale": scale, **{k: cfg[k] for k in (
            "context", "embed_dim", "num_heads", "num_layers", "ffn_dim", "dropout")}}
        _common.save(out, kept, config)
        profile = lag_profile(kept, contexts, scale)
        ratios = [season_ratio(p) for p in profile]
        near = [season_ratio(p, within=1) for p in profile]
        png_fc = save_png(draw_forecasts(months, series, starts, {k: preds[k] for k in ("naive", *MODELS)}),
                          out / "forecast.png")
        png_lag = save_png(draw_lags(profile), out / "forecast_attention.png")

    mae = {k: [e[0] for e in err[k]] for k in MODELS}
    rmse = {k: [e[1] for e in err[k]] for k in MODELS}
    peak = [int(p.argmax()) + 1 for p in profile]
    metrics: dict = {"months": len(series), "train months": n_train, "origins": len(starts),
                     "seeds": cfg["seeds"]}
    labels = {"months": "Months (May 1964 - December 2001)", "train months": "Training months",
              "origins": f"Forecast origins in the held-out tail ({HORIZON} months ahead each)",
              "seeds": "Seeds (each trains both models)"}
    for k in MODELS:
        metrics[f"{k} MAE"] = statistics.mean(mae[k])
        metrics[f"{k} RMSE"] = statistics.mean(rmse[k])
        labels[f"{k} MAE"] = f"MAE, {MODEL_NAMES[k]} (ppm, mean over seeds)"
        labels[f"{k} RMSE"] = f"RMSE, {MODEL_NAMES[k]} (ppm, mean over seeds)"
    metrics["naive MAE"], metrics["naive RMSE"] = naive
    labels |= {"naive MAE": "MAE, seasonal naive (ppm)", "naive RMSE": "RMSE, seasonal naive (ppm)"}
    for i, (r, q, p) in enumerate(zip(ratios, near, peak, strict=True)):
        metrics[f"season ratio layer {i + 1}"] = r
        metrics[f"season band ratio layer {i + 1}"] = q
        metrics[f"peak lag layer {i + 1}"] = p
        labels[f"season ratio layer {i + 1}"] = (f"Layer {i + 1}: mean weight at lags 12, 24, ... over the mean at "
                                                 f"other lags (seed {seed})")
        labels[f"season band ratio layer {i + 1}"] = (f"Layer {i + 1}: the same within one month of 12, 24, ... "
                                                      f"(seed {seed})")
        labels[f"peak lag layer {i + 1}"] = f"Layer {i + 1}: the lag with the most weight (months, seed {seed})"
    rows = [{"Model": MODEL_NAMES[k], "MAE (ppm)": _spread(mae[k]), "RMSE (ppm)": _spread(rmse[k])} for k in MODELS]
    rows.append({"Model": MODEL_NAMES["naive"], "MAE (ppm)": f"{naive[0]:.3f}", "RMSE (ppm)": f"{naive[1]:.3f}"})
    best = min(MODELS, key=lambda k: metrics[f"{k} MAE"])
    beats = metrics[f"{best} MAE"] < naive[0]
    found = [f"layer {i + 1} puts {r:.2f}x the mean weight of the other lags on lags 12, 24, ... and {q:.2f}x within "
             f"one month of them (its heaviest lag: {p})" for i, (r, q, p) in enumerate(zip(ratios, near, peak,
                                                                                              strict=True))]
    sections = [
        Section("Forecast error on the held-out tail",
                f"Monthly CO2 at Mauna Loa, {len(series)} months; the last {TEST_MONTHS} held out. From each of "
                f"{len(starts)} origins in the tail, {HORIZON} months forecast from the {c} before; errors in ppm over "
                f"every origin and month ahead, mean ± standard deviation over {cfg['seeds']} seed(s). Lowest MAE: the "
                f"{MODEL_NAMES[best]}, " + ("below" if beats else "not below") + " the seasonal naive forecast's.",
                table=rows, images=[png_fc]),
        Section("Does the attention find the season?",
                f"The Transformer of seed {seed}, its last position predicting the next month: " + "; ".join(found)
                + f". A ratio of 1 would be no preference for the same month of earlier years. Lag {c}, the window's "
                "first month, is left out of the ratios: every window is shifted to make it 0, so a model may read "
                "it as a reference point whatever the season.",
                images=[png_lag]),
    ]
    return Result("forecast", metrics, total.seconds, sections, labels)
