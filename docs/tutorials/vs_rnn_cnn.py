# %% [markdown]
# # Attention against RNNs, LSTMs and convolutions
#
# Articles that introduce self-attention justify it against what came before with three claims:
#
# 1. **Sequential computation.** A recurrent network (RNN, LSTM) must process token *t* before token
#    *t + 1*, so its work cannot be spread over the tokens; attention handles all of them at once.
# 2. **Path length.** For information to go from the first token to the last, a recurrent network
#    passes it through every step in between (*n − 1* of them), a stack of convolutions of width *k*
#    through about *n / (k − 1)* layers, and attention through one.
# 3. **Long range.** Recurrent networks lose information over long distances: what the first tokens
#    said fades before the last ones are read.
#
# This tutorial tests each claim on this machine, at sizes that run in seconds: the time of one
# layer against the sequence length, the steps and layers between two distant tokens, counted in
# the autograd graph, how strongly the last output depends on each earlier token, and a small
# training task that needs a token from a chosen distance back. `attnkit train recall` runs that
# task at full size, and `attnkit lab rnn_conv` runs the other checks with more training.

# %%
import math
import statistics
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

import attnkit
from attnkit import analysis
from attnkit.apps import recall
from attnkit.lab import rnn_conv

torch.manual_seed(0)
# One thread: what a single core does with each layer (and the same numbers on every run).
torch.set_num_threads(1)

# %% [markdown]
# ## Claim 1: sequential computation, and what it costs in time
#
# Four layers of the same width `d = 64` map a sequence `[batch, n, d]` to another: `nn.RNN` (tanh),
# `nn.LSTM`, a `Conv1d` of width 3, and causal multi-head attention (4 heads). We time a forward and
# backward pass of each for `n` from 64 to 512 tokens: the median of five runs, taken in turn
# so that a busy moment on the machine hits all four alike.

# %%
d, batch = 64, 2
layers = {"nn.RNN": torch.nn.RNN(d, d, batch_first=True), "nn.LSTM": torch.nn.LSTM(d, d, batch_first=True),
          "Conv1d, width 3": torch.nn.Conv1d(d, d, 3, padding=1), "attention": attnkit.MultiHeadAttention(d, 4)}


def run_layer(name, layer, x):
    if name.startswith("nn."):
        return layer(x)[0]
    if name.startswith("Conv1d"):
        return layer(x.transpose(1, 2)).transpose(1, 2)  # Conv1d wants [batch, d, n]
    return layer(x, is_causal=True)


def seconds(fns, repeat=3):
    """Median seconds of each function, run round-robin after one warm-up call each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


lengths = [64, 128, 256, 512]
ms = {name: [] for name in layers}
for n in lengths:
    x = torch.randn(batch, n, d, requires_grad=True)
    fns = {name: (lambda name=name, layer=layer, x=x: run_layer(name, layer, x).sum().backward())
           for name, layer in layers.items()}
    for name, t in seconds(fns, repeat=5).items():
        ms[name].append(1e3 * t)

q = torch.randn(batch, 4, 512, d // 4)
print("attention runs on the backend:", attnkit.which_backend(q, q, q, is_causal=True))
print(f"\nms per forward + backward, batch {batch}, width {d}, one thread:")
print(f"{'n':>6}" + "".join(f"{name:>17}" for name in layers))
for i, n in enumerate(lengths):
    print(f"{n:>6}" + "".join(f"{ms[name][i]:>17.2f}" for name in layers))
print("\ngrowth from n = 128 to n = 512 (time x 4^p: p = 1 is linear, p = 2 quadratic):")
for name in layers:
    print(f"  {name:<16} p = {math.log(ms[name][-1] / ms[name][1], 4):.2f}")
print("\nthe arithmetic of one forward, attention's QK^T and PV against an RNN cell's two d x d products:")
for i, n in enumerate(lengths):
    attention_flops = analysis.attention_cost(n, d, 4, batch=batch, causal=True).attention_flops
    flops = attention_flops / (batch * rnn_conv.recurrent_flops(n, d))
    print(f"  n = {n:>4}: attention does {flops:4.1f} times the RNN's FLOPs, in "
          f"{ms['attention'][i] / ms['nn.RNN'][i]:.2f} times its time")

fig, ax = plt.subplots(figsize=(6.4, 3.6), layout="constrained")
for name in layers:
    ax.plot(lengths, ms[name], marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set(xlabel="sequence length n", ylabel="ms per forward + backward",
       title="One layer of width 64 on one CPU thread")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# Read the table with the claim in mind. It is about *sequential steps*, not about time on one core:
# on one thread everything runs one operation after another anyway, so attention's freedom to do all
# tokens at once buys nothing here, and its arithmetic grows as `n² d` (every query against every
# key) against `n d²` for the recurrent layers. Its exponent heads towards 2 once `n` is well past
# the width; at these short lengths each call's fixed costs still weigh, and the exponents above are
# what these lengths show. The last lines set arithmetic against time: how they compare is how well
# each layer's work suits the core. Attention's work is a few large matrix products; a recurrent
# layer's is `n` small ones, each waiting for the one before. That waiting is what the claim is
# about, and it costs most where many operations could run at once (a GPU, many cores): the
# recurrent layers cannot use them, since step *t + 1* needs step *t*.
#
# The sequential steps themselves can be counted without a clock. The autograd graph of an output
# records every operation it came from; its longest chain of operations is the part that no amount
# of hardware can run in parallel (`attnkit.lab.rnn_conv.graph_depth`). For one attention layer and
# for an RNN cell unrolled over `n` tokens:

# %%
for n in (16, 32, 64):
    depth = rnn_conv.sequential_steps(n)
    print(f"n = {n:>2}: longest chain of operations, attention {depth['attention']:>3}, "
          f"RNN cell {depth['recurrent']:>3}")

# %% [markdown]
# Attention's chain does not change with `n`; the recurrent one grows by the same amount (three
# operations per cell) for every token. That part of claim 1 holds exactly, by construction.
#
# ## Claim 2: path length between distant tokens
#
# How many steps does information take from token 0 to token `n − 1`? For a recurrent layer it is
# the `n − 1` cells between them. For stacked layers we measure it: stack causal layers one at a
# time until the gradient of the last output with respect to the first input is not zero
# (`rnn_conv.layers_to_connect`). A convolution of width `k` reaches `k − 1` tokens further back per
# layer; a *dilated* convolution, whose spacing grows `k`-fold per layer, reaches `kᴸ` tokens with
# `L` layers; one attention layer reaches every token.

# %%
k = 3
measured = {}
for n in (16, 64):
    measured[n] = {
        "attention": rnn_conv.layers_to_connect(lambda i: attnkit.MultiHeadAttention(8, 1), n, 4),
        "convolution": rnn_conv.layers_to_connect(lambda i: rnn_conv.Conv(8, k, causal=True), n, n),
        "dilated convolution": rnn_conv.layers_to_connect(
            lambda i: rnn_conv.Conv(8, k, dilation=k**i, causal=True), n, math.ceil(math.log(n, k)) + 2),
    }
expected = {"recurrent (steps)": lambda n: n - 1, "convolution": lambda n: math.ceil((n - 1) / (k - 1)),
            "dilated convolution": lambda n: math.ceil(math.log(n, k)), "attention": lambda n: 1}
for n, found in measured.items():
    print(f"n = {n}: layers to link the first and the last token, measured:", found)
    print("        expected:", {name: f(n) for name, f in expected.items() if name in found})

ns = np.array([4, 8, 16, 32, 64, 128, 256, 512, 1024])
fig, ax = plt.subplots(figsize=(6.4, 3.4), layout="constrained")
for (name, f), color in zip(expected.items(), ("C0", "C2", "C3", "C1"), strict=True):
    ax.plot(ns, [f(int(n)) for n in ns], color=color, label=name)
    if name in measured[16]:
        ax.plot(list(measured), [measured[n][name] for n in measured], "o", color=color)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set(xlabel="sequence length n", ylabel="steps or layers from token 0 to token n - 1",
       title=f"Path length (width-{k} convolutions; dots: measured)")
ax.legend(fontsize=8)
plt.show()

# %% [markdown]
# The measured layers match the formulas, so claim 2 holds as stated. It is a claim about the
# *shape* of the network: a short path makes it easier to learn a long-range link, it does not
# guarantee that the model learns one.
#
# ## Claim 3: losing information over long range
#
# A first look, before any training: how strongly does the last output depend on each earlier
# token? We take the gradient of the last position's output with respect to each input token, in
# freshly initialised layers (64 tokens, width 32), and plot its size against the distance back.

# %%
torch.manual_seed(0)
n, width = 64, 32
x = torch.randn(8, n, width, requires_grad=True)
fresh = {"nn.RNN": torch.nn.RNN(width, width, batch_first=True),
         "nn.LSTM": torch.nn.LSTM(width, width, batch_first=True), "attention": attnkit.MultiHeadAttention(width, 4)}
sensitivity = {}
for name, layer in fresh.items():
    out = run_layer(name, layer, x)
    (grad,) = torch.autograd.grad(out[:, -1].sum(), x)
    sensitivity[name] = grad.norm(dim=-1).mean(0).flip(0)  # [n]: index = distance back from the last token

fig, ax = plt.subplots(figsize=(6.4, 3.4), layout="constrained")
for name, s in sensitivity.items():
    ax.plot(range(n), s.numpy(), label=name)
ax.set_yscale("log")
ax.set(xlabel="distance back from the last token", ylabel="|d output / d token| (mean over 8)",
       title="How much the last output depends on each token, at initialisation")
ax.legend(fontsize=8)
plt.show()
for name, s in sensitivity.items():
    print(f"{name:<10} distance 1: {float(s[1]):.1e}   distance 16: {float(s[16]):.1e}   "
          f"distance 63: {float(s[63]):.1e}")

# %% [markdown]
# The recurrent layers' dependence falls by orders of magnitude with distance (each step multiplies
# the gradient by the recurrent weights and the slope of the nonlinearity, and here both shrink it:
# the *vanishing gradient*), while attention's stays at one level, since every earlier key is one
# step away. That is what the layers do *before* training. Training can change it: the LSTM's gates
# exist to keep a value for as long as it is needed. So the claim needs a task.
#
# ### A small long-range recall task
#
# The task of `attnkit train recall` (`attnkit.apps.recall`): a sequence of random values holds one
# `CUE` token; the value just after it is the answer; the sequence ends with a `QUERY` token, and
# `distance` random values lie between the answer and the query. The model must say the answer at
# the query:
#
# ```text
# 7 3 CUE 12 5 9 1 ... 4 QUERY   -> 12      (distance: the values between 12 and QUERY)
# ```
#
# Three models of similar size (printed below), from `recall.build_one`: `nn.RNN`, `nn.LSTM`, and
# two layers of attnkit's causal attention with ALiBi positions. Each trains 150 steps on the same
# batches (sequences of 6 to 19 tokens, distances up to 16) with AdamW. The learning rates are 3e-3
# for the RNN and 1e-2 for the other two: of 3e-3 and 1e-2, each model's better one in a trial with
# these settings and seeds (each of the three did clearly worse at the other). Accuracy is measured
# on 200 held-out sequences per distance, 19 tokens long whatever the distance, so every model does
# the same work at every distance (`recall.test_set` draws them from its own seed).

# %%
cfg = {**recall.DEFAULTS, "steps": 150, "warmup": 15, "max_distance": 16, "min_len": 6, "attn_ffn": 64,
       "eval_distances": (0, 4, 8, 12, 16), "eval_per_distance": 200,
       "lr": {"RNN": 3e-3, "LSTM": 1e-2, "attention": 1e-2}}
sizes = {key: cfg[key] for key in recall.MODEL_KEYS}
tests = recall.test_set(cfg)


def train(model, lr, steps, warmup):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def factor(s):  # a linear warm-up, then a cosine decay to 0
        return (s + 1) / warmup if s < warmup else 0.5 + 0.5 * math.cos(math.pi * (s - warmup) / (steps - warmup))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    for step in range(steps):
        seq, answer = recall.batch_for(step, 0, cfg)  # the same batches for every model
        loss = F.cross_entropy(model(seq), answer)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
    return model.eval()


accuracy = {}
for i, name in enumerate(recall.MODELS):
    torch.manual_seed(i)
    model = train(recall.build_one(name, sizes), cfg["lr"][name], cfg["steps"], cfg["warmup"])
    accuracy[name] = {dist: recall.accuracy(model, *tests[dist]) for dist in cfg["eval_distances"]}
    print(f"{name:<10} {recall.param_count(model):>6,} parameters; held-out accuracy by distance: "
          + ", ".join(f"{dist}: {acc:.0%}" for dist, acc in accuracy[name].items()))
print(f"chance: {1 / cfg['num_values']:.0%}")

# %%
accuracy_figure = recall.draw_accuracy(accuracy, 1 / cfg["num_values"], cfg["steps"])

# %%
near, far = cfg["eval_distances"][0], cfg["eval_distances"][-1]
chance = 1 / cfg["num_values"]
for name, by_distance in accuracy.items():
    said = "falls with distance" if by_distance[near] - by_distance[far] > 0.1 else "does not fall with distance"
    beyond = max(acc for dist, acc in by_distance.items() if dist > near)
    level = (f"beyond distance {near} at most {beyond:.0%}, less than 3 times chance" if beyond < 3 * chance
             else f"at every distance at least {min(by_distance.values()):.0%}")
    print(f"{name:<10} {said} ({by_distance[near]:.0%} at distance {near}, {by_distance[far]:.0%} at {far}); {level}")

# What the closing lines below state, checked on this run's numbers.
depths = {n: rnn_conv.sequential_steps(n) for n in (16, 32, 64)}
assert depths[16]["attention"] == depths[32]["attention"] == depths[64]["attention"]
assert depths[64]["recurrent"] - depths[32]["recurrent"] == 2 * (depths[32]["recurrent"] - depths[16]["recurrent"]) > 0
assert all(found[name] == expected[name](n) for n, found in measured.items() for name in found)
for name in ("nn.RNN", "nn.LSTM"):  # fades by orders of magnitude over 62 steps, at initialisation
    assert sensitivity[name][63] < 1e-3 * sensitivity[name][1], name
assert sensitivity["attention"][63] > 0.1 * sensitivity["attention"][1]
falls = {name: by_distance[near] - by_distance[far] > 0.1 for name, by_distance in accuracy.items()}
assert falls == {"RNN": True, "LSTM": False, "attention": False}, falls
assert max(acc for dist, acc in accuracy["RNN"].items() if dist > near) < 3 * chance

# %% [markdown]
# ("Falls" means more than 10 points lower at the farthest distance than at the nearest.) What this
# run says about claim 3 is in the three lines above, one per model. The plain RNN is the recurrent
# network the claim describes, and the one the fading gradients above belong to. The LSTM is the
# recurrent network people actually used, and its gates are there to carry a value across many
# steps: whether they carry the answer 16 tokens here is the second line. Attention's path to the
# answer is one step at every distance, so the question for it is only whether 150 steps were
# enough to learn where to look.
#
# What the verdicts depend on: distances up to 16, 150 steps, one seed, these learning rates. At
# longer distances an LSTM has more to keep, and `attnkit train recall` (distances to 64, 1,000
# steps, and the time per training step against length) is the run to settle it for a given
# budget.
#
# ## What to take away
#
# - **Sequential computation**: holds exactly as a count of steps: attention's longest chain of
#   operations does not grow with `n`, a recurrent cell's grows by a fixed amount per token. It is
#   not a claim about time on one core, where attention does `n² d` arithmetic against the recurrent
#   layer's `n d²` in `n` small steps: what each costs on this machine is the table.
# - **Path length**: holds as stated: 1 layer for attention, `n − 1` steps for a recurrence,
#   `⌈(n − 1) / (k − 1)⌉` convolution layers, `⌈log_k n⌉` dilated ones, measured.
# - **Long range**: at initialisation the recurrent layers' dependence on a token fades by orders of
#   magnitude over 60 steps and attention's does not. After training (150 steps, distances up to
#   16), the plain RNN's accuracy falls with distance, to less than 3 times chance beyond distance 0,
#   while the LSTM's and attention's do not fall. So at these distances the claim that recurrent
#   networks lose what lies far back holds for the plain RNN and not for the LSTM; whether an LSTM
#   loses it further back, or with a smaller budget, is what `attnkit train recall` measures.
#
# The [glossary](glossary.md) has these terms in Chinese and English; the tutorial
# [Long sequences](long_sequences.md) takes up attention's own cost, the `n²`.
