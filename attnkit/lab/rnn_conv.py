"""Self-attention vs recurrent and convolutional layers: cost, sequential steps, path length."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from ..analysis.complexity import attention_cost
from ..modules import MultiHeadAttention
from ._common import WIDTH, figure, reverse_batch, save, shift_batch, train
from .runner import Finding

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


def graph_depth(t: Tensor) -> int:
    """Longest chain of operations from the inputs to ``t`` in its autograd graph: the steps that
    must run one after another, however many processors there are."""
    depth: dict = {}

    def longest(fn) -> int:
        if fn is None:
            return 0
        if fn not in depth:
            depth[fn] = 1 + max((longest(nxt) for nxt, _ in fn.next_functions), default=0)
        return depth[fn]

    return longest(t.grad_fn)


def sequential_steps(n: int, width: int = 8) -> dict[str, int]:
    """Measured :func:`graph_depth` of one attention layer and of a recurrent cell unrolled over ``n`` tokens."""
    torch.manual_seed(0)
    x = torch.randn(1, n, width, requires_grad=True)
    cell, h = nn.RNNCell(width, width), torch.zeros(1, width)
    for i in range(n):
        h = cell(x[:, i], h)
    return {"attention": graph_depth(MultiHeadAttention(width, 1)(x)), "recurrent": graph_depth(h)}


def recurrent_flops(n: int, d: int) -> float:
    """FLOPs of ``nn.RNNCell(d, d)`` run over ``n`` tokens, counted as torch's FLOP counter counts them:
    each step multiplies by its input-to-hidden and its hidden-to-hidden weights (two ``d x d``
    products, 2 FLOPs per multiply-add), so ``4 n d^2`` in all; the bias adds and tanh are not counted."""
    cell = nn.RNNCell(d, d)
    return 2.0 * n * (cell.weight_ih.numel() + cell.weight_hh.numel())


def run(quick: bool, out: Path) -> Finding:
    n, d, k = 512, 64, 3
    calc = {"attention": attention_cost(n, d).attention_flops, "recurrent": recurrent_flops(n, d),
            "convolution": 2.0 * k * n * d * d}
    n_path = 64
    # Causal stacks, as in the table's count: reaching back n - 1 positions takes (n - 1) / (k - 1)
    # plain layers, or log_k n layers whose dilation grows k-fold per layer.
    paths = {"attention": layers_to_connect(lambda i: MultiHeadAttention(8, 1), n_path, 4),
             "convolution": layers_to_connect(lambda i: Conv(8, k, causal=True), n_path, n_path),
             "dilated convolution": layers_to_connect(lambda i: Conv(8, k, dilation=k ** i, causal=True), n_path,
                                                      math.ceil(math.log(n_path, k)) + 2)}
    depth = {m: sequential_steps(m) for m in (16, 32, 64)}
    steps = 250 if quick else 1500
    mixers = {"attention": lambda: MultiHeadAttention(WIDTH, 2), f"window {k}": lambda: LocalAttention(WIDTH, k),
              f"conv {k}": lambda: Conv(WIDTH, k)}
    acc = {task: {name: train(make, steps=steps, task=fn)["accuracy"] for name, make in mixers.items()}
           for task, fn in (("shift by 1", partial(shift_batch, by=1)), ("reverse", reverse_batch))}
    figures = {"flops_per_layer": calc, "sequential_steps": {"attention": 1, "recurrent": n, "convolution": 1},
               "graph_depth_by_n": depth, "layers_to_link_first_and_last_of_64": paths,
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
    r16, r32, r64 = (depth[m]["recurrent"] for m in (16, 32, 64))
    depth_ok = depth[16]["attention"] == depth[64]["attention"] and r64 - r32 == 2 * (r32 - r16) > 0  # linear in n
    why = (f"At n = {n}, d = {d} a layer costs {calc['attention']:.2g} FLOPs as attention (QK^T and PV), "
           f"{calc['recurrent']:.2g} as a recurrence (input-to-hidden and hidden-to-hidden products, 4 n d^2) "
           f"and {calc['convolution']:.2g} as a width-{k} convolution; the longest chain of dependent "
           f"operations in the autograd graph is {depth[16]['attention']} for attention at n = 16, 32, 64 and "
           f"{r16}, {r32}, {r64} for a recurrent cell; linking the first and last of {n_path} positions took "
           f"{paths['attention']} attention layer, {paths['convolution']} convolution layers and "
           f"{paths['dilated convolution']} dilated ones, as the table says; a width-{k} window and a width-{k} "
           f"convolution both learn the local task ({acc['shift by 1'][f'window {k}']:.2f}, "
           f"{acc['shift by 1'][f'conv {k}']:.2f}), and only full attention reverses the sequence in one layer "
           f"({acc['reverse']['attention']:.2f}, against {acc['reverse'][f'window {k}']:.2f} and "
           f"{acc['reverse'][f'conv {k}']:.2f}).")
    verdict = "supported" if local_ok and paths_ok and depth_ok else "depends"
    labels = {"flops_per_layer": f"FLOPs per layer (n = {n}, d = {d}, convolution width {k}; a multiply-add is 2; "
                                 "attention's scores and weighted sum, a recurrent cell's input-to-hidden and "
                                 "hidden-to-hidden products, without projections)",
              "sequential_steps": f"Sequential steps per layer, as the table counts them (n = {n})",
              "graph_depth_by_n": "Longest chain of dependent operations, measured, by n",
              "layers_to_link_first_and_last_of_64": f"Layers to link the first and last of {n_path} positions, "
                                                     "measured",
              "expected_conv_layers": f"Layers to link them, expected, convolution: ceil({n_path - 1} / {k - 1})",
              "expected_dilated_layers": f"Layers to link them, expected, dilated convolution: ceil(log base {k} "
                                         f"of {n_path})",
              "accuracy": f"Accuracy after {steps} steps, by task and mixing layer",
              "attention": "Attention", "recurrent": "Recurrent", "convolution": "Convolution",
              "dilated convolution": "Dilated convolution", f"window {k}": f"Attention window {k}",
              f"conv {k}": f"Convolution {k}", "shift by 1": "Shift by 1", "reverse": "Reverse"}
    return Finding("rnn_conv", CLAIM, figures, verdict, why, [pic], labels=labels)
