# %% [markdown]
# # Attention by hand, on four tokens
#
# Self-attention lets every token of a sequence build its new representation as a weighted mix of
# all the tokens, with weights it computes from the tokens themselves. This tutorial does every step
# by hand on four tokens with eight numbers each, prints and draws each intermediate, and then checks
# the result against `attnkit.attention` and against PyTorch's own `torch.nn.MultiheadAttention`.
#
# The formula we are going to take apart is *scaled dot-product attention* (Vaswani et al., 2017):
#
# ```text
# Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V
# ```

# %%
import math

import matplotlib.pyplot as plt
import torch

import attnkit
from attnkit import viz
from attnkit.modules import TransformerEncoderLayer

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

tokens = ["the", "cat", "sat", "down"]
n, d_model = len(tokens), 8
X = torch.randn(n, d_model)  # one row per token: its embedding
print("X, the token embeddings, shape", tuple(X.shape))
print(X)

# %% [markdown]
# ## Queries, keys and values
#
# Each token asks a question (its **query**), advertises what it holds (its **key**), and offers
# content (its **value**). All three are linear maps of the same embedding, with three weight
# matrices that a model learns; here they are random. Dividing by `√d_model` keeps the
# entries at about the size of the embeddings.

# %%
d_k = d_model  # one head, as wide as the model, so torch.nn.MultiheadAttention can take the same weights
W_q = torch.randn(d_model, d_k) / math.sqrt(d_model)
W_k = torch.randn(d_model, d_k) / math.sqrt(d_model)
W_v = torch.randn(d_model, d_k) / math.sqrt(d_model)

Q = X @ W_q
K = X @ W_k
V = X @ W_v
for name, M in (("Q", Q), ("K", K), ("V", V)):
    print(f"{name} = X @ W_{name.lower()}, shape {tuple(M.shape)}")
    print(M, end="\n\n")

# %%
fig, axes = plt.subplots(1, 3, figsize=(12, 2.8), layout="constrained")
lim = max(float(M.abs().max()) for M in (Q, K, V))  # one colour scale for the three
for ax, (name, M) in zip(axes, (("Q", Q), ("K", K), ("V", V)), strict=True):
    im = ax.imshow(M, cmap="RdBu_r", vmin=-lim, vmax=lim)
    ax.set_title(f"{name}: one row per token")
    ax.set_yticks(range(n), tokens)
    ax.set_xticks(range(d_k))
    ax.set_xlabel("feature")
fig.colorbar(im, ax=axes, shrink=0.8)

# %% [markdown]
# ## Scores: every query against every key
#
# The score of query *i* against key *j* is their dot product: large when the two vectors point the
# same way. `Q Kᵀ` computes all *n* × *n* of them at once; row *i* is what token *i* thinks of
# every token, itself included.

# %%
scores = Q @ K.T
print("scores = Q @ K.T, shape", tuple(scores.shape), "(rows: queries, columns: keys)")
print(scores)
print("\nthe score of 'cat' (query) against 'sat' (key), as a dot product:",
      f"{float(Q[1] @ K[2]):.3f} =", f"{float(scores[1, 2]):.3f}")

# %% [markdown]
# ## Scaling by √d_k
#
# A dot product of `d_k` terms grows with `d_k`: with entries of variance 1 its variance is `d_k`.
# Large scores push the softmax to put almost all the weight on one key, where its gradient nearly
# vanishes. Dividing by `√d_k` brings the variance back to about 1, whatever the head size.

# %%
scaled = scores / math.sqrt(d_k)
print(f"d_k = {d_k}, sqrt(d_k) = {math.sqrt(d_k):.3f}")
print("scaled = scores / sqrt(d_k)")
print(scaled)


def signed_map(ax, M, title):
    """A heat map with the token names and each number written in its cell."""
    lim = float(M.abs().max())
    im = ax.imshow(M, cmap="RdBu_r", vmin=-lim, vmax=lim)
    ax.set_xticks(range(n), tokens)
    ax.set_yticks(range(n), tokens)
    ax.xaxis.tick_top()
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title)
    for i in range(n):
        for j in range(n):
            dark = abs(float(M[i, j])) > lim / 2  # white on the dark cells
            ax.text(j, i, f"{float(M[i, j]):.2f}", ha="center", va="center", fontsize=9,
                    color="white" if dark else "black")
    return im


fig, axes = plt.subplots(1, 2, figsize=(9, 4), layout="constrained")
fig.colorbar(signed_map(axes[0], scores, "scores  Q K^T"), ax=axes[0], shrink=0.7)
fig.colorbar(signed_map(axes[1], scaled, "scaled  Q K^T / sqrt(d_k)"), ax=axes[1], shrink=0.7)

# %% [markdown]
# ## Softmax, row by row
#
# Each query turns its row of scores into weights that are positive and sum to 1:
# `w[i, j] = exp(s[i, j]) / Σ_j' exp(s[i, j'])`. Subtracting the row's largest score first changes
# nothing mathematically (it cancels) but keeps `exp` from overflowing; every implementation does it.

# %%
weights = torch.empty(n, n)
for i in range(n):
    row = scaled[i]
    e = torch.exp(row - row.max())
    weights[i] = e / e.sum()
    print(f"{tokens[i]!r:>6} attends with {weights[i]}, sum {float(weights[i].sum()):.6f}")

print("\nthe same with torch.softmax:", torch.allclose(weights, torch.softmax(scaled, dim=-1)))
print("every row sums to 1:", torch.allclose(weights.sum(dim=-1), torch.ones(n)))

# %%
weights_map = viz.heatmap(weights, tokens, title="attention weights  softmax(Q K^T / sqrt(d_k))")

# %% [markdown]
# ## The weighted sum of the values
#
# The output of token *i* is the mix of all the value vectors, each weighted by how much token *i*
# attends to it: row *i* of `weights @ V`.

# %%
out = weights @ V
print("out = weights @ V, shape", tuple(out.shape))
print(out)

i = tokens.index("cat")
by_hand = sum(weights[i, j] * V[j] for j in range(n))
print(f"\nthe output of {tokens[i]!r}, written out:")
print(" + ".join(f"{float(weights[i, j]):.3f} * V[{tokens[j]!r}]" for j in range(n)))
print("=", by_hand)
print("equal to row", i, "of out:", torch.allclose(by_hand, out[i]))

# %% [markdown]
# ## The same numbers from attnkit
#
# `attnkit.attention` takes queries, keys and values shaped `[..., heads, length, head_size]`, so our
# single head gets a head dimension of size 1. Its default scale is `1 / √d_k`, as above, and
# `return_weights=True` also returns the probabilities.

# %%
ak_out, ak_weights = attnkit.attention(Q[None], K[None], V[None], return_weights=True)
print("attnkit.attention: out", tuple(ak_out.shape), "weights", tuple(ak_weights.shape))
print("backend chosen:", attnkit.which_backend(Q[None], K[None], V[None], return_weights=True))
print("weights equal ours:", torch.allclose(ak_weights[0], weights),
      f"(max abs difference {float((ak_weights[0] - weights).abs().max()):.1e})")
print("output equal ours: ", torch.allclose(ak_out[0], out),
      f"(max abs difference {float((ak_out[0] - out).abs().max()):.1e})")
assert torch.allclose(ak_weights[0], weights) and torch.allclose(ak_out[0], out)

# %% [markdown]
# ## The same numbers from `torch.nn.MultiheadAttention`
#
# PyTorch's module holds the three projections stacked in `in_proj_weight`, in the convention of
# `nn.Linear` (`y = x W^T`), so it takes our matrices transposed. Its output projection, which a
# real model also learns, is set to the identity so that the outputs are comparable, and the biases
# are switched off. With one head, the weights it returns are that head's.

# %%
mha = torch.nn.MultiheadAttention(d_model, num_heads=1, bias=False, batch_first=True)
with torch.no_grad():
    mha.in_proj_weight.copy_(torch.cat([W_q.T, W_k.T, W_v.T]))
    mha.out_proj.weight.copy_(torch.eye(d_model))
    pt_out, pt_weights = mha(X[None], X[None], X[None], need_weights=True)

print("torch.nn.MultiheadAttention: out", tuple(pt_out.shape), "weights", tuple(pt_weights.shape))
print("weights equal ours:", torch.allclose(pt_weights[0], weights),
      f"(max abs difference {float((pt_weights[0] - weights).abs().max()):.1e})")
print("output equal ours: ", torch.allclose(pt_out[0], out),
      f"(max abs difference {float((pt_out[0] - out).abs().max()):.1e})")
assert torch.allclose(pt_weights[0], weights) and torch.allclose(pt_out[0], out)  # the text below says so

# %% [markdown]
# The three agree up to float32 rounding: attention is nothing more than these four lines.
#
# ## One more step: a causal mask
#
# A language model that predicts the next token must not look ahead: query *i* may only attend to
# keys *j* ≤ *i*. The masked scores become `-inf` before the softmax, so their weights are exactly
# 0 and each row still sums to 1 over what it may see. In attnkit a mask is boolean with `True` =
# may attend, or simply `is_causal=True`.

# %%
causal = torch.ones(n, n, dtype=torch.bool).tril()
by_hand_causal = torch.softmax(scaled.masked_fill(~causal, float("-inf")), dim=-1)
_, ak_causal = attnkit.attention(Q[None], K[None], V[None], is_causal=True, return_weights=True)
print("may attend (True):")
print(causal)
print("causal weights:")
print(by_hand_causal)
print("attnkit with is_causal=True agrees:", torch.allclose(ak_causal[0], by_hand_causal))
assert torch.allclose(ak_causal[0], by_hand_causal) and torch.equal(by_hand_causal[~causal], torch.zeros(6))
assert torch.allclose(by_hand_causal.sum(-1), torch.ones(n))  # each row still sums to 1

causal_map = viz.heatmap(by_hand_causal, tokens, mask=causal, title="causal attention weights")

# %% [markdown]
# ## The whole call in one picture, and the block around it
#
# A model does all of the above for a batch of sequences and several heads at once, and then mixes
# the heads' outputs with one more learned matrix, the output projection `W_o`. The picture follows
# one call of `attnkit.MultiHeadAttention` (2 sequences of 5 tokens, width 12, 3 heads of 4, a
# causal mask), and every shape in it is read off that call's own tensors: `B` sequences, `H`
# heads, `L` tokens, `D` numbers per head, `E = H × D` per token. The code checks first that the
# steps, done one by one, give the module's own output.

# %%
B, L, E, H = 2, 5, 12, 3
block_mha = attnkit.MultiHeadAttention(E, H).eval()
x = torch.randn(B, L, E)
mask = attnkit.masks.causal(L)
q, k, v = block_mha.project_qkv(x, x, x)                     # (B, L, E) -> three (B, H, L, D)
raw = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])       # (B, H, L, L)
hidden = raw.masked_fill(~mask, float("-inf"))               # (B, H, L, L)
heads, w = attnkit.attention(q, k, v, mask=mask, return_weights=True)  # (B, H, L, D), (B, H, L, L)
side_by_side = heads.transpose(1, 2).reshape(B, L, E)        # (B, L, H * D)
projected = block_mha.out_proj(side_by_side)                 # (B, L, E)
assert torch.allclose(w, torch.softmax(hidden, dim=-1), atol=1e-6)
assert torch.allclose(projected, block_mha(x, mask=mask), atol=1e-6)


def shape(t, names):
    return f"[{names}] = [{', '.join(map(str, t.shape))}]"


call_figure = viz.flow_diagram({
    "x": (f"X\n{shape(x, 'B, L, E')}", (1, 0)),
    "q": (f"Q = X W_q\n{shape(q, 'B, H, L, D')}", (0, 1)),
    "k": (f"K = X W_k\n{shape(k, 'B, H, L, D')}", (1, 1)),
    "v": (f"V = X W_v\n{shape(v, 'B, H, L, D')}", (2, 1)),
    "s": (f"scores Q Kᵀ / √D\n{shape(raw, 'B, H, L, L')}", (0.5, 2)),
    "m": (f"mask: -inf where False\n{shape(hidden, 'B, H, L, L')}", (0.5, 3)),
    "w": (f"softmax, row by row\n{shape(w, 'B, H, L, L')}", (0.5, 4)),
    "h": (f"weighted sum, weights @ V\n{shape(heads, 'B, H, L, D')}", (1.5, 5)),
    "c": (f"heads side by side\n{shape(side_by_side, 'B, L, H·D')}", (1.5, 6)),
    "o": (f"output projection, · W_o\n{shape(projected, 'B, L, E')}", (1.5, 7)),
}, [("x", "q"), ("x", "k"), ("x", "v"), ("q", "s"), ("k", "s"), ("s", "m"), ("m", "w"), ("w", "h"),
    ("v", "h"), ("h", "c"), ("c", "o")], title="One call of MultiHeadAttention, with its shapes")

# %% [markdown]
# A Transformer layer wraps that call: the attention's output is added to its input (a *residual*
# connection) and normalised, then a feed-forward network of two linear layers does the same. The
# shapes below are recorded, with forward hooks, from a call of attnkit's `TransformerEncoderLayer`
# in its default arrangement (normalisation after each sum, as in the original Transformer).

# %%
layer = TransformerEncoderLayer(E, H, ffn_dim=4 * E).eval()
seen = {}
parts = {"attention": layer.self_attn, "norm1": layer.norm1, "linear1": layer.ff.linear1,
         "linear2": layer.ff.linear2, "norm2": layer.norm2}
hooks = [m.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out))
         for name, m in parts.items()]
with torch.no_grad():
    y = layer(x)
for hook in hooks:
    hook.remove()
assert torch.equal(seen["norm2"], y)  # the last box is the layer's output

block_figure = viz.flow_diagram({
    "x": (f"X\n{shape(x, 'B, L, E')}", (0, 0)),
    "a": (f"multi-head self-attention\n(the call above)\n{shape(seen['attention'], 'B, L, E')}", (0, 1), "op"),
    "n1": (f"X + attention, LayerNorm\n{shape(seen['norm1'], 'B, L, E')}", (0, 2), "op"),
    "f1": (f"linear, ReLU\n{shape(seen['linear1'], 'B, L, 4E')}", (0, 3), "op"),
    "f2": (f"linear\n{shape(seen['linear2'], 'B, L, E')}", (0, 4), "op"),
    "n2": (f"sum, LayerNorm\n{shape(seen['norm2'], 'B, L, E')}", (0, 5), "op"),
}, [("x", "a"), ("a", "n1"), ("x", "n1", "residual"), ("n1", "f1"), ("f1", "f2"), ("f2", "n2"),
    ("n1", "n2", "residual")], title="One TransformerEncoderLayer, with its shapes")

# %% [markdown]
# Where next: [masks](../guides/masks.md) for every way to say who may attend to whom,
# [positions](../guides/positions.md) for how a model learns where a token is, and the
# [glossary](glossary.md) for these terms in Chinese and English with their attnkit names.
