"""Sharing projections: Q = K (``share_qk``) makes the scores symmetric; K = V (``share_kv``) saves weights."""

from __future__ import annotations

from pathlib import Path

import torch

from ..modules import MultiHeadAttention
from ._common import WIDTH, figure, save, train
from .runner import Finding

CLAIM = ("If queries and keys share one projection, the score matrix is symmetric (word i scores word j "
         "as j scores i) and each word's score with itself is a squared norm, so words lean towards "
         "themselves; sharing keys and values saves a projection's parameters at little cost in quality.")


def scores(mha: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Per-head raw scores ``q k^T`` of self-attention on ``x``: ``[B, H, L, L]``."""
    q, k, _ = mha.project_qkv(x, x, x)
    return q @ k.transpose(-1, -2)


def run(quick: bool, out: Path) -> Finding:
    torch.manual_seed(0)
    e, h, n = 64, 4, 12
    x = torch.randn(4, n, e)
    plain, shared = MultiHeadAttention(e, h), MultiHeadAttention(e, h, share_qk=True)
    with torch.no_grad():
        s_plain, s_shared = scores(plain, x), scores(shared, x)
        w_plain = plain(x, need_weights=True)[1]
        w_shared = shared(x, need_weights=True)[1]

    def asym(s):
        return ((s - s.transpose(-1, -2)).abs().amax() / s.abs().amax()).item()

    def self_weight(w):
        return w.diagonal(dim1=-2, dim2=-1).mean().item()

    def n_params(m):
        return sum(p.numel() for p in m.parameters())

    steps = 300 if quick else 1500
    seeds = [0] if quick else [0, 1, 2]
    variants = {"separate": {}, "share_qk": {"share_qk": True}, "share_kv": {"share_kv": True}}
    acc = {name: sum(train(lambda kw=kw: MultiHeadAttention(WIDTH, 2, **kw), steps=steps, seed=s)["accuracy"]
                     for s in seeds) / len(seeds) for name, kw in variants.items()}
    figures = {"asymmetry_separate": asym(s_plain), "asymmetry_share_qk": asym(s_shared),
               "self_weight_separate": self_weight(w_plain), "self_weight_share_qk": self_weight(w_shared),
               "params_separate": n_params(plain), "params_share_qk": n_params(shared),
               "params_share_kv": n_params(MultiHeadAttention(e, h, share_kv=True)),
               **{f"accuracy_{k}": v for k, v in acc.items()}}
    fig, axes = figure(2, width=3.4)
    for ax, s, title in ((axes[0][0], s_plain, "separate Q, K"), (axes[0][1], s_shared, "share_qk: Q = K")):
        ax.imshow(s[0, 0].numpy(), cmap="RdBu")
        ax.set_title(f"scores q k^T, {title}", fontsize=9)
    pic = save(fig, out / "lab_sharing.png")
    saved = figures["params_separate"] - figures["params_share_kv"]
    ok = figures["asymmetry_share_qk"] < 1e-6 and figures["self_weight_share_qk"] > figures["self_weight_separate"]
    why = (f"With share_qk the scores are symmetric to {figures['asymmetry_share_qk']:.1e} (relative) and the "
           f"self-weight rises from {figures['self_weight_separate']:.2f} to {figures['self_weight_share_qk']:.2f}; "
           f"share_kv saves {saved:,} of {figures['params_separate']:,} parameters; on the reversal task the "
           f"accuracy is {acc['separate']:.2f} separate, {acc['share_qk']:.2f} Q = K, {acc['share_kv']:.2f} K = V "
           "(after the same training steps).")
    kinds = {"separate": "separate Q and K", "share_qk": "Q = K shared"}
    labels = {**{f"asymmetry_{k}": f"Score asymmetry, max |S - S^T| / max |S|, {w}" for k, w in kinds.items()},
              **{f"self_weight_{k}": f"Mean self-weight, {w}" for k, w in kinds.items()},
              "params_separate": f"Parameters, separate projections (width {e}, {h} heads)",
              "params_share_qk": "Parameters, Q = K shared", "params_share_kv": "Parameters, K = V shared",
              "accuracy_separate": f"Reversal-task accuracy after {steps} steps, separate projections",
              "accuracy_share_qk": f"Reversal-task accuracy after {steps} steps, Q = K shared",
              "accuracy_share_kv": f"Reversal-task accuracy after {steps} steps, K = V shared"}
    return Finding("sharing", CLAIM, figures, "supported" if ok else "depends", why, [pic], labels=labels)
