"""A convolution is a special case of self-attention: K*K heads, one per offset, with relative-position
scores (Cordonnier, Loukas & Jaggi 2020, "On the Relationship between Self-Attention and Convolutional
Layers", ICLR), and what a content term adds that no convolution has."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import attention
from ._common import figure, save
from .runner import Finding

CLAIM = ("A multi-head self-attention layer with relative-position scores and K*K heads, each attending to one "
         "offset, computes exactly a K x K convolution (any weights, any zero padding) of an image whose pixels are "
         "its tokens; and attention can do what the convolution cannot: with a content term in the scores its "
         "weights change with the input.")

#: The sharpness of the quadratic relative-position score, ``-alpha * |delta - offset|^2``; the weight on
#: every other pixel falls as ``exp(-alpha)`` (the paper lets alpha grow without bound).
ALPHAS = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


def offsets(k: int) -> list[tuple[int, int]]:
    """The ``k * k`` offsets ``(dy, dx)``, row-major, one head each: head ``h`` is kernel tap ``divmod(h, k)``."""
    if k < 1 or k % 2 == 0:
        raise ValueError(f"k must be an odd positive kernel size, got {k}")
    r = k // 2
    return [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1)]


def grid_deltas(height: int, width: int) -> Tensor:
    """``[N, N, 2]``: for query pixel ``i`` and key pixel ``j`` of a ``height x width`` grid (row-major
    tokens), the key's position minus the query's, ``(dy, dx)``."""
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    pos = torch.stack([ys.flatten(), xs.flatten()], -1)  # (N, 2)
    return pos[None, :, :] - pos[:, None, :]  # (N, N, 2): key - query


def relative_scores(height: int, width: int, k: int, alpha: float, dtype=torch.float64) -> Tensor:
    """``[k*k, N, N]``: head ``h``'s score ``-alpha * |delta - offset_h|^2`` (the paper's quadratic
    relative encoding, up to a per-row constant that the softmax ignores)."""
    delta = grid_deltas(height, width).to(dtype)
    off = torch.tensor(offsets(k), dtype=dtype)  # (H, 2)
    return -alpha * ((delta[None] - off[:, None, None]) ** 2).sum(-1)


def offset_masks(height: int, width: int, k: int) -> Tensor:
    """``[k*k, N, N]`` bool: head ``h`` may attend only to the key at its own offset (the limit of
    :func:`relative_scores` as alpha grows)."""
    delta = grid_deltas(height, width)
    off = torch.tensor(offsets(k))
    return (delta[None] == off[:, None, None]).all(-1)


def conv_as_attention(image: Tensor, weight: Tensor, bias: Tensor | None = None, *, padding: int = 0,
                      alpha: float | None = None, content: tuple[Tensor, Tensor] | None = None,
                      return_weights: bool = False):
    """A 2-D convolution (stride 1, zero padding) computed as one multi-head self-attention layer.

    The padded image's pixels are the tokens. Head ``h`` of the ``K * K`` heads has the value
    projection ``weight[:, :, dy + K // 2, dx + K // 2]^T`` and relative-position scores that put its
    weight on the pixel at offset ``(dy, dx)``: exactly (``alpha=None``: a mask allowing that one key)
    or in the limit (``alpha``: the quadratic score of :func:`relative_scores`). The output projection
    adds the heads' outputs (``[I I ... I]``) and the convolution's bias. The outputs are read at the
    pixels whose whole ``K x K`` neighbourhood lies in the padded image, which is what
    ``F.conv2d(image, weight, bias, padding=padding)`` returns.

    Plain PyTorch, for a reader: ``out[b, :, y, x] = bias + sum_h weights_h[(y, x) -> (y + dy, x + dx)]
    * (W_h^T image[b, :, y + dy, x + dx])``, where ``weights_h`` is one-hot.

    Args:
        image: ``[B, C_in, H, W]``.
        weight: ``[C_out, C_in, K, K]``, ``K`` odd.
        bias: ``[C_out]`` or ``None``.
        padding: zeros added on each side, ``0 .. K // 2``.
        alpha: ``None`` for the exact (masked) heads, else the relative score's sharpness.
        content: ``(w_q, w_k)``, each ``[K*K, C_in, D]``: adds the content score ``q_h . k_h / sqrt(D)`` of
            the padded pixels to the positional one (needs ``alpha``): a layer that is no longer a convolution.
        return_weights: also return the attention weights ``[B, K*K, N, N]`` over the padded grid.

    Returns:
        ``[B, C_out, H + 2 padding - K + 1, W + 2 padding - K + 1]`` (and the weights).
    """
    if image.dim() != 4 or weight.dim() != 4 or weight.shape[1] != image.shape[1] or weight.shape[2] != weight.shape[3]:
        raise ValueError(f"image must be [B, C_in, H, W] and weight [C_out, C_in, K, K], got {tuple(image.shape)} "
                         f"and {tuple(weight.shape)}")
    k = weight.shape[-1]
    heads = offsets(k)
    if not 0 <= padding <= k // 2:
        raise ValueError(f"padding must be in 0 .. {k // 2} (K // 2), got {padding}")
    if content is not None and alpha is None:
        raise ValueError("content needs alpha: a content score beside a mask that allows one key changes nothing")
    b, c_in = image.shape[:2]
    padded = F.pad(image, (padding,) * 4)
    gh, gw = padded.shape[-2:]
    x = padded.flatten(2).transpose(1, 2)  # (B, N, C_in): one token per pixel of the padded image
    r = k // 2
    w_v = torch.stack([weight[:, :, dy + r, dx + r].T for dy, dx in heads])  # (H, C_in, C_out)
    v = torch.einsum("bnc,hco->bhno", x, w_v)  # (B, H, N, C_out)
    zeros = x.new_zeros(b, len(heads), x.shape[1], 1)  # no content: q . k = 0, the scores are positional only
    q = k_ = zeros
    if alpha is None:
        scores = {"mask": offset_masks(gh, gw, k).to(image.device)[None]}  # (1, H, N, N): one per head
    else:
        scores = {"bias": relative_scores(gh, gw, k, alpha, image.dtype).to(image.device)[None]}
    if content is not None:
        w_q, w_k = content
        q = torch.einsum("bnc,hcd->bhnd", x, w_q)  # (B, H, N, D)
        k_ = torch.einsum("bnc,hcd->bhnd", x, w_k)
    out, w = attention(q, k_, v, **scores, return_weights=True)  # (B, H, N, C_out), (B, H, N, N)
    out = out.sum(1)  # the output projection [I I ... I]: the heads' outputs added
    if bias is not None:
        out = out + bias
    out = out.transpose(1, 2).reshape(b, -1, gh, gw)[:, :, r:gh - r, r:gw - r]  # centres of full neighbourhoods
    return (out, w) if return_weights else out


def rounding_bound(terms: int, scale: float, dtype: torch.dtype) -> float:
    """What two orders of summing ``terms`` products of size ``scale`` may differ by: ``terms * eps * scale``."""
    return terms * torch.finfo(dtype).eps * scale


def _digits(n: int) -> Tensor:
    from sklearn.datasets import load_digits

    return torch.tensor(load_digits().images[:n], dtype=torch.float64)[:, None] / 16.0  # (n, 1, 8, 8)


def run(quick: bool, out: Path) -> Finding:
    gen = torch.Generator().manual_seed(0)
    images = _digits(4 if quick else 16).repeat(1, 3, 1, 1)  # three input channels
    images = images + 0.1 * torch.randn(images.shape, generator=gen, dtype=torch.float64)
    cases = [(3, 0), (3, 1), (5, 1), (5, 2)] if quick else [(1, 0), (3, 0), (3, 1), (5, 0), (5, 1), (5, 2), (7, 3)]
    rows = []
    for k, pad in cases:
        weight = torch.randn(4, 3, k, k, generator=gen, dtype=torch.float64)
        bias = torch.randn(4, generator=gen, dtype=torch.float64)
        row = {"kernel": f"{k} x {k}", "padding": pad}
        for dtype, name in ((torch.float64, "float64"), (torch.float32, "float32")):
            ref = F.conv2d(images.to(dtype), weight.to(dtype), bias.to(dtype), padding=pad)
            got = conv_as_attention(images.to(dtype), weight.to(dtype), bias.to(dtype), padding=pad)
            err = (got - ref).abs().max().item()
            bound = rounding_bound(k * k * 3 + 1, (images.abs().max() * weight.abs().max()).item(), dtype)
            row[f"error_{name}"], row[f"bound_{name}"] = err, bound
            row["shape_matches"] = got.shape == ref.shape
        rows.append(row)
    exact = all(r["shape_matches"] and r[f"error_{d}"] <= r[f"bound_{d}"] for r in rows for d in ("float64", "float32"))

    # The paper's construction proper: finite alpha, no mask; the error falls as exp(-alpha).
    k, pad = 3, 1
    weight = torch.randn(4, 3, k, k, generator=gen, dtype=torch.float64)
    ref = F.conv2d(images, weight, padding=pad)
    by_alpha = {a: (conv_as_attention(images, weight, padding=pad, alpha=a) - ref).abs().max().item()
                for a in ALPHAS}
    bound = rounding_bound(k * k * 3, (images.abs().max() * weight.abs().max()).item(), torch.float64)
    falls = all(by_alpha[a] >= by_alpha[b] or by_alpha[b] <= bound for a, b in pairwise(ALPHAS))
    limit_ok = falls and by_alpha[ALPHAS[-1]] <= bound

    # What a convolution cannot do: the same layer with a content term weighs the 3 x 3 neighbourhood
    # differently for each input; without it, the weights are the same for every image.
    d = 8
    w_q = torch.randn(k * k, 3, d, generator=gen, dtype=torch.float64)
    w_k = torch.randn(k * k, 3, d, generator=gen, dtype=torch.float64)
    alpha_c = 1.0
    _, w_pos = conv_as_attention(images, weight, padding=pad, alpha=alpha_c, return_weights=True)
    _, w_con = conv_as_attention(images, weight, padding=pad, alpha=alpha_c, content=(w_q, w_k), return_weights=True)
    spread_pos = (w_pos - w_pos[:1]).abs().max().item()  # across images, same query, same head
    spread_con = (w_con - w_con[:1]).abs().max().item()
    # Total variation between two images' weight rows, averaged over heads and the image's own pixels.
    gh = images.shape[-1] + 2 * pad
    inner = torch.zeros(gh, gh, dtype=torch.bool)
    inner[pad:gh - pad, pad:gh - pad] = True
    tv = 0.5 * (w_con[1:] - w_con[:1]).abs().sum(-1)[..., inner.flatten()].mean().item()
    content_ok = spread_pos == 0.0 and spread_con > 0.0

    figures = {"exact_by_kernel": rows, "error_by_alpha": by_alpha, "bound_by_alpha": bound,
               "weight_spread_positional": spread_pos, "weight_spread_content": spread_con,
               "mean_total_variation_content": tv, "images": len(images)}
    fig, axes = figure(3, width=3.4, height=3.0)
    ax = axes[0][0]
    ax.semilogy(list(by_alpha), [max(e, 1e-18) for e in by_alpha.values()], "o-", label="attention - convolution")
    ax.axhline(bound, color="grey", ls=":", label="float64 rounding bound")
    ax.set(xlabel="alpha", ylabel="largest |difference|", title="Relative scores -alpha |delta - offset|^2")
    ax.legend(fontsize=7)
    centre = (pad + 3) * gh + pad + 3  # a pixel in the digit's middle
    for ax, (name, w) in zip(axes[0][1:], (("positional only", w_pos), ("with a content term", w_con)), strict=True):
        tap = w[:2, k * k // 2, centre].reshape(2, gh, gh)  # the centre head's weights, two images
        ax.imshow(torch.cat([tap[0], torch.full((gh, 1), float("nan"), dtype=tap.dtype), tap[1]], 1).numpy(),
                  cmap="viridis")
        ax.set(title=f"{name}: centre head,\ntwo images", xticks=[], yticks=[])
    pic = save(fig, out / "lab_conv_attention.png")
    verdict = "supported" if exact and limit_ok and content_ok else "refuted"
    worst = {d: max(r[f"error_{d}"] for r in rows) for d in ("float64", "float32")}
    why = (f"With one head per offset, masked to that one key, the layer equals F.conv2d for kernels "
           f"{', '.join(r['kernel'] for r in rows)} with paddings {', '.join(str(r['padding']) for r in rows)} "
           f"on {len(images)} digit images with 3 channels, to {worst['float64']:.1e} in float64 and "
           f"{worst['float32']:.1e} in float32 (each within its rounding bound: {'yes' if exact else 'no'}); with the "
           f"paper's quadratic relative score instead of the mask the difference falls from "
           f"{by_alpha[ALPHAS[0]]:.1e} at alpha = {ALPHAS[0]:g} to {by_alpha[ALPHAS[-1]]:.1e} at alpha = "
           f"{ALPHAS[-1]:g}; the positional-only weights are the same for every image (largest difference "
           f"{spread_pos:.1e}), and a content term makes them differ by up to {spread_con:.2f} (mean total variation "
           f"{tv:.2f} between two images' rows at alpha = {alpha_c:g}). Stride 1 and zero padding only.")
    labels = {"exact_by_kernel": "Masked heads against F.conv2d, by kernel and padding", "kernel": "Kernel",
              "padding": "Padding", "error_float64": "Largest difference, float64",
              "bound_float64": "Rounding bound, float64", "error_float32": "Largest difference, float32",
              "bound_float32": "Rounding bound, float32", "shape_matches": "Same output shape",
              "error_by_alpha": "Largest difference from F.conv2d by alpha (3 x 3 kernel, padding 1, float64)",
              "bound_by_alpha": "Float64 rounding bound for that comparison",
              "weight_spread_positional": "Largest change of the weights between images, positional scores only",
              "weight_spread_content": "Largest change of the weights between images, with a content term",
              "mean_total_variation_content": "Mean total variation between two images' weight rows, with a "
                                              "content term",
              "images": "Images"}
    return Finding("conv_attention", CLAIM, figures, verdict, why, [pic], labels=labels)
