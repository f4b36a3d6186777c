"""Sharing projections: Q = K (``share_qk``) makes the scores symmetric; K = V (``share_kv``) saves weights.

Each part of the claim is measured on its own, and the verdict is "supported" only when every
part holds: the symmetry and the self-weight at initialisation; and, on the reversal task trained
from a finite set of sequences from several random starts, the accuracy on sequences not seen in training
(K = V against separate projections) and the gap between the training sequences and those
(Q = K against separate projections, at two sizes of the training set).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..modules import MultiHeadAttention
from ._common import WIDTH, figure, save, train
from .runner import Finding

CLAIM = ("If queries and keys share one projection, the score matrix is symmetric (word i scores word j "
         "as j scores i) and each word's score with itself is a squared norm, so words lean towards "
         "themselves. A common tutorial adds that shared Q = K generalises poorly, and that sharing keys "
         "and values saves a projection's parameters at little cost in quality.")
#: The training sets of the accuracy runs: this many sequences, drawn once per seed. K = V is
#: trained on the larger; Q = K and separate projections on both, since a gap can depend on it.
POOLS = (64, 256)
POOL = POOLS[-1]
#: "Little cost in quality": K = V's mean accuracy on unseen sequences at most this far below separate projections'.
LITTLE = 0.05
VARIANTS = {"separate": {}, "share_qk": {"share_qk": True}, "share_kv": {"share_kv": True}}


def scores(mha: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Per-head raw scores ``q k^T`` of self-attention on ``x``: ``[B, H, L, L]``."""
    q, k, _ = mha.project_qkv(x, x, x)
    return q @ k.transpose(-1, -2)


def claim_parts(figures: dict[str, object]) -> dict[str, bool]:
    """Which parts of :data:`CLAIM` the figures support: the symmetry (with the self-weight rising),
    K = V's small cost on unseen sequences, and Q = K's poorer generalisation (at every training-set
    size, every seed's gap between training and unseen sequences larger than every seed's gap with
    separate projections)."""
    def gaps(k, pool):
        return [t - h for t, h in zip(figures[f"train_accuracy_{k}_{pool}"], figures[f"heldout_accuracy_{k}_{pool}"],
                                      strict=True)]

    return {"symmetry": figures["asymmetry_share_qk"] < 1e-6
            and figures["self_weight_share_qk"] > figures["self_weight_separate"],
            "kv_little_cost": figures["accuracy_share_kv"] >= figures["accuracy_separate"] - LITTLE,
            "qk_generalises_poorly": all(min(gaps("share_qk", p)) > max(gaps("separate", p)) for p in POOLS)}


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
    seeds = [0, 1, 2] if quick else [0, 1, 2, 3, 4]
    runs = {(name, pool): [train(lambda kw=kw: MultiHeadAttention(WIDTH, 2, **kw), steps=steps, seed=s, pool=pool)
                           for s in seeds]
            for name, kw in VARIANTS.items() for pool in POOLS if pool == POOL or name != "share_kv"}
    figures = {"asymmetry_separate": asym(s_plain), "asymmetry_share_qk": asym(s_shared),
               "self_weight_separate": self_weight(w_plain), "self_weight_share_qk": self_weight(w_shared),
               "params_separate": n_params(plain), "params_share_qk": n_params(shared),
               "params_share_kv": n_params(MultiHeadAttention(e, h, share_kv=True))}
    for (name, pool), results in runs.items():
        heldout = [r["accuracy"] for r in results]
        fitted = [r["train_accuracy"] for r in results]
        figures[f"heldout_accuracy_{name}_{pool}"] = heldout
        figures[f"train_accuracy_{name}_{pool}"] = fitted
        figures[f"gap_{name}_{pool}"] = sum(t - a for t, a in zip(fitted, heldout, strict=True)) / len(seeds)
        if pool == POOL:
            figures[f"accuracy_{name}"] = sum(heldout) / len(heldout)
    parts = claim_parts(figures)
    figures["claim_parts"] = {k: "holds" if v else "does not hold" for k, v in parts.items()}
    fig, axes = figure(2, width=3.4)
    for ax, s, title in ((axes[0][0], s_plain, "separate Q, K"), (axes[0][1], s_shared, "share_qk: Q = K")):
        ax.imshow(s[0, 0].numpy(), cmap="RdBu")
        ax.set_title(f"scores q k^T, {title}", fontsize=9)
    pic = save(fig, out / "lab_sharing.png")
    saved = figures["params_separate"] - figures["params_share_kv"]

    def spread(name):
        acc = figures[f"heldout_accuracy_{name}_{POOL}"]
        return f"{figures[f'accuracy_{name}']:.2f} ({min(acc):.2f}-{max(acc):.2f})"

    def mean(key):
        return sum(figures[key]) / len(figures[key])

    small = POOLS[0]
    fit_qk, fit_sep = mean(f"train_accuracy_share_qk_{POOL}"), mean(f"train_accuracy_separate_{POOL}")
    fit = (f"which also fits them less well: {fit_qk:.2f} against {fit_sep:.2f}" if fit_qk < fit_sep - 0.005
           else f"both fit them: {fit_qk:.2f} and {fit_sep:.2f}")

    why = (f"With share_qk the scores are symmetric to {figures['asymmetry_share_qk']:.1e} (relative) and the "
           f"self-weight rises from {figures['self_weight_separate']:.2f} to {figures['self_weight_share_qk']:.2f}; "
           f"share_kv saves {saved:,} of {figures['params_separate']:,} parameters. Trained {steps} steps on "
           f"{POOL} reversal sequences, {len(seeds)} random starts, the accuracy on unseen sequences "
           "(mean, lowest-highest) "
           f"is {spread('separate')} separate, {spread('share_qk')} Q = K, {spread('share_kv')} K = V, and the "
           f"gap from the training sequences {figures[f'gap_separate_{POOL}']:.2f} separate, "
           f"{figures[f'gap_share_qk_{POOL}']:.2f} Q = K ({fit}); "
           f"on {small} sequences (training accuracy {mean(f'train_accuracy_share_qk_{small}'):.2f} Q = K, "
           f"{mean(f'train_accuracy_separate_{small}'):.2f} separate) the gaps are "
           f"{figures[f'gap_share_qk_{small}']:.2f} Q = K and {figures[f'gap_separate_{small}']:.2f} separate. "
           f"K = V's cost {'is' if parts['kv_little_cost'] else 'is not'} within {LITTLE}; Q = K "
           + ("generalises worse from every start at both sizes." if parts["qk_generalises_poorly"]
              else "does not generalise worse from every start at both sizes, so that part depends on the data."))
    kinds = {"separate": "separate Q and K", "share_qk": "Q = K shared"}
    variants = {"separate": "separate projections", "share_qk": "Q = K shared", "share_kv": "K = V shared"}
    labels = {**{f"asymmetry_{k}": f"Score asymmetry, max |S - S^T| / max |S|, {w}" for k, w in kinds.items()},
              **{f"self_weight_{k}": f"Mean self-weight, {w}" for k, w in kinds.items()},
              "params_separate": f"Parameters, separate projections (width {e}, {h} heads)",
              "params_share_qk": "Parameters, Q = K shared", "params_share_kv": "Parameters, K = V shared",
              **{f"heldout_accuracy_{k}_{p}": f"Accuracy on unseen sequences per random start, {w} ({steps} steps, {p} "
                                               "training sequences)" for k, w in variants.items() for p in POOLS},
              **{f"train_accuracy_{k}_{p}": f"Accuracy on the {p} training sequences per random start, {w}"
                 for k, w in variants.items() for p in POOLS},
              **{f"gap_{k}_{p}": f"Mean gap, training minus unseen accuracy, {w} ({p} training sequences)"
                 for k, w in variants.items() for p in POOLS},
              **{f"accuracy_{k}": f"Mean accuracy on unseen sequences, {w} ({POOL} training sequences)"
                 for k, w in variants.items()},
              "claim_parts": "Parts of the claim",
              "symmetry": "Q = K gives symmetric scores and a higher self-weight",
              "kv_little_cost": f"K = V costs at most {LITTLE} of accuracy on unseen sequences",
              "qk_generalises_poorly": "Q = K generalises worse (a larger gap from every start, at both sizes)"}
    return Finding("sharing", CLAIM, figures, "supported" if all(parts.values()) else "depends", why, [pic],
                   labels=labels)
