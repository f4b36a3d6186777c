# %% [markdown]
# # Many heads
#
# One attention head computes one set of weights per query: one idea of "which other tokens matter
# to me". Multi-head attention runs several heads side by side, each on its own slice of the
# projections, so that one head can follow the previous token while another links a pronoun to its
# noun, and then mixes their outputs with one more linear map.
#
# This tutorial follows the tensors through the reshapes that make the heads, counts what the heads
# cost, checks `attnkit.MultiHeadAttention` against PyTorch's `torch.nn.MultiheadAttention`, and
# then looks at the 72 heads of a real pretrained model, MiniLM: what they attend to, and what the
# model loses when one of them is switched off.

# %%
import matplotlib.pyplot as plt
import torch
from torch.utils.flop_counter import FlopCounterMode

import attnkit
from attnkit import analysis, viz
from attnkit.models import Bert

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)
# The tensors here are small: one thread runs them fastest (several threads mostly wait for each
# other, badly so on a busy machine).
torch.set_num_threads(1)

B, L, E, H = 2, 5, 16, 4  # batch, tokens, model width, heads
D = E // H  # each head's size
x = torch.randn(B, L, E)
mha = attnkit.MultiHeadAttention(E, H).eval()
print(f"batch B = {B}, tokens L = {L}, width E = {E}, heads H = {H}, head size D = E / H = {D}")
print("x:", tuple(x.shape), "= [B, L, E]")

# %% [markdown]
# ## From `[B, L, E]` to `[B, H, L, D]` and back
#
# The query projection is one `E × E` linear map. Its output has `E` features per token; the heads
# do not get separate matrices, they get separate **slices**: head 0 the first `D` features, head 1
# the next `D`, and so on. Two steps make that a head axis. `view(B, L, H, D)` cuts each token's `E`
# features into `H` pieces of `D`, and `transpose(1, 2)` moves the head axis in front of the tokens,
# so that each head is a separate `[L, D]` matrix that attention can treat on its own.

# %%
q = mha.q_proj(x)
print("q = q_proj(x):                ", tuple(q.shape), "[B, L, E]")
q_split = q.view(B, L, H, D)
print("q.view(B, L, H, D):           ", tuple(q_split.shape), "[B, L, H, D]")
q_heads = q_split.transpose(1, 2)
print("   .transpose(1, 2):          ", tuple(q_heads.shape), "[B, H, L, D]")

h = 2
print(f"\nhead {h} is features {h * D} ... {(h + 1) * D - 1} of the projection:",
      torch.equal(q_heads[:, h], q[..., h * D:(h + 1) * D]))
q_ak, k_ak, v_ak = mha.project_qkv(x, x, x)
print("the module's own project_qkv gives the same:", torch.equal(q_ak, q_heads))

per_head = attnkit.attention(q_ak, k_ak, v_ak)
print("\nattention, every head at once:", tuple(per_head.shape), "[B, H, L, D]")
merged = per_head.transpose(1, 2).reshape(B, L, E)
print("   .transpose(1, 2).reshape(B, L, E):", tuple(merged.shape), "[B, L, E]  (the heads side by side)")
out = mha.out_proj(merged)
print("out_proj(...):", tuple(out.shape), "equals mha(x):", torch.allclose(out, mha(x), atol=1e-6))

# %% [markdown]
# The way back needs the transpose too. A frequent bug reshapes `[B, H, L, D]` straight to
# `[B, L, E]`: the numbers fit, nothing raises, and the tokens get scrambled. To see where each
# piece lands, we fill every head's output with a label, `"h2p3"` for head 2 at position 3, and
# print which labels end up in the output row of token 0.

# %%
labels = [[f"h{h}p{p}" for p in range(L)] for h in range(H)]  # [H, L], one label per [D] piece
code = torch.arange(H * L).view(1, H, L, 1).expand(1, H, L, D)  # the same, as numbers


def row_zero(t):
    """The labels of the D-sized pieces of token 0's output row."""
    return [labels[int(c) // L][int(c) % L] for c in t[0, 0, ::D]]


print("right: transpose(1, 2).reshape ->", row_zero(code.transpose(1, 2).reshape(1, L, E)))
print("wrong: reshape alone           ->", row_zero(code.reshape(1, L, E)))
wrong = per_head.reshape(B, L, E)
print("\nthe wrong merge differs from the right one:", not torch.allclose(wrong, merged))

# %% [markdown]
# With the transpose, token 0's row holds position 0 of every head. Without it, it holds positions
# 0 to 3 of head 0: the output for token 0 is built from other tokens' results.
#
# ## Many small heads cost what one big head costs
#
# One head of size `E` computes an `L × L` matrix of scores with `L × L × E` multiply-adds, and the
# same again to mix the values. `H` heads of size `E / H` each do `L × L × E / H` of both, so
# together they do exactly the same amount: splitting the width into heads changes the *shape* of
# the work, not its amount. The projections are the same `E × E` matrices whatever `H` is, so the
# parameters do not change either.
#
# Here we count the floating-point operations (a multiply-add is 2) of a layer with `E = 64` on
# 128 tokens: by the formula `4 L² E` for the two products, with PyTorch's FLOP counter
# (`torch.utils.flop_counter`) around `attnkit.attention` and around the whole module, and with
# `attnkit.analysis.attention_cost`. (The counter counts matrix products, so we run the `reference`
# backend, which computes the scores as a matrix product; the other backends compute the same
# thing in tiles.)

# %%
E_big, L_big = 64, 128
x_big = torch.randn(1, L_big, E_big)
print(f"E = {E_big}, L = {L_big}; by the formula, QK^T and PV: 4 L^2 E = {4 * L_big**2 * E_big:,} FLOPs\n")
print(f"{'heads':>5} {'head size':>9} {'QK^T + PV, counted':>19} {'whole module, counted':>22} "
      f"{'attention_cost':>15} {'parameters':>11} {'score entries':>14}")
costs = []
for heads in (1, 2, 4, 8, 16):
    m = attnkit.MultiHeadAttention(E_big, heads, bias=False)
    qh, kh, vh = m.project_qkv(x_big, x_big, x_big)
    with FlopCounterMode(display=False) as core:
        attnkit.attention(qh, kh, vh, backend="reference")
    with FlopCounterMode(display=False) as whole:
        m(x_big, backend="reference")
    cost = analysis.attention_cost(L_big, E_big, heads)
    params = sum(p.numel() for p in m.parameters())
    costs.append((heads, core.get_total_flops(), whole.get_total_flops(), params, cost.score_elements))
    print(f"{heads:>5} {E_big // heads:>9} {core.get_total_flops():>19,} {whole.get_total_flops():>22,} "
          f"{cost.attention_flops:>15,.0f} {params:>11,} {cost.score_elements:>14,}")
same_flops = len({c[1] for c in costs}) == 1 and len({c[2] for c in costs}) == 1
print("\nthe same FLOPs for every number of heads:", same_flops)
print("the same parameters for every number of heads:", len({c[3] for c in costs}) == 1)

# %% [markdown]
# What does grow with the number of heads is the last column: `H` score matrices of `L × L`
# instead of one, so the softmax handles `H` times more entries and a backend that stores the
# weights stores `H` times more. That, not the arithmetic, is what many heads cost.
#
# ## The same module as PyTorch's
#
# `torch.nn.MultiheadAttention` computes the same thing with its weights laid out differently (the
# three projections stacked in one `in_proj_weight`). `MultiHeadAttention.from_torch` copies a
# PyTorch module into an attnkit one, and `to_torch` goes the other way. One detail of PyTorch's
# module catches people out: by default it returns the attention weights **averaged over the
# heads**; `average_attn_weights=False` gives one map per head.

# %%
torch_mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
ours = attnkit.MultiHeadAttention.from_torch(torch_mha).eval()

with torch.no_grad():
    out_t, w_t = torch_mha(x, x, x, need_weights=True, average_attn_weights=False)
    out_a, w_a = ours(x, need_weights=True)
    _, w_t_avg = torch_mha(x, x, x, need_weights=True)  # PyTorch's default
print("PyTorch out", tuple(out_t.shape), "weights", tuple(w_t.shape), "| attnkit out", tuple(out_a.shape),
      "weights", tuple(w_a.shape))
print(f"outputs equal:          max abs difference {float((out_t - out_a).abs().max()):.1e}")
print(f"per-head weights equal: max abs difference {float((w_t - w_a).abs().max()):.1e}")
print("PyTorch's default weights", tuple(w_t_avg.shape), "are the mean of the heads:",
      torch.allclose(w_t_avg, w_a.mean(1), atol=1e-6))

back = ours.to_torch().eval()
with torch.no_grad():
    out_back, _ = back(x, x, x)
print(f"to_torch and back:      max abs difference {float((out_back - out_a).abs().max()):.1e}")

# %% [markdown]
# ## The heads of a real model
#
# `attnkit.models.Bert.from_pretrained()` loads MiniLM (all-MiniLM-L6-v2, a sentence-embedding model)
# from a Python package that bundles its weights, so nothing is downloaded: 6 layers of 12 heads of
# size 32. `output_attentions=True` returns every layer's weights, `[B, H, L, L]` per layer.

# %%
bert = Bert.from_pretrained()
cfg = bert.config
print(f"MiniLM: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads each, width "
      f"{cfg.hidden_size}, head size {cfg.hidden_size // cfg.num_attention_heads}")

sentence = "The cat sat on the mat because it was tired."
enc = bert.tokenizer([sentence])
words = bert.tokenizer.convert_ids_to_tokens(enc.input_ids[0])
with torch.no_grad():
    result = bert(enc.input_ids, enc.attention_mask, output_attentions=True)
attn = torch.stack(result.attentions)[:, 0]  # [layers, heads, L, L]
print("tokens:", words)
print("attention of all layers:", tuple(attn.shape), "= [layers, heads, L, L]")

# %% [markdown]
# A few simple patterns can be measured for every head: the mean weight a token gives to the token
# just before it, to the one just after it, to itself, and to the `[CLS]` token at the start
# (many heads put much of their weight there). For each pattern we print the
# head that follows it most.

# %%
n = attn.shape[-1]
i = torch.arange(n)
patterns = {
    "previous token": attn[..., i[1:], i[:-1]].mean(-1),
    "next token": attn[..., i[:-1], i[1:]].mean(-1),
    "itself": attn[..., i, i].mean(-1),
    "[CLS]": attn[..., :, 0].mean(-1),
}
for name, score in patterns.items():
    layer, head = divmod(int(score.argmax()), score.shape[1])
    print(f"{name:>15}: strongest in layer {layer} head {head}, mean weight {float(score.max()):.2f} "
          f"(median over all 72 heads {float(score.median()):.2f})")

best_prev = divmod(int(patterns["previous token"].argmax()), attn.shape[1])
best_next = divmod(int(patterns["next token"].argmax()), attn.shape[1])

# %% [markdown]
# Here are all the heads of the layer that holds the strongest previous-token head. A head that
# follows the previous token draws a line just below the diagonal.

# %%
layer_grid = viz.head_grid(attn[best_prev[0]], words, ncols=6,
                           title=f"MiniLM layer {best_prev[0]}: '{sentence}'")

# %% [markdown]
# And one number per head for the whole model: the entropy of its weights (`attnkit.viz.head_stats`,
# in bits: 0 for a head that puts all of a token's weight on one key). Sharp heads have low entropy,
# heads that spread their weight evenly have high entropy.

# %%
entropy_map = viz.head_stats(result.attentions, "entropy",
                             title="MiniLM: mean entropy of each head's weights (bits)")
ent = torch.stack([analysis.entropy(a)[0] for a in result.attentions])  # [layers, heads]
low = divmod(int(ent.argmin()), ent.shape[1])
print(f"sharpest head: layer {low[0]} head {low[1]}, {float(ent.min()):.2f} bits; "
      f"broadest: {float(ent.max()):.2f} bits (uniform over {n} tokens would be {float(torch.tensor(n).log2()):.2f})")

# %% [markdown]
# ## Which heads does the sentence embedding need? Switch them off one at a time
#
# A picture of a head says what it looks at, not whether the model needs it. To ask that, we
# **ablate** heads: zero one head's output (its `D` columns of the input to the output projection,
# `out_proj`) with a PyTorch forward hook, and measure how much the model's sentence embedding
# (`bert.encode`: mean of the last layer's tokens, normalised) moves. We use the cosine similarity
# between the embedding with and without the head, and report `1 − cosine`: 0 means the head made
# no difference. We do this for each of the 72 heads on four sentences, and average.
#
# To give the numbers a scale we also print the same distance between *different* sentences, and
# the effect of switching off a whole layer's attention (all 12 heads at once).

# %%
sentences = [sentence, "A dog ran across the park in the rain.", "Stock prices fell sharply on Monday.",
             "She plays the violin every evening."]
n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
d_head = cfg.hidden_size // n_heads
full = bert.encode(sentences)  # [4, 384], unit length


def ablated(layer, heads):
    """The sentence embeddings with ``heads`` of ``layer`` zeroed."""

    def zero_heads(module, args):
        (z,) = args
        z = z.clone()
        for h in heads:
            z[..., h * d_head:(h + 1) * d_head] = 0
        return (z,)

    handle = bert.layers[layer].self_attn.out_proj.register_forward_pre_hook(zero_heads)
    try:
        return bert.encode(sentences)
    finally:
        handle.remove()


def distance(emb):
    return float(1 - (emb * full).sum(-1).mean())


print("no head switched off:", f"{distance(ablated(0, [])):.1e}")
effect = torch.tensor([[distance(ablated(layer, [h])) for h in range(n_heads)] for layer in range(n_layers)])
whole_layer = [distance(ablated(layer, range(n_heads))) for layer in range(n_layers)]
pairs = full @ full.T
between = 1 - pairs[~torch.eye(len(sentences), dtype=torch.bool)]
print(f"between different sentences:      1 - cosine from {float(between.min()):.3f} to {float(between.max()):.3f}")
print("a whole layer's attention off:    " + ", ".join(f"layer {i}: {d:.3f}" for i, d in enumerate(whole_layer)))
print(f"one head off, over all 72 heads:  from {float(effect.min()):.4f} to {float(effect.max()):.4f}, "
      f"median {float(effect.median()):.4f}")
print("\nthe five heads whose loss moves the embedding most:")
for flat in effect.flatten().argsort(descending=True)[:5].tolist():
    layer, head = divmod(flat, n_heads)
    print(f"  layer {layer} head {head}: 1 - cosine = {float(effect[layer, head]):.4f}")
per_layer = effect.mean(1)
print("\nmean effect of one head, per layer:", ", ".join(f"{float(v):.4f}" for v in per_layer),
      f"(largest: layer {int(per_layer.argmax())})")
print("in every layer, each head alone moves the embedding less than the whole layer's attention does:",
      all(float(effect[layer].max()) < whole_layer[layer] for layer in range(n_layers)))
print("every head alone moves it less than the closest two different sentences are apart:",
      float(effect.max()) < float(between.min()))
for name, (layer, head) in (("previous-token", best_prev), ("next-token", best_next)):
    rank = int((effect > effect[layer, head]).sum()) + 1
    print(f"the {name} head (layer {layer} head {head}): 1 - cosine = {float(effect[layer, head]):.4f}, "
          f"rank {rank} of 72")

# %%
fig, ax = plt.subplots(figsize=(9, 3.8), layout="constrained")
im = ax.imshow(effect, cmap="magma_r", aspect="auto")
ax.set_xticks(range(n_heads))
ax.set_yticks(range(n_layers))
ax.set(xlabel="head", ylabel="layer",
       title="MiniLM: how far the sentence embedding moves when one head is zeroed (1 - cosine)")
for (layer, head), value in zip(torch.cartesian_prod(torch.arange(n_layers), torch.arange(n_heads)).tolist(),
                                effect.flatten().tolist(), strict=True):
    ax.text(head, layer, f"{value:.3f}", ha="center", va="center", fontsize=7,
            color="white" if value > float(effect.max()) / 2 else "black")
fig.colorbar(im, ax=ax, label="1 - cosine to the full model")

# What the text below states, checked on these numbers.
assert float(effect.max()) < float(between.min()) / 2  # any one head: far less than two sentences apart
assert all(float(effect[layer].max()) < whole_layer[layer] for layer in range(n_layers))
assert int(per_layer.argmax()) == n_layers - 1  # the last layer's heads matter most
crisp_ranks = [int((effect > effect[layer, head]).sum()) + 1 for layer, head in (best_prev, best_next)]
assert min(crisp_ranks) > 5, crisp_ranks  # the crisp heads are not among the five that matter most

# %% [markdown]
# Three things to read from these numbers. First, removing any single head moves the embedding far
# less than the distance between two different sentences, and less than removing all the heads of
# its own layer: the model survives the loss of any one head. (The residual connections carry each
# token's representation past the attention, and the other heads still work.) Second, the heads of
# the last layer matter most for this embedding, which is no surprise: there is no later layer to
# make up for them, and the embedding is read straight from that layer's output. Third, a head
# with a crisp, recognisable pattern is not necessarily one the embedding leans on: compare the
# previous-token and next-token heads' ranks above.
#
# What this measurement depends on: zeroing is one way to remove a head (replacing its output by its
# average over many sentences is another, and can give different numbers); four short sentences are
# a small sample; and "matters for the mean-pooled sentence embedding" is one question among many:
# a head can matter for a task that this distance does not see.
#
# Where next: [Attention by hand](attention_by_hand.md) computes one head step by step; the guide
# [The viewer and analysis](../guides/viewer.md) draws every layer and head of a model in an
# interactive page; the [glossary](glossary.md) has these terms in Chinese and English.
