# %% [markdown]
# # Masks, and the classic mistakes
#
# A mask tells attention which keys each query may look at. Two masks cover most models: a
# **padding mask**, which hides the filler tokens that make the sequences of a batch the same
# length, and a **causal mask**, which stops a token from reading the tokens after it. Both are easy
# to state and easy to get subtly wrong, and a wrong mask rarely raises an error: the model trains
# anyway, on the wrong information.
#
# This tutorial builds both masks with `attnkit.masks`, then runs the classic mistakes found in
# tutorial code on the web exactly as they are usually written, next to the fix, and measures what
# each one does. attnkit has one convention everywhere: a boolean mask is `True` where a query
# **may attend** a key.

# %%
import math

import matplotlib.pyplot as plt
import torch

import attnkit
from attnkit import masks, viz

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

sentences = [["the", "cat", "sat", "on", "the", "mat"], ["a", "dog", "ran"]]
lengths = [len(s) for s in sentences]
L, D = max(lengths), 8
tokens = [s + ["[pad]"] * (L - len(s)) for s in sentences]  # padded on the right
q, k, v = (torch.randn(2, 1, L, D) for _ in range(3))  # [batch, heads, length, head size]
for row in tokens:
    print(" ".join(f"{t:>6}" for t in row))
print("q, k, v:", tuple(q.shape), "= [batch, heads, length, head size]")

# %% [markdown]
# ## The padding mask
#
# The second sentence has 3 real tokens and 3 padding tokens. No query should take anything from a
# padding token, so the padding mask hides padding **keys**: every query row gets the same
# pattern. `masks.padding(lengths, L)` builds it with shape `[batch, 1, 1, L]`, which broadcasts over
# the heads and the query rows. `masks.picture` draws a 2-D mask as text, `#` for may attend.

# %%
keep = masks.padding(lengths, L)
print("masks.padding(lengths, L): shape", tuple(keep.shape), "dtype", keep.dtype)
print("keys a query of sentence 2 may attend:", keep[1, 0, 0].tolist())
print("\nsentence 2, queries down, keys across:")
print(masks.picture(keep[1, 0].expand(L, L)))

out, w = attnkit.attention(q, k, v, mask=keep, return_weights=True)
print("\nsentence 2's attention weights:")
print(w[1, 0])
print("weight on padding keys:", float(w[1, 0, :, lengths[1]:].sum()), "| every row sums to 1:",
      torch.allclose(w.sum(-1), torch.ones(2, 1, L)))

# %% [markdown]
# Hugging Face tokenizers give an `attention_mask` of 1 for a real token and 0 for padding;
# PyTorch's `key_padding_mask` is `True` for a token to *ignore*. Convert either once, at the edge,
# and the polarity question is settled. attnkit refuses an integer 0/1 mask outright, so that a
# 0/1 tensor can never be mistaken for a boolean one (or added to the scores, as below).

# %%
hf_attention_mask = torch.tensor([[1] * lengths[0] + [0] * (L - lengths[0]), [1] * lengths[1] + [0] * (L - lengths[1])])
torch_key_padding_mask = hf_attention_mask == 0
print("Hugging Face attention_mask:\n", hf_attention_mask)
print("same as ours from Hugging Face's:", torch.equal(masks.from_hf_attention_mask(hf_attention_mask), keep))
print("same as ours from PyTorch's:     ", torch.equal(masks.from_key_padding_mask(torch_key_padding_mask), keep))
try:
    attnkit.attention(q, k, v, mask=hf_attention_mask[:, None, None, :])
except TypeError as e:
    print("\nan integer mask is refused:", e)

# %% [markdown]
# ## The causal mask
#
# A language model predicts each next token, so token *i* may look at tokens 0 … *i* (itself
# included) and at nothing after it: the allowed pairs form the lower triangle, diagonal included.
# `masks.causal(L)` builds it; `is_causal=True` asks for the same thing without building a tensor.
# With padding too, the two masks combine with `&`: a pair is allowed when both allow it.

# %%
causal = masks.causal(L)
print("masks.causal(L):")
print(masks.picture(causal))
_, w_causal = attnkit.attention(q, k, v, is_causal=True, return_weights=True)
_, w_causal_mask = attnkit.attention(q, k, v, mask=causal, return_weights=True)
print("is_causal=True gives the same weights:", torch.allclose(w_causal, w_causal_mask))

both = causal & keep  # [L, L] & [B, 1, 1, L] -> [B, 1, L, L]
print("\ncausal & padding, sentence 2, shape", tuple(both.shape))
print(masks.picture(both[1, 0]))

fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), layout="constrained")
for ax, (title, m) in zip(axes, (("padding (sentence 2)", keep[1, 0].expand(L, L)), ("causal", causal),
                                 ("causal & padding (sentence 2)", both[1, 0])), strict=True):
    ax.imshow(m, cmap="Greens", vmin=0, vmax=1.3)
    ax.set_xticks(range(L), tokens[1] if "sentence" in title else tokens[0], rotation=90)
    ax.set_yticks(range(L), tokens[1] if "sentence" in title else tokens[0])
    ax.xaxis.tick_top()
    ax.set_title(title, fontsize=10)
fig.suptitle("Green: may attend. Queries down, keys across the top.", fontsize=10)

# %% [markdown]
# ## How we measure a mistake
#
# For the padding mistakes, two numbers on sentence 2 say whether padding got through:
#
# - **weight on padding**: how much of each real query's weight goes to padding keys (0 when the
#   mask works);
# - **leak**: how much the real tokens' outputs change when we replace the padding tokens' keys
#   and values by large random numbers (0 when the mask works: padding content must not matter).
#
# We also print the smallest row sum of the weights (1 for a proper softmax) and count NaNs. Every
# "as written" function below is the idiom as it appears in tutorials; every fix is checked against
# `attnkit.attention`.

# %%
REAL = slice(0, lengths[1])  # the real tokens of sentence 2
PAD = slice(lengths[1], L)
k_noise, v_noise = k.clone(), v.clone()
k_noise[1, :, PAD] = 10 * torch.randn(1, L - lengths[1], D)
v_noise[1, :, PAD] = 10 * torch.randn(1, L - lengths[1], D)


def measure(fn):
    """What ``fn(q, k, v) -> (out, weights)`` does with sentence 2's padding."""
    out, w = fn(q, k, v)
    out_noise, _ = fn(q, k_noise, v_noise)
    return {"weight on padding": float(w[1, 0, REAL, PAD].sum(-1).mean()),
            "leak": float((out_noise[1, 0, REAL] - out[1, 0, REAL]).abs().max()),
            "min row sum": float(w[1, 0, REAL].sum(-1).min()),
            "NaNs": int(out.isnan().sum())}


measured = {}  # every row shown, by name: the summary at the end is checked against them


def show(rows):
    measured.update(rows)
    print(f"{'':<34} {'weight on padding':>17} {'leak':>8} {'min row sum':>12} {'NaNs':>5}")
    for name, r in rows.items():
        print(f"{name:<34} {r['weight on padding']:>17.3f} {r['leak']:>8.3f} {r['min row sum']:>12.3f} {r['NaNs']:>5}")


def fixed(q, k, v):
    """The fix for every padding mistake below: a boolean mask, True = may attend, given to attnkit."""
    return attnkit.attention(q, k, v, mask=keep, return_weights=True)


scale = 1 / math.sqrt(D)
show({"attnkit.attention(mask=keep)": measure(fixed)})

# %% [markdown]
# ## Mistake 1: adding the 0/1 mask to the scores
#
# A mask of ones and zeros (like Hugging Face's `attention_mask`) added to the scores changes each
# score by 1 or by 0. That tilts the weights a little towards the real tokens, but it hides nothing:
# the padding keys still get a large share of the weight, and their content reaches the outputs. An
# *additive* mask only works when the hidden positions get `-inf` (or a very
# large negative number), so that `exp` sends them to exactly 0.

# %%
mask01 = hf_attention_mask[:, None, None, :].float()  # 1 = real token, 0 = padding


def add_the_mask(q, k, v):  # as written
    scores = q @ k.transpose(-2, -1) * scale + mask01
    w = torch.softmax(scores, dim=-1)
    return w @ v, w


def add_minus_inf(q, k, v):  # the additive form done right
    scores = q @ k.transpose(-2, -1) * scale + torch.where(mask01 > 0, 0.0, float("-inf"))
    w = torch.softmax(scores, dim=-1)
    return w @ v, w


show({"as written: scores + mask01": measure(add_the_mask),
      "fix: scores + (0 or -inf)": measure(add_minus_inf),
      "fix: attnkit.attention(mask=keep)": measure(fixed)})
print("the additive fix equals attnkit:", torch.allclose(add_minus_inf(q, k, v)[0], fixed(q, k, v)[0], atol=1e-6))

# %% [markdown]
# ## Mistake 2: multiplying the scores by the mask
#
# `scores * mask` sets the hidden scores to 0, not to `-inf`. A score of 0 is an ordinary score
# (`exp(0) = 1`), so padding keys still get weight, about as much as an average real key.

# %%


def multiply_by_the_mask(q, k, v):  # as written
    scores = q @ k.transpose(-2, -1) * scale * mask01
    w = torch.softmax(scores, dim=-1)
    return w @ v, w


show({"as written: scores * mask01": measure(multiply_by_the_mask),
      "fix: attnkit.attention(mask=keep)": measure(fixed)})
w_mul = multiply_by_the_mask(q, k, v)[1][1, 0, REAL]
print(f"\nas written, mean weight per padding key {float(w_mul[:, PAD].mean()):.3f}, "
      f"per real key {float(w_mul[:, REAL].mean()):.3f}")

# %% [markdown]
# ## Mistake 3: masking after the softmax, without renormalising
#
# Zeroing the padding weights *after* the softmax does hide the padding, but the weights the real
# keys keep no longer sum to 1: each output shrinks by whatever share went to padding, by a
# different amount in every row. Dividing each row by its new sum repairs it, and then it equals
# masking before the softmax (the softmax's denominator simply cancels).

# %%


def mask_after_softmax(q, k, v):  # as written
    w = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) * keep
    return w @ v, w


def mask_after_softmax_renormalised(q, k, v):
    w = torch.softmax(q @ k.transpose(-2, -1) * scale, dim=-1) * keep
    w = w / w.sum(-1, keepdim=True)
    return w @ v, w


show({"as written: softmax(s) * keep": measure(mask_after_softmax),
      "fix: ... then divide by the row sum": measure(mask_after_softmax_renormalised),
      "fix: attnkit.attention(mask=keep)": measure(fixed)})
out_bad, w_bad = mask_after_softmax(q, k, v)
out_good, _ = fixed(q, k, v)
shrink = out_bad[1, 0, REAL].norm(dim=-1) / out_good[1, 0, REAL].norm(dim=-1)
print("\nrow sums of sentence 2's real queries, as written:", w_bad[1, 0, REAL].sum(-1))
print("their output length as a share of the correct one:", shrink)
print("the renormalised version equals attnkit:",
      torch.allclose(mask_after_softmax_renormalised(q, k, v)[0], out_good, atol=1e-6))

# %% [markdown]
# Here are sentence 2's weights under the three mistakes so far, next to the correct ones, on one
# colour scale: the padding columns should be empty.

# %%
panels = {"correct (attnkit)": fixed(q, k, v)[1],
          "1: scores + mask01": add_the_mask(q, k, v)[1],
          "2: scores * mask01": multiply_by_the_mask(q, k, v)[1],
          "3: softmax(s) * keep": mask_after_softmax(q, k, v)[1]}
padding_mistakes = viz.head_grid(torch.stack([w[1, 0] for w in panels.values()]), tokens[1], labels=list(panels),
                                 ncols=4, title="Sentence 2: where the weight goes")

# %% [markdown]
# ## Mistake 4: a random boolean "mask"
#
# Code that needs a mask for a demonstration sometimes writes `torch.rand(L, L) > 0.1`. That is not
# a causal mask nor a padding mask: it hides a random tenth of the pairs and keeps about nine in ten
# of the future pairs visible, so a token's output depends on tokens after it. We check that
# directly on 64 tokens: change only the last token, and see which earlier outputs move.

# %%
n = 64
random_mask = torch.rand(n, n) > 0.1
future = torch.ones(n, n, dtype=torch.bool).triu(1)  # the pairs (i, j) with j > i
qn, kn, vn = (torch.randn(1, 1, n, D) for _ in range(3))
kn2, vn2 = kn.clone(), vn.clone()
kn2[..., -1, :] += 3.0
vn2[..., -1, :] += 3.0  # only the last token changes


def earlier_rows_that_move(mask):
    before = attnkit.attention(qn, kn, vn, mask=mask)
    after = attnkit.attention(qn, kn2, vn2, mask=mask)
    return int(((after - before)[0, 0, : n - 1].abs().amax(-1) > 1e-6).sum())


for name, m in (("as written: torch.rand(L, L) > 0.1", random_mask), ("fix: masks.causal(L)", masks.causal(n))):
    print(f"{name:<36} pairs kept {m.float().mean():.0%}, future pairs visible {m[future].float().mean():.0%}, "
          f"earlier tokens whose output moves when the last token changes: {earlier_rows_that_move(m)} of {n - 1}")

# %% [markdown]
# ## Mistake 5: a row with nothing to attend gives NaN
#
# Sometimes a query may attend no key at all. It happens naturally with **left** padding (common
# when a decoder generates for a batch): combined with the causal mask, a padding query at the start
# sees only padding keys. With plain `masked_fill(-inf)` and `softmax`, such a row is
# `exp(-inf) / Σ exp(-inf) = 0 / 0`, which is NaN. The NaN does not stay in its row: the next layer
# gives that position a weight of exactly 0, but `0 × NaN` is still NaN, so every output of the next
# layer becomes NaN. The old workaround of filling with `-1e9` instead gives finite numbers, but the
# empty row then spreads its weight evenly over all keys, the ones it was meant not to see included.
# attnkit returns zeros for such a row (zero weights, zero output, zero gradient).

# %%
keep_left = keep.flip(-1)  # the same sentences, padded on the left
left_causal = causal & keep_left
print("causal & left padding, sentence 2:")
print(masks.picture(left_causal[1, 0]))
empty_rows = (~left_causal[1, 0].any(-1)).nonzero().flatten().tolist()
print("rows with no key to attend:", empty_rows)


def plain(q, k, v, mask, fill=float("-inf")):  # as written in most tutorials
    scores = (q @ k.transpose(-2, -1) * scale).masked_fill(~mask, fill)
    w = torch.softmax(scores, dim=-1)
    return w @ v, w


def two_layers(attend):
    """Two attention layers, the second reading the first's outputs as its values."""
    out1, w1 = attend(q, k, v)
    out2, _ = attend(q, k, out1)
    return out1, w1, out2


for name, attend in (
    ("as written: masked_fill(-inf)", lambda q, k, v: plain(q, k, v, left_causal)),
    ("workaround: masked_fill(-1e9)", lambda q, k, v: plain(q, k, v, left_causal, fill=-1e9)),
    ("fix: attnkit.attention", lambda q, k, v: attnkit.attention(q, k, v, mask=left_causal, return_weights=True)),
):
    out1, w1, out2 = two_layers(attend)
    print(f"\n{name}")
    print(f"  layer 1: NaN rows {int(out1[1, 0].isnan().any(-1).sum())} of {L}; weights of row 0: {w1[1, 0, 0]}")
    print(f"  layer 2: NaN rows {int(out2[1, 0].isnan().any(-1).sum())} of {L} in sentence 2")

# %% [markdown]
# ## Mistake 6: a causal mask off by one, or the wrong way round
#
# Four ways to build "the causal mask" that each look plausible in a code listing, next to the
# right one. PyTorch's `torch.triu(ones, diagonal=1)` is the *future*: in PyTorch's
# `attn_mask`, `True` means "do not attend", so given to a library where `True` means "may attend" it
# lets every token see only the future. `tril(diagonal=1)` lets every token see one token ahead;
# `tril(diagonal=-1)` hides each token from itself and leaves the first row empty; `triu(diagonal=0)`
# is the right mask transposed, so each token sees itself and the future. We count, for
# each: the future pairs it lets through, the allowed pairs (past and self) it hides, the rows left
# with nothing, and, as before, how many earlier outputs move when only the last token changes.

# %%
ones = torch.ones(L, L, dtype=torch.bool)
candidates = {
    "triu(diagonal=1)  [torch's 'future']": ones.triu(1),
    "triu(diagonal=0)": ones.triu(0),
    "tril(diagonal=1)": ones.tril(1),
    "tril(diagonal=-1)": ones.tril(-1),
    "masks.causal(L)  [right]": masks.causal(L),
}
future_L = ones.triu(1)
qc, kc, vc = q[:1], k[:1], v[:1]
kc2, vc2 = kc.clone(), vc.clone()
kc2[..., -1, :] += 3.0
vc2[..., -1, :] += 3.0
print(f"{'mask (True = may attend)':<38} {'future pairs seen':>17} {'allowed pairs hidden':>21} "
      f"{'empty rows':>11} {'earlier outputs moved':>22}")
for name, m in candidates.items():
    moved = (attnkit.attention(qc, kc2, vc2, mask=m) - attnkit.attention(qc, kc, vc, mask=m))[0, 0, :-1]
    print(f"{name:<38} {int(m[future_L].sum()):>17} {int((~m[~future_L]).sum()):>21} "
          f"{int((~m.any(-1)).sum()):>11} {int((moved.abs().amax(-1) > 1e-6).sum()):>17} of {L - 1}")

fig, axes = plt.subplots(1, len(candidates), figsize=(13, 3), layout="constrained")
for ax, (name, m) in zip(axes, candidates.items(), strict=True):
    ax.imshow(m, cmap="Greens", vmin=0, vmax=1.3)
    ax.set_title(name.split("  ")[0] + ("\n(right)" if "right" in name else "\n(wrong)"), fontsize=9)
    ax.set_xticks(range(L))
    ax.set_yticks(range(L))
    ax.xaxis.tick_top()
fig.suptitle("Green: may attend. Queries down, keys across.", fontsize=10)

# %% [markdown]
# Only the lower triangle with its diagonal keeps every earlier output independent of the last
# token while hiding nothing a token is allowed to see.
#
# ## Mistake 7: the padding mask on the query axis
#
# A padding mask of shape `[batch, L]` has to be given two new axes to broadcast against the scores
# `[batch, heads, queries, keys]`. `mask[:, None, None, :]` puts the sequence on the **key** axis, the
# right one; `mask[:, None, :, None]` puts it on the **query** axis. The second hides the padding
# *queries* (whose outputs nobody uses) and lets every real query attend to the padding *keys*:
# the opposite of what was meant. It also leaves the padding rows with nothing to attend, so plain
# softmax code gets NaN there too.

# %%
key_padding = hf_attention_mask.bool()  # [batch, L], True = real token


def on_the_query_axis(q, k, v):  # as written
    return plain(q, k, v, key_padding[:, None, :, None])


def on_the_key_axis(q, k, v):  # the fix
    return plain(q, k, v, key_padding[:, None, None, :])


show({"as written: mask[:, None, :, None]": measure(on_the_query_axis),
      "fix: mask[:, None, None, :]": measure(on_the_key_axis),
      "fix: attnkit.attention(mask=keep)": measure(fixed)})
print("\nthe key-axis fix equals attnkit:", torch.allclose(on_the_key_axis(q, k, v)[0], fixed(q, k, v)[0], atol=1e-6))
print("masks.padding already has the key axis: shape", tuple(keep.shape), "= [batch, 1, 1, keys]")

query_axis = viz.head_grid(torch.stack([on_the_query_axis(q, k, v)[1][1, 0].nan_to_num(), fixed(q, k, v)[1][1, 0]]),
                           tokens[1], labels=["as written: query axis\n(NaN drawn as 0)", "fix: key axis"],
                           ncols=2, title="Sentence 2: the padding mask on the wrong axis and the right one")

# What the summary below states, checked on the numbers above.
for name, r in measured.items():
    if name.startswith("fix"):  # every fix: no weight on padding, no leak, rows summing to 1, no NaN
        assert r["weight on padding"] == 0 and r["leak"] < 1e-5 and abs(r["min row sum"] - 1) < 1e-5 and not r["NaNs"]
for name in ("as written: scores + mask01", "as written: scores * mask01", "as written: mask[:, None, :, None]"):
    assert measured[name]["weight on padding"] > 0.05 and measured[name]["leak"] > 0.05, name  # padding gets through
assert measured["as written: softmax(s) * keep"]["min row sum"] < 0.99 and bool((shrink < 1).all())
assert random_mask[future].float().mean() > 0.5  # most future pairs stay visible
nan_rows = [int(two_layers(attend)[2][1, 0].isnan().any(-1).sum()) for attend in (
    lambda q, k, v: plain(q, k, v, left_causal),
    lambda q, k, v: attnkit.attention(q, k, v, mask=left_causal, return_weights=True))]
assert nan_rows == [L, 0]  # NaN in one row spreads to every row of the next layer; attnkit gives none
for name, m in candidates.items():  # each wrong causal mask lets the future in or hides a token from itself
    wrong = bool(m[future_L].any()) or bool((~m[~future_L]).any())
    assert wrong != ("right" in name), name

# %% [markdown]
# ## Summary
#
# | mistake | what the measurement shows | fix |
# | --- | --- | --- |
# | adding a 0/1 mask | padding still gets weight; its content leaks | a bool `mask=`, or add `-inf`, not 0 |
# | multiplying the scores by the mask | a hidden score of 0 is still a score | the same |
# | masking after the softmax | rows no longer sum to 1, outputs shrink | mask before the softmax (or renormalise) |
# | a random boolean "mask" | most future pairs stay visible | `masks.causal` or `is_causal=True` |
# | a row with nothing to attend | NaN, which the next layer spreads to every row | attnkit gives zeros |
# | causal mask off by one or reversed | the future leaks, or a token loses itself | `masks.causal`, `is_causal` |
# | padding on the query axis | real queries attend to padding | `[batch, 1, 1, keys]`: `masks.padding` |
#
# Where next: the guide [Masks and the one polarity](../guides/masks.md) lists every mask attnkit
# builds (windows, documents, prefix-LM, sparse patterns) and how other libraries' masks convert.
