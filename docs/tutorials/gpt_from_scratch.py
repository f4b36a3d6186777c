# %% [markdown]
# # A GPT from scratch
#
# A GPT is a stack of self-attention layers that predicts the next token from the ones before it.
# Nothing more is needed to make one: token embeddings, position embeddings, a few Transformer
# layers whose attention is *causal* (a position sees only itself and the positions before it),
# and a linear map back to the vocabulary. Trained on text to guess each next character, it learns
# to write text of the same kind.
#
# This tutorial builds the model that `attnkit train lm` trains (`attnkit.apps.lm.GPT`, made of
# `attnkit.modules.TransformerEncoderLayer`), trains a tiny one for a few seconds on a corpus that
# ships with Python itself (the docstrings of the standard library), and then asks four questions
# of it: how fast its loss falls, whether it beats a bigram model (a table of which character follows
# which), what it writes, and what its attention heads look at. The sizes are cut so that the whole
# page runs in seconds on one CPU thread; `attnkit train lm` is the full run (three layers, a
# thousand steps, the docstrings of 118 modules).

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from attnkit import viz
from attnkit.apps import lm

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)
# One thread: the model is small (several threads mostly wait for each other), and the numbers
# below are then the same on every run on one machine.
torch.set_num_threads(1)

# %% [markdown]
# ## The corpus: Python's own docstrings
#
# `lm.corpus` reads the docstrings of a list of standard-library modules with `inspect` (in a fresh
# interpreter, so the text does not depend on what this process imported), one document per
# function, class or method, headed by its name and signature. Every 10th docstring is held out
# for validation, whole. Tokens are characters: the comparison with the bigram model below is then
# per character, free of any tokenizer's choices. The full run reads 118 modules; here, 16 small
# ones.

# %%
MODULES = ("base64", "bisect", "colorsys", "copy", "fnmatch", "glob", "graphlib", "heapq", "json", "keyword",
           "netrc", "queue", "sched", "shlex", "string", "textwrap")
data = lm.corpus(MODULES, min_char_count=2)
vocab = data.vocab
train_ids, val_ids = torch.from_numpy(data.train), torch.from_numpy(data.val)
V = len(vocab)
print(f"{len(MODULES)} modules: {len(train_ids):,} training characters, {len(val_ids):,} validation "
      f"characters, {V} tokens (the characters seen at least twice, and one for the rest)")
print("\nthe first held-out docstring, as the model reads it:\n")
print(data.val_docs[0][:300])

# %% [markdown]
# ## The model
#
# `lm.GPT` is a few dozen lines. Each character id becomes a learned vector (`tok`), its position adds
# another (`pos`), and the sum goes through pre-norm Transformer layers run with `is_causal=True`;
# a final LayerNorm, and the output is multiplied by the token table itself (the output layer is
# *tied* to the input embeddings, as in GPT-2), giving one score (logit) per character of the
# vocabulary at every position. Here it has one layer of 4 heads, 32 wide, and sees 16 characters.

# %%
BLOCK = 16
model = lm.GPT(vocab_size=V, block_size=BLOCK, embed_dim=32, num_heads=4, num_layers=1, ffn_dim=128, dropout=0.0)
print(model)
print(f"\n{sum(p.numel() for p in model.parameters()):,} parameters")

# %% [markdown]
# Causal means that the prediction at position *t* cannot depend on a later character, or the model
# would learn to copy the answer. That is easy to check: change the last character of a window and
# compare the logits at every position.

# %%
x = train_ids[:BLOCK][None]  # [1, L]
x_changed = x.clone()
x_changed[0, -1] = (x[0, -1] + 1) % V
with torch.no_grad():
    moved = (model(x) - model(x_changed)).abs().amax(-1)[0]  # [L]: the largest change of each position's logits
print(f"largest change of the logits at positions 0..{BLOCK - 2}: {float(moved[:-1].max()):.1e}")
print(f"at the last position, whose input changed:      {float(moved[-1]):.3f}")

# %% [markdown]
# ## Training
#
# Training is next-character prediction on random windows of the training text: the input is 16
# characters, the target the same 16 shifted by one, and the loss the cross-entropy of each
# position's prediction. Before any training the output is close to uniform, so the loss starts near
# `ln V`. The loop is the one `attnkit train lm` runs: AdamW, a short linear warm-up and a cosine
# decay of the learning rate, gradients clipped at norm 1.

# %%
STEPS, BATCH, LR, WARMUP = 500, 32, 1e-2, 50
gen = torch.Generator().manual_seed(0)
opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
schedule = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: (s + 1) / WARMUP if s < WARMUP else 0.5 * (1 + np.cos(np.pi * (s - WARMUP) / (STEPS - WARMUP))))
losses = []
start = time.perf_counter()
model.train()
for _ in range(STEPS):
    batch = lm.windows(train_ids, torch.randint(len(train_ids) - BLOCK, (BATCH,), generator=gen), BLOCK + 1)
    logits = model(batch[:, :-1])  # [B, L, V]
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    schedule.step()
    losses.append(loss.item())
model.eval()
print(f"{STEPS} steps of {BATCH} windows in {time.perf_counter() - start:.1f} s on one thread")
print(f"first loss {losses[0]:.3f} (ln V = {np.log(V):.3f}), mean of the last 20: {np.mean(losses[-20:]):.3f}")

# %% [markdown]
# ## Does it beat a bigram model?
#
# A falling training loss says the model learns something, not that it learns more than the obvious.
# The obvious here is a **bigram** model: count, in the training text, how often each character
# follows each other one, and predict from the last character alone. It is smoothed towards the
# characters' overall frequencies (with a weight `alpha` chosen on the end of the training text), so
# no character gets probability 0. Both models are scored on the same held-out characters, in nats
# per character; the **perplexity** `exp(cross-entropy)` reads as "as unsure as a uniform choice
# among that many characters". `lm.cross_entropy` scores every validation character once, each
# predicted from at least 8 characters before it (the start of the text aside).

# %%
def bigram_table(ids: np.ndarray, alpha: float) -> np.ndarray:
    """``P[a, b]``: the probability that ``b`` follows ``a``, counted on ``ids`` and smoothed."""
    counts = np.zeros((V, V))
    np.add.at(counts, (ids[:-1], ids[1:]), 1)
    unigram = (np.bincount(ids, minlength=V) + 1) / (len(ids) + V)
    return (counts + alpha * unigram) / (counts.sum(1, keepdims=True) + alpha)


def bigram_nats(table: np.ndarray, ids: np.ndarray) -> float:
    return float(-np.log(table[ids[:-1], ids[1:]]).mean())


cut = int(0.9 * len(data.train))
alpha = min((1, 4, 16, 64), key=lambda a: bigram_nats(bigram_table(data.train[:cut], a), data.train[cut:]))
bigram = bigram_nats(bigram_table(data.train, alpha), data.val)
gpt = lm.cross_entropy(model, val_ids)
uniform = np.log(V)
print(f"{'model':<22}{'nats/char':>10}{'perplexity':>12}")
for name, nats in (("uniform over V", uniform), (f"bigram (alpha {alpha})", bigram), ("this GPT", gpt)):
    print(f"{name:<22}{nats:>10.3f}{np.exp(nats):>12.2f}")
print(f"\nthe GPT's perplexity is {np.exp(gpt) / np.exp(bigram):.2f} times the bigram's")
assert gpt < bigram, "the text below says that the GPT beats the bigram"


# %%
loss_figure = lm.draw_loss(losses, {f"bigram (alpha {alpha})": bigram}, gpt)
running = np.convolve(losses, np.ones(20) / 20, mode="valid")  # the curve drawn: a mean of 20 steps
crossed = int(np.argmax(running < bigram)) + 20 if (running < bigram).any() else None
print("the training curve first falls below the bigram's held-out loss at step", crossed)

# %% [markdown]
# The solid line is the training loss, the dashed one the same model on held-out text, the dotted one
# the bigram. The gap between the dashed and dotted lines is what 16 characters of context buy over
# one, at this size and after this little training. A trigram is a harder bar; `attnkit train lm`
# reports it too.
#
# ## A sample
#
# `lm.generate` writes one character at a time: the model's logits for the next character, divided
# by a temperature (0.8: a little sharper than the model's own distribution), turned into
# probabilities and sampled. It runs the model through a KV cache, so each new character costs one
# position's work, not the whole window's. The prompt is the first line of a held-out docstring:
# a name and a signature the model never saw.

# %%
prompt = next(doc.split("\n", 1)[0] + "\n" for doc in data.val_docs if len(doc.split("\n", 1)[0]) < BLOCK // 2)
ids = lm.generate(model, torch.from_numpy(vocab.encode(prompt)), 200, temperature=0.8,
                  generator=torch.Generator().manual_seed(1))
print(prompt + vocab.decode(ids.tolist()))

# %% [markdown]
# After a few seconds of training the text has the look of a docstring (words of plausible length,
# spaces, common short words, some punctuation) and none of the sense. The full run's samples read
# better, and are still not Python documentation: a model this small, trained this briefly, learns
# spelling before meaning.
#
# ## What the heads look at
#
# With a trained model we can record its attention weights (`lm.recorded_attention`) on held-out
# text and ask what each head does. One pattern is easy to measure: a **previous-token head** puts
# its weight on the character just before the query. `lm.previous_token_score` is the mean weight
# from each position to the one before it: 1 for a head that does only that, and about
# `mean(1 / (i + 1))` for a head that spreads its weight evenly over what it may see. Such a head
# is useful to a one-layer model: the layer then hands each position the last *two* characters,
# which is what a trigram knows. `attnkit train lm` calls a head "formed" from a score of 0.4
# (`lm.FORMED`).

# %%
starts = torch.linspace(0, len(val_ids) - BLOCK - 1, 16).long()
with torch.no_grad(), lm.recorded_attention(model) as maps:
    model(lm.windows(val_ids, starts, BLOCK))
attn = maps[0]  # [16 windows, heads, L, L]
scores = lm.previous_token_score(attn).mean(0)  # [heads]
chance = float(lm.previous_token_score(lm.uniform_causal(BLOCK)))
best = int(scores.argmax())
print("previous-token score of each head:", [round(float(s), 3) for s in scores])
print(f"uniform causal attention scores {chance:.3f}")
verdict = ("a previous-token head formed" if scores[best] >= lm.FORMED else
           f"no head reaches {lm.FORMED}: no previous-token head formed by that measure")
print(f"head {best} scores highest, {float(scores[best]):.2f} ({float(scores[best]) / chance:.1f} times uniform): "
      f"{verdict}")

# %% [markdown]
# One score per head hides where the rest of the weight goes. The next picture spreads it out: for
# each head, the mean weight a query gives to the key 0, 1, 2, ... positions back (0 is itself),
# over the same 16 windows, beside what a uniform head would give.

# %%
DISTANCES = 8
profile = torch.stack([attn.diagonal(-d, dim1=-2, dim2=-1).mean((0, -1)) for d in range(DISTANCES)], -1)
uniform_profile = [float(lm.uniform_causal(BLOCK).diagonal(-d).mean()) for d in range(DISTANCES)]
fig, ax = plt.subplots(figsize=(6.4, 3), layout="constrained")
for h, row in enumerate(profile):
    ax.plot(range(DISTANCES), row.numpy(), marker="o", label=f"head {h}")
ax.plot(range(DISTANCES), uniform_profile, color="grey", ls=":", label="uniform causal")
ax.set_xlabel("distance back from the query (0: itself, 1: the previous character)")
ax.set_ylabel("mean weight")
ax.set_title("Where each head of the trained GPT puts its weight, on held-out text")
ax.legend(fontsize=8)
plt.show()
for h, row in enumerate(profile):
    print(f"head {h}: most weight at distance {int(row.argmax())}; on itself {float(row[0]):.2f}, on the previous "
          f"character {float(row[1]):.2f}, on the last three (distances 0-2) {float(row[:3].sum()):.2f}")
print(f"uniform causal attention: {uniform_profile[0]:.2f} on itself, {sum(uniform_profile[:3]):.2f} on the last three")
local = float(profile[:, :3].sum(-1).min())
print(f"\nevery head puts at least {local:.2f} of its weight on the last three characters "
      f"(uniform attention would put {sum(uniform_profile[:3]):.2f} there)")

# %% [markdown]
# A line that peaks at distance 1 is a previous-token head. One that peaks at 0 keeps much of the
# weight on the current character itself, which the residual connection already carries: what such
# a head adds to it is the share it gives to the one or two characters before. Both are *local*
# heads; with 16 characters to choose from, how much weight lands on the last three says how local.
#
# And the four heads on one held-out snippet, as weight maps: a head that looks at the previous
# character draws a line just below the diagonal, a head that looks at the last few a band along
# it. The masked (hatched) upper triangle is the future, which causal attention never sees.

# %%
snippet = val_ids[300:300 + BLOCK]
labels = [{" ": "\u2423", "\n": "\u23ce"}.get(c, c) for c in vocab.decode(snippet.tolist())]
with torch.no_grad(), lm.recorded_attention(model) as maps:
    model(snippet[None])
causal = torch.ones(BLOCK, BLOCK, dtype=torch.bool).tril()
heads_figure = viz.head_grid(maps[0][0], labels, mask=causal, ncols=4,
                             title="The trained GPT's four heads on held-out text")

# What the closing lines below state, checked.
assert float(moved[:-1].max()) < 1e-6 < float(moved[-1])  # a later character moves no earlier prediction
assert gpt < bigram

# %% [markdown]
# ## What to take away
#
# - A GPT is embeddings, causal self-attention layers and a tied output layer; the causal mask is
#   what stops it reading the answer, and changing a later character leaves every earlier
#   prediction as it was.
# - A one-layer model trained for a few seconds on 16 modules' docstrings beats the bigram model on
#   held-out text, by the margin printed above; that is this seed, these sizes and 500 steps.
# - What formed in the heads is printed above: how close each comes to a previous-token head, and
#   how much of its weight stays on the last three characters. Whether a head crosses the 0.4 line,
#   and which head it is, depends on the seed and on how long the model trains (the full run's
#   longer training and three layers give the heads more room); a head below the line may still do
#   part of the job, and a score says where a head looks, not what the model needs it for (the
#   tutorial [Many heads](many_heads.md) switches heads off to ask that).
#
# The full run: `attnkit train lm` (three layers, 1,000 steps, about 800,000 characters; it also
# reports a trigram baseline, looks for induction heads and writes an HTML report). The
# [glossary](glossary.md) has these terms in Chinese and English.
