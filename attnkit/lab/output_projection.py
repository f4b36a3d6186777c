"""The output projection W_O: an ablation, and why a following linear layer can absorb it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..modules import MultiHeadAttention
from ._common import WIDTH, figure, save, train
from .runner import Finding

CLAIM = ("The output projection W_O, which mixes the concatenated heads back into the model width, is "
         "indispensable to multi-head attention.")


def without_out_proj(width: int, heads: int) -> MultiHeadAttention:
    """Multi-head attention whose concatenated heads go out as they are (``H * Dv == width``)."""
    mha = MultiHeadAttention(width, heads)
    mha.out_proj = nn.Identity()
    return mha


def fold_error(width: int = 32, heads: int = 4) -> float:
    """Largest difference between ``next(W_O(concat))`` and ``(next o W_O)(concat)``: a linear layer
    after W_O absorbs it, so without a nonlinearity in between W_O adds nothing a model could not learn."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(width, heads).double()
    after = nn.Linear(width, width).double()
    folded = nn.Linear(width, width).double()
    with torch.no_grad():
        folded.weight.copy_(after.weight @ mha.out_proj.weight)
        folded.bias.copy_(after.weight @ mha.out_proj.bias + after.bias)
        x = torch.randn(2, 6, width, dtype=torch.float64)
        full = after(mha(x))
        plain = without_out_proj(width, heads).double()
        plain.load_state_dict({k: v for k, v in mha.state_dict().items() if not k.startswith("out_proj")})
        return (folded(plain(x)) - full).abs().max().item()


def run(quick: bool, out: Path) -> Finding:
    steps = 300 if quick else 1500
    seeds = [0] if quick else [0, 1, 2]
    res = {}
    for name, make in (("with W_O", lambda: MultiHeadAttention(WIDTH, 4)),
                       ("without W_O", lambda: without_out_proj(WIDTH, 4))):
        runs = [train(make, steps=steps, seed=s) for s in seeds]
        res[name] = {"accuracy": sum(r["accuracy"] for r in runs) / len(runs), "params": runs[0]["mixer_params"]}
    figures = {"accuracy_with_wo": res["with W_O"]["accuracy"], "accuracy_without_wo": res["without W_O"]["accuracy"],
               "params_with_wo": res["with W_O"]["params"], "params_without_wo": res["without W_O"]["params"],
               "fold_error": fold_error()}
    fig, axes = figure(1, width=3.6)
    ax = axes[0][0]
    ax.bar(list(res), [r["accuracy"] for r in res.values()])
    ax.set(ylabel="accuracy (reversal task)", ylim=(0, 1.05), title=f"W_O ablation, {steps} steps")
    pic = save(fig, out / "lab_output_projection.png")
    gap = figures["accuracy_with_wo"] - figures["accuracy_without_wo"]
    verdict = "supported" if gap > 0.05 else "depends"
    fold = (f"a linear layer that directly follows W_O absorbs it exactly (to {figures['fold_error']:.0e})")
    if verdict == "supported":
        why = (f"Without W_O the accuracy drops from {figures['accuracy_with_wo']:.2f} to "
               f"{figures['accuracy_without_wo']:.2f}, although {fold}.")
    else:
        why = (f"Accuracy {figures['accuracy_with_wo']:.2f} with W_O and {figures['accuracy_without_wo']:.2f} without "
               f"({figures['params_with_wo'] - figures['params_without_wo']:,} fewer parameters): each head then "
               f"writes its own slice of the residual stream and the next layers mix them, and {fold}; W_O is "
               "needed where the concatenated width differs from the model's, not everywhere.")
    labels = {"accuracy_with_wo": f"Reversal-task accuracy after {steps} steps, with W_O",
              "accuracy_without_wo": f"Reversal-task accuracy after {steps} steps, without W_O",
              "params_with_wo": "Attention parameters, with W_O",
              "params_without_wo": "Attention parameters, without W_O",
              "fold_error": "Largest difference after folding W_O into the next linear layer"}
    return Finding("output_projection", CLAIM, figures, verdict, why, [pic], labels=labels)
