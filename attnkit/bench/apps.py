"""Applications suite: train every ``attnkit.apps`` task with its defaults and check it against its target.

Not a timing race like the other suites: each task trains from scratch (the ViT with three seeds,
since its target is a mean), and the table says what each reached, the target, whether it was met,
and how many seconds each run took, against the task's time budget. A task that is not in
this version is listed with a note instead of stopping the suite. Checkpoints, pictures and
reports go to ``out_dir/apps/<task>/seed<N>/``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from statistics import mean

import torch

from ..apps import TASKS
from ._util import markdown_table, progress, write_report

#: Most seconds one training run may take.
SECONDS_TARGET = 180.0

Metrics = dict[str, float | int | str]


def _vit(runs: list[Metrics]) -> tuple[str, bool]:
    vit, cnn = mean(m["vit_acc"] for m in runs), mean(m["cnn_acc"] for m in runs)
    seeds = f"mean of {len(runs)} seeds" if len(runs) > 1 else "one seed"
    return f"ViT {vit:.1%}, CNN {cnn:.1%} (test accuracy, {seeds})", vit >= 0.96


def _caption(runs: list[Metrics]) -> tuple[str, bool]:
    (m,) = runs
    exact, placed = m["exact_caption"], m["attention_on_digit"]
    return f"exact caption {exact:.1%}, attention on the digit {placed:.1%}", exact >= 0.9 and placed >= 0.9


def _translate(runs: list[Metrics]) -> tuple[str, bool]:
    m, rnn = runs  # the Transformer, then the RNN baseline (VARIANTS)
    greedy = m["greedy_exact"]
    beam = next(v for k, v in m.items() if k.startswith("beam") and k.endswith("_exact"))
    return (f"{m['pairs']}: Transformer greedy {greedy:.1%}, beam {beam:.1%} (exact match), character similarity "
            f"{m['greedy_chars']:.3f}; RNN with additive attention greedy {rnn['greedy_exact']:.1%}, character "
            f"similarity {rnn['greedy_chars']:.3f}"), greedy >= 0.98 and beam >= greedy


def _spread(m: Metrics, key: str) -> str:
    return f"{m[key]:.1%} ± {m[key + ' sd']:.1%}"


def _graph(runs: list[Metrics]) -> tuple[str, bool]:
    (m,) = runs
    acc = {k: m[f"{k} accuracy"] for k in ("gat", "mean", "mlp")}
    return (f"test accuracy over {m['seeds']} seeds, {m['test nodes']} test nodes: graph attention "
            f"{_spread(m, 'gat accuracy')}, neighbour averaging {_spread(m, 'mean accuracy')}, MLP without edges "
            f"{_spread(m, 'mlp accuracy')}; first-layer attention evenness {m['evenness']:.3f}"), (
        acc["gat"] > acc["mlp"] and acc["mean"] > acc["mlp"])


def _forecast(runs: list[Metrics]) -> tuple[str, bool]:
    (m,) = runs
    layers = sorted(int(k.rsplit(" ", 1)[1]) for k in m if k.startswith("season ratio layer "))
    season = ", ".join(f"layer {i} {m[f'season ratio layer {i}']:.2f}x ({m[f'season band ratio layer {i}']:.2f}x "
                       "within a month)" for i in layers)
    return (f"MAE over 12 months ahead (ppm, mean of {m['seeds']} seeds): Transformer {m['transformer MAE']:.3f}, "
            f"LSTM {m['lstm MAE']:.3f}, seasonal naive {m['naive MAE']:.3f}; weight at lags 12, 24, ...: {season}"), (
        m["transformer MAE"] < m["naive MAE"])


def _tag(runs: list[Metrics]) -> tuple[str, bool]:
    (m,) = runs
    acc = {k: m[f"accuracy {k}"] for k in ("Transformer tagger", "per-token majority", "majority tag")}
    return (f"per-token accuracy on {m['test tokens']:,} held-out tokens: tagger {acc['Transformer tagger']:.1%}, "
            f"per-token majority {acc['per-token majority']:.1%}, majority tag {acc['majority tag']:.1%}"), (
        acc["Transformer tagger"] > acc["per-token majority"])


def _classify(runs: list[Metrics]) -> tuple[str, bool]:
    (m,) = runs
    att, bow = m["attention pooling accuracy"], m["bag-of-words LR accuracy"]
    return (f"attention pooling {att:.1%}, bag of words {bow:.1%} ({m['data set']}, "
            f"{m['train sentences']:,} + {m['test sentences']:,} sentences)"), att > bow


def _recommend(runs: list[Metrics]) -> tuple[str, bool]:
    (m,) = runs
    ours, pop = m["HR@10 SASRec (causal self-attention)"], m["HR@10 most popular"]
    trans = m["HR@10 last-item transitions"]
    return (f"hit rate@10 {ours:.1%}, most popular {pop:.1%}, last-item transitions {trans:.1%}",
            ours >= 2 * pop and ours > trans)


def _lm(runs: list[Metrics]) -> tuple[str, bool]:
    (m,) = runs
    ppl = {name: m[f"validation perplexity per char, {name}"] for name in ("GPT", "trigram", "bigram")}
    return (f"validation perplexity per char: GPT {ppl['GPT']:.2f}, trigram {ppl['trigram']:.2f}, bigram "
            f"{ppl['bigram']:.2f}; best previous-token score {m['previous-token score']:.2f}, induction "
            f"{m['induction score']:.2f} (random characters repeated), "
            f"{m['induction score, held-out text repeated']:.2f} (held-out text repeated)"), ppl["GPT"] < ppl["trigram"]


def _recall(runs: list[Metrics]) -> tuple[str, bool]:
    (m,) = runs
    far = max(int(k.rsplit(" ", 1)[1]) for k in m if k.startswith("attention accuracy at distance "))
    acc = {name: m[f"{name} accuracy at distance {far}"] for name in ("attention", "LSTM", "RNN")}
    return (f"accuracy at distance {far}: " + ", ".join(f"{name} {a:.1%}" for name, a in acc.items()),
            acc["attention"] >= 0.95)


def vit_by_share(runs: list[Metrics]) -> str:
    """The ViT against the CNN at each share of the training images, over the ViT runs (one per seed):
    each model's mean test accuracy with its lowest and highest run, the CNN's lead, and the trend in
    words (:func:`attnkit.apps.vit.trend`). Empty when the runs do not report the shares."""
    from ..apps.vit import DEFAULTS, trend

    def key(model: str, share: float) -> str:
        return f"{model}_acc" if share == 1.0 else f"{model}_acc_{share:.0%}"

    shares = sorted(DEFAULTS["fractions"])
    if not all(key(m, f) in r for r in runs for m in ("vit", "cnn") for f in shares):
        return ""

    def spread(values: list[float], fmt: str) -> str:
        return (f"{format(mean(values), fmt)} ({format(min(values), fmt)} to {format(max(values), fmt)})"
                if len(values) > 1 else format(values[0], fmt))

    rows, leads = [], {}
    for f in shares:
        vit, cnn = ([r[key(m, f)] for r in runs] for m in ("vit", "cnn"))
        leads[f] = [100 * (c - v) for c, v in zip(cnn, vit, strict=True)]
        rows.append([f"{f:.0%}", spread(vit, ".1%"), spread(cnn, ".1%"), spread(leads[f], "+.1f")])
    said = trend(leads)
    return ("\n\n## ViT against a CNN by share of the training images\n\n"
            f"Test accuracy on the same held-out digits, mean of {len(runs)} runs (seeds) with the lowest and "
            "highest run in brackets; the CNN's lead is its accuracy minus the ViT's, in points.\n\n"
            + markdown_table(["share of the training images", "ViT", "CNN", "CNN lead (points)"], rows)
            + f"\n\n{said[0].upper()}{said[1:]}")


#: task -> (the target in words, seeds to run, judge(metrics of each seed) -> (what was reached, met?)).
TARGETS: dict[str, tuple[str, tuple[int, ...], Callable[[list[Metrics]], tuple[str, bool]]]] = {
    "vit": ("test accuracy >= 96% (mean of 3 seeds), CNN beside it", (0, 1, 2), _vit),
    "caption": ("exact caption >= 90%, strongest patch on the digit >= 90%", (0,), _caption),
    "translate": ("French -> German numbers: greedy exact match >= 98%, beam no worse; the RNN beside it", (0,),
                  _translate),
    "classify": ("attention pooling beats bag of words", (0,), _classify),
    "recommend": ("hit@10 >= 2x most-popular and > transition", (0,), _recommend),
    "lm": ("validation perplexity per character below the smoothed trigram's", (0,), _lm),
    "recall": ("attention >= 95% at the farthest distance; the LSTM and RNN beside it", (0,), _recall),
    "graph": ("both graph models above the MLP that ignores edges; attention against averaging as measured", (0,),
              _graph),
    "forecast": ("Transformer MAE below the seasonal naive forecast's; the LSTM beside it", (0,), _forecast),
    "tag": ("per-token accuracy above the per-token majority's", (0,), _tag),
}
#: Tasks run more than once per seed, with these keyword arguments each (the judge gets the runs in
#: this order); a task not listed runs once, with its defaults.
VARIANTS: dict[str, tuple[dict, ...]] = {"translate": ({}, {"model": "rnn"})}


def run(quick: bool, out_dir: Path, tasks: tuple[str, ...] | None = None) -> str:
    """Train, judge, print and write ``out_dir/apps.md``; return the report. ``tasks``: only these
    (default: every one of :data:`TASKS`)."""
    say = progress("apps")
    rows, notes, sections = [], [], []
    for name in TASKS if tasks is None else tasks:
        target, seeds, judge = TARGETS[name]
        try:
            task = importlib.import_module(f"attnkit.apps.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"attnkit.apps.{name}":
                raise
            rows.append([name, "not in this version", target, "-", "-"])
            continue
        seeds = seeds[:1] if quick else seeds
        results = []
        for seed in seeds:
            for kwargs in VARIANTS.get(name, ({},)):
                say(f"{name}, seed {seed}" + "".join(f", {k} {v}" for k, v in kwargs.items()))
                folder = "-".join([f"seed{seed}", *map(str, kwargs.values())])
                results.append(task.run(out=out_dir / "apps" / name / folder, seed=seed, quick=quick, progress=False,
                                        **kwargs))
        try:
            reached, met = judge([r.metrics for r in results])
        except KeyError as e:
            reached, met = f"metric {e} not reported", None
        secs = [r.seconds for r in results]
        slow = max(secs) > SECONDS_TARGET
        verdict = "-" if met is None else ("yes" if met and not slow else "no")
        if slow:
            notes.append(f"{name} took {max(secs):.0f} s, above the {SECONDS_TARGET:.0f} s target")
        rows.append([name, reached, target, verdict, " / ".join(f"{s:.0f}" for s in secs)])
        if name == "vit":
            sections.append(vit_by_share([r.metrics for r in results]))
    body = (markdown_table(["task", "reached", "target", "met?", "seconds per run"], rows)
            + f"\n\nEach run trains from scratch with the task's defaults on {torch.get_num_threads()} "
            f"thread(s); a target is met only if every run also took <= {SECONDS_TARGET:.0f} s. Runs on a "
            "machine shared with other work take longer; the seconds say what this run saw."
            + ("\n\nQuick mode: the tiny test sizes and one seed, so the targets are not expected to be met."
               if quick else "")
            + "".join(f"\n- {n}" for n in notes)
            + "".join(sections))
    cmd = ("attnkit bench apps" + (" --quick" if quick else "") if tasks is None
           else f'python -c "from attnkit.bench import apps; apps.run({quick}, OUT, tasks={tuple(tasks)!r})"')
    return write_report(out_dir, "apps", "Applications: what each task reaches, against its target", body, cmd)
