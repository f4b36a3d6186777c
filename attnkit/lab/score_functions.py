"""Score functions: scaled dot product vs multiplicative (Luong) vs additive (Bahdanau)."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from .. import approx
from ..functional import attention
from ._common import WIDTH, figure, save, train
from .runner import Finding

CLAIM = ("Dot-product scores q.k/sqrt(d) are cheaper than additive scores v.tanh(W_q q + W_k k) (they are one "
         "matrix product) and, scaled, as accurate; multiplicative scores q^T W k sit in between.")
KINDS = ("dot", "multiplicative", "additive")
#: Accuracy at or above which a score function has solved the task: if all do, the task cannot compare them.
CEILING = 0.99


class ScoredAttention(nn.Module):
    """Single-head self-attention ``[B, L, E] -> [B, L, E]`` with one of :data:`KINDS` as its score.

    The multiplicative and additive scores are :func:`attnkit.approx.attention`'s.

    * dot: ``q . k / sqrt(E)``.
    * multiplicative: ``q^T W k / sqrt(E)`` (Luong et al. 2015, "general").
    * additive: ``w . tanh(q + k)`` with ``q = W_q x``, ``k = W_k x`` (Bahdanau et al. 2015); its
      ``B * L * L * E`` tanh are what make it costly.
    """

    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind = kind
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(width, width) for _ in range(4))
        self.w = nn.Linear(width, width, bias=False) if kind == "multiplicative" else None
        self.score_vec = nn.Parameter(torch.randn(width) / math.sqrt(width)) if kind == "additive" else None

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (p(x)[:, None] for p in (self.q_proj, self.k_proj, self.v_proj))  # (B, 1, L, E)
        if self.kind == "additive":  # q, k are already W_q x, W_k x
            out = approx.attention(q, k, v, kind="additive", score_vector=self.score_vec)
        elif self.kind == "multiplicative":  # self.w(q) . k = q^T W^T k
            out = approx.attention(q, k, v, kind="multiplicative", weight=self.w.weight.T, scale=q.shape[-1] ** -0.5)
        else:
            out = attention(q, k, v)
        return self.out_proj(out[:, 0])


def forward_seconds(kind: str, n: int, width: int, repeats: int) -> float:
    """Median time of one forward pass on ``[1, n, width]``."""
    torch.manual_seed(0)
    m = ScoredAttention(width, kind)
    x = torch.randn(1, n, width)
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first call warms up and is dropped
            t0 = time.perf_counter()
            m(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run(quick: bool, out: Path) -> Finding:
    steps = 300 if quick else 1500
    seeds = [0] if quick else [0, 1, 2]
    n = 256 if quick else 512
    acc = {kind: sum(train(lambda kind=kind: ScoredAttention(WIDTH, kind), steps=steps, seed=s)["accuracy"]
                     for s in seeds) / len(seeds) for kind in KINDS}
    secs = {kind: forward_seconds(kind, n, 64, 3 if quick else 7) for kind in KINDS}
    figures = {**{f"accuracy_{k}": v for k, v in acc.items()},
               **{f"forward_ms_{k}_n{n}": round(v * 1e3, 3) for k, v in secs.items()},
               "additive_vs_dot_time": secs["additive"] / secs["dot"]}
    fig, axes = figure(2, width=3.4)
    axes[0][0].bar(KINDS, [acc[k] for k in KINDS])
    axes[0][0].set(ylabel="accuracy (reversal task)", ylim=(0, 1.05), title=f"{steps} training steps")
    axes[0][1].bar(KINDS, [secs[k] * 1e3 for k in KINDS])
    axes[0][1].set(ylabel="ms per forward", title=f"n = {n}, d = 64")
    for ax in axes[0]:
        ax.tick_params(axis="x", labelsize=8)
    pic = save(fig, out / "lab_score_functions.png")
    cheaper = secs["additive"] > secs["dot"]
    # A task every score function solves cannot tell them apart: "as accurate" is then untested,
    # and the verdict may not count it as support.
    ceiling = min(acc.values()) >= CEILING
    as_good = acc["dot"] >= max(acc.values()) - 0.05
    figures["accuracy_claim"] = ("untested: every score function reaches the task's ceiling" if ceiling
                                 else "tested" if as_good else "refuted: the dot product is less accurate")
    if cheaper and as_good and not ceiling:
        verdict = "supported"
    else:
        verdict = "depends" if cheaper else "refuted"
    accuracy = (f"the accuracy half is untested here: after {steps} steps all three reach the ceiling of this task "
                f"({acc['dot']:.2f} dot, {acc['multiplicative']:.2f} multiplicative, {acc['additive']:.2f} "
                "additive), so it cannot tell them apart" if ceiling else
                f"after {steps} steps the accuracies are {acc['dot']:.2f} (dot), {acc['multiplicative']:.2f} "
                f"(multiplicative), {acc['additive']:.2f} (additive)")
    why = (f"Additive scores took {figures['additive_vs_dot_time']:.1f}x the dot product's time here at n = {n}, "
           f"d = 64 (a tanh over n x n x d values; the ratio is this machine's); {accuracy}.")
    names = {"dot": "dot product", "multiplicative": "multiplicative", "additive": "additive"}
    labels = {**{f"accuracy_{k}": f"Reversal-task accuracy after {steps} steps, {w}" for k, w in names.items()},
              **{f"forward_ms_{k}_n{n}": f"Forward time, {w} (ms, n = {n}, d = 64)" for k, w in names.items()},
              "additive_vs_dot_time": "Forward time, additive / dot product",
              "accuracy_claim": "Whether this task tests 'as accurate'"}
    return Finding("score_functions", CLAIM, figures, verdict, why, [pic], labels=labels)
