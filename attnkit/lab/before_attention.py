"""Before attention: a window MLP, an RNN, an LSTM and attention on the recall task, and the RNN's
gradient over distance, vanishing and exploding, against the scale of its recurrent weights."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..apps import recall
from ..apps._common import fit, seed_all
from ._common import figure, save
from .runner import Finding

CLAIM = ("The history the articles tell: a feed-forward network over a window of the last w tokens cannot use "
         "anything farther back; a recurrent network can, but the gradient linking its output to an input d steps "
         "back is multiplied by the recurrent Jacobian at every step, so it vanishes exponentially in d when the "
         "recurrent weights are below 1 and explodes when they are above; the LSTM's gated memory carries "
         "information farther; attention reaches every distance in one step.")

MODELS = ("MLP", *recall.MODELS)
#: The window MLP's sizes, learning rate and training steps (times the others'). At the others' size and
#: steps it did not learn the task even where the cue lies in its window (tried: 48 hidden units, 1,000 and
#: 3,000 steps); with these it does, so what it misses beyond the window is the window's doing.
MLP = {"mlp_window": 16, "mlp_hidden": 256}
MLP_QUICK = {"mlp_window": 6, "mlp_hidden": 64}
MLP_LR = 3e-3
MLP_STEPS = 3
#: Spectral scales of the recurrent weights (an orthogonal matrix times the scale: every singular value is it).
SCALES = (0.5, 0.9, 1.0, 1.1, 1.5, 2.0, 4.0)
#: Input sizes for the gradient: unit-variance inputs (the tanh often saturates) and small ones (it stays near linear).
INPUT_STDS = (1.0, 0.01)
#: Gradient over distance: ``STEPS`` inputs, hidden size ``HIDDEN``, averaged over ``BATCH`` sequences.
STEPS, HIDDEN, BATCH = 64, 64, 16


def gradient_by_distance(scale: float, *, tanh: bool, input_std: float, seed: int = 0) -> Tensor:
    """``[STEPS]``: at index ``d``, the mean norm of ``d (u . h_T) / d x_{T-d}`` for the recurrence
    ``h_t = act(W_ih x_t + W_hh h_{t-1})``, ``W_hh = scale * Q`` (``Q`` orthogonal), ``act`` tanh or the
    identity, ``u`` a random direction; float64, one backward pass for every distance."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN, generator=gen, dtype=torch.float64))
    w_hh = scale * q
    w_ih = torch.randn(HIDDEN, HIDDEN, generator=gen, dtype=torch.float64) / math.sqrt(HIDDEN)
    x = (input_std * torch.randn(BATCH, STEPS, HIDDEN, generator=gen, dtype=torch.float64)).requires_grad_(True)
    h = x.new_zeros(BATCH, HIDDEN)
    for t in range(STEPS):
        h = x[:, t] @ w_ih.T + h @ w_hh.T
        h = torch.tanh(h) if tanh else h
    u = torch.randn(BATCH, HIDDEN, generator=gen, dtype=torch.float64)
    (grad,) = torch.autograd.grad((u * h).sum(), x)
    return grad.norm(dim=-1).mean(0).flip(0)  # (STEPS,): distance 0 is the last input


def per_step_factor(g: Tensor) -> float:
    """``exp`` of the least-squares slope of ``log g`` against distance: what each step multiplies by."""
    d = torch.arange(len(g), dtype=torch.float64)
    lg = g.clamp_min(1e-300).log()
    return math.exp(float(((d - d.mean()) * (lg - lg.mean())).sum() / ((d - d.mean()) ** 2).sum()))


def train_recall(quick: bool) -> tuple[dict[str, dict[int, float]], dict, dict[str, int]]:
    """Train the four models on the recall app's batches; held-out accuracy by distance, the settings,
    the parameter counts."""
    cfg = {**recall.DEFAULTS, **MLP, **(recall.QUICK | MLP_QUICK if quick else {})}
    lrs = {**cfg["lr"], "MLP": MLP_LR}
    tests = recall.test_set(cfg)
    acc, params = {}, {}
    for i, name in enumerate(MODELS):
        seed_all(i)
        model = recall.build_one(name, cfg)

        def loss_fn(m, batch):
            return F.cross_entropy(m(batch[0]), batch[1])

        steps = cfg["steps"] * (MLP_STEPS if name == "MLP" else 1)
        fit(model, lambda step: recall.batch_for(step, 0, cfg), loss_fn, steps=steps, lr=lrs[name],
            warmup=cfg["warmup"], desc=f"recall {name}", progress=False)
        acc[name] = {d: recall.accuracy(model, *tests[d]) for d in cfg["eval_distances"]}
        params[name] = recall.param_count(model)
    return acc, cfg, params


def run(quick: bool, out: Path) -> Finding:
    grads = {(tanh, std, s): gradient_by_distance(s, tanh=tanh, input_std=std)
             for tanh in (False, True) for std in INPUT_STDS for s in SCALES}
    factors = {k: per_step_factor(g) for k, g in grads.items()}
    far = STEPS - 1
    rows = [{"recurrence": "Tanh" if tanh else "Linear", "input_std": std, "scale": s,
             "grad_distance_0": float(grads[tanh, std, s][0]), f"grad_distance_{far}": float(grads[tanh, std, s][far]),
             "per_step_factor": factors[tanh, std, s]}
            for tanh in (False, True) for std in INPUT_STDS for s in SCALES]
    # Linear recurrence: the factor is the scale (every singular value of W_hh), to a few per cent.
    linear_ok = all(abs(factors[False, std, s] / s - 1) < 0.05 for std in INPUT_STDS for s in SCALES)

    def vanishes(key):
        return float(grads[key][far] / grads[key][0]) < 1e-3

    def explodes(key):
        return float(grads[key][far] / grads[key][0]) > 1e3

    tanh_vanish = [s for s in SCALES if vanishes((True, 1.0, s))]
    tanh_explode = [s for s in SCALES if explodes((True, 1.0, s))]
    tanh_explode_small = [s for s in SCALES if explodes((True, 0.01, s))]

    acc, cfg, params = train_recall(quick)
    chance = 1 / cfg["num_values"]
    window_reach = cfg["mlp_window"] - 3  # the cue must lie in the window
    inside = [d for d in cfg["eval_distances"] if d <= window_reach]
    beyond = [d for d in cfg["eval_distances"] if d > window_reach]
    mlp_in = min(acc["MLP"][d] for d in inside)
    mlp_out = max(acc["MLP"][d] for d in beyond)
    # The window shows only if the MLP learned the task where it can see the cue.
    mlp_window_shown = mlp_in >= 0.8 and mlp_out < 3 * chance
    last = cfg["eval_distances"][-1]
    rnn, lstm, attn = (acc[m][last] for m in ("RNN", "LSTM", "attention"))
    ladder = lstm > rnn + 0.1 and attn >= lstm - 0.05

    figures = {"gradient_table": rows, "linear_factor_equals_scale": linear_ok,
               "tanh_vanishing_scales_unit_inputs": ", ".join(f"{s:g}" for s in tanh_vanish) or "none",
               "tanh_exploding_scales_unit_inputs": ", ".join(f"{s:g}" for s in tanh_explode) or "none",
               "tanh_exploding_scales_small_inputs": ", ".join(f"{s:g}" for s in tanh_explode_small) or "none",
               "recall_accuracy": {m: acc[m] for m in MODELS}, "parameters": params,
               "mlp_window": cfg["mlp_window"], "mlp_accuracy_inside_window": mlp_in,
               "mlp_accuracy_beyond_window": mlp_out, "chance": chance, "steps": cfg["steps"]}
    fig, axes = figure(3, width=3.6, height=3.0)
    for ax, tanh, std in ((axes[0][0], False, 1.0), (axes[0][1], True, 1.0)):
        for s in SCALES:
            ax.semilogy(grads[tanh, std, s].clamp_min(1e-300).numpy(), label=f"scale {s:g}")
        ax.set(xlabel="distance d", ylabel="|d output / d input at d|",
               title=("tanh" if tanh else "linear") + f" recurrence, inputs std {std:g}")
    axes[0][0].legend(fontsize=6)
    ax = axes[0][2]
    for m in MODELS:
        ax.plot(list(acc[m]), [acc[m][d] for d in acc[m]], "o-", label=m)
    ax.axhline(chance, color="grey", ls=":")
    ax.axvline(window_reach, color="grey", ls="--", lw=0.8)
    ax.set(xlabel="distance", ylabel="held-out accuracy", ylim=(0, 1.05), title=f"Recall, {cfg['steps']} steps")
    ax.legend(fontsize=7)
    pic = save(fig, out / "lab_before_attention.png")

    verdict = ("supported" if linear_ok and tanh_vanish and tanh_explode and mlp_window_shown and ladder
               else "depends")
    accs = "; ".join(f"{m} {acc[m][last]:.0%}" for m in MODELS)
    why = (f"Over {STEPS} steps the gradient of a linear recurrence is multiplied per step by its recurrent scale "
           f"({'as measured for every scale' if linear_ok else 'not for every scale'}: it vanishes below 1 and "
           f"explodes above); with tanh and unit-variance inputs it vanished (below 1e-3 of its size at distance 0 by "
           f"distance {far}) at scales {figures['tanh_vanishing_scales_unit_inputs']} and exploded (above 1e3) at "
           f"{figures['tanh_exploding_scales_unit_inputs']}, since a saturated tanh shrinks the slope that the scale "
           f"grows; with small inputs it exploded at {figures['tanh_exploding_scales_small_inputs']}. On the recall "
           f"task ({cfg['steps']} steps, one training run) the MLP over the last {cfg['mlp_window']} tokens, given "
           f"{MLP_STEPS} times the steps and {params['MLP'] / params['LSTM']:.1f} times the LSTM's parameters, reached "
           f"at least "
           f"{mlp_in:.0%} where the cue lies in its window (distance <= {window_reach}) and at most {mlp_out:.0%} "
           f"beyond it (chance {chance:.0%}); at distance {last}: {accs}"
           + ("" if mlp_window_shown else "; the MLP did not learn the task inside its window, so its blindness "
                                           "beyond it is not shown")
           + ("" if ladder else "; the LSTM did not beat the RNN by 10 points with attention at least as good")
           + ".")
    labels = {"gradient_table": f"Gradient over distance ({HIDDEN} hidden units, orthogonal recurrent weights times "
                                "the scale, float64)",
              "recurrence": "Recurrence", "input_std": "Input standard deviation", "scale": "Recurrent scale",
              "grad_distance_0": "Gradient norm at distance 0", f"grad_distance_{far}": f"Gradient norm at distance "
                                                                                      f"{far}",
              "per_step_factor": "Factor per step (fitted)",
              "linear_factor_equals_scale": "Linear recurrence: fitted factor per step within 5% of the scale",
              "tanh_vanishing_scales_unit_inputs": "Tanh, unit inputs: scales where the gradient vanished",
              "tanh_exploding_scales_unit_inputs": "Tanh, unit inputs: scales where the gradient exploded",
              "tanh_exploding_scales_small_inputs": "Tanh, inputs of std 0.01: scales where the gradient exploded",
              "recall_accuracy": "Recall accuracy by model and distance", "parameters": "Parameters by model",
              "mlp_window": "MLP window (tokens)",
              "mlp_accuracy_inside_window": "MLP accuracy where the cue lies in its window (lowest)",
              "mlp_accuracy_beyond_window": "MLP accuracy beyond its window (highest)", "chance": "Chance accuracy",
              "steps": f"Training steps per model (the MLP {MLP_STEPS} times as many)",
              "MLP": "Window MLP", "RNN": "RNN", "LSTM": "LSTM",
              "attention": "Attention"}
    return Finding("before_attention", CLAIM, figures, verdict, why, [pic], labels=labels)
