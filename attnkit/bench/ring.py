"""Ring suite: per-rank memory and total time of ring attention against world size.

The question it answers: at a fixed total sequence length, does the memory one rank needs fall as
``1/P`` with ``P`` ranks, and what does splitting cost in total CPU time against one process
doing the same work? Every configuration runs in freshly spawned gloo processes on this machine
(loopback, one thread per rank), fed the same forward + backward; the anchor is
``attnkit.attention`` on the full sequence in one process with one thread. The configurations are
spawned interleaved, round after round, and the time tables quote medians over rounds.

Memory is the peak resident set reached during the first forward + backward, above the resident
set just before it (inputs already allocated): the working memory of attention on that rank.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from pathlib import Path

import torch

import attnkit

from ..distributed import ring_attention, shard
from ..distributed.local import run_local
from ._util import attention_flops, markdown_table, median_time, peak_rss_mb, write_report


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20  # resident pages (4 KiB on Linux)


def _measure(rank, world, cfg, ring: bool, repeat: int):
    g = torch.Generator().manual_seed(0)
    b, h, n, d = cfg["batch"], cfg["heads"], cfg["length"], cfg["head_dim"]
    full = [torch.randn(b, h, n, d, generator=g) for _ in range(3)]
    if ring:
        q, k, v = (shard(t, 2, layout=cfg["layout"]).clone().requires_grad_() for t in full)
    else:
        q, k, v = (t.requires_grad_() for t in full)
    del full

    def step(q, k, v):
        if ring:
            out = ring_attention(q, k, v, is_causal=cfg["is_causal"], layout=cfg["layout"], window=cfg.get("window"))
        else:
            out = attnkit.attention(q, k, v, is_causal=cfg["is_causal"], window=cfg.get("window"))
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    # One tiny step first, so one-time costs (lazy imports, thread pools, gloo buffers) are in
    # the baseline and not counted as attention's working memory.
    step(*(t[:, :, :8].detach().clone().requires_grad_() for t in (q, k, v)))
    _trim()  # hand freed heap back, so the step cannot reuse it unseen
    before = _rss_mb()
    cpu0, t0 = time.process_time(), time.perf_counter()
    step(q, k, v)
    mem = peak_rss_mb() - before
    if repeat == 0:  # memory run: one step
        return {"mem": mem, "wall": time.perf_counter() - t0, "cpu": time.process_time() - cpu0}
    cpu0 = time.process_time()
    wall = median_time(lambda: step(q, k, v), repeat=repeat, warmup=0)
    cpu = (time.process_time() - cpu0) / repeat
    return {"mem": mem, "wall": wall, "cpu": cpu}


def _trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the figures may then undercount a little
        pass


def _run_config(cfg, world: int | None, repeat: int) -> dict:
    """``world=None``: the single-process anchor. Per-rank figures reduced over the ranks."""
    res = run_local(_measure, world or 1, cfg, world is not None, repeat, timeout=600.0, threads=1)
    return {"mem": max(r["mem"] for r in res), "wall": max(r["wall"] for r in res),
            "cpu": sum(r["cpu"] for r in res)}


def _memory_section(quick: bool, worlds: list[int]) -> str:
    """One forward + backward per world size at a length where the sequence, not the tile, dominates.

    A causal sliding window keeps the work O(L * window), so the sequence can be long enough for
    the shard-sized state to dwarf the fixed workspace, on two cores. There is no single-process
    row: ``attnkit.attention`` with a window builds the dense ``L x L`` mask.
    """
    cfg = {"batch": 1, "heads": 1, "head_dim": 64, "length": 16384 if quick else 131072,
           "layout": "contiguous", "is_causal": True, "window": (1024, 0)}
    res = {w: _run_config(cfg, w, repeat=0) for w in worlds}
    for w, r in res.items():
        print(f"memory run P={w}: {r}", flush=True)
    one, two = res[1]["mem"], res[2]["mem"]
    rows = [[f"ring, {w} rank{'s' if w > 1 else ''}", res[w]["mem"], f"{res[w]['mem'] / one:.3f}",
             f"{res[w]['mem'] / two:.3f}", f"{1 / w:.3f}", res[w]["wall"] * 1e3] for w in worlds]
    title = (f"### Memory: causal sliding window (1024, 0), contiguous, B=1, H=1, L={cfg['length']} total, "
             "D=64, float32, one forward + backward")
    header = ["run", "peak MiB / rank", "mem vs 1 rank", "mem vs 2 ranks", "1/P", "wall ms (slowest rank)"]
    return title + "\n\n" + markdown_table(header, rows)


def run(quick: bool, out_dir: Path) -> str:
    worlds = [1, 2, 4]
    rounds, repeat = (1, 1) if quick else (3, 2)
    sections = [_memory_section(quick, worlds)]
    for layout, is_causal in (("zigzag", True), ("contiguous", False)):
        cfg = {"batch": 1, "heads": 4, "head_dim": 64, "length": 1024 if quick else 4096,
               "layout": layout, "is_causal": is_causal}
        runs: dict[object, list[dict]] = {w: [] for w in [None, *worlds]}
        for r in range(rounds):
            for w in [None, *worlds]:  # interleaved: anchor, P=1, 2, 4, then again
                runs[w].append(_run_config(cfg, w, repeat))
                print(f"{layout} causal={is_causal} round {r} P={w or 'anchor'}: {runs[w][-1]}", flush=True)
        med = {w: {key: statistics.median(x[key] for x in rs) for key in ("mem", "wall", "cpu")}
               for w, rs in runs.items()}
        anchor, one = med[None], med[1]
        n, d, h = cfg["length"], cfg["head_dim"], cfg["heads"]
        flops = attention_flops(n, n, d, h, density=0.5 if is_causal else 1.0, backward=True)
        rows = [["attnkit.attention, 1 process", "-", anchor["mem"], "-", "-", anchor["wall"] * 1e3,
                 anchor["cpu"] * 1e3, "1.00", "-", f"{flops / anchor['cpu'] / 1e9:.1f}"]]
        for w in worlds:
            m = med[w]
            sent = _bytes_sent_per_rank(cfg, w) / 2**20
            rows.append([f"ring, {w} rank{'s' if w > 1 else ''}", f"{sent:.1f}", m["mem"],
                         f"{m['mem'] / one['mem']:.3f}", f"{1 / w:.3f}", m["wall"] * 1e3, m["cpu"] * 1e3,
                         f"{m['cpu'] / anchor['cpu']:.2f}", f"{m['cpu'] / one['cpu']:.2f}",
                         f"{flops / m['cpu'] / 1e9:.1f}"])
        header = ["run", "MiB sent / rank", "peak MiB / rank", "mem vs 1 rank", "1/P", "wall ms (slowest rank)",
                  "CPU ms (all ranks)", "CPU vs 1 process", "CPU vs ring P=1", "GFLOP/CPU-s"]
        title = (f"### {'causal' if is_causal else 'non-causal'}, layout {layout}: B=1, H={h}, "
                 f"L={n} total, D={d}, float32, forward + backward")
        sections.append(title + "\n\n" + markdown_table(header, rows))

    body = (
        "Per-rank working memory (peak RSS during the first forward + backward, above the RSS\n"
        "before it, inputs already allocated) and time, for a fixed total length split over P gloo\n"
        "ranks on this machine, one thread each, against `attnkit.attention` on the whole sequence\n"
        "in one process (PyTorch's fused SDPA kernel). CPU ms sums the ranks' process CPU time per\n"
        "forward + backward: the cost of the same total work, comparable even when P exceeds the\n"
        "2 cores (wall time then includes waiting for a core). Time tables: medians over\n"
        f"{rounds} interleaved rounds of {repeat} repeats; the memory table is one run each.\n\n"
        + "\n\n".join(sections)
        + "\n\nReading. A rank holds state proportional to its shard length L/P plus a fixed\n"
        "workspace (the banded kernel's blocks of 64 query rows; the allocator's and gloo's own).\n"
        "With one rank the shard-sized state is the output, its gradient, dq and the key/value\n"
        "block with its gradient; from two ranks on, a second key/value block and two gradient\n"
        "accumulators are in flight while the rank computes (that is the overlap), roughly twice\n"
        "the buffers. So memory falls as 1/P from P = 2 on ('mem vs 2 ranks', the rest is the\n"
        "fixed workspace), while the step from 1 to 2 ranks buys overlap more than memory. The\n"
        "memory table uses a long sequence (a sliding window keeps its work O(L * window)) so the\n"
        "L/P part shows. Time: each rank runs the banded C++ kernel of the `band` backend on the\n"
        "allowed cells of each (query run, key run) of a block, with its rows' mask worked out once\n"
        "per call as intervals; 'CPU vs 1 process' is that kernel plus the ring's merging against\n"
        "PyTorch's fused kernel on the whole sequence, and 'CPU vs ring P=1' what splitting costs\n"
        "(communication, smaller blocks, a zigzag shard's two runs per block).\n"
    )
    cmd = "attnkit bench ring" + (" --quick" if quick else "")
    return write_report(out_dir, "ring", "Ring attention: memory and time against world size", body, cmd,
                        threads=1)  # every rank and the anchor run on one thread (run_local)


def _bytes_sent_per_rank(cfg, world: int) -> float:
    """Forward: P-1 k/v blocks; backward: P-1 k/v blocks and P float32 gradient accumulators."""
    if world == 1:
        return 0.0
    block = cfg["batch"] * cfg["heads"] * (cfg["length"] / world) * 2 * cfg["head_dim"] * 4  # float32 k|v
    return 2 * (world - 1) * block + world * block
