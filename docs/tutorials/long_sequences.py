# %% [markdown]
# # Long sequences: windows, sparse patterns and approximations
#
# Full attention compares every query with every key: for `n` tokens, `n²` scores per head. Double
# the sequence and the work quadruples; so does the memory of any implementation that keeps the
# score matrix. This tutorial measures that cost on this machine, then the three ways out that
# articles describe, each with what it gives up:
#
# 1. **Windows**: each token attends only to its neighbours. Exact on what it keeps; linear in `n`.
# 2. **Sparse patterns**: a window plus a few global tokens (Longformer), dilated or strided keys
#    (Sparse Transformer). Exact on their pattern; the kernels skip the blocks the pattern leaves out.
# 3. **Approximations**: kernel feature maps (linear attention, Performer), landmarks (Nyström),
#    low-rank projections (Linformer). Every key still counts, but the result is no longer exact.
#
# Sizes are cut so that the page runs in seconds on one CPU thread: one sequence of up to 4,096
# tokens, 2 heads of 32. `attnkit bench blockwise` and `attnkit bench approx` measure the same at
# full size (tens of thousands of tokens), and the guides [Mask plans](../guides/mask-plans.md) and
# [Approximate attention](../guides/approximate.md) cover the API.

# %%
import functools
import statistics
import time

import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap

import attnkit
from attnkit import analysis, approx, masks
from attnkit.maskplan import tile_kinds

torch.manual_seed(0)
# One thread: what a single core does (and steadier timings on a shared machine).
torch.set_num_threads(1)
H, D = 2, 32  # heads, head size


def ms(fn, repeat=3):
    """Median milliseconds of ``fn()`` over ``repeat`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def qkv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, H, n, D, generator=g) for _ in range(3))


# %% [markdown]
# ## What full attention costs
#
# Memory first. A backend that *materialises* attention keeps the `n × n` matrix of every head: the
# reference backend does (it is the one that returns the weights), and so does the textbook
# `softmax(Q Kᵀ / √d) V` written in three lines. PyTorch's fused kernel (`sdpa`) and attnkit's tile
# kernels stream the keys in blocks with an online softmax and never hold it. `analysis.attention_cost`
# computes both from the shapes; at `n = 2,048` we also ask the reference backend for the weights
# and measure the tensor it returns.

# %%
print(f"{'n':>7} {'score matrix, 2 heads, float32':>32} {'sdpa: what it keeps':>22}")
for n in (1024, 4096, 16384, 65536):
    held = analysis.attention_cost(n, H * D, H, backend="reference")
    tiled = analysis.attention_cost(n, H * D, H, backend="sdpa")
    print(f"{n:>7,} {held.score_bytes / 2**20:>28,.0f} MiB {tiled.peak_attention_bytes / 2**20:>18,.2f} MiB")
q, k, v = qkv(2048)
_, weights = attnkit.attention(q, k, v, return_weights=True)
formula = analysis.attention_cost(2048, H * D, H).score_bytes
print(f"\nthe weights the reference backend returns at n = 2,048: {tuple(weights.shape)}, "
      f"{weights.nbytes / 2**20:.0f} MiB (the formula: {formula / 2**20:.0f} MiB)")
del weights

# %% [markdown]
# Streaming removes the memory wall, not the arithmetic: every score is still computed. Time, for
# full causal attention (`attnkit.attention`, which hands this call to its banded kernel: one
# interval of keys per row) from 512 to 4,096 tokens:

# %%
lengths = [512, 1024, 2048, 4096]
full_ms = []
for n in lengths:
    q, k, v = qkv(n)
    full_ms.append(ms(lambda q=q, k=k, v=v: attnkit.attention(q, k, v, is_causal=True)))
print("backend:", attnkit.which_backend(q, k, v, is_causal=True))
for n, t in zip(lengths, full_ms, strict=True):
    print(f"n = {n:>5,}: causal attention {t:7.1f} ms")
print(f"4,096 against 2,048 tokens: {full_ms[3] / full_ms[2]:.1f} times the time (quadratic: 4)")

# %% [markdown]
# ## Windows
#
# `window=(left, right)` lets each query see `left` keys before it and `right` after it. With
# `is_causal=True` and `window=(128, 0)`, each token sees itself and the 128 before it, as in
# Mistral's sliding-window layers. The work per query is fixed, so the work grows linearly with `n`
# where full attention's grows quadratically. Nothing is approximated: on the keys it keeps, the
# result is exact (checked below against the same pattern as a dense boolean mask), and the kernel
# does not compute the rest and throw it away, it never visits it. At short lengths a kernel's
# fixed costs can outweigh the saving; where the window starts to pay on this machine is printed.

# %%
window_ms = []
for n in lengths:
    q, k, v = qkv(n)
    window_ms.append(ms(lambda q=q, k=k, v=v: attnkit.attention(q, k, v, is_causal=True, window=(128, 0))))
print("backend for the window:", attnkit.which_backend(q, k, v, is_causal=True, window=(128, 0)))
for n, t, f in zip(lengths, window_ms, full_ms, strict=True):
    print(f"n = {n:>5,}: window of 128 {t:6.1f} ms, full causal {f:6.1f} ms")
faster = [n for n, t, f in zip(lengths, window_ms, full_ms, strict=True) if t < f]
print(f"the window is faster than full causal attention from n = {faster[0]:,} on" if faster
      else "the window is not faster than full causal attention at these lengths")
print(f"from 1,024 to 4,096 tokens the window's time grows {window_ms[3] / window_ms[1]:.1f} times, full attention's "
      f"{full_ms[3] / full_ms[1]:.1f} times (linear: 4, quadratic: 16)")

q, k, v = qkv(512)
dense = masks.sliding_window(512, left=128, right=0)
same = (attnkit.attention(q, k, v, is_causal=True, window=(128, 0))
        - attnkit.attention(q, k, v, mask=dense, backend="reference")).abs().max()
print(f"\nwindow against the same pattern as a dense mask on the reference backend: largest difference {same:.1e}")

# %% [markdown]
# What a window gives up is reach: a token cannot see anything further back than 128 positions in
# one layer. Stacked, `L` layers reach `128 L` positions back (each layer passes on what it saw),
# which is why windowed models still use long contexts.
#
# ## Sparse patterns
#
# A window plus something that reaches further. Three patterns that `attnkit.masks` writes as typed
# masks (each knows its own rows, so no cell is evaluated to plan it):
#
# - **global + local** (Longformer, `masks.global_tokens_mod`): a window, plus a few global positions
#   (here the first four) that see every token and that every token sees, for a `[CLS]` token or a
#   question;
# - **dilated window** (Longformer, `masks.dilated_window_mod`): the window's keys spaced `d` apart,
#   so the same number of keys covers `d` times the distance;
# - **strided** (Sparse Transformer, `masks.strided_mod`): the last `s` keys plus every `s`-th key
#   before them, so two layers connect any two tokens.
#
# Here they are on 48 tokens (dark: may attend):

# %%
n_small = 48
patterns = {
    "window (causal, 6)": masks.sliding_window(n_small, left=6, right=0),
    "global + local (window 3, 4 global)": masks.global_tokens(n_small, 3, [0, 1, 2, 3]),
    "dilated window (3 keys each side, d = 4)": masks.dilated_window(n_small, 3, 4),
    "strided (causal, s = 8)": masks.strided(n_small, 8),
}
fig, axes = plt.subplots(1, 4, figsize=(11, 3.2), layout="constrained")
for ax, (name, mask) in zip(axes, patterns.items(), strict=True):
    ax.imshow(mask, cmap="Greys", vmin=0, vmax=1.4)
    ax.set_title(f"{name}\n{float(mask.float().mean()):.0%} of the pairs", fontsize=9)
    ax.set(xticks=[], yticks=[], xlabel="key", ylabel="query")
plt.show()

# %% [markdown]
# Each is passed as `mask_mod=` (or as a plan, below), like any predicate, and gives the same result as
# its dense mask. At 2,048 tokens, with a window of 64 (32 keys each side for the dilated one, a
# stride of 64), each keeps a small share of the pairs. We time each against full attention (the
# strided pattern is causal, the other two are not) and against what one would write without
# attnkit: the same pattern as a dense boolean mask, handed to PyTorch's SDPA.

# %%
n = 2048
mods = {"global + local": masks.global_tokens_mod(64, torch.arange(4)),
        "dilated window": masks.dilated_window_mod(32, 4),
        "strided": masks.strided_mod(64)}
q, k, v = qkv(n)
full_plain = ms(lambda: attnkit.attention(q, k, v))
full_causal = ms(lambda: attnkit.attention(q, k, v, is_causal=True))
print(f"n = {n:,}: full attention {full_plain:.1f} ms, full causal {full_causal:.1f} ms")
for name, mod in mods.items():
    plan = attnkit.mask_plan(mod, q_len=n)  # worked out once, then reused by every call
    t = ms(lambda plan=plan: attnkit.attention(q, k, v, mask=plan))
    dense = masks.materialize(mod, 1, 1, n, n)  # [1, 1, n, n] bool, True: may attend
    share = float(dense.float().mean())
    t_dense = ms(lambda dense=dense: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    full = full_causal if name == "strided" else full_plain
    print(f"  {name:<15} keeps {share:5.1%} of the pairs: {t:6.1f} ms on {attnkit.which_backend(q, k, v, mask=plan)} "
          f"({t / full:.2f} of full attention's time); as a dense mask on SDPA {t_dense:6.1f} ms")

q, k, v = qkv(256)
for name, mod in mods.items():
    dense = attnkit.attention(q, k, v, mask=masks.materialize(mod, 1, 1, 256, 256), backend="reference")
    gap = (attnkit.attention(q, k, v, mask_mod=mod) - dense).abs().max()
    print(f"{name:<15} as mask_mod against its dense mask, n = 256: largest difference {gap:.1e}")

# %% [markdown]
# Keeping few pairs is not the same as being fast. Each pattern gives exactly its dense mask's result
# (the last three lines), but its time depends on how its kept pairs fall into the blocks a kernel
# works on (next) and on the kernel that runs it, printed beside each time: read it against full
# attention and against the same pattern as a dense mask on SDPA, which computes every pair in one
# fused kernel. A pattern can land well under full attention's time, or above it. The benchmark
# [Blockwise kernels](../benchmarks/blockwise.md) measures the patterns at 8,192 tokens and beyond.
#
# The kernels skip work by blocks: they cut the queries into tiles and the keys into blocks, and an
# `attnkit.MaskPlan` (built once by `attnkit.mask_plan`) says for every pair whether it is **empty**
# (skipped), **full** (computed with no mask at all) or **partial** (computed, and the mask applied
# inside). The picture shows the plans of the three patterns at 1,024 tokens in tiles of 64:

# %%
n, tile = 1024, 64
fig, axes = plt.subplots(1, 3, figsize=(10, 3.4), layout="constrained")
colours = ListedColormap(["white", "#3b5b92", "#f2b880"])  # empty, full, partial
for ax, (name, mod) in zip(axes, mods.items(), strict=True):
    kinds = attnkit.mask_plan(mod, q_len=n).kinds(tile, tile)
    counts = [int((kinds == kind).sum()) for kind in (tile_kinds.EMPTY, tile_kinds.FULL, tile_kinds.PARTIAL)]
    ax.imshow(kinds, cmap=colours, vmin=0, vmax=2)
    ax.set_title(f"{name}\nempty {counts[0]}, full {counts[1]}, partial {counts[2]}", fontsize=9)
    ax.set(xlabel="key block", ylabel="query tile", xticks=[], yticks=[])
    pairs = float(masks.materialize(mod, 1, 1, n, n).float().mean())
    print(f"{name:<15} keeps {pairs:5.1%} of the pairs and touches {1 - counts[0] / kinds.numel():5.1%} of the tiles")
fig.suptitle(f"Mask plans at n = {n:,}, tiles of {tile}: white skipped, blue full, orange partial", fontsize=10)
plt.show()

# %% [markdown]
# A tile is skipped only when its block of pairs holds none that the pattern keeps. A window with a
# few global rows and columns leaves most tiles empty; keys scattered a few positions apart (dilated,
# strided) fall into many tiles, and each of those is partial: computed whole, with the mask
# evaluated on top. So the share of pairs a pattern keeps understates what it costs a tiled kernel:
# the share of tiles it touches (printed) is closer to the work done, and how a kernel handles
# partial tiles and the rows that see every key decides the rest.
#
# ## Approximations
#
# `attnkit.approx` keeps every key but no longer computes `softmax(Q Kᵀ) V` exactly:
#
# - `elu` (linear attention, Katharopoulos et al.): `softmax(q · k)` replaced by `φ(q) · φ(k)` with
#   `φ = elu + 1`, so the products can be regrouped as `φ(Q) (φ(K)ᵀ V)`: linear in `n`. A different
#   function, not an estimate of the softmax.
# - `performer` (FAVOR+): random features whose products estimate `exp(q · k / √d)` without bias;
#   more features, less noise.
# - `nystrom` (Nyströmformer): the attention matrix rebuilt from a few *landmarks* (means of
#   segments of the queries and keys); good when the matrix is close to low rank.
# - `linformer`: the keys and values projected from `n` rows down to `k` by matrices that are learned
#   with the model.
#
# How far from exact attention are they? We measure the error of each output against the exact one,
# divided by how far exact attention is from plainly averaging the values (the answer of attention
# that gives every key the same weight): 0 is exact, 1 is no better than averaging. The answer
# depends on the inputs, so we use two kinds:
#
# - **unstructured**: queries, keys and values drawn at random, each token on its own;
# - **in runs**: the sequence is 8 runs of similar tokens (each run's queries and keys near one point),
#   as text is made of stretches about one thing. The attention matrix is then close to rank 8, and
#   neighbouring tokens alike, which is what Nyström's segment means assume.

# %%
error_lengths = [256, 512, 1024, 2048]
kinds_args = {"elu": {}, "performer": {"num_features": 64, "seed": 0}, "nystrom": {"num_landmarks": 32}}


def runs(n, seed=1, count=8):
    """Queries and keys in ``count`` runs of tokens near one point each; random values."""
    g = torch.Generator().manual_seed(seed)
    run = torch.arange(n) * count // n  # which run each position is in

    def near_points():
        centres = torch.randn(H, count, D, generator=g)
        return (centres[:, run] + 0.3 * torch.randn(H, n, D, generator=g))[None]  # [1, H, n, D]

    return near_points(), near_points(), torch.randn(1, H, n, D, generator=g)


names = [*kinds_args, "linformer (untrained)"]
errors = {inputs: {name: [] for name in names} for inputs in ("unstructured", "in runs")}
for n in error_lengths:
    for inputs, (q, k, v) in (("unstructured", qkv(n, seed=1)), ("in runs", runs(n))):
        exact = attnkit.attention(q, k, v)
        spread = (exact - v.mean(-2, keepdim=True)).norm()
        outs = {kind: approx.attention(q, k, v, kind=kind, **args) for kind, args in kinds_args.items()}
        with torch.no_grad():
            outs[names[-1]] = approx.attention(q, k, v, kind="linformer", projection=approx.LinformerProjection(n, 64))
        for name, out in outs.items():
            errors[inputs][name].append(float((out - exact).norm() / spread))
for inputs, table in errors.items():
    print(f"{inputs} inputs: error (0: exact, 1: no better than averaging)")
    print(f"{'n':>6}" + "".join(f"{name:>23}" for name in names))
    for i, n in enumerate(error_lengths):
        print(f"{n:>6}" + "".join(f"{table[name][i]:>23.2f}" for name in names))
    best = min(names, key=lambda name: table[name][-1])
    print(f"closest at n = {error_lengths[-1]:,}: {best}, {table[best][-1]:.2f}\n")

fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained", sharey=True)
for ax, (inputs, table) in zip(axes, errors.items(), strict=True):
    for name in kinds_args:
        ax.plot(error_lengths, table[name], marker="o", label=name)
    ax.axhline(1, color="grey", ls=":", label="averaging the values")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="sequence length n", title=f"{inputs} inputs", ylim=(0, 3.2))
axes[0].set_ylabel("error against exact attention")
axes[1].legend(fontsize=8)
plt.show()

# %% [markdown]
# On unstructured inputs none of them is close: the closest is about as far from exact attention as
# plain averaging. On inputs in runs, Nyström comes closest by far, because its landmarks (segment
# means) are then nearly the runs' own points. Performer's estimate is noisy on both: its noise
# grows with the length of the query and key vectors (its features multiply terms of size
# `exp(‖q‖² / 2√d)`), and these are long; more features lower it. `elu` computes another function, so it stays far from
# softmax attention whatever the inputs (a model trained with it learns around that). An untrained
# Linformer projection is not meant to be used: its matrices are learned with the model.
# On a trained model the picture differs again: the benchmark
# [Approximate attention](../benchmarks/approx.md) swaps each method into the bundled MiniLM, where
# Nyström with 32 landmarks keeps the sentence embeddings closest to the exact model's.
#
# What they buy is time. The same call, against exact attention (non-causal, since Nyström and
# Linformer do not support a causal mask):

# %%
approx_ms = {"exact": [], "elu": [], "performer": [], "nystrom": []}
for n in lengths:
    q, k, v = qkv(n)
    approx_ms["exact"].append(ms(lambda q=q, k=k, v=v: attnkit.attention(q, k, v)))
    for kind, args in kinds_args.items():
        approx_ms[kind].append(ms(functools.partial(approx.attention, q, k, v, kind=kind, **args)))
print(f"{'n':>6}" + "".join(f"{name:>12}" for name in approx_ms))
for i, n in enumerate(lengths):
    print(f"{n:>6}" + "".join(f"{approx_ms[name][i]:>10.1f}ms" for name in approx_ms))

fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
for name, t in approx_ms.items():
    ax.plot(lengths, t, marker="o", label=name)
ax.plot(lengths, window_ms, marker="s", ls="--", label="exact, causal window of 128")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set(xlabel="sequence length n", ylabel="ms per call", title="One call, 2 heads of 32, one CPU thread")
ax.legend(fontsize=8)
plt.show()
for kind in ("elu", "performer", "nystrom", "linformer"):
    print(f"masks {kind} honours: {', '.join(approx.SUPPORTS[kind]) or 'none'}")

# What the closing lines below state, checked on this run's numbers.
assert tiled.peak_attention_bytes < held.score_bytes / 1000  # the fused kernel never holds the scores
assert same < 1e-5  # the window: exact on what it keeps
for n in (512, 4096):  # the window's pairs: at most 129 keys per query, n * 129 - 128 * 129 / 2 in all
    assert int(masks.sliding_window(n, left=128, right=0).sum()) == 129 * n - 128 * 129 // 2
q, k, v = qkv(256)
n, tile = 1024, 64
for name, mod in mods.items():
    dense = attnkit.attention(q, k, v, mask=masks.materialize(mod, 1, 1, 256, 256), backend="reference")
    assert (attnkit.attention(q, k, v, mask_mod=mod) - dense).abs().max() < 1e-5, name  # exact on the pattern
    kinds = attnkit.mask_plan(mod, q_len=n).kinds(tile, tile)
    pairs = float(masks.materialize(mod, 1, 1, n, n).float().mean())
    touched = 1 - float((kinds == tile_kinds.EMPTY).float().mean())
    if name == "global + local":
        assert int((kinds == tile_kinds.FULL).sum()) > 0  # the global rows and columns: full tiles
    else:
        assert touched > 2 * pairs, name  # scattered keys touch a larger share of the tiles than of the pairs
at_last = {inputs: {name: table[name][-1] for name in names} for inputs, table in errors.items()}
assert min(at_last["unstructured"].values()) > 0.5  # none close on unstructured inputs
assert at_last["in runs"]["nystrom"] < 0.5  # only Nystrom comes close, on inputs in runs
assert all(error > 0.5 for name, error in at_last["in runs"].items() if name != "nystrom")
assert not any("causal" in honoured for kind in ("nystrom", "linformer") for honoured in approx.SUPPORTS[kind])

# %% [markdown]
# ## Which one, when
#
# What the measurements above support, with what they depend on:
#
# - **Exact attention, `n` up to a few thousand**: `attnkit.attention`, on a fused or tiled kernel.
#   Its memory stays small because the score matrix is never held; its work grows as `n²`, and what
#   that costs in time on this machine is the table above.
# - **Local context is enough** (each layer looks back a fixed distance): `window=`. Exact on what it
#   keeps; its pairs grow linearly with `n` (at most 129 keys per query here), and stacked layers
#   reach further.
# - **A few tokens must see, and be seen by, everything**: `masks.global_tokens_mod`. Exact; the
#   global rows and columns are whole tiles, computed without a mask.
# - **Reach far back with a few keys per query**: `masks.dilated_window_mod`, `masks.strided_mod`.
#   Exact on the pattern, but scattered keys touch a larger share of the tiles than of the pairs
#   (more than twice, in the plans above), and the kernels' work follows the tiles.
# - **Every key, in linear time**: `attnkit.approx`, with an error you have measured on your own
#   model's inputs: here none of them was close on unstructured inputs, and only Nyström on inputs
#   in runs; which masks each honours is printed above (Nyström and Linformer take no causal mask).
#
# A fixed pattern is a decision about what the model may see, made before training; an
# approximation is a decision about how precisely it sees everything. The first keeps the maths
# exact and costs reach; the second keeps the reach and costs exactness, by an amount that depends on
# the inputs.
#
# The [glossary](glossary.md) has these terms in Chinese and English.
