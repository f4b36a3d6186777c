"""Half precision on the CPU: float32, bfloat16 and float16 attention, attnkit against PyTorch's SDPA.

The anchor is this CPU's own matmul in each dtype, measured in the same run: its bf16:float32 and
fp16:float32 speed ratios say what half precision can gain here at all (about 1 on a CPU without
bf16/fp16 products, 2 or more with AVX512-BF16 or AMX). Each row times the same masked attention
in the three dtypes on one thread (CPU-time medians, every dtype in each round), for attnkit and for SDPA (a
causal call uses SDPA's own causal kernel; a window gives SDPA the dense boolean mask), and gives
each dtype's time over attnkit's own float32 time. The CPU's flags that matter are printed first.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit

from .. import _cpu
from ._util import interleaved_medians, markdown_table, matmul_gflops, progress, write_report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADER = ["mask", "dtype", "attnkit backend", "attnkit ms", "SDPA ms", "SDPA / attnkit", "attnkit / own float32"]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def run(quick: bool, out_dir: Path) -> str:
    say = progress("dtypes")
    n, heads, dim = (512, 4, 64) if quick else (4096, 8, 64)
    repeat = 3 if quick else 7
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        have = [f for f in FLAGS if f in _cpu.flags()] or ["none of them (or unknown)"]
        say(f"CPU flags: {', '.join(have)}")
        size = 512 if quick else 1024
        peak = {name: matmul_gflops(size, dtype) for name, dtype in DTYPES.items()}
        say("matmul GFLOP/s, one thread: " + ", ".join(f"{k} {v:.1f}" for k, v in peak.items()))
        i = torch.arange(n)
        window = (i.view(-1, 1) - i.view(1, -1)).abs() <= 256
        cases = {"window +-256": ({"window": (256, 256)}, {"attn_mask": window}),
                 "causal": ({"is_causal": True}, {"is_causal": True})}
        rows = []
        for label, (ours, theirs) in cases.items():
            g = torch.Generator().manual_seed(0)
            base = [torch.randn(1, heads, n, dim, generator=g) for _ in range(3)]
            inputs = {name: [t.to(dtype) for t in base] for name, dtype in DTYPES.items()}
            fns = {}
            for name, (q, k, v) in inputs.items():  # every dtype and both sides in the same rounds
                fns["attnkit", name] = lambda q=q, k=k, v=v, kw=ours: attnkit.attention(q, k, v, **kw)
                fns["sdpa", name] = lambda q=q, k=k, v=v, kw=theirs: F.scaled_dot_product_attention(q, k, v, **kw)
            with torch.no_grad():
                t = interleaved_medians(fns, repeat=repeat, alternate=True, clock=time.process_time)
            for name, (q, k, v) in inputs.items():
                row = [label, name, attnkit.which_backend(q, k, v, **ours), t["attnkit", name] * 1e3,
                       t["sdpa", name] * 1e3, t["sdpa", name] / t["attnkit", name],
                       t["attnkit", name] / t["attnkit", "float32"]]
                say("  ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in row))
                rows.append(row)
    finally:
        torch.set_num_threads(threads)
    body = (f"CPU flags: {', '.join(have)}. Matmul anchor, one thread, {size}^2, measured in this run: "
            + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items())
            + f" (bf16 : float32 = {peak['bfloat16'] / peak['float32']:.2f}, "
            f"fp16 : float32 = {peak['float16'] / peak['float32']:.2f}).\n\n"
            f"B=1, H={heads}, D={dim}, n = {n}, forward, one thread; CPU-time medians of {repeat} rounds, each "
            "round running every dtype on both sides (the order reversed every other round, so that a shared "
            "machine's load hits all alike). `attnkit / own float32` is each dtype's attnkit time over attnkit's "
            "float32 time for the same mask (below 1: half precision is faster).\n\n" + markdown_table(HEADER, rows))
    return write_report(out_dir, "dtypes", "Half precision on the CPU: float32, bfloat16, float16", body,
                        "attnkit bench dtypes" + (" --quick" if quick else ""))


if __name__ == "__main__":  # pragma: no cover
    start = time.perf_counter()
    print(run(quick=True, out_dir=Path("bench/results")))
    print(f"{time.perf_counter() - start:.0f} s")
