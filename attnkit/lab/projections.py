"""Self-attention with Q = K = V = X (no projections): each token attends mostly to itself.

The claim is stated as the tutorial limits it: a word's own score |x|^2 beats its score with every
other word when the vectors have equal norms (Cauchy-Schwarz: x.y <= |x| |y| = |x|^2, equal only
for y = x), which is checked exactly; with unequal norms a longer vector in the same direction
outscores it, which a two-word counterexample shows. What is measured beyond that is how much weight
each word puts on itself, and how often its own score is the largest in its row on real embeddings,
whose norms differ.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..functional import attention
from ..modules import MultiHeadAttention
from ._common import figure, minilm, save
from .runner import Finding

CLAIM = ("Without the learned projections (queries, keys and values all equal to the input X), each word's "
         "score with itself is |x|^2. When the words' vectors have equal norms, that beats its score with any "
         "other word (with unequal norms it need not), so each word mostly attends to itself; the projections "
         "are what let a word look elsewhere.")
#: Two words in the same direction, the second twice as long: the first scores the second (2) above
#: itself (1), and puts most of its weight on it.
COUNTEREXAMPLE = ((1.0, 0.0), (2.0, 0.0))
SENTENCES = ["The river bank was eroding after the storm.", "She deposited the money at the bank on Monday.",
             "A quick brown fox jumps over the lazy dog.", "Attention lets every word look at every other word."]


def weights(x: torch.Tensor) -> torch.Tensor:
    """The weights of plain ``softmax(X X^T / sqrt(E))`` for ``x [B, L, E]``: ``[B, L, L]``."""
    h = x[:, None]  # (B, 1, L, E): one head, the input itself as q, k and v
    with torch.no_grad():
        _, w = attention(h, h, h, return_weights=True, backend="reference")
    return w[:, 0]


def self_weight(x: torch.Tensor, mha: MultiHeadAttention | None = None) -> float:
    """Mean diagonal of the attention weights of ``x [B, L, E]``: plain ``softmax(X X^T / sqrt(E))``
    without ``mha``, else that module's (mean over its heads)."""
    if mha is None:
        w = weights(x)
    else:
        with torch.no_grad():
            _, w = mha(x, need_weights=True)
    return w.diagonal(dim1=-2, dim2=-1).mean().item()


def own_score_is_row_max(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """For ``x [B, L, E]``: whether each word's score with itself, ``x_i . x_i``, is strictly larger
    than its score with every other word (among the real words of ``mask [B, L]``), ``[B, L]``."""
    s = x @ x.transpose(-1, -2)
    real = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else mask
    eye = torch.eye(x.shape[1], dtype=torch.bool)
    others = s.masked_fill(eye | ~real[:, None, :], float("-inf")).amax(-1)
    return s.diagonal(dim1=-2, dim2=-1) > others


def run(quick: bool, out: Path) -> Finding:
    torch.manual_seed(0)
    n, e = 16, 64
    x = torch.randn(8, n, e)
    mha = MultiHeadAttention(e, 4, backend="reference")
    equal = x / x.norm(dim=-1, keepdim=True) * math.sqrt(e)  # the same vectors, all of norm sqrt(e)
    pair = torch.tensor(COUNTEREXAMPLE)[None]
    pair_scores = (pair @ pair.transpose(-1, -2))[0]
    figures = {"self_weight_random_no_proj": self_weight(x), "self_weight_random_proj": self_weight(x, mha),
               "uniform": 1 / n,
               "own_score_max_share_equal_norms": own_score_is_row_max(equal).float().mean().item(),
               "own_score_max_share_random": own_score_is_row_max(x).float().mean().item(),
               "counterexample_own_score": pair_scores[0, 0].item(),
               "counterexample_other_score": pair_scores[0, 1].item(),
               "counterexample_self_weight": weights(pair)[0, 0, 0].item()}
    model = minilm()
    enc = model.tokenizer(SENTENCES)
    mask = enc["attention_mask"].bool()  # real tokens; padding is left out of every mean
    with torch.no_grad():
        emb = model(enc["input_ids"], enc["attention_mask"], output_hidden_states=True).hidden_states[0]
        h = emb[:, None]  # (B, 1, L, E)
        _, w = attention(h, h, h, mask=mask[:, None, None, :], return_weights=True, backend="reference")
        _, wp = model.layers[0].attn(emb, key_mask=mask, need_weights=True)
    figures["self_weight_minilm_no_proj"] = w[:, 0].diagonal(dim1=-2, dim2=-1)[mask].mean().item()
    figures["self_weight_minilm_layer0_proj"] = wp.diagonal(dim1=-2, dim2=-1).mean(1)[mask].mean().item()
    figures["own_score_max_share_minilm"] = own_score_is_row_max(emb, mask)[mask].float().mean().item()
    norms = emb.norm(dim=-1)[mask]
    figures["minilm_norm_range"] = [round(norms.min().item(), 2), round(norms.max().item(), 2)]
    fig, axes = figure(2, width=3.4)
    axes[0][0].imshow(w[0, 0, : mask[0].sum(), : mask[0].sum()].numpy(), cmap="viridis", vmin=0, vmax=1)
    axes[0][0].set_title("MiniLM embeddings, Q=K=V=X", fontsize=9)
    _, wr = mha(x[:1], need_weights=True)
    axes[0][1].imshow(wr[0, 0].detach().numpy(), cmap="viridis", vmin=0, vmax=1)
    axes[0][1].set_title("random X, random projections", fontsize=9)
    pic = save(fig, out / "lab_projections.png")
    s = figures["self_weight_random_no_proj"]
    # Every part of the claim: the equal-norm case exactly, the counterexample, the self-weights.
    limited = (figures["own_score_max_share_equal_norms"] == 1.0
               and figures["counterexample_other_score"] > figures["counterexample_own_score"])
    verdict = "supported" if limited and s > 0.8 and figures["self_weight_minilm_no_proj"] > 0.5 else "depends"
    lo, hi = figures["minilm_norm_range"]
    why = (f"With equal norms each word's own score is the largest of its row for "
           f"{figures['own_score_max_share_equal_norms']:.0%} of words, as Cauchy-Schwarz guarantees; with unequal "
           f"norms it is not guaranteed: of words (1, 0) and (2, 0) the first scores the second "
           f"{figures['counterexample_other_score']:.0f} against {figures['counterexample_own_score']:.0f} for "
           f"itself and puts {figures['counterexample_self_weight']:.2f} of its weight on itself. On MiniLM's input "
           f"embeddings, whose norms range from {lo:.1f} to {hi:.1f}, the own score is the row's largest for "
           f"{figures['own_score_max_share_minilm']:.0%} of the words. The mean self-weight with Q = K = V = X is "
           f"{s:.2f} on random vectors (d = {e}: |x|^2/sqrt(d) = {math.sqrt(e):.0f} against O(1) for other pairs) and "
           f"{figures['self_weight_minilm_no_proj']:.2f} on MiniLM's input embeddings, against "
           f"{figures['self_weight_random_proj']:.2f} with random projections (uniform would be {1 / n:.2f}) and "
           f"{figures['self_weight_minilm_layer0_proj']:.2f} with MiniLM's own first-layer projections.")
    labels = {"self_weight_random_no_proj": f"Mean self-weight, random vectors, Q = K = V = X (d = {e})",
              "self_weight_random_proj": "Mean self-weight, random vectors, random projections (4 heads)",
              "uniform": f"Uniform weight, 1/n (n = {n})",
              "self_weight_minilm_no_proj": "Mean self-weight, MiniLM's input embeddings, Q = K = V = X",
              "self_weight_minilm_layer0_proj": "Mean self-weight, MiniLM's input embeddings, its first layer's "
                                                "projections",
              "own_score_max_share_equal_norms": f"Share of words whose own score is their row's largest, random "
                                                 f"vectors scaled to equal norms (d = {e})",
              "own_score_max_share_random": "Share of words whose own score is their row's largest, random vectors",
              "own_score_max_share_minilm": "Share of words whose own score is their row's largest, MiniLM's "
                                            "input embeddings",
              "minilm_norm_range": "Norms of MiniLM's input embeddings, smallest and largest",
              "counterexample_own_score": "Counterexample (1, 0) and (2, 0): the first word's own score",
              "counterexample_other_score": "Counterexample: the first word's score with the second",
              "counterexample_self_weight": "Counterexample: the first word's weight on itself"}
    return Finding("projections", CLAIM, figures, verdict, why, [pic], labels=labels)
