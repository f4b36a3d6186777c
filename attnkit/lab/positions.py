"""Positions: attention alone ignores order; sinusoidal encodings turn offsets into linear maps."""

from __future__ import annotations

from pathlib import Path

import torch

from ..modules import MultiHeadAttention
from ..positional import SinusoidalPositionalEncoding, sinusoidal_table
from ._common import figure, save
from .runner import Finding

CLAIM = ("Self-attention without positional information is permutation-equivariant: shuffling the words "
         "shuffles the outputs the same way and changes nothing else. Sinusoidal encodings fix that, and "
         "PE(pos + k) is a fixed linear function of PE(pos) for every offset k, which makes relative positions easy "
         "to learn. A common description says odd positions use cosine and even positions sine.")


def linear_map_residual(k: int, dim: int, positions: int) -> float:
    """Fit ``M`` with ``PE[pos + k] = PE[pos] M`` by least squares (float64); return the largest residual."""
    pe = sinusoidal_table(positions + k, dim, dtype=torch.float64)
    a, b = pe[:positions], pe[k:]
    # The slowest sinusoids are nearly constant over a few hundred positions (condition number ~1e18):
    # the default QR driver breaks down there, the SVD one returns the exact map.
    m = torch.linalg.lstsq(a, b, driver="gelsd").solution
    return (a @ m - b).abs().max().item()


def run(quick: bool, out: Path) -> Finding:
    torch.manual_seed(0)
    e, n = 32, 10
    mha = MultiHeadAttention(e, 4).double()
    pe = SinusoidalPositionalEncoding(e)
    x = torch.randn(2, n, e, dtype=torch.float64)
    perm = torch.randperm(n)
    with torch.no_grad():
        equi = (mha(x[:, perm]) - mha(x)[:, perm]).abs().max().item()
        with_pe = (mha(pe(x[:, perm])) - mha(pe(x))[:, perm]).abs().max().item()
    offsets = [1, 3, 10, 50] if quick else [1, 2, 3, 5, 10, 20, 50, 100]
    residuals = {k: linear_map_residual(k, 64, 200 if quick else 1000) for k in offsets}
    table = sinusoidal_table(4, 6, dtype=torch.float64)
    # Even *dimensions* are sines and odd dimensions cosines, at every position: at position 0 the
    # row reads 0, 1, 0, 1, ... and position 1 (odd) still starts with sin(1).
    figures = {"permutation_error_no_pe": equi, "permutation_error_with_pe": with_pe,
               "max_linear_map_residual": max(residuals.values()),
               "pe_row_pos0": [round(v, 4) for v in table[0].tolist()],
               "pe_row_pos1": [round(v, 4) for v in table[1].tolist()], "pe_pos1_dim0_is_sin1": table[1, 0].item()}
    fig, axes = figure(2)
    big = sinusoidal_table(50, 32)
    ax = axes[0][0]
    im = ax.imshow(big.numpy(), aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    ax.set(xlabel="dimension (even: sin, odd: cos)", ylabel="position", title="Sinusoidal table")
    fig.colorbar(im, ax=ax)
    ax = axes[0][1]
    ax.semilogy(list(residuals), [max(r, 1e-17) for r in residuals.values()], "o-")
    ax.set(xlabel="offset k", ylabel="max |PE(pos) M_k - PE(pos+k)|", title="PE(pos+k) as a linear map of PE(pos)")
    pic = save(fig, out / "lab_positions.png")
    ok = equi < 1e-12 and with_pe > 1e-3 and max(residuals.values()) < 1e-5
    why = (f"Permuting the input permutes the output to {equi:.1e} without positions (and moves it by {with_pe:.2f} "
           f"with them); PE(pos + k) = PE(pos) M_k holds to {max(residuals.values()):.1e} for k in {offsets}; "
           "and it is odd dimensions, not odd positions, that use cosine (position 1 starts with "
           f"sin(1) = {table[1, 0].item():.3f}).")
    labels = {"permutation_error_no_pe": "Largest change when the input is permuted, without positions",
              "permutation_error_with_pe": "Largest change when the input is permuted, with sinusoidal positions",
              "max_linear_map_residual": "Largest residual of PE(pos + k) = PE(pos) M_k, over k = "
                                         + ", ".join(map(str, offsets)),
              "pe_row_pos0": "Sinusoidal table, position 0 (dimensions 0 to 5)",
              "pe_row_pos1": "Sinusoidal table, position 1 (dimensions 0 to 5)",
              "pe_pos1_dim0_is_sin1": "Sinusoidal table, position 1, dimension 0 (sin(1) = 0.8415)"}
    return Finding("positions", CLAIM, figures, "supported" if ok else "depends", why, [pic], labels=labels)
