"""Self-attention vs recurrent and convolutional layers: cost, sequential steps, path length."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from ..analysis.complexity import attention_cost
from ..modules import MultiHeadAttention
from . import Finding
from ._common import WIDTH, figure, reverse_batch, save, shift_batch, train

CLAIM = ("Per layer, self-attention costs O(n^2 d) against O(n d^2) for a recurrent layer and O(k n d^2) for a "
         "convolution of width k; it needs O(1) sequential steps (a recurrent layer n) and links any two "
         "positions in one step (path length 1, against n for a recurrent layer and log_k n for dilated "
         "convolutions). A local attention window of width k does what a width-k convolution does.")


class Conv(nn.Module):
    """1-D convolution of odd width ``k``, ``[B, L, E] -> [B, L, E]``: centred, or causal (each output
    sees itself and the ``k - 1`` inputs before it, spaced by ``dilation``)."""

    def __init__(self, width: int, k: int, *, dilation: int = 1, causal: bool = False) -> None:
        super().__init__()
        reach = (k - 1) * dilation
        self.pad = (reach, 0) if causal else (reach // 2, reach // 2)
        self.conv = nn.Conv1d(width, width, k, dilation=dilation)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(nn.functional.pad(x.transpose(1, 2), self.pad)).transpose(1, 2)


class LocalAttention(nn.Module):
    """Self-attention that sees only the ``k`` positions centred on each query (odd ``k``)."""

    def __init__(self, width: int, k: int) -> None:
        super().__init__()
        self.attn, self.k = MultiHeadAttention(width, 2), k

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, window=(self.k // 2, self.k // 2))


def layers_to_connect(make_layer, n: int, limit: int) -> int:
    """How many stacked layers until output ``n - 1`` depends on input 0 (a measured path length)."""
    torch.manual_seed(0)
    x = torch.randn(1, n, 8, requires_grad=True)
    layers = []
    for depth in range(1, limit + 1):
        layers.append(make_layer(depth - 1))
        h = x
        for layer in layers:
            h = layer(h)
        (grad,) = torch.autograd.grad(h[0, -1].sum(), x)
        if grad[0, 0].abs().sum() > 0:
            return depth
    return limit + 1


def run(quick: bool, out: Path) -> Finding:
    n, d, k = 512, 64, 3
    calc = {"attention": attention_cost(n, d).attention_flops, "recurrent": 2.0 * n * d * d,
            "convolution": 2.0 * k * n * d * d}
    n_path = 64
    # Causal stacks, as in the table's count: reaching back n - 1 positions takes (n - 1) / (k - 1)
    # plain layers, or log_k n layers whose dilation grows k-fold per layer.
    paths = {"attention": layers_to_connect(lambda i: MultiHeadAttention(8, 1), n_path, 4),
             "convolution": layers_to_connect(lambda i: Conv(8, k, causal=True), n_path, n_path),
             "dilated convolution": layers_to_connect(lambda i: Conv(8, k, dilation=k ** i, causal=True), n_path,
                                                      math.ceil(math.log(n_path, k)) + 2)}
    steps = 250 if quick else 1500
    mixers = {"attention": lambda: MultiHeadAttention(WIDTH, 2), f"window {k}": lambda: LocalAttention(WIDTH, k),
              f"conv {k}": lambda: Conv(WIDTH, k)}
    acc = {task: {name: train(make, steps=steps, task=fn)["accuracy"] for name, make in mixers.items()}
           for task, fn in (("shift by 1", partial(shift_batch, by=1)), ("reverse", reverse_batch))}
    figures = {"flops_per_layer": calc, "sequential_steps": {"attention": 1, "recurrent": n, "convolution": 1},
               "layers_to_link_first_and_last_of_64": paths,
               "expected_conv_layers": math.ceil((n_path - 1) / (k - 1)),
               "expected_dilated_layers": math.ceil(math.log(n_path, k)),
               "accuracy": acc}
    fig, axes = figure(1, width=4.6)
    ax = axes[0][0]
    names = list(mixers)
    for j, (task, res) in enumerate(acc.items()):
        ax.bar([i + 0.4 * j for i in range(len(names))], [res[m] for m in names], width=0.4, label=task)
    ax.set_xticks([i + 0.2 for i in range(len(names))], names)
    ax.set(ylabel="accuracy", ylim=(0, 1.05), title=f"Same model, different mixing layer ({steps} steps)")
    ax.legend(fontsize=8)
    pic = save(fig, out / "lab_rnn_conv.png")
    local_ok = acc["shift by 1"][f"window {k}"] > 0.9 and acc["shift by 1"][f"conv {k}"] > 0.9
    paths_ok = (paths["attention"] == 1 and paths["convolution"] == figures["expected_conv_layers"]
                and paths["dilated convolution"] == figures["expected_dilated_layers"])
    why = (f"At n = {n}, d = {d} a layer costs {calc['attention']:.2g} FLOPs as attention, {calc['recurrent']:.2g} as "
           f"a recurrence (one d x d matrix per step, {n} steps in sequence) and "
           f"{calc['convolution']:.2g} as a width-{k} convolution; linking the "
           f"first and last of {n_path} positions took {paths['attention']} attention layer, "
           f"{paths['convolution']} convolution layers and {paths['dilated convolution']} dilated ones, as the table "
           f"says; a width-{k} window and a width-{k} convolution both learn the local task "
           f"({acc['shift by 1'][f'window {k}']:.2f}, {acc['shift by 1'][f'conv {k}']:.2f}), and only full "
           f"attention reverses the sequence in one layer ({acc['reverse']['attention']:.2f}, against "
           f"{acc['reverse'][f'window {k}']:.2f} and {acc['reverse'][f'conv {k}']:.2f}).")
    return Finding("rnn_conv", CLAIM, figures, "supported" if local_ok and paths_ok else "depends", why, [pic])
