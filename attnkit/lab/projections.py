"""Self-attention with Q = K = V = X (no projections): each token attends mostly to itself."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..functional import attention
from ..modules import MultiHeadAttention
from ._common import figure, minilm, save
from .runner import Finding

CLAIM = ("Without the learned projections (queries, keys and values all equal to the input X), each word's "
         "score with itself, |x|^2, beats its score with any other word, so each word mostly attends to itself; "
         "the projections are what let a word look elsewhere.")
SENTENCES = ["The river bank was eroding after the storm.", "She deposited the money at the bank on Monday.",
             "A quick brown fox jumps over the lazy dog.", "Attention lets every word look at every other word."]


def self_weight(x: torch.Tensor, mha: MultiHeadAttention | None = None) -> float:
    """Mean diagonal of the attention weights of ``x [B, L, E]``: plain ``softmax(X X^T / sqrt(E))``
    without ``mha``, else that module's (mean over its heads)."""
    with torch.no_grad():
        if mha is None:
            h = x[:, None]  # (B, 1, L, E): one head, the input itself as q, k and v
            _, w = attention(h, h, h, return_weights=True, backend="reference")
        else:
            _, w = mha(x, need_weights=True)
    return w.diagonal(dim1=-2, dim2=-1).mean().item()


def run(quick: bool, out: Path) -> Finding:
    torch.manual_seed(0)
    n, e = 16, 64
    x = torch.randn(8, n, e)
    mha = MultiHeadAttention(e, 4, backend="reference")
    figures = {"self_weight_random_no_proj": self_weight(x), "self_weight_random_proj": self_weight(x, mha),
               "uniform": 1 / n}
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
    fig, axes = figure(2, width=3.4)
    axes[0][0].imshow(w[0, 0, : mask[0].sum(), : mask[0].sum()].numpy(), cmap="viridis", vmin=0, vmax=1)
    axes[0][0].set_title("MiniLM embeddings, Q=K=V=X", fontsize=9)
    _, wr = mha(x[:1], need_weights=True)
    axes[0][1].imshow(wr[0, 0].detach().numpy(), cmap="viridis", vmin=0, vmax=1)
    axes[0][1].set_title("random X, random projections", fontsize=9)
    pic = save(fig, out / "lab_projections.png")
    s = figures["self_weight_random_no_proj"]
    verdict = "supported" if s > 0.8 and figures["self_weight_minilm_no_proj"] > 0.5 else "depends"
    why = (f"With Q = K = V = X the mean self-weight is {s:.2f} on random vectors (d = {e}: |x|^2/sqrt(d) = "
           f"{math.sqrt(e):.0f} against O(1) for other pairs) and {figures['self_weight_minilm_no_proj']:.2f} on "
           f"MiniLM's input embeddings, against {figures['self_weight_random_proj']:.2f} with random projections "
           f"(uniform would be {1 / n:.2f}) and {figures['self_weight_minilm_layer0_proj']:.2f} with MiniLM's own "
           "first-layer projections.")
    labels = {"self_weight_random_no_proj": f"Mean self-weight, random vectors, Q = K = V = X (d = {e})",
              "self_weight_random_proj": "Mean self-weight, random vectors, random projections (4 heads)",
              "uniform": f"Uniform weight, 1/n (n = {n})",
              "self_weight_minilm_no_proj": "Mean self-weight, MiniLM's input embeddings, Q = K = V = X",
              "self_weight_minilm_layer0_proj": "Mean self-weight, MiniLM's input embeddings, its first layer's "
                                                "projections"}
    return Finding("projections", CLAIM, figures, verdict, why, [pic], labels=labels)
