# %% [markdown]
# # Positions: what attention knows about order, and the ways to tell it
#
# Self-attention mixes tokens by weights computed from their contents, so on its own it cannot tell
# "the dog bit the man" from "the man bit the dog". This tutorial first shows that exactly (permute the
# tokens, and the outputs permute with them), then looks at three ways of giving attention the order:
# the sinusoidal table of the original Transformer, rotary embeddings (RoPE) and linear biases
# (ALiBi), each with the property it is chosen for, measured. (Learned embeddings, a trained vector
# per position as in BERT and GPT-2, are `positional.LearnedPositionalEmbedding`.)

# %%
import math

import matplotlib.pyplot as plt
import torch

import attnkit
from attnkit import positional

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

# %% [markdown]
# ## Without positions, attention cannot see order
#
# Take six tokens, run one attention layer, then shuffle the tokens and run it again. If the layer
# knew the order, shuffling would change what each token computes. It does not: each token's output
# is the same vector, only moved to the token's new place. Attention without positions is
# *permutation-equivariant*.

# %%
n, d = 6, 16
mha = attnkit.MultiHeadAttention(d, 2).eval()
x = torch.randn(1, n, d)
perm = torch.randperm(n)
with torch.no_grad():
    out = mha(x)
    out_shuffled = mha(x[:, perm])
print("permutation:", perm.tolist())
gap = (out_shuffled - out[:, perm]).abs().max().item()
print(f"largest difference between the shuffled run and the shuffled outputs: {gap:.2e}")
assert gap < 1e-5

# %% [markdown]
# A causal mask is the one exception: it does tell order apart, because token *i* sees only tokens
# up to *i*. Shuffle the tokens under a causal mask and the outputs change:

# %%
with torch.no_grad():
    causal = mha(x, is_causal=True)
    causal_shuffled = mha(x[:, perm], is_causal=True)
gap_causal = (causal_shuffled - causal[:, perm]).abs().max().item()
print(f"the same comparison under a causal mask: {gap_causal:.3f}")

# %% [markdown]
# ## The sinusoidal table
#
# The original Transformer adds to each token's embedding a vector that depends only on its position:
#
# ```text
# PE(pos, 2i)   = sin(pos / 10000^(2i/d))
# PE(pos, 2i+1) = cos(pos / 10000^(2i/d))
# ```
#
# A common explanation gets this backwards and says odd *positions* use cosine and even *positions*
# use sine. It is the *dimensions* that alternate: every position has both, a sine in each even
# dimension and a cosine in each odd one. The picture shows the table: each column a dimension,
# fast waves on the left, slow ones on the right.

# %%
table = positional.sinusoidal_table(64, 32)
print("table shape (positions, dimensions):", tuple(table.shape))
pos, i = 5, 3
print(f"PE({pos}, {2 * i}) = {table[pos, 2 * i]:.4f}, sin({pos} / 10000^({2 * i}/32)) = "
      f"{math.sin(pos / 10000 ** (2 * i / 32)):.4f}")
print(f"PE({pos}, {2 * i + 1}) = {table[pos, 2 * i + 1]:.4f}, cos(...) = {math.cos(pos / 10000 ** (2 * i / 32)):.4f}")

fig, ax = plt.subplots(figsize=(7, 3.2), layout="constrained")
im = ax.imshow(table, cmap="RdBu_r", aspect="auto", vmin=-1, vmax=1)
ax.set_xlabel("dimension (even: sin, odd: cos)")
ax.set_ylabel("position")
ax.set_title("The sinusoidal position table")
fig.colorbar(im, ax=ax)
plt.show()

# %% [markdown]
# Two properties make the table useful. Every position gets a different vector (the slowest waves
# have periods far beyond the sequence), and the dot product of two positions' vectors depends only
# on how far apart they are, not on where they are: `PE(p)·PE(p + k)` is the same for every `p`.

# %%
table = positional.sinusoidal_table(256, 64)
distinct = torch.cdist(table, table) + torch.eye(256) * 1e9
print(f"closest pair of different positions: distance {distinct.min():.3f} (0 would mean two positions share a vector)")
for k in (1, 4, 16):
    dots = (table[:-k] * table[k:]).sum(-1)
    print(f"PE(p)·PE(p+{k:2d}) over every p: min {dots.min():.4f}, max {dots.max():.4f}")
offsets = torch.arange(64)
similarity = table[64] @ table[64 + offsets - 32].T
fig, ax = plt.subplots(figsize=(6, 2.6), layout="constrained")
ax.plot((offsets - 32).numpy(), similarity.numpy())
ax.set_xlabel("offset k")
ax.set_ylabel("PE(p)·PE(p+k)")
ax.set_title("The table's similarity falls with distance, and depends on nothing else")
plt.show()

# %% [markdown]
# ## Rotary embeddings: relative position inside the score
#
# RoPE does not add anything to the embeddings. It rotates each query and key by an angle
# proportional to its position, pair of features by pair of features. Since rotations compose, the
# score between a query at position *m* and a key at position *n* depends only on *m − n*: move
# both tokens by the same amount and every score stays the same.

# %%
rope = positional.RotaryEmbedding(16)
q1, k1 = torch.randn(1, 16), torch.randn(1, 16)
for m, n_ in ((3, 1), (10, 8), (100, 98)):
    qm = rope(q1, start=m)
    kn = rope(k1, start=n_)
    print(f"query at {m:3d}, key at {n_:3d} (m - n = {m - n_}): score {float((qm * kn).sum()):.6f}")
qm, kn = rope(q1, start=10), rope(k1, start=5)
print(f"query at  10, key at   5 (m - n = 5): score {float((qm * kn).sum()):.6f}  (another offset, another score)")

# %% [markdown]
# `attnkit.MultiHeadAttention(..., rotary=positional.RotaryEmbedding(head_dim))` applies it inside
# the module, to the queries and keys of every head. The layer now sees order: shuffling the tokens
# no longer just shuffles the outputs.

# %%
mha_rope = attnkit.MultiHeadAttention(d, 2, rotary=positional.RotaryEmbedding(d // 2)).eval()
with torch.no_grad():
    plain = mha_rope(x)
    shuffled = mha_rope(x[:, perm])
gap_rope = (shuffled - plain[:, perm]).abs().max()
print(f"with RoPE, shuffled run against shuffled outputs: largest difference {gap_rope:.3f}")


# %% [markdown]
# ## ALiBi: a penalty that grows with distance
#
# ALiBi adds no vector at all. It subtracts from each score a slope times the distance between
# query and key, with a different slope per head: steep heads look close by, shallow heads far away.

# %%
alibi = positional.ALiBi(4)
bias = alibi.bias(12, 12)
print("slopes per head:", [round(float(s), 4) for s in alibi.slopes])
fig, axes = plt.subplots(1, 4, figsize=(10, 2.8), layout="constrained")
for h, ax in enumerate(axes):
    ax.imshow(bias[h], cmap="viridis")
    ax.set_title(f"head {h}: slope {float(alibi.slopes[h]):.3f}")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
plt.show()

# %% [markdown]
# What the slopes do to the weights: with equal contents everywhere, the weights come from the bias
# alone. The steepest head puts more than half of the last query's weight on its 3 nearest keys; the
# shallowest spreads it almost evenly over all 12 (an even spread would give 3/12 = 0.25).

# %%
weights = torch.softmax(bias[:, -1], dim=-1)  # the last query, causal: keys 0..11
for h in range(4):
    near = float(weights[h, -3:].sum())
    print(f"head {h}: weight on the 3 nearest keys {near:.2f}")

# What the text above and the lines below state, checked.
near = weights[:, -3:].sum(-1)
assert near[int(alibi.slopes.argmax())] > 0.5 and abs(float(near[int(alibi.slopes.argmin())]) - 3 / 12) < 0.01
assert gap < 1e-5 and gap_rope > 0.1  # equivariant without positions; RoPE sees order
sines = positional.sinusoidal_table(64, 32)
assert all(math.isclose(float(sines[p, 2 * i]), math.sin(p / 10000 ** (2 * i / 32)), abs_tol=1e-6)
           and math.isclose(float(sines[p, 2 * i + 1]), math.cos(p / 10000 ** (2 * i / 32)), abs_tol=1e-6)
           for p in range(64) for i in range(16))  # every position: sine in even dimensions, cosine in odd
for k in (1, 4, 16):  # the table's dot products depend on the offset alone
    dots = (table[:-k] * table[k:]).sum(-1)
    assert float(dots.max() - dots.min()) < 1e-3
assert torch.equal(bias[:, 1:, 1:], bias[:, :-1, :-1])  # ALiBi: the same along every diagonal, m - n alone
rope_scores = [float((rope(q1, start=m + shift) * rope(k1, start=shift)).sum()) for m in (2, 5) for shift in (0, 40)]
assert math.isclose(*rope_scores[:2], abs_tol=1e-4) and math.isclose(*rope_scores[2:], abs_tol=1e-4)

# %% [markdown]
# ## What to take away
#
# - Without positions (and without a causal mask), attention is permutation-equivariant: shuffling
#   the tokens only shuffles the outputs.
# - The sinusoidal table alternates sine and cosine across *dimensions*; every position gets both.
#   Its dot products depend only on the offset.
# - RoPE puts relative position into the score itself; ALiBi subtracts a distance penalty per head.
#   Both make the score depend on `m − n` alone. Papers credit that with carrying over better to
#   lengths not seen in training; this tutorial shows the property, not that claim.
