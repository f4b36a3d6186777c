"""Core suite: ``attnkit.attention`` (auto) against raw PyTorch SDPA and the naive textbook formula.

The question it answers: what does attnkit's validation and dispatch cost on top of the fused
kernel it calls, and how far is the textbook formula from both? Target: at most 3% over raw SDPA
at n >= 1024.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit
from attnkit import backends, nonfinite
from attnkit.cache import KVCache, visible
from attnkit.call import validate_call

from ._util import attention_flops, interleaved_medians, markdown_table, matmul_gflops, write_report


def naive(q, k, v):
    """The textbook formula: matmul, scale, softmax, matmul, with the n x n matrix materialised."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(scores, dim=-1), v)


HEADER = ["n", "pass", "attnkit ms", "SDPA ms", "naive ms", "attnkit / SDPA", "naive / attnkit",
          "attnkit % of matmul peak"]


#: Column widths of the progress lines: the name, and room for "fwd+bwd" and "1234.56" under short names.
WIDTHS = [max(len(h), 7) for h in HEADER]


def _progress(cells) -> str:
    """One measured row (or the header), each cell right-aligned in its column."""
    return "  " + "  ".join((f"{c:.2f}" if isinstance(c, float) else str(c)).rjust(w)
                            for w, c in zip(WIDTHS, cells, strict=True))


def _case(fn, q, k, v, backward: bool):
    if not backward:
        def run():
            with torch.no_grad():
                fn(q, k, v)
        return run

    def run_bwd():
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    return run_bwd


CHECK_HEADER = ["mask", "backend", "with check ms", "without ms", "overhead %", "check alone ms", "check % of fwd"]


def _finiteness_check(n: int, heads: int, dim: int, repeat: int) -> str:
    """What the NaN/inf rule's one check per call (:func:`attnkit.nonfinite.all_finite`) costs a finite
    forward: ``attnkit.attention`` against the same request served by the same backend without it, interleaved,
    on one thread by CPU time (a shared machine's load moves wall-clock medians by more than the 2% measured)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g) for _ in range(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A decode step: one query over a KV cache's buffers, half written; the cache vouches for them.
    cache = KVCache(1, n, heads, dim)
    cache.update(k[:, :, : n // 2], v[:, :, : n // 2])
    cached = cache.update(k[:, :, n // 2:n // 2 + 1], v[:, :, n // 2:n // 2 + 1])
    step = (q[:, :, :1], cached.k, cached.v)
    rows = []
    try:
        for label, (a, b, c), kw in (("window (256, 256)", (q, k, v), {"window": (256, 256)}),
                                     ("causal", (q, k, v), {"is_causal": True}),
                                     (f"decode step, KV cache {n // 2 + 1} of {n}", step,
                                      {"mask": visible(cached, 1, causal=True)})):
            def unchecked(a=a, b=b, c=c, kw=kw):
                req = validate_call(a, b, c, **kw)
                return backends.select(req)(req)

            req = validate_call(a, b, c, **kw)
            with torch.no_grad():
                t = interleaved_medians({"with": lambda a=a, b=b, c=c, kw=kw: attnkit.attention(a, b, c, **kw),
                                         "without": unchecked, "check": lambda req=req: nonfinite.all_finite(req)},
                                        repeat=repeat, alternate=True, clock=time.process_time)
            row = [label, backends.select(req).name, t["with"] * 1e3, t["without"] * 1e3,
                   f"{100 * (t['with'] / t['without'] - 1):+.1f}", t["check"] * 1e3,
                   f"{100 * t['check'] / t['without']:.2f}"]
            print(_progress_check(row))
            rows.append(row)
    finally:
        torch.set_num_threads(threads)
    return (f"### The NaN/inf rule's finiteness check, n = {n}, forward, one thread\n\n"
            f"B=1, H={heads}, D={dim}, float32; CPU time on one thread, medians of {repeat} interleaved rounds (order "
            "reversed every other round). `with check` is `attnkit.attention`; `without` builds the same request and "
            "calls the same backend directly; `check alone` is the check (a sum of each of q, k, v and one host "
            "sync: it reads the inputs once, at memory speed; a KV cache's buffers are vouched for by the cache, "
            "which checks each step's new tokens only). Budget: 2% of the forward.\n\n"
            + markdown_table(CHECK_HEADER, rows))


def _progress_check(cells) -> str:
    return "  " + "  ".join((f"{c:.2f}" if isinstance(c, float) else str(c)).rjust(max(len(h), 7))
                            for h, c in zip(CHECK_HEADER, cells, strict=True))


def run(quick: bool, out_dir: Path) -> str:
    sizes = [256, 512] if quick else [1024, 4096]
    repeat = 3 if quick else 9
    heads, dim = 8, 64
    peak = matmul_gflops(1024 if quick else 2048)
    print(f"matmul anchor: {peak:.1f} GFLOP/s (float32)")
    print(_progress(HEADER))
    rows = []
    for n in sizes:
        for backward in (False, True):
            g = torch.Generator().manual_seed(n)
            q, k, v = (torch.randn(1, heads, n, dim, generator=g, requires_grad=backward) for _ in range(3))
            fns = {
                "attnkit": _case(lambda q, k, v: attnkit.attention(q, k, v), q, k, v, backward),
                "sdpa": _case(F.scaled_dot_product_attention, q, k, v, backward),
                "naive": _case(naive, q, k, v, backward),
            }
            t = interleaved_medians(fns, repeat=repeat)
            flops = attention_flops(n, n, dim, heads, backward=backward)
            row = [n, "fwd+bwd" if backward else "fwd", t["attnkit"] * 1e3, t["sdpa"] * 1e3, t["naive"] * 1e3,
                   f"{t['attnkit'] / t['sdpa']:.3f}", f"{t['naive'] / t['attnkit']:.2f}",
                   f"{flops / t['attnkit'] / 1e9 / peak:.0%}"]
            print(_progress(row))
            rows.append(row)
    body = (f"B=1, H={heads}, D={dim}, float32, no mask; medians of {repeat} interleaved runs. "
            f"Matmul anchor measured in the same run: {peak:.1f} GFLOP/s.\n\n" + markdown_table(HEADER, rows) +
            "\n\n`attnkit / SDPA` is the dispatch overhead (validation, backend selection); target <= 1.03 "
            "at n >= 1024. `naive` is the textbook matmul-softmax-matmul formula, as tutorials write it.")
    body += "\n\n" + _finiteness_check(256 if quick else 4096, heads, dim, repeat if quick else 21)
    return write_report(out_dir, "core", "attnkit.attention vs PyTorch SDPA vs the naive formula", body,
                        "attnkit bench core" + (" --quick" if quick else ""))
