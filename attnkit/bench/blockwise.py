"""``attnkit bench blockwise``: programmable attention on CPU against SDPA, FlexAttention and the machine.

Measures, in one run and interleaved (so that load from other processes hits every candidate alike):

* sliding window ``|i - j| <= 256``: forward against SDPA with the dense bool mask and against
  compiled FlexAttention with a BlockMask (its compile time reported apart); forward+backward
  against SDPA (FlexAttention has no CPU backward);
* packed documents (causal within each) as a ``mask_mod``, forward and forward+backward, against
  SDPA with the dense mask and the tile schedule;
* ALiBi as a ``score_mod``, causal and not, forward+backward against SDPA given the dense float bias;
* efficiency: GFLOP/s over the cells actually attended, as a fraction of measured matmul GFLOP/s;
* sparse patterns, forward+backward against SDPA with the dense mask: Longformer (window and
  global tokens) and a BigBird block layout; a user's own window predicate against ``window=``;
  a mask plan built once for a 12-layer encoder, its cost against the encoder's forward;
* peak RSS of forward+backward with a score_mod against ``n``, each ``n`` in a fresh subprocess;
* the same comparisons on one thread by CPU time, and where the window forward's time goes: the
  tiles' matrix products alone (the kernel's BLAS at its shapes) against the softmax and the rest.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import masks, scores
from .._io import atomic_write
from ..backends import _band
from ..functional import attention
from ..maskplan import mask_plan
from ._util import (
    attention_flops,
    interleaved_medians,
    markdown_table,
    matmul_gflops,
    median_time,
    peak_rss_mb,
    progress,
    write_report,
)

H, D, WINDOW = 8, 64, 256
DOC = 1024  # tokens per packed document
PLAIN = "attnkit, backend='tiles' (plain tiles)"
TILES = "attnkit, backend='fused_tiles' (tile schedule + PyTorch's flash kernel)"


def _plain(q, k, v, **kw):
    """The plain tiles, no fused kernel: what the fused paths are measured against."""
    return attention(q, k, v, backend="tiles", **kw)


def _tiles(q, k, v, **kw):
    """The tile schedule with PyTorch's flash kernel, without the banded C++ kernel."""
    return attention(q, k, v, backend="fused_tiles", **kw)


def _interleaved(cands: dict, rounds: int, clock=time.perf_counter) -> dict[str, float]:
    """Median seconds per candidate; each round runs every candidate once, in turn."""
    return interleaved_medians(cands, repeat=rounds, warmup=1, clock=clock)


def _fwd_bwd(fn, q, k, v):
    def run():
        for t in (q, k, v):
            t.grad = None
        out = fn(q, k, v)
        out.backward(torch.ones_like(out))
    return run


def _flex_child(n: int, rounds: int, threads: int = 0) -> None:
    """Compiled FlexAttention with a BlockMask against blockwise, forward, interleaved; print JSON.

    Runs in its own process: the compiled kernel brings its own OpenMP threads, which would stay
    behind and disturb every later measurement of the parent. With ``threads`` set, both run on
    that many threads (the compiled kernel fixes its thread count when compiled) and are timed by
    CPU time.
    """
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def window(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= WINDOW) & (kv_idx - q_idx <= WINDOW)

        t0 = time.perf_counter()
        block_mask = create_block_mask(window, None, None, n, n, device="cpu")
        compiled = torch.compile(flex_attention)
        with torch.no_grad():
            compiled(q, k, v, block_mask=block_mask)
        seconds = time.perf_counter() - t0
    except Exception as e:  # reported verbatim in the table
        print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}))
        return
    with torch.no_grad():
        res = _interleaved({"flex": lambda: compiled(q, k, v, block_mask=block_mask),
                            "mine": lambda: attention(q, k, v, window=(WINDOW, WINDOW))}, rounds,
                           clock=time.process_time if threads else time.perf_counter)
    print(json.dumps({"compile_s": seconds, **res}))


def _cpu_child(n: int, n_alibi: int, rounds: int) -> None:
    """The main comparisons again, on one thread, timed by CPU time; print JSON.

    Other processes sharing the cores stretch wall time most for code made of many parallel
    regions (every region waits for its slowest thread); one thread and ``process_time`` measure
    the work itself.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)

    def cpu(fn) -> float:
        return median_time(fn, repeat=rounds, warmup=1, clock=time.process_time)

    q, k, v = (torch.randn(1, H, n, D, requires_grad=True) for _ in range(3))
    dense = masks.sliding_window(n, left=WINDOW, right=WINDOW)
    res = {}
    with torch.no_grad():
        res["window_fwd_sdpa"] = cpu(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
        res["window_fwd_mine"] = cpu(lambda: attention(q, k, v, window=(WINDOW, WINDOW)))
        res["causal_fwd_sdpa"] = cpu(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        res["causal_fwd_mine"] = cpu(lambda: attention(q, k, v, is_causal=True, backend="blockwise"))
        res["window_fwd_plain"] = cpu(lambda: _plain(q, k, v, window=(WINDOW, WINDOW)))
        res["causal_fwd_plain"] = cpu(lambda: _plain(q, k, v, is_causal=True))
        res["window_fwd_tiles"] = cpu(lambda: _tiles(q, k, v, window=(WINDOW, WINDOW)))
        res["causal_fwd_tiles"] = cpu(lambda: _tiles(q, k, v, is_causal=True))
    res["window_fb_sdpa"] = cpu(_fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense),
                                         q, k, v))
    res["window_fb_mine"] = cpu(_fwd_bwd(lambda a, b, c: attention(a, b, c, window=(WINDOW, WINDOW)), q, k, v))
    res["window_fb_tiles"] = cpu(_fwd_bwd(lambda a, b, c: _tiles(a, b, c, window=(WINDOW, WINDOW)), q, k, v))
    mod, longformer = _global_tokens(n, torch.arange(32))  # as in the sparse patterns' table, whose wall
    res["longformer_fb_sdpa"] = cpu(_fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(  # times are noisiest
        a, b, c, attn_mask=longformer), q, k, v))
    res["longformer_fb_mine"] = cpu(_fwd_bwd(lambda a, b, c: attention(a, b, c, mask_mod=mod), q, k, v))
    res["longformer_cells"] = int(longformer.sum())
    qa, ka, va = (torch.randn(1, H, n_alibi, D, requires_grad=True) for _ in range(3))
    slopes = scores.alibi_slopes(H)
    pos = torch.arange(n_alibi)
    for causal in (False, True):
        bias = -slopes.view(-1, 1, 1) * (pos.view(-1, 1) - pos.view(1, -1)).abs()
        if causal:
            bias = bias.masked_fill(pos.view(1, -1) > pos.view(-1, 1), float("-inf"))
        res[f"alibi{causal}_sdpa"] = cpu(_fwd_bwd(lambda a, b, c, bias=bias: F.scaled_dot_product_attention(
            a, b, c, attn_mask=bias), qa, ka, va))
        res[f"alibi{causal}_mine"] = cpu(_fwd_bwd(lambda a, b, c, causal=causal: attention(
            a, b, c, score_mod=scores.alibi(slopes), is_causal=causal), qa, ka, va))
    a = torch.randn(2048, 2048)
    res["matmul_gflops"] = 2 * 2048**3 / cpu(lambda: a @ a) / 1e9
    print(json.dumps(res))


def _window_tiles(n: int, rows: int) -> list[tuple[int, int, int, int]]:
    """The banded kernel's tiles for the window: per block of ``rows`` query rows, (first row,
    rows, first key, end key), the keys being the union of the block's rows' intervals (one segment,
    the first row's start to the last row's end)."""
    return [(i0, min(rows, n - i0), max(0, i0 - WINDOW), min(n, min(n, i0 + rows) + WINDOW))
            for i0 in range(0, n, rows)]


class _Products:
    """Row-major products ``(a, b, c, m, n, k, b transposed)`` of float32 tensors, c = a op(b), made by
    the BLAS the banded kernel calls (``sgemm_`` in torch's own library, through ctypes) when called.

    Timing a call times the kernel's matrix products alone: same library, shapes and data.
    """

    def __init__(self, products: list[tuple]):
        self.sgemm = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).sgemm_
        self.products = products  # the tensors, and (below) the ctypes values, the argument lists point to
        self.values, self.calls = [], []
        ref = ctypes.byref
        for a, b, c, m, n, k, bt in products:  # column-major C^T = op(B)^T A^T, as the kernel's gemm()
            ints = [ctypes.c_int(x) for x in (n, m, k, b.stride(0), a.stride(0), c.stride(0))]
            flags = [ctypes.c_char(b"T" if bt else b"N"), ctypes.c_char(b"N")]
            one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
            self.values.append((ints, flags, one, zero))
            self.calls.append((ref(flags[0]), ref(flags[1]), ref(ints[0]), ref(ints[1]), ref(ints[2]), ref(one),
                               ctypes.c_void_p(b.data_ptr()), ref(ints[3]), ctypes.c_void_p(a.data_ptr()),
                               ref(ints[4]), ref(zero), ctypes.c_void_p(c.data_ptr()), ref(ints[5])))

    def __call__(self) -> None:
        for args in self.calls:
            self.sgemm(*args)


def _budget_child(n: int, rounds: int) -> None:
    """Where the window forward's time goes, one thread by CPU time; print JSON.

    For the kernel's tile height and two others: the kernel's time, and the two products of each
    tile alone (q k^T and p v, the kernel's BLAS on the same data at the kernel's shapes, less the
    call overhead of as many 1 x 1 products), interleaved with each other and the matmul anchor.
    Products alone over the attended cells are the most this tiling could reach with a free softmax.
    """
    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    one, big = torch.ones(1, 1), torch.randn(2048, 2048)
    kernel_rows = _band.Q_ROWS

    def kernel(rows: int):
        def run():
            _band.Q_ROWS = rows
            try:
                with torch.no_grad():
                    attention(q, k, v, window=(WINDOW, WINDOW))
            finally:
                _band.Q_ROWS = kernel_rows
        return run

    sizes, fns, computed = (kernel_rows, kernel_rows // 2, kernel_rows * 2), {"peak": lambda: big @ big}, {}
    for rows in sizes:
        tiles = _window_tiles(n, rows)
        s, acc = torch.empty(rows * (rows + 2 * WINDOW)), torch.empty(rows, D)
        products = []
        for h in range(H):
            for i0, r, a, e in tiles:
                scores = s[:r * (e - a)].view(r, e - a)  # the kernel's layout: one tile's scores, rows of e - a
                products.append(((q[0, h, i0:i0 + r] * D**-0.5).contiguous(), k[0, h, a:e], scores,
                                 r, e - a, D, True))
                products.append((scores, v[0, h, a:e], acc[:r], r, D, e - a, False))
        computed[rows] = H * sum(r * (e - a) for _, r, a, e in tiles)
        fns[f"kernel {rows}"] = kernel(rows)
        fns[f"products {rows}"] = _Products(products)
        fns[f"calls {rows}"] = _Products([(one, one, one.clone(), 1, 1, 1, False)] * len(products))
    t = interleaved_medians(fns, repeat=max(rounds, 7), clock=time.process_time, alternate=True)
    res = {"kernel_rows": kernel_rows, "matmul_gflops": 2 * 2048**3 / t["peak"] / 1e9,
           "rows": [{"rows": rows, "computed": computed[rows], "kernel": t[f"kernel {rows}"],
                     "products": t[f"products {rows}"] - t[f"calls {rows}"]} for rows in sizes]}
    print(json.dumps(res))


def _budget(n: int, rounds: int, cells: int) -> str:
    """The section on where the window forward's time goes (``_budget_child``, in its own process)."""
    c = _child(f"_budget_child({n}, {rounds})")
    title = f"## Where the window forward's time goes, n = {n}, one thread"
    if "error" in c:
        return f"{title}\n\nfailed: {c['error']}"
    flop = 4 * D  # per cell: q k^T and p v, a multiply and an add each
    peak = c["matmul_gflops"]
    rows, ceilings = [], []
    for r in c["rows"]:
        ceilings.append(100 * flop * cells * H / r["products"] / 1e9 / peak)
        rows.append([f"{r['rows']}" + (" (the kernel's)" if r["rows"] == c["kernel_rows"] else ""),
                     f"{r['computed'] / (H * cells):.2f}", r["kernel"] * 1e3, r["products"] * 1e3,
                     f"{100 * (1 - r['products'] / r['kernel']):.0f}%",
                     f"{100 * flop * r['computed'] / r['products'] / 1e9 / peak:.0f}%",
                     f"{100 * flop * cells * H / r['kernel'] / 1e9 / peak:.0f}%", f"{ceilings[-1]:.0f}%"])
    return (f"{title}\n\n"
            "The kernel computes rectangles: each block of query rows multiplies against every key any of "
            "its rows sees, so the window's slanted edges are computed and masked. Products alone: the two "
            "products of every tile (q k^T, then p v) through the BLAS the kernel calls, on the same data at "
            "the kernel's shapes, less the call overhead; the rest is the softmax, copies and memory traffic. The last "
            "column is what the tiling reaches with a free softmax: products alone over the attended "
            f"cells, against the single-thread matmul peak ({peak:.0f} GFLOP/s). The highest here is "
            f"{max(ceilings):.0f}%, against the target of 85%: smaller tiles waste fewer cells but multiply "
            "more slowly, larger ones the reverse.\n\n"
            + markdown_table(["tile rows", "cells computed / attended", "kernel ms", "products alone ms",
                              "softmax and the rest", "products, of peak over the cells they compute",
                              "kernel, of peak over attended cells",
                              "ceiling: products alone over attended cells"], rows))


def _child(call: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", f"from attnkit.bench.blockwise import {call.split('(')[0]}; {call}"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _global_tokens(n: int, tokens: torch.Tensor) -> tuple:
    """The window +-WINDOW with these global tokens: its predicate and its dense ``[n, n]`` mask."""
    return masks.global_tokens_mod(WINDOW, tokens), masks.global_tokens(n, WINDOW, tokens)


def _window_cells(n: int) -> int:
    i = torch.arange(n)
    return int(((i.view(-1, 1) - i.view(1, -1)).abs() <= WINDOW).sum())


def _peak_mb() -> float:
    """This process's peak RSS in MiB.

    Linux hands a child started by fork+exec the parent's ``ru_maxrss``, so ``peak_rss_mb`` would
    report the benchmark's own peak; ``VmHWM`` belongs to the new address space alone.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_rss_mb()


def _rss_child(n: int) -> None:
    """Forward+backward of causal attention with an ALiBi score_mod at length ``n``; print peak RSS."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, n, D, requires_grad=True) for _ in range(3))
    slopes = torch.nn.Parameter(scores.alibi_slopes(H))
    before = _peak_mb()
    t0 = time.perf_counter()
    out = attention(q, k, v, is_causal=True, score_mod=scores.alibi(slopes), backend="blockwise")
    out.backward(torch.ones_like(out))
    print(json.dumps({"n": n, "peak_mb": _peak_mb(), "inputs_mb": before, "seconds": time.perf_counter() - t0,
                      "slopes_grad_finite": bool(torch.isfinite(slopes.grad).all())}))


def _plot(points: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(matplotlib not installed: no plot)"
    ns = [p["n"] for p in points]
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot(ns, [p["peak_mb"] / 1024 for p in points], "o-", label="attnkit blockwise (measured)")
    ax.plot(ns, [H * n * n * 4 / 2**30 for n in ns], "--", label="one dense fp32 score matrix")
    ax.axhline(3.0, color="grey", lw=0.8, ls=":", label="3 GB target")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("peak RSS (GiB)")
    ax.set_title(f"fwd+bwd, causal + ALiBi score_mod, H={H}, D={D}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    plt.close(fig)
    return f"![peak RSS against n]({path.name})"


def _sparse_patterns(n: int, rounds: int, peak: float, plain: tuple, grads: tuple) -> str:
    """Longformer and BigBird patterns forward+backward against SDPA with the dense mask, and a
    user's own window predicate (no attnkit helper) against ``window=``: one table."""
    first, spread = torch.arange(32), torch.arange(32) * (n // 32)
    layout = masks.bigbird_layout(-(-n // 64), seed=0)
    patterns = {  # Longformer's global tokens are the first ones ([CLS], a question); spread, each is a lone key
        "Longformer: window +-256, the first 32 tokens global": (*_global_tokens(n, first), 10),
        "window +-256, 32 global tokens spread over the sequence": (*_global_tokens(n, spread), None),
        "BigBird layout (blocks of 64: 3 window, 2 global, 3 random)": (masks.block_sparse_mod(layout, 64),
                                                                       masks.block_sparse(layout, 64)[:n, :n], 6),
        "dilated window: every 2nd key within +-128": (masks.dilated_window_mod(64, 2),
                                                       masks.dilated_window(n, 64, 2), None),
        "Sparse Transformer strided, stride 128, causal": (masks.strided_mod(128), masks.strided(n, 128), None),
    }
    rows = []
    for name, (mod, dense, target) in patterns.items():
        plan = median_time(lambda mod=mod: mask_plan(mod, q_len=n), repeat=7, warmup=0)
        times = _interleaved({
            "sdpa": _fwd_bwd(lambda a, b, c, dense=dense: F.scaled_dot_product_attention(a, b, c, attn_mask=dense),
                             *grads),
            "mine": _fwd_bwd(lambda a, b, c, mod=mod: attention(a, b, c, mask_mod=mod), *grads),
        }, rounds)
        gf = attention_flops(n, n, D, H, density=float(dense.sum()) / (n * n), backward=True) / times["mine"] / 1e9
        rows.append([name, times["sdpa"] * 1e3, times["mine"] * 1e3, f"{times['sdpa'] / times['mine']:.1f}x",
                     f">= {target}x" if target else "-", f"{100 * gf / peak:.0f}%", plan * 1e3])

    def own_window(b, h, q_idx, kv_idx):  # as a user writes it: no attnkit helper, no annotation
        return (q_idx - kv_idx).abs() <= WINDOW

    q, k, v = plain
    with torch.no_grad():
        fwd = _interleaved({"mine": lambda: attention(q, k, v, mask_mod=own_window),
                            "helper": lambda: attention(q, k, v, window=(WINDOW, WINDOW))}, rounds)
    fb = _interleaved({"mine": _fwd_bwd(lambda a, b, c: attention(a, b, c, mask_mod=own_window), *grads),
                       "helper": _fwd_bwd(lambda a, b, c: attention(a, b, c, window=(WINDOW, WINDOW)), *grads)},
                      rounds)
    own = [["forward", fwd["mine"] * 1e3, fwd["helper"] * 1e3, f"{fwd['mine'] / fwd['helper']:.2f}"],
           ["forward + backward", fb["mine"] * 1e3, fb["helper"] * 1e3, f"{fb['mine'] / fb['helper']:.2f}"]]
    return (f"## Sparse patterns, n = {n}, forward + backward\n\n"
            "Each as its `attnkit.masks` predicate against SDPA given the dense bool mask. Of peak: GFLOP/s over "
            "the attended cells against the matmul peak of this run (target for Longformer >= 70%). Plan: "
            "`attnkit.mask_plan` of the predicate (the builder writes its rows' intervals itself; median of 7 fresh "
            "builds), made on the first call and reused after.\n\n"
            + markdown_table(["pattern", "SDPA dense ms", "attnkit ms", "SDPA / attnkit", "target", "of matmul peak",
                              "plan ms"], rows)
            + f"\n\n### A user's own window predicate, `(q_idx - kv_idx).abs() <= {WINDOW}`, against `window=`\n\n"
            + markdown_table(["pass", "predicate ms", "window= ms", "predicate / window= (target <= 1.2)"], own))


def _plan_reuse(n: int, rounds: int) -> str:
    """A user's predicate (packed documents) turned into a plan once and given to all 12 layers of
    an encoder: the plan's cost (fresh builds) against the encoder's forward."""
    from ..modules.transformer import TransformerEncoder, TransformerEncoderLayer

    docs = torch.arange(n) // 512

    def documents(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    torch.manual_seed(0)
    encoder = TransformerEncoder([TransformerEncoderLayer(512, H, dropout=0.0) for _ in range(12)]).eval()
    x = torch.randn(1, n, 512)
    build = median_time(lambda: mask_plan(documents, q_len=n, heads=H), repeat=5, warmup=0)
    plan = mask_plan(documents, q_len=n, heads=H)
    with torch.no_grad():
        forward = _interleaved({"encoder": lambda: encoder(x, mask=plan)}, rounds)["encoder"]
    return (f"## A mask plan built once, reused by a 12-layer encoder, n = {n}\n\n"
            f"A user's predicate (packed documents of 512 tokens) is worked out once by `attnkit.mask_plan` "
            f"({plan.derived_by}) and given as `mask=plan` to every layer (d = 512, {H} heads, feed-forward 2048). "
            f"The plan: {build * 1e3:.1f} ms (median of 5 fresh builds); the encoder's forward: "
            f"{forward * 1e3:,.0f} ms; the plan is **{100 * build / forward:.2f}%** of one forward (target <= 2%), "
            "paid once however many layers and steps reuse it.")


def run(quick: bool, out_dir: Path) -> str:
    torch.manual_seed(0)
    load_start = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    n = 2048 if quick else 8192
    n_alibi = 1024 if quick else 4096
    rounds = 2 if quick else 5
    say = progress("blockwise")
    say("banded kernel (built at install, else compiled on first use)")
    band_line = ("Window and causal calls run the banded C++ kernel (`attnkit/backends/csrc/band/`)."
                 if _band.available() else
                 f"The banded C++ kernel is NOT available here ({_band.unavailable_reason()}); window and causal "
                 "calls run the tile schedule.")
    say(f"matmul anchor, then sliding window n = {n}, forward ({rounds} rounds)")
    peak = matmul_gflops()
    sections = []

    # --- sliding window: forward --------------------------------------------------------------
    q, k, v = (torch.randn(1, H, n, D) for _ in range(3))
    dense = masks.sliding_window(n, left=WINDOW, right=WINDOW)
    with torch.no_grad():
        cands = {
            "SDPA, dense bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
            "attnkit blockwise, window=(256, 256)": lambda: attention(q, k, v, window=(WINDOW, WINDOW)),
            TILES: lambda: _tiles(q, k, v, window=(WINDOW, WINDOW)),
            PLAIN: lambda: _plain(q, k, v, window=(WINDOW, WINDOW)),
        }
        fwd = _interleaved(cands, rounds)
    mine = fwd["attnkit blockwise, window=(256, 256)"]
    cells = _window_cells(n)
    rows = [[name, t * 1e3, t / mine] for name, t in fwd.items()]
    say("compiled FlexAttention in its own process (compiles first)")
    flex = _child(f"_flex_child({n}, {rounds})")
    if "error" in flex:
        rows.append(["FlexAttention compiled, BlockMask (own process)", f"failed: {flex['error']}", "-"])
        flex_line = ""
    else:
        rows.append(["FlexAttention compiled, BlockMask (own process)", flex["flex"] * 1e3, flex["flex"] / mine])
        rows.append(["attnkit blockwise (in FlexAttention's process)", flex["mine"] * 1e3, flex["mine"] / mine])
        need = attention_flops(n, n, D, H, density=cells / (n * n)) / (flex["flex"] / 1.5) / 1e9
        flex_line = (f"\n\nFlexAttention compile (create_block_mask + first call): {flex['compile_s']:.1f} s. "
                     f"Against FlexAttention, both measured interleaved in its process: "
                     f"{flex['flex'] / flex['mine']:.2f}x (target >= 1.5x). For scale: 1.5x FlexAttention's time "
                     f"here is {flex['flex'] / 1.5 * 1e3:.0f} ms, i.e. {need:.0f} GFLOP/s over the attended cells "
                     f"alone, {100 * need / peak:.0f}% of the matmul peak measured in this run.")
    sections.append(f"## Sliding window |i - j| <= {WINDOW}, n = {n}, forward\n\n"
                    + markdown_table(["candidate", "median ms", "x attnkit time"], rows)
                    + f"\n\nTarget: >= 8x faster than SDPA dense (measured "
                      f"{fwd['SDPA, dense bool mask'] / mine:.2f}x)." + flex_line)

    # --- sliding window: forward + backward ---------------------------------------------------
    say("sliding window, forward + backward")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fb = _interleaved({
        "SDPA, dense bool mask": _fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense),
                                          qg, kg, vg),
        "attnkit blockwise": _fwd_bwd(lambda a, b, c: attention(a, b, c, window=(WINDOW, WINDOW)), qg, kg, vg),
        TILES: _fwd_bwd(lambda a, b, c: _tiles(a, b, c, window=(WINDOW, WINDOW)), qg, kg, vg),
    }, rounds)
    sections.append(f"## Sliding window, n = {n}, forward + backward\n\n"
                    + markdown_table(["candidate", "median ms", "x attnkit time"],
                                     [[name, t * 1e3, t / fb["attnkit blockwise"]] for name, t in fb.items()])
                    + f"\n\nTarget: >= 5x faster than SDPA dense (measured "
                      f"{fb['SDPA, dense bool mask'] / fb['attnkit blockwise']:.2f}x). "
                      "FlexAttention has no backward on CPU.")

    # --- packed documents ------------------------------------------------------------------------
    say(f"packed documents ({n // DOC} x {DOC}, causal within each), forward and forward + backward")
    docs = torch.arange(n) // DOC
    doc_mod = masks.and_masks(masks.document_mod(docs), masks.causal_mod())
    doc_dense = masks.document(docs) & masks.causal(n)
    doc_cells = n // DOC * DOC * (DOC + 1) // 2
    doc_rows = []

    def sdpa_docs(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=doc_dense)

    for label, grad in (("forward", False), ("forward + backward", True)):
        cands = {"SDPA, dense bool mask": sdpa_docs,
                 "attnkit blockwise, mask_mod=and_masks(document_mod, causal_mod)":
                     lambda a, b, c: attention(a, b, c, mask_mod=doc_mod),
                 TILES: lambda a, b, c: _tiles(a, b, c, mask_mod=doc_mod)}
        if grad:
            res = _interleaved({name: _fwd_bwd(fn, qg, kg, vg) for name, fn in cands.items()}, rounds)
        else:
            with torch.no_grad():
                res = _interleaved({name: (lambda fn=fn: fn(q, k, v)) for name, fn in cands.items()}, rounds)
        ours = res["attnkit blockwise, mask_mod=and_masks(document_mod, causal_mod)"]
        gf = attention_flops(n, n, D, H, density=doc_cells / (n * n), backward=grad) / ours / 1e9
        doc_rows += [[label, name, t * 1e3, t / ours, f"{100 * gf / peak:.0f}%" if t == ours else "-"]
                     for name, t in res.items()]
    sections.append(f"## Packed documents ({n // DOC} x {DOC} tokens, causal within each), n = {n}\n\n"
                    "What training on packed sequences needs: every row sees one interval of keys, so the "
                    "banded kernel serves it.\n\n"
                    + markdown_table(["pass", "candidate", "median ms", "x attnkit time", "attnkit of matmul peak"],
                                     doc_rows))

    # --- ALiBi as score_mod ---------------------------------------------------------------------
    say(f"ALiBi as a score_mod, n = {n_alibi}")
    qa, ka, va = (torch.randn(1, H, n_alibi, D, requires_grad=True) for _ in range(3))
    slopes = scores.alibi_slopes(H)
    pos = torch.arange(n_alibi)
    alibi_rows = []
    for causal in (False, True):
        bias = -slopes.view(-1, 1, 1) * (pos.view(-1, 1) - pos.view(1, -1)).abs()
        if causal:
            bias = bias.masked_fill(pos.view(1, -1) > pos.view(-1, 1), float("-inf"))
        res = _interleaved({
            "sdpa": _fwd_bwd(lambda a, b, c, bias=bias: F.scaled_dot_product_attention(a, b, c, attn_mask=bias),
                             qa, ka, va),
            "mine": _fwd_bwd(lambda a, b, c, causal=causal: attention(a, b, c, score_mod=scores.alibi(slopes),
                                                                      is_causal=causal), qa, ka, va),
        }, rounds)
        alibi_rows.append([f"causal={causal}", res["sdpa"] * 1e3, res["mine"] * 1e3, res["mine"] / res["sdpa"]])
    sections.append(f"## ALiBi as a score_mod, n = {n_alibi}, forward + backward\n\n"
                    + markdown_table(["case", "SDPA + dense float bias ms", "attnkit blockwise ms",
                                      "attnkit / SDPA (target <= 1.3)"], alibi_rows))

    # --- efficiency ------------------------------------------------------------------------------
    say("causal, for the efficiency table")
    with torch.no_grad():
        causal_fwd = _interleaved({
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "mine": lambda: attention(q, k, v, is_causal=True, backend="blockwise"),
            "tiles": lambda: _tiles(q, k, v, is_causal=True),
            "plain": lambda: _plain(q, k, v, is_causal=True),
        }, rounds)
    qg2, kg2, vg2 = (t.clone().requires_grad_() for t in (q, k, v))
    causal_fb = _interleaved({"mine": _fwd_bwd(lambda a, b, c: attention(a, b, c, is_causal=True,
                                                                          backend="blockwise"), qg2, kg2, vg2)},
                             max(1, rounds - 1))["mine"]
    causal_cells = n * (n + 1) // 2
    eff = []
    for name, cells_, sec, bwd in (("window, forward", cells, mine, False),
                                   ("window, forward+backward", cells, fb["attnkit blockwise"], True),
                                   ("causal, forward", causal_cells, causal_fwd["mine"], False),
                                   ("causal, forward+backward", causal_cells, causal_fb, True),
                                   ("window, forward, backend='fused_tiles'", cells, fwd[TILES], False),
                                   ("window, forward+backward, backend='fused_tiles'", cells, fb[TILES], True),
                                   ("causal, forward, backend='fused_tiles'", causal_cells, causal_fwd["tiles"],
                                    False),
                                   ("window, forward, plain path", cells, fwd[PLAIN], False),
                                   ("causal, forward, plain path", causal_cells, causal_fwd["plain"], False),
                                   ("SDPA causal (fused kernel), forward", causal_cells, causal_fwd["sdpa"], False)):
        gf = attention_flops(n, n, D, H, density=cells_ / (n * n), backward=bwd) / sec / 1e9
        eff.append([name, sec * 1e3, gf, f"{100 * gf / peak:.0f}%"])
    sections.append(f"## Efficiency at n = {n} (matmul peak measured in this run: {peak:.0f} GFLOP/s)\n\n"
                    "GFLOP/s counted over attended cells only (4 * cells * D * H forward; backward 2.5x). Targets: "
                    "the window at >= 85% of the matmul peak, forward and forward+backward; causal forward at least "
                    f"as fast as SDPA's own causal kernel (here {causal_fwd['sdpa'] / causal_fwd['mine']:.2f}x its "
                    "speed).\n\n"
                    + markdown_table(["case", "median ms", "GFLOP/s", "of matmul peak"], eff))

    # --- sparse patterns and a plan reused --------------------------------------------------------
    say("sparse patterns (Longformer, BigBird, a user's window predicate), forward + backward")
    sections.append(_sparse_patterns(n, rounds, peak, (q, k, v), (qg, kg, vg)))
    say("a mask plan built once for a 12-layer encoder")
    sections.append(_plan_reuse(4096 if not quick else 1024, max(2, rounds - 2)))

    # --- memory ------------------------------------------------------------------------------------
    ns = [1024, 2048, 4096] if quick else [4096, 8192, 16384, 32768]
    points = []
    for m in ns:
        say(f"peak RSS at n = {m} (fresh process)")
        points.append(_child(f"_rss_child({m})"))
    points = [p for p in points if "error" not in p]
    plot = _plot(points, out_dir / "blockwise_memory.png") if not quick else ""
    sections.append("## Peak RSS, forward+backward, causal + ALiBi score_mod (slopes as nn.Parameter)\n\n"
                    "Each n in a fresh subprocess; peak RSS includes the Python/torch runtime and the inputs.\n\n"
                    + markdown_table(["n", "peak RSS MiB", "after inputs MiB", "seconds",
                                      "one dense fp32 score matrix MiB"],
                                     [[p["n"], p["peak_mb"], p["inputs_mb"], p["seconds"], H * p["n"] ** 2 * 4 / 2**20]
                                      for p in points])
                    + (f"\n\n{plot}" if plot else ""))

    # --- one thread, CPU time -------------------------------------------------------------------
    say("one thread, CPU time (own process)")
    c = _child(f"_cpu_child({n}, {n_alibi}, {rounds})")
    if "error" in c:
        sections.append(f"## One thread, CPU time\n\nfailed: {c['error']}")
    else:
        cases = [("window fwd", "window_fwd", "mine", cells, False),
                 ("window fwd+bwd", "window_fb", "mine", cells, True),
                 ("causal fwd", "causal_fwd", "mine", n * (n + 1) // 2, False),
                 ("Longformer fwd+bwd (window +-256, the first 32 tokens global)", "longformer_fb", "mine",
                  c["longformer_cells"], True),
                 ("window fwd, backend='fused_tiles'", "window_fwd", "tiles", cells, False),
                 ("window fwd+bwd, backend='fused_tiles'", "window_fb", "tiles", cells, True),
                 ("causal fwd, backend='fused_tiles'", "causal_fwd", "tiles", n * (n + 1) // 2, False),
                 ("window fwd, plain path", "window_fwd", "plain", cells, False),
                 ("causal fwd, plain path", "causal_fwd", "plain", n * (n + 1) // 2, False)]
        rows1 = []
        for label, key, who, cells_, bwd in cases:
            t = c[f"{key}_{who}"]
            gf = attention_flops(n, n, D, H, density=cells_ / (n * n), backward=bwd) / t / 1e9
            rows1.append([f"{label}, n = {n}", c[key + "_sdpa"] * 1e3, t * 1e3,
                          c[key + "_sdpa"] / t, f"{100 * gf / c['matmul_gflops']:.0f}%"])
        for causal in (False, True):
            key = f"alibi{causal}"
            rows1.append([f"ALiBi causal={causal} fwd+bwd, n = {n_alibi}", c[key + "_sdpa"] * 1e3,
                          c[key + "_mine"] * 1e3, c[key + "_sdpa"] / c[key + "_mine"], "-"])
        say("compiled FlexAttention on one thread (own process)")
        flex1 = _child(f"_flex_child({n}, {rounds}, threads=1)")
        if "error" in flex1:
            rows1.append([f"FlexAttention compiled, window fwd, n = {n}", f"failed: {flex1['error']}", "-", "-", "-"])
        else:
            rows1.append([f"window fwd, n = {n}: FlexAttention compiled (in place of SDPA)", flex1["flex"] * 1e3,
                          flex1["mine"] * 1e3, flex1["flex"] / flex1["mine"], "-"])
        sections.append("## One thread, CPU time (robust to other load)\n\n"
                        "The same comparisons in a subprocess with `torch.set_num_threads(1)`, timed by "
                        f"`time.process_time` (single-thread matmul: {c['matmul_gflops']:.0f} GFLOP/s). SDPA uses "
                        "the dense bool mask (window, Longformer), `is_causal` (causal) or the dense float bias "
                        "(ALiBi).\n\n"
                        + markdown_table(["case", "SDPA ms", "attnkit ms", "SDPA / attnkit",
                                          "attnkit of matmul peak"], rows1))

    say("where the window forward's time goes, one thread (own process)")
    sections.append(_budget(n, rounds, cells))

    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    body = (f"B=1, H={H}, D={D}, float32 on CPU; medians of {rounds} interleaved rounds. Ratios are "
            "against anchors measured in the same run; other processes may share the 2 cores, so "
            f"absolute times are noisy (load average at start: {load_start}, at end: {load}). Under such "
            "load, wall time punishes code made of many parallel regions far more than one fused kernel "
            "(compare the measured matmul peak with the quiet-machine 160 GFLOP/s); the last table, one "
            f"thread timed by CPU time, measures the work itself.\n\n{band_line}\n\n"
            + "\n\n".join(sections))
    cmd = "attnkit bench blockwise" + (" --quick" if quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_report(out_dir, "blockwise", "Blockwise attention (mask_mod / score_mod / window) on CPU", body,
                        cmd)
