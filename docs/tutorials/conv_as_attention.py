# %% [markdown]
# # A convolution is a special case of self-attention
#
# Articles that compare self-attention with convolutions often say that attention is the more
# general of the two: a convolution mixes each pixel's fixed neighbourhood with fixed weights, while
# attention may mix any pixels with weights it computes. Cordonnier, Loukas and Jaggi made this exact
# ("On the Relationship between Self-Attention and Convolutional Layers", ICLR 2020): a multi-head
# self-attention layer with `K × K` heads and relative-position scores can compute any `K × K`
# convolution. This tutorial builds that layer with `attnkit.attention`, checks it against
# `torch.nn.functional.conv2d` on a real image, and then shows what the same layer can do that no
# convolution can.
#
# The construction, in three lines:
#
# 1. **Tokens are pixels.** An image `[C_in, H, W]` becomes `H · W` tokens of `C_in` features.
# 2. **One head per kernel tap.** Head `(dy, dx)` attends, from every pixel, to the one pixel at offset
#    `(dy, dx)`: its attention weights are one-hot, given by the *relative position* alone.
# 3. **Values carry the kernel.** Head `(dy, dx)`'s value projection is the kernel's slice
#    `W[:, :, dy, dx]` (`C_in → C_out`); the output projection adds the heads up, plus the bias.
#
# Then pixel `p`'s output is `bias + Σ_(dy,dx) W[:, :, dy, dx] · x[p + (dy, dx)]`: the convolution.

# %%
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import attnkit
from attnkit.lab.conv_attention import conv_as_attention

torch.manual_seed(0)
torch.set_num_threads(1)

image = torch.tensor(load_digits().images[:2], dtype=torch.float64)[:, None] / 16  # two digits, [2, 1, 8, 8]
K, C_in, C_out, padding = 3, 1, 2, 1
weight = torch.randn(C_out, C_in, K, K, dtype=torch.float64)
bias = torch.randn(C_out, dtype=torch.float64)
reference = F.conv2d(image, weight, bias, padding=padding)  # [2, C_out, 8, 8]
print("image:", tuple(image.shape), " kernel:", tuple(weight.shape), " convolution:", tuple(reference.shape))

# %% [markdown]
# ## Tokens, offsets and one mask per head
#
# Zero padding is part of the image: we pad first, so the border pixels' neighbours exist as tokens
# (holding zeros). `delta[i, j]` is the position of pixel `j` minus that of pixel `i`; head `h`
# may attend only where `delta` equals its offset. The masks are `[heads, N, N]`; attnkit wants a
# per-head mask as `[1, H, Lq, Lk]` (one for every batch element).

# %%
padded = F.pad(image, (padding,) * 4)  # [2, 1, 10, 10]
G = padded.shape[-1]
x = padded.flatten(2).transpose(1, 2)  # [B, N, C_in], N = 100 tokens, one per pixel
ys, xs = torch.meshgrid(torch.arange(G), torch.arange(G), indexing="ij")
pos = torch.stack([ys.flatten(), xs.flatten()], -1)  # [N, 2]
delta = pos[None, :, :] - pos[:, None, :]  # [N, N, 2]: key minus query
offsets = [(dy, dx) for dy in range(-(K // 2), K // 2 + 1) for dx in range(-(K // 2), K // 2 + 1)]
masks = torch.stack([(delta == torch.tensor(o)).all(-1) for o in offsets])  # [9, N, N]
print(f"{len(offsets)} heads, offsets {offsets}")
print("keys each query may see, per head (a border query sees none past the padding):",
      masks.sum(-1).unique().tolist())

# %%
centre = 5 * G + 5  # a pixel in the middle of the padded image
fig, axes = plt.subplots(1, len(offsets), figsize=(11, 1.6))
for ax, o, m in zip(axes, offsets, masks, strict=True):
    ax.imshow(m[centre].reshape(G, G), cmap="Greys")
    ax.plot(5, 5, "r.", ms=4)
    ax.set(title=f"{o}", xticks=[], yticks=[])
fig.suptitle("What each head may attend to, from the red pixel", fontsize=9)

# %% [markdown]
# ## The layer, and the check against `conv2d`
#
# With the masks doing all the selecting, queries and keys carry nothing: `q = k = 0`, so every
# allowed score is 0 and each head's softmax puts weight 1 on its single allowed key. A query whose
# head sees no key (the offset leaves the padded image) gets zeros from that head: attnkit's rule
# for an entirely masked row. We read the outputs at the pixels whose whole neighbourhood exists.

# %%
w_v = torch.stack([weight[:, :, dy + K // 2, dx + K // 2].T for dy, dx in offsets])  # [9, C_in, C_out]
v = torch.einsum("bnc,hco->bhno", x, w_v)  # [B, 9, N, C_out]: each head's values
zeros = torch.zeros(x.shape[0], len(offsets), x.shape[1], 1, dtype=x.dtype)
heads = attnkit.attention(zeros, zeros, v, mask=masks[None])  # [B, 9, N, C_out]
out = heads.sum(1) + bias  # the output projection [I I ... I], and the bias
r = K // 2
out = out.transpose(1, 2).reshape(-1, C_out, G, G)[:, :, r:G - r, r:G - r]
error = (out - reference).abs().max().item()
print(f"largest difference from F.conv2d: {error:.1e} (float64)")
assert error < 1e-12

# %% [markdown]
# ## The paper's relative-position score
#
# Cordonnier et al. do not use masks: each head scores key `j` from query `i` by a quadratic in
# their relative position, `-α · |delta - offset_h|²` (up to terms the softmax ignores). The right
# pixel scores 0 and its nearest rivals `-α`, so the weight on everything else falls as `e^(-α)`,
# and the layer tends to the convolution as `α` grows. With the scores as an additive `bias`:

# %%
sharpness = [0.5, 1, 2, 4, 8, 16, 32, 64]
errors = {}
for alpha in sharpness:
    scores = -alpha * ((delta[None] - torch.tensor(offsets)[:, None, None]) ** 2).sum(-1)  # [9, N, N]
    soft = attnkit.attention(zeros, zeros, v, bias=scores[None].to(x.dtype)).sum(1) + bias
    soft = soft.transpose(1, 2).reshape(-1, C_out, G, G)[:, :, r:G - r, r:G - r]
    errors[alpha] = (soft - reference).abs().max().item()
    print(f"alpha = {alpha:>4}: largest difference from the convolution {errors[alpha]:.1e}")
assert all(a >= b for a, b in zip(errors.values(), list(errors.values())[1:], strict=False))
assert errors[64] < 1e-12

fig, ax = plt.subplots(figsize=(4.2, 3.0))
ax.semilogy(list(errors), [max(e, 1e-17) for e in errors.values()], "o-")
ax.set(xlabel="alpha", ylabel="largest |attention - conv2d|", title="Quadratic relative scores tend to conv2d")

# %% [markdown]
# ## What a convolution cannot do
#
# A convolution applies the same weights to every image. So does the layer above: its scores depend
# on positions only. Add the usual content score `q · k / √D`, with `q` and `k` projected from the
# pixels, and the weights each head gives the neighbourhood change with what is in it. This is the
# layer the paper's argument keeps (it learns a mixture of both); no choice of kernel reproduces it,
# because a kernel's weights cannot depend on the input.

# %%
D = 4
w_q, w_k = torch.randn(2, len(offsets), C_in, D, dtype=torch.float64)
q = torch.einsum("bnc,hcd->bhnd", x, w_q)  # [B, 9, N, D]
k = torch.einsum("bnc,hcd->bhnd", x, w_k)
scores = -1.0 * ((delta[None] - torch.tensor(offsets)[:, None, None]) ** 2).sum(-1)[None].to(x.dtype)
_, positional = attnkit.attention(zeros, zeros, v, bias=scores, return_weights=True)
_, content = attnkit.attention(q, k, v, bias=scores, return_weights=True)
same_pos = (positional[0] - positional[1]).abs().max().item()
moved = (content[0] - content[1]).abs().max().item()
print(f"largest change of the weights between the two digits: positional only {same_pos:.1e}, "
      f"with the content score {moved:.2f}")
assert same_pos == 0.0 and moved > 0.05

fig, axes = plt.subplots(2, 3, figsize=(6.5, 4.4))
for row, b in enumerate(range(2)):
    axes[row, 0].imshow(padded[b, 0], cmap="gray_r")
    axes[row, 1].imshow(positional[b, len(offsets) // 2, centre].reshape(G, G), cmap="viridis")
    axes[row, 2].imshow(content[b, len(offsets) // 2, centre].reshape(G, G), cmap="viridis")
for ax, title in zip(axes[0], ("digit", "centre head, positional", "centre head, with content"), strict=True):
    ax.set_title(title, fontsize=9)
for ax in axes.flat:
    ax.set(xticks=[], yticks=[])

# %% [markdown]
# ## Takeaway
#
# `attnkit lab conv_attention` runs the same construction (`attnkit.lab.conv_attention.conv_as_attention`)
# for kernels from 1 × 1 to 7 × 7, every zero padding from none to `K // 2`, three input channels,
# float64 and float32, and gives the verdict. What it depends on: stride 1 and zero padding; a strided
# or dilated convolution needs other offsets and a subsampled output, which the construction does not
# cover here.

# %%
again = (conv_as_attention(image, weight, bias, padding=padding) - reference).abs().max().item()
print(f"the lab's function, same image and kernel: largest difference {again:.1e}")
assert again < 1e-12
print(f"The masked layer equals conv2d to {error:.0e}; the quadratic score reaches it at alpha = 64 "
      f"({errors[64]:.0e}); a content term moves the weights by up to {moved:.2f} between two digits.")
