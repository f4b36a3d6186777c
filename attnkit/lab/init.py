"""Initialisation: heads that start equal stay equal; a random (Xavier) start makes them differ."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..modules import MultiHeadAttention
from ._common import TinyModel, figure, reverse_batch, save
from .runner import Finding

CLAIM = ("Attention weights need a random initialisation such as Xavier's: with zero (or any identical) "
         "initial weights every head computes the same thing, receives the same gradient and so never "
         "becomes different.")


def head_spread(w: torch.Tensor, heads: int) -> float:
    """Largest difference between any head's rows of a ``[H*D, E]`` projection and head 0's."""
    per = w.view(heads, -1, w.shape[-1])
    return (per - per[:1]).abs().max().item()


def trained(fill: str, steps: int, heads: int = 4) -> dict[str, float]:
    """Train on the reversal task after initialising the attention weights by ``fill``."""
    torch.manual_seed(0)
    model = TinyModel(MultiHeadAttention(32, heads))
    attn = model.mixer
    for lin in attn.projections() + (attn.out_proj,):
        if fill == "zero":
            nn.init.zeros_(lin.weight)
        elif fill == "constant":
            nn.init.constant_(lin.weight, 0.05)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first_grad = None
    for _ in range(steps):
        x, y = reverse_batch(64, gen)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        if first_grad is None:
            first_grad = {"grad_norm_q": attn.q_proj.weight.grad.norm().item(),
                          "grad_head_spread_q": head_spread(attn.q_proj.weight.grad, heads)}
        opt.step()
    x, y = reverse_batch(1024, torch.Generator().manual_seed(10_000))
    with torch.no_grad():
        acc = (model(x).argmax(-1) == y).float().mean().item()
    return {**first_grad, "weight_head_spread_q": head_spread(attn.q_proj.weight.detach(), heads), "accuracy": acc}


def run(quick: bool, out: Path) -> Finding:
    steps = 200 if quick else 1500
    res = {fill: trained(fill, steps) for fill in ("xavier", "zero", "constant")}
    figures = {f"{fill}_{k}": v for fill, r in res.items() for k, v in r.items()}
    fig, axes = figure(1, width=4.6)
    ax = axes[0][0]
    names = list(res)
    ax.bar(names, [res[n]["accuracy"] for n in names])
    for i, n in enumerate(names):
        ax.text(i, res[n]["accuracy"], f"heads differ by\n{res[n]['weight_head_spread_q']:.2g}", ha="center",
                va="bottom", fontsize=8)
    ax.set(ylabel="accuracy (reversal task)", ylim=(0, 1.3), title=f"Attention initialisation, {steps} steps")
    pic = save(fig, out / "lab_init.png")
    ok = (res["zero"]["grad_norm_q"] == 0.0 and res["constant"]["weight_head_spread_q"] == 0.0
          and res["xavier"]["weight_head_spread_q"] > 0.0)
    why = (f"Zero weights give W_q a gradient of exactly {res['zero']['grad_norm_q']:g} (the scores stay flat "
           f"and nothing flows back through them), identical constant weights give every head the same gradient, "
           f"so after {steps} steps the heads still differ by {res['constant']['weight_head_spread_q']:g} "
           f"(accuracy {res['constant']['accuracy']:.2f}), while Xavier reaches {res['xavier']['accuracy']:.2f}.")
    starts = {"xavier": "Xavier start", "zero": "Zero start", "constant": "Constant start (0.05)"}
    labels = {f"{fill}_{k}": f"{start}: {what}" for fill, start in starts.items() for k, what in (
        ("grad_norm_q", "norm of W_q's first gradient"),
        ("grad_head_spread_q", "largest difference between heads in W_q's first gradient"),
        ("weight_head_spread_q", f"largest difference between heads in W_q after {steps} steps"),
        ("accuracy", f"reversal-task accuracy after {steps} steps"))}
    return Finding("init", CLAIM, figures, "supported" if ok else "depends", why, [pic], labels=labels)
