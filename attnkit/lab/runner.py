"""What ``attnkit.lab`` offers, behind its ``__init__``: the experiments' registry
(:data:`EXPERIMENTS`), what one finds (:class:`Finding`), running one (:func:`run_one`, which
imports the experiment's module only then) and the report of several (:func:`write_report`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

VERDICTS = ("supported", "refuted", "depends")
"""The verdicts a :class:`Finding` may give."""

EXPERIMENTS: dict[str, tuple[str, str]] = {
    "scaling": ("scaling", "Dividing scores by sqrt(d_k) keeps the softmax out of saturation"),
    "projections": ("projections", "Without Q/K/V projections each word attends mostly to itself"),
    "sharing": ("sharing", "Sharing Q = K makes the scores symmetric; sharing K = V saves parameters"),
    "score_functions": ("score_functions", "Dot-product vs additive vs multiplicative scores"),
    "cost": ("cost", "Self-attention costs O(n^2 d); more heads do not add FLOPs"),
    "rnn_conv": ("rnn_conv", "Self-attention vs recurrent and convolutional layers"),
    "positions": ("positions", "Without positions attention ignores order; sinusoids encode offsets linearly"),
    "output_projection": ("output_projection", "The output projection W_O is indispensable"),
    "heads": ("heads", "Heads of a trained model specialise"),
    "heads_vs_one": ("heads_vs_one", "Many heads beat one head of the same width"),
    "init": ("init", "Zero initialisation leaves heads identical; Xavier breaks the symmetry"),
    "conv_attention": ("conv_attention", "A convolution is a special case of self-attention"),
    "before_attention": ("before_attention", "Before attention: window MLP, RNN (vanishing and exploding "
                                             "gradients), LSTM"),
}
"""Experiment name -> (its module here, the claim in one line), in the order the report shows them."""


@dataclass
class Finding:
    """What one experiment found.

    Args:
        name: the experiment's key in :data:`EXPERIMENTS`.
        claim: the claim tested, in words.
        figures: the measured numbers, by key (floats, ints, short strings, or mappings and lists
            of them); the keys are for code, the report shows ``labels``.
        verdict: ``supported``, ``refuted`` or ``depends``.
        why: one sentence explaining the verdict.
        pictures: PNG files written into the output folder.
        seconds: how long the experiment took.
        labels: what the report calls each figure key, and each key inside a figure that is a
            mapping (a table's column, a dictionary's entry): words with units, such as
            ``"Jacobian trace, unscaled (d_k = 4096)"``. A key without one is shown with its
            underscores as spaces (:func:`attnkit.viz.report.label`).
    """

    name: str
    claim: str
    figures: dict[str, object]
    verdict: str
    why: str
    pictures: list[Path] = field(default_factory=list)
    seconds: float = 0.0
    labels: dict[object, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {self.verdict!r}")


def check_names(names: list[str]) -> list[str]:
    """``names`` in registry order (all of them when empty); ``ValueError`` naming any unknown one."""
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"unknown experiment {', '.join(map(repr, unknown))}; expected some of: "
                         f"{', '.join(EXPERIMENTS)}")
    return [n for n in EXPERIMENTS if not names or n in names]


def run_one(name: str, *, quick: bool, out: Path) -> Finding:
    """Run the experiment ``name``, writing its pictures into ``out``.

    ``out`` is created if missing; an existing one must be the user's own and not writable by
    others (:func:`attnkit._io.own_folder`, which raises ``ValueError`` saying why not). Every
    file is written whole or not at all, replacing (never writing through) a link in its place.

    It runs on one thread: the experiments' tensors are small, so on a shared machine extra
    threads mostly wait for each other, and one thread keeps the timings comparable.
    """
    import time

    import torch

    from .._io import own_folder

    check_names([name])
    out = own_folder(out)
    module = importlib.import_module(f".{EXPERIMENTS[name][0]}", __package__)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        finding = module.run(quick, out)
        finding.seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return finding


def verdict_table(findings: list[Finding]) -> list[dict[str, object]]:
    """One row per finding: experiment (its name), verdict, seconds and why, for printing (the
    report shows the claims' titles instead: :func:`write_report`)."""
    return [{"experiment": f.name, "verdict": f.verdict, "seconds": round(f.seconds, 1), "why": f.why}
            for f in findings]


def _shown(value: object, labels: Mapping[object, str]) -> object:
    """``value`` with every mapping key inside it replaced by its label (:func:`attnkit.viz.report.label`)."""
    from ..viz.report import label

    if isinstance(value, Mapping):
        return {label(k, labels): _shown(v, labels) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_shown(v, labels) for v in value]
    return value


def _is_rows(value: object) -> bool:
    return isinstance(value, list | tuple) and bool(value) and all(isinstance(v, Mapping) for v in value)


def write_report(findings: list[Finding], out: Path, *, quick: bool) -> Path:
    """``out/report.html``: the verdict table, then each experiment's claim, verdict, figures and
    pictures. Figures appear under their :attr:`Finding.labels`; one that is a list of rows (a
    table of its own) gets its own section after the experiment's."""
    from ..viz import report
    from ..viz.report import label

    intro = ("Each claim that tutorials make about attention, tested by a small experiment"
             + (" (quick settings: fewer steps and sizes)." if quick else "."))
    sections = [report.Section("Verdicts", intro, table=[
        {"Experiment": EXPERIMENTS[f.name][1], "Verdict": f.verdict, "Seconds": round(f.seconds, 1)}
        for f in findings])]
    for f in findings:
        title = EXPERIMENTS[f.name][1]
        tables = {k: v for k, v in f.figures.items() if _is_rows(v)}
        figures = [{"Figure": label(k, f.labels), "Value": _shown(v, f.labels)}
                   for k, v in f.figures.items() if k not in tables]
        sections.append(report.Section(title, f"Claim: {f.claim}\n\nVerdict: {f.verdict}. {f.why}\n\n"
                                              f"Run alone: attnkit lab {f.name}", table=figures, images=f.pictures))
        sections += [report.Section(f"{title}: {label(k, f.labels)}", table=_shown(v, f.labels))
                     for k, v in tables.items()]
    return report.write_report(Path(out) / "report.html", "attnkit lab", sections)
