"""What self-attention costs against n, d and the number of heads: counted and measured."""

from __future__ import annotations

import time
from pathlib import Path

import matplotlib.ticker
import torch

from ..analysis.complexity import attention_cost
from ..functional import attention
from ._common import figure, fit_exponent, save
from .runner import Finding

CLAIM = ("Self-attention costs O(n^2 d) time and O(n^2) memory for the scores; splitting the width d into h "
         "heads keeps the FLOPs and parameters and multiplies the score memory by h. Tutorials also write "
         "multi-head cost as O(n^2 d m) for m heads and say that more heads cost more.")


def seconds(n: int, d: int, heads: int, repeats: int, backend: str) -> float:
    """Fastest of ``repeats`` timed attention calls on ``[1, heads, n, d / heads]``: on a shared
    machine other work only ever adds time, so the minimum is the least disturbed figure."""
    gen = torch.Generator().manual_seed(n + d)
    q, k, v = (torch.randn(1, heads, n, d // heads, generator=gen) for _ in range(3))
    attention(q, k, v, backend=backend)  # warms caches and allocators; not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        attention(q, k, v, backend=backend)
        times.append(time.perf_counter() - t0)
    return min(times)


def weights_bytes(n: int, d: int) -> int:
    """Bytes of the ``[1, 1, n, n]`` weight matrix the reference backend actually returns."""
    q = torch.randn(1, 1, n, d)
    _, w = attention(q, q, q, return_weights=True, backend="reference")
    return w.numel() * w.element_size()


def run(quick: bool, out: Path) -> Finding:
    # Time against n and d with the tiled kernel that users run (sdpa), from n = 1024 up, where
    # the products dominate; head counts with the reference backend, which materialises the scores.
    ns = [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192]
    ds = [64, 128, 256, 512] if quick else [64, 128, 256, 512, 1024]
    n_fixed, d_fixed, reps = 1024, 64, (3 if quick else 7)
    flops_n = [attention_cost(n, d_fixed).attention_flops for n in ns]
    mem_n = [attention_cost(n, d_fixed).score_bytes for n in ns]
    mem_ns = [256, 512, 1024, 2048]
    mem_measured = [weights_bytes(n, d_fixed) for n in mem_ns]
    flops_d = [attention_cost(n_fixed, d).attention_flops for d in ds]
    time_n = [seconds(n, d_fixed, 1, reps, "sdpa") for n in ns]
    time_d = [seconds(n_fixed, d, 1, reps, "sdpa") for d in ds]
    heads = [1, 2, 4, 8, 16]
    width = 256
    flops_h = [attention_cost(512, width, h).attention_flops for h in heads]
    mem_h = [attention_cost(512, width, h).score_bytes for h in heads]
    time_h = [seconds(512, width, h, reps, "reference") for h in heads]
    figures = {"flops_exponent_n": fit_exponent(ns, flops_n), "memory_exponent_n": fit_exponent(ns, mem_n),
               "measured_memory_exponent_n": fit_exponent(mem_ns, mem_measured),
               "flops_exponent_d": fit_exponent(ds, flops_d), "time_exponent_n": fit_exponent(ns, time_n),
               "time_exponent_d": fit_exponent(ds, time_d),
               "flops_ratio_16_vs_1_heads": flops_h[-1] / flops_h[0],
               "score_memory_ratio_16_vs_1_heads": mem_h[-1] / mem_h[0],
               "time_ratio_16_vs_1_heads": time_h[-1] / time_h[0],
               "time_ms_by_n": {n: round(t * 1e3, 3) for n, t in zip(ns, time_n, strict=True)},
               "time_ms_by_heads": {h: round(t * 1e3, 3) for h, t in zip(heads, time_h, strict=True)}}
    fig, axes = figure(2)
    ax = axes[0][0]
    ax.loglog(ns, time_n, "o-", label=f"measured (slope {figures['time_exponent_n']:.2f})")
    ax.loglog(ns, [f * time_n[-1] / flops_n[-1] for f in flops_n], "k--", label="FLOPs ~ n^2 (scaled)")
    ax.set(xlabel="sequence length n", ylabel="seconds", title=f"Attention time vs n (sdpa, d = {d_fixed})")
    ax.set_xticks(ns, [str(n) for n in ns], minor=False)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(heads, [t / time_h[0] for t in time_h], "o-", label="measured time")
    ax.plot(heads, [f / flops_h[0] for f in flops_h], "k--", label="FLOPs")
    ax.plot(heads, [m / mem_h[0] for m in mem_h], "s:", label="score memory")
    ax.set(xlabel="heads at width 256", ylabel="relative to 1 head", title="Same width, more heads (reference)")
    ax.legend(fontsize=8)
    pic = save(fig, out / "lab_cost.png")
    ok = abs(figures["flops_exponent_n"] - 2) < 1e-9 and figures["flops_ratio_16_vs_1_heads"] == 1.0
    why = (f"The counted FLOPs grow as n^{figures['flops_exponent_n']:.2f} and d^{figures['flops_exponent_d']:.2f} "
           f"(measured time: n^{figures['time_exponent_n']:.2f}, d^{figures['time_exponent_d']:.2f}), the score matrix "
           f"as n^{figures['measured_memory_exponent_n']:.2f} (measured on the weights returned); 16 heads at the "
           f"same width have the same FLOPs and {figures['score_memory_ratio_16_vs_1_heads']:.0f}x the score memory, "
           f"so O(n^2 d m) for m heads is wrong (the heads split d); their time rose "
           f"x{figures['time_ratio_16_vs_1_heads']:.1f} here with a backend that materialises the scores, from "
           "writing, normalising and reading h score matrices, not from arithmetic.")
    labels = {"flops_exponent_n": f"Exponent of the counted FLOPs in n (d = {d_fixed})",
              "memory_exponent_n": f"Exponent of the counted score memory in n (d = {d_fixed})",
              "measured_memory_exponent_n": "Exponent of the measured score memory in n (weights returned)",
              "flops_exponent_d": f"Exponent of the counted FLOPs in d (n = {n_fixed})",
              "time_exponent_n": f"Exponent of the measured time in n (d = {d_fixed})",
              "time_exponent_d": f"Exponent of the measured time in d (n = {n_fixed})",
              "flops_ratio_16_vs_1_heads": f"FLOPs, 16 heads / 1 head (n = 512, width {width})",
              "score_memory_ratio_16_vs_1_heads": f"Score memory, 16 heads / 1 head (n = 512, width {width})",
              "time_ratio_16_vs_1_heads": f"Time, 16 heads / 1 head (n = 512, width {width})",
              "time_ms_by_n": f"Time by n (ms, d = {d_fixed})",
              "time_ms_by_heads": f"Time by number of heads (ms, n = 512, width {width})"}
    return Finding("cost", CLAIM, figures, "supported" if ok else "depends", why, [pic], labels=labels)
