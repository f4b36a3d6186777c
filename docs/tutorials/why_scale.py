# %% [markdown]
# # Why divide by √d_k, honestly
#
# Scaled dot-product attention divides every score by `√d_k`, the square root of the query and key
# size: `softmax(Q Kᵀ / √d_k) V`. A common explanation of why goes in four steps:
#
# 1. the dot product `q · k` of two random vectors of size `d_k` has variance `d_k`;
# 2. such large scores make the softmax *saturate*: one key gets almost all the weight;
# 3. a saturated softmax has a vanishing gradient;
# 4. so without the scaling, training fails.
#
# This tutorial measures each step. The first two hold exactly as stated. The third holds for the
# softmax's own slope, but the gradient that reaches the queries is *larger* without the scaling at
# every size measured here. The fourth depends on how the weights start: from the unit-variance
# queries and keys the argument assumes, the unscaled model falls far behind; from the Xavier
# initialisation that attnkit (like most libraries) uses, both train.

# %%
import math

import matplotlib.pyplot as plt
import torch
from torch import nn

import attnkit
from attnkit import analysis
from attnkit.positional import SinusoidalPositionalEncoding

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)

DIMS = [4, 16, 64, 256, 1024, 4096]  # the head sizes d_k we measure
N_KEYS, N_QUERIES = 64, 256  # each query scores 64 keys; 256 queries per size
gen = torch.Generator().manual_seed(0)
data = {}
for d in DIMS:
    q = torch.randn(N_QUERIES, d, generator=gen)  # entries of mean 0 and variance 1
    k = torch.randn(N_KEYS, d, generator=gen)
    v = torch.randn(N_KEYS, d, generator=gen)
    data[d] = (q, k, v)
print(f"{len(DIMS)} head sizes d_k = {DIMS}; {N_QUERIES} queries against {N_KEYS} keys each,")
print("every entry drawn from a normal distribution with mean 0 and variance 1")

# %% [markdown]
# ## Step 1: `q · k` has variance `d_k`
#
# `q · k = q₁k₁ + q₂k₂ + … + q_dk k_dk` is a sum of `d_k` products. When the entries are independent
# with mean 0 and variance 1, each product has mean 0 and variance 1 too, and variances of
# independent terms add up: the sum has variance `d_k`, so its typical size (standard deviation) is
# `√d_k`. Dividing by `√d_k` divides the variance by `d_k` and brings it back to 1, whatever the
# head size.

# %%
print(f"{'d_k':>6} {'var(q.k)':>10} {'var(q.k) / d_k':>15} {'var(q.k / sqrt(d_k))':>21}")
var_raw, var_scaled = [], []
for d in DIMS:
    q, k, _ = data[d]
    raw = q @ k.T
    var_raw.append(raw.var().item())
    var_scaled.append((raw / math.sqrt(d)).var().item())
    print(f"{d:>6} {var_raw[-1]:>10.1f} {var_raw[-1] / d:>15.3f} {var_scaled[-1]:>21.3f}")

fig, ax = plt.subplots(figsize=(5.5, 3.6), layout="constrained")
ax.loglog(DIMS, var_raw, "o-", label="q . k  (unscaled)")
ax.loglog(DIMS, var_scaled, "s-", label="q . k / sqrt(d_k)  (scaled)")
ax.loglog(DIMS, DIMS, ":", color="grey", label="the line  variance = d_k")
ax.set(xlabel="d_k (query and key size)", ylabel="variance of the scores",
       title="Unscaled scores grow with d_k; scaled ones stay at 1")
ax.legend()

# %% [markdown]
# ## Step 2: large scores saturate the softmax
#
# The softmax turns a query's row of scores into weights that sum to 1. When the scores are spread
# over a wide range, the exponential makes the largest one win by a huge factor: the weights become
# nearly one-hot. Two numbers say how peaked a row is: its **entropy** (in bits: `log₂ 64 = 6` for
# weights spread evenly over 64 keys, 0 for all the weight on one key; `attnkit.analysis.entropy`
# computes it) and its **largest weight**. We also count the rows that give more than 0.99 to a
# single key.

# %%
LOG2_N = math.log2(N_KEYS)
stats = {"unscaled": [], "scaled": []}
print(f"entropy of uniform weights over {N_KEYS} keys: {LOG2_N:.1f} bits")
print(f"{'d_k':>6} | {'entropy (bits)':^19} | {'largest weight':^19} | {'rows with max > 0.99':^21}")
print(f"{'':>6} | {'unscaled':>9} {'scaled':>9} | {'unscaled':>9} {'scaled':>9} | {'unscaled':>10} {'scaled':>10}")
for d in DIMS:
    q, k, _ = data[d]
    row = {}
    for name, scale in (("unscaled", 1.0), ("scaled", 1 / math.sqrt(d))):
        w = torch.softmax(q @ k.T * scale, dim=-1)
        row[name] = {"entropy": analysis.entropy(w).item(), "max": w.amax(-1).mean().item(),
                     "saturated": (w.amax(-1) > 0.99).float().mean().item()}
        stats[name].append(row[name])
    u, s = row["unscaled"], row["scaled"]
    print(f"{d:>6} | {u['entropy']:>9.3f} {s['entropy']:>9.3f} | {u['max']:>9.3f} {s['max']:>9.3f} | "
          f"{u['saturated']:>10.0%} {s['saturated']:>10.0%}")

fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
for name, marker in (("unscaled", "o-"), ("scaled", "s-")):
    axes[0].semilogx(DIMS, [r["entropy"] for r in stats[name]], marker, label=name)
    axes[1].semilogx(DIMS, [r["max"] for r in stats[name]], marker, label=name)
axes[0].axhline(LOG2_N, ls=":", color="grey", label=f"uniform over {N_KEYS} keys")
axes[0].set(xlabel="d_k", ylabel="mean entropy of a row (bits)", title="How spread out the weights are")
axes[1].axhline(1 / N_KEYS, ls=":", color="grey", label="uniform: 1/64")
axes[1].set(xlabel="d_k", ylabel="mean largest weight of a row", title="How much the top key takes", ylim=(0, 1.02))
for ax in axes:
    ax.legend()

# %% [markdown]
# Here is what that means for one query: its 64 weights at `d_k = 1024`, without and with the
# scaling.

# %%
q, k, _ = data[1024]
one_row = {name: torch.softmax(q[0] @ k.T * scale, dim=-1)
           for name, scale in (("unscaled", 1.0), ("scaled", 1 / math.sqrt(1024)))}
fig, axes = plt.subplots(1, 2, figsize=(10, 2.8), layout="constrained", sharey=True)
for ax, (name, w) in zip(axes, one_row.items(), strict=True):
    ax.bar(range(N_KEYS), w)
    ax.set(title=f"one query's weights, {name} (d_k = 1024)", xlabel="key", ylim=(0, 1))
    print(f"{name:>8}: largest weight {w.max().item():.3f}, keys with weight > 0.01: {int((w > 0.01).sum())}")
axes[0].set_ylabel("weight")

# %% [markdown]
# ## Step 3: the softmax's slope collapses
#
# How strongly a small change of the scores `s` moves the weights `a = softmax(s)` is the softmax's
# Jacobian, the matrix of derivatives `∂aᵢ/∂sⱼ`. It has a closed form, `diag(a) − a aᵀ`: its
# entries are `aᵢ(1 − aᵢ)` on the diagonal and `−aᵢaⱼ` off it. First we check the formula against
# PyTorch's automatic differentiation, then we measure its size (the Frobenius norm, the square root
# of the sum of its squared entries) against `d_k`.

# %%
def softmax_jacobian(a):
    """d softmax / d scores, [..., n, n], from the weights a = softmax(scores) [..., n]."""
    return torch.diag_embed(a) - a[..., :, None] * a[..., None, :]


s = torch.randn(6, generator=gen)
by_autograd = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, -1), s)
print("closed form equals autograd's Jacobian:", torch.allclose(softmax_jacobian(torch.softmax(s, -1)), by_autograd))

jac = {"unscaled": [], "scaled": []}
print(f"\n{'d_k':>6} {'|J| unscaled':>13} {'|J| scaled':>11}")
for d in DIMS:
    q, k, _ = data[d]
    for name, scale in (("unscaled", 1.0), ("scaled", 1 / math.sqrt(d))):
        a = torch.softmax(q @ k.T * scale, dim=-1)
        jac[name].append(softmax_jacobian(a).flatten(-2).norm(dim=-1).mean().item())
    print(f"{d:>6} {jac['unscaled'][-1]:>13.4f} {jac['scaled'][-1]:>11.4f}")
bigger = [d for d, u, s in zip(DIMS, jac["unscaled"], jac["scaled"], strict=True) if u > s]
smaller = [d for d, u, s in zip(DIMS, jac["unscaled"], jac["scaled"], strict=True) if u < s]
print(f"\nunscaled Jacobian larger at d_k = {bigger}, smaller at d_k = {smaller}")
print(f"at d_k = {DIMS[-1]} the unscaled one is {jac['unscaled'][-1] / jac['scaled'][-1]:.2f} times the scaled one")

fig, ax = plt.subplots(figsize=(5.5, 3.6), layout="constrained")
ax.loglog(DIMS, jac["unscaled"], "o-", label="unscaled")
ax.loglog(DIMS, jac["scaled"], "s-", label="scaled")
ax.set(xlabel="d_k", ylabel="mean Frobenius norm of the Jacobian", title="The softmax's slope against d_k")
ax.legend()

# %% [markdown]
# The scaled softmax keeps the same slope at every size, because its scores keep the same spread.
# The unscaled one is not simply flatter: at small `d_k` its moderately peaked rows are *steeper*
# than the scaled ones (a softmax is flat both when the weights are all equal and when one weight
# takes everything, and steepest in between). Once the rows saturate, the slope falls towards 0,
# and it keeps falling as `d_k` grows. That collapse is the "vanishing gradient" of step 3.
#
# ## But the gradient that reaches q does not vanish
#
# A model does not learn the scores themselves: it learns the weights that make the queries and
# keys. The gradient that reaches a query is `scale × Σⱼ (∂L/∂sⱼ) kⱼ`: the gradient at the scores,
# multiplied by keys whose length is about `√d_k`, times the scale. Without the scaling, the factor
# `√d_k` is no longer divided away, and it can outgrow the collapse of the softmax. We measure three
# things, with a fixed random loss direction: the gradient at the scores, the gradient at the query,
# and how many keys share the gradient at the scores (a participation ratio: 1 when one key gets all
# of it, 64 when all keys get the same). We compute them by hand, and check the gradient at the
# query against `attnkit.attention` with `scale=1.0` (unscaled) and its default scale.

# %%
grads = {"unscaled": [], "scaled": []}
print(f"{'d_k':>6} | {'|dL/ds| at the scores':^21} | {'|dL/dq| at the query':^21} | {'keys sharing dL/ds':^19} | "
      f"{'rows with dL/ds = 0':^19}")
print(f"{'':>6} | {'unscaled':>10} {'scaled':>10} | {'unscaled':>10} {'scaled':>10} | {'unscaled':>9} {'scaled':>9} | "
      f"{'unscaled':>9} {'scaled':>9}")
for d in DIMS:
    q, k, v = data[d]
    upstream = torch.randn(N_QUERIES, d, generator=gen) / math.sqrt(d)  # the loss is sum(out * upstream)
    row = {}
    for name, scale in (("unscaled", 1.0), ("scaled", 1 / math.sqrt(d))):
        q_ = q.clone().requires_grad_(True)
        scores = q_ @ k.T * scale
        scores.retain_grad()
        (torch.softmax(scores, -1) @ v * upstream).sum().backward()
        g = scores.grad.abs()
        share = g.sum(-1) ** 2 / (g**2).sum(-1).clamp_min(1e-30)  # 0 for a row with no gradient at all
        # the same gradient at the query through attnkit
        q_ak = q.clone().requires_grad_(True)
        out = attnkit.attention(q_ak[None], k[None], v[None], scale=None if name == "scaled" else 1.0)
        (out[0] * upstream).sum().backward()
        assert torch.allclose(q_ak.grad, q_.grad, rtol=1e-3, atol=1e-5)
        row[name] = {"ds": scores.grad.norm(dim=-1).mean().item(), "dq": q_.grad.norm(dim=-1).mean().item(),
                     "keys": share.mean().item(), "none": (g.amax(-1) == 0).float().mean().item()}
        grads[name].append(row[name])
    u, s = row["unscaled"], row["scaled"]
    print(f"{d:>6} | {u['ds']:>10.4f} {s['ds']:>10.4f} | {u['dq']:>10.4f} {s['dq']:>10.4f} | "
          f"{u['keys']:>9.1f} {s['keys']:>9.1f} | {u['none']:>9.1%} {s['none']:>9.1%}")

larger_q = [d for d, u, s in zip(DIMS, grads["unscaled"], grads["scaled"], strict=True) if u["dq"] > s["dq"]]
print("\nattnkit.attention's gradient at the query equals the hand-computed one at every size (checked above)")
print(f"gradient at the query larger unscaled at d_k = {larger_q} ({len(larger_q)} of {len(DIMS)} sizes)")
print(f"at d_k = {DIMS[-1]}: at the scores unscaled/scaled = "
      f"{grads['unscaled'][-1]['ds'] / grads['scaled'][-1]['ds']:.2f}, at the query unscaled/scaled = "
      f"{grads['unscaled'][-1]['dq'] / grads['scaled'][-1]['dq']:.1f}")

fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
for name, marker in (("unscaled", "o-"), ("scaled", "s-")):
    axes[0].loglog(DIMS, [r["ds"] for r in grads[name]], marker, label=name)
    axes[1].loglog(DIMS, [r["dq"] for r in grads[name]], marker, label=name)
axes[0].set(xlabel="d_k", ylabel="mean norm", title="Gradient at the scores: shrinks unscaled")
axes[1].set(xlabel="d_k", ylabel="mean norm", title="Gradient at the query: grows unscaled")
for ax in axes:
    ax.legend()

# %% [markdown]
# So "the gradient vanishes" is true at the scores, not at the query. What the saturation does
# take away is shown in the last two columns: unscaled, the gradient at the scores falls on a couple
# of keys per query (and on none at all for the rows saturated to the last bit of float32), so a query
# learns only about the key it already looks at, and gets next to no signal about the others.
# Whether that hurts training is a question for an experiment.
#
# ## Step 4: does training fail without the scaling? It depends on the start
#
# A small, fair test. The task: reverse a sequence of 8 digits, so every position must fetch a token
# from elsewhere, which needs attention. The model: embeddings with sinusoidal positions, one
# `attnkit.MultiHeadAttention` head with `d_k = 256`, a feed-forward block, a residual around each.
# The only difference between the two arms is `scale=` (`None`, the default `1/√d_k`, or `1.0`);
# both see the same batches, the same initial weights and the same optimiser (Adam, learning rate
# 0.003, 150 steps of 64 sequences), with two seeds each.
#
# We run it from two starts:
#
# - **unit-variance**: the query and key projections start with `N(0, 1/width)` weights, so `q` and
#   `k` have entries of variance about 1 or more, the premise of the argument above;
# - **Xavier**: attnkit's default (`xavier_normal_`), which for a 32 → 256 projection starts the
#   weights much smaller, so the unscaled scores start far less spread.

# %%
VOCAB, LENGTH, WIDTH, HEAD = 10, 8, 32, 256
STEPS, BATCH, SEEDS = 150, 64, (0, 1)


class Reverser(nn.Module):
    """Embedding + positions -> one attention head (residual) -> feed-forward (residual) -> logits."""

    def __init__(self, scale, init):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = SinusoidalPositionalEncoding(WIDTH)
        self.attn = attnkit.MultiHeadAttention(WIDTH, 1, head_dim=HEAD, scale=scale)
        if init == "unit-variance":
            for proj in (self.attn.q_proj, self.attn.k_proj):
                nn.init.normal_(proj.weight, std=WIDTH**-0.5)
        self.ffn = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(),
                                 nn.Linear(2 * WIDTH, WIDTH))
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        h = self.pos(self.embed(x))
        h = h + self.attn(h)
        h = h + self.ffn(h)
        return self.out(h)


def batch(n, generator):
    x = torch.randint(0, VOCAB, (n, LENGTH), generator=generator)
    return x, x.flip(-1)


def train(scale, init, seed):
    torch.manual_seed(seed)  # the same initial weights for both arms
    model = Reverser(scale, init)
    with torch.no_grad():  # how spread out the scores are at the start, before any scale is applied
        h = model.pos(model.embed(batch(256, torch.Generator().manual_seed(99))[0]))
        q, k, _ = model.attn.project_qkv(h, h, h)
        start_var = (q @ k.transpose(-1, -2)).var().item()
    gen = torch.Generator().manual_seed(seed)  # the same batches for both arms
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(STEPS):
        x, y = batch(BATCH, gen)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    x, y = batch(1024, torch.Generator().manual_seed(10_000 + seed))  # held-out sequences
    with torch.no_grad():
        accuracy = (model(x).argmax(-1) == y).float().mean().item()
    return {"accuracy": accuracy, "losses": losses, "start_var": start_var}


# Tensors this small run fastest on one thread (several threads mostly wait for each other, badly so
# on a busy machine), and one thread also keeps the order of the sums, hence the numbers, fixed.
threads = torch.get_num_threads()
torch.set_num_threads(1)
try:
    runs = {(init, arm): [train(None if arm == "scaled" else 1.0, init, seed) for seed in SEEDS]
            for init in ("unit-variance", "Xavier") for arm in ("scaled", "unscaled")}
finally:
    torch.set_num_threads(threads)

print(f"{'start':>14} {'arm':>9} {'var(q.k) at start':>18} {'var after the scale':>20} {'accuracy per seed':>18}")
accuracy = {}
for (init, arm), rs in runs.items():
    start = sum(r["start_var"] for r in rs) / len(rs)
    after = start / HEAD if arm == "scaled" else start
    accuracy[init, arm] = sum(r["accuracy"] for r in rs) / len(rs)
    per_seed = "  ".join(f"{r['accuracy']:.3f}" for r in rs)
    print(f"{init:>14} {arm:>9} {start:>18.1f} {after:>20.2f} {per_seed:>18}")
print(f"\n(chance is {1 / VOCAB:.2f}; accuracy is per token, on 1024 held-out sequences, "
      f"mean over {len(SEEDS)} seeds)")
for init in ("unit-variance", "Xavier"):
    gap = accuracy[init, "scaled"] - accuracy[init, "unscaled"]
    print(f"{init:>14} start: scaled {accuracy[init, 'scaled']:.3f}, unscaled {accuracy[init, 'unscaled']:.3f}, "
          f"gap {gap:+.3f}")

# The prose above and below says this; if a change of PyTorch ever made it false, the page must not say it.
assert accuracy["unit-variance", "scaled"] - accuracy["unit-variance", "unscaled"] > 0.3
assert min(accuracy["Xavier", "scaled"], accuracy["Xavier", "unscaled"]) > 0.9

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained", sharey=True)
window = 10  # a running mean over 10 steps, so the curves read
print("first step where the running-mean loss is below 1 (- if never within the run):")
for ax, init in zip(axes, ("unit-variance", "Xavier"), strict=True):
    for arm, colour in (("scaled", "C1"), ("unscaled", "C0")):
        reached = []
        for i, r in enumerate(runs[init, arm]):
            smooth = torch.tensor(r["losses"]).unfold(0, window, 1).mean(-1)
            ax.plot(range(window, STEPS + 1), smooth, color=colour, alpha=0.9 - 0.4 * i,
                    label=f"{arm}, seed {SEEDS[i]}")
            below = (smooth < 1).nonzero()
            reached.append(str(int(below[0]) + window) if len(below) else "-")
        per_seed = ", ".join(f"seed {s}: {n}" for s, n in zip(SEEDS, reached, strict=True))
        print(f"  {init:>14} start, {arm:>8}: {per_seed}")
    ax.set(title=f"start: {init}", xlabel="training step", ylabel="loss (running mean)")
    ax.legend(fontsize=8)

# %% [markdown]
# From the unit-variance start the unscaled head's scores start out hugely spread, its softmax is
# saturated from the first step, and after 150 steps it is far behind the scaled one. From the
# Xavier start the unscaled scores are much less spread to begin with and both arms learn the task,
# the unscaled one after a longer plateau (compare the steps at which each arm's loss first falls
# below 1).
# The scaling makes the model's behaviour independent of `d_k` and of how large the projections
# start; without it, whether training works depends on an initialisation that happens to keep the
# scores small.
#
# What this experiment depends on, so that you can vary it: one head of size 256 on a tiny task;
# Adam, which rescales each parameter's step by its own gradient history (so a larger gradient at
# the queries does not by itself mean larger steps); a fixed learning rate; 150 steps (given longer,
# a saturated model may still get there); and two seeds. With more heads, larger `d_k` or plain SGD
# the numbers would move.
#
# ## Summary
#
# The table below is computed from the measurements above.

# %%
last = DIMS[-1]
i_last = DIMS.index(last)
print(f"1. variance of q.k at d_k = {last}: {var_raw[i_last]:.0f} unscaled, {var_scaled[i_last]:.2f} scaled")
print(f"2. mean entropy at d_k = {last}: {stats['unscaled'][i_last]['entropy']:.2f} bits unscaled, "
      f"{stats['scaled'][i_last]['entropy']:.2f} scaled; rows with one weight > 0.99: "
      f"{stats['unscaled'][i_last]['saturated']:.0%} unscaled, {stats['scaled'][i_last]['saturated']:.0%} scaled")
print(f"3. softmax Jacobian norm at d_k = {last}: {jac['unscaled'][i_last]:.4f} unscaled, "
      f"{jac['scaled'][i_last]:.4f} scaled (holds: it collapses)")
print(f"   gradient at the query at d_k = {last}: {grads['unscaled'][i_last]['dq']:.3f} unscaled, "
      f"{grads['scaled'][i_last]['dq']:.3f} scaled (does not vanish: larger unscaled at {len(larger_q)} of "
      f"{len(DIMS)} sizes)")
print(f"4. reversal accuracy, unit-variance start: {accuracy['unit-variance', 'scaled']:.2f} scaled, "
      f"{accuracy['unit-variance', 'unscaled']:.2f} unscaled; Xavier start: {accuracy['Xavier', 'scaled']:.2f} "
      f"scaled, {accuracy['Xavier', 'unscaled']:.2f} unscaled (depends on the start)")

# The words in brackets above are verdicts; they must follow from the numbers.
assert var_raw[i_last] > 0.8 * last and 0.8 < var_scaled[i_last] < 1.2
assert stats["unscaled"][i_last]["saturated"] > stats["scaled"][i_last]["saturated"]
falling = jac["unscaled"][jac["unscaled"].index(max(jac["unscaled"])):]
assert all(a > b for a, b in zip(falling, falling[1:], strict=False))  # it collapses: falls with every d_k ...
assert jac["unscaled"][i_last] < 0.25 * jac["scaled"][i_last] and max(jac["scaled"]) < 1.1 * min(jac["scaled"])
assert larger_q and grads["unscaled"][i_last]["dq"] > 0.1 * grads["scaled"][i_last]["dq"]  # it does not vanish

# %% [markdown]
# Where next: [Attention by hand](attention_by_hand.md) computes the scaled scores step by step on
# four tokens; the [glossary](glossary.md) has these terms (scaling factor, softmax, vanishing
# gradient) in Chinese and English.
