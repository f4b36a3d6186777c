"""A/B of the band kernel's float32 products in one process: sgemm for every product (A) against oneDNN's
brgemm for the products the kernel sends to it (B), switched between timed calls (``set_f32_brgemm``), A and B
alternating (A B, B A, ...) so that load on a shared machine falls on both alike.

    PYTHONPATH=. python bench/f32_ab.py [--label LABEL] [--quick]

Cells: window (256 each side) and causal, forward and forward + backward, 1 and 2 threads; n = 4096, H = 8,
D = 64, B = 1, float32, through ``attnkit.attention(..., backend="band")``. Prints the CPU's flags, the threads
and the load average, and writes the run as the section ``LABEL`` of ``bench/results/f32_products.md`` (other
labels' sections are kept, so a run before a change and one after it sit side by side).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

import attnkit
from attnkit import _cpu
from attnkit._io import atomic_write
from attnkit.backends import _band

OUT = Path(__file__).resolve().parent / "results" / "f32_products.md"
TITLE = "# float32 products in the band kernel: sgemm against oneDNN's brgemm, A/B in one process"
COMMAND = "PYTHONPATH=. python bench/f32_ab.py --label LABEL"
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def _times(run, mod, reps: int) -> tuple[list[float], list[float]]:
    """Wall-clock seconds of ``reps`` calls of ``run`` with sgemm and with brgemm, alternating which goes first."""
    a, b = [], []
    for r in range(reps):
        for brgemm in ((False, True) if r % 2 == 0 else (True, False)):
            mod.set_f32_brgemm(brgemm)
            t0 = time.perf_counter()
            run()
            (b if brgemm else a).append(time.perf_counter() - t0)
    return a, b


def _cell(mod, mask: str, backward: bool, threads: int, n: int, budget_s: float) -> dict:
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 8, n, 64, generator=gen) for _ in range(4))
    kw = {"window": (256, 256)} if mask == "window" else {"is_causal": True}
    if backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def run():
            attnkit.attention(q, k, v, backend="band", **kw).backward(dout)
            q.grad = k.grad = v.grad = None
    else:
        def run():
            with torch.no_grad():
                attnkit.attention(q, k, v, backend="band", **kw)
    a, b = _times(run, mod, 2)  # warm-up: each way's micro-kernels and buffers made once
    reps = max(5, min(15, int(budget_s / (statistics.median(a + b) * 2))))
    a, b = _times(run, mod, reps)
    ratios = sorted(x / y for x, y in zip(a, b, strict=True))
    return {"mask": mask, "pass": "forward + backward" if backward else "forward", "threads": threads,
            "reps": reps, "sgemm": statistics.median(a), "brgemm": statistics.median(b),
            "ratio": statistics.median(a) / statistics.median(b), "low": ratios[len(ratios) // 4],
            "high": ratios[(3 * len(ratios)) // 4]}


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=OUT.parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=OUT.parent).stdout.strip()
        return out.stdout.strip() + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="current", help="the section of the results file this run writes")
    parser.add_argument("--quick", action="store_true", help="n = 1024, one thread, no file written")
    args = parser.parse_args()
    if not _band.available():
        raise SystemExit(f"the band kernel is not available: {_band.unavailable_reason()}")
    mod = _band._module()
    if not mod.has_f32_brgemm():
        raise SystemExit("this torch or CPU has no float32 brgemm: nothing to compare")
    chosen = mod.f32_brgemm()
    flags = ", ".join(f if f in _cpu.flags() else f"no {f}" for f in FLAGS)
    load = os.getloadavg()
    head = (f"CPU: {_cpu.name()} ({os.cpu_count()} cores); flags: {flags}; torch {torch.__version__}; "
            f"commit {_commit()}; load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; the load's choice: "
            f"{_band.float32_products()}")
    print(head, flush=True)
    n, threads = (1024, (1,)) if args.quick else (4096, (1, 2))
    rows = []
    t0 = time.perf_counter()
    try:
        for t in threads:
            for mask in ("window", "causal"):
                for backward in (False, True):
                    row = _cell(mod, mask, backward, t, n, 2.0 if args.quick else 14.0)
                    rows.append(row)
                    print(f"{mask:7s} {row['pass']:19s} {t} thread(s): sgemm {row['sgemm'] * 1e3:8.1f} ms, brgemm "
                          f"{row['brgemm'] * 1e3:8.1f} ms, {row['ratio']:.2f}x (pairs {row['low']:.2f}-"
                          f"{row['high']:.2f}, {row['reps']} each) [{time.perf_counter() - t0:.0f} s]", flush=True)
    finally:
        mod.set_f32_brgemm(chosen)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.quick:
        return
    table = ["| mask | pass | threads | sgemm (ms) | brgemm (ms) | sgemm / brgemm | pairs' middle half |",
             "|---|---|---|---|---|---|---|"]
    table += [f"| {r['mask']} | {r['pass']} | {r['threads']} | {r['sgemm'] * 1e3:.1f} | {r['brgemm'] * 1e3:.1f} | "
              f"{r['ratio']:.2f}x | {r['low']:.2f}-{r['high']:.2f} |" for r in rows]
    section = (f"## {args.label}\n\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. {head}; after: "
               f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}.\n\n" + "\n".join(table) + "\n")
    _write(args.label, section)
    print(f"wrote {OUT}")


def _write(label: str, section: str) -> None:
    """The results file with ``section`` in place of the run labelled ``label`` (first), the others kept."""
    kept = []
    if OUT.exists():
        parts = re.split(r"(?m)^(?=## )", OUT.read_text(encoding="utf-8"))
        kept = [p.rstrip("\n") + "\n" for p in parts[1:] if not p.startswith(f"## {label}\n")]
    text = (f"{TITLE}\n\nMeasured on {platform.machine()}, 1 and 2 threads, torch {torch.__version__}, python "
            f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}.\nCommand: `{COMMAND}`\n\n"
            "Each row: one shape (n = 4096, H = 8, D = 64, B = 1, float32) through `attnkit.attention(..., "
            "backend=\"band\")`, a window of 256 keys on each side or causal, timed with every float32 product "
            "through the BLAS's sgemm and with the kernel's brgemm products on (`set_f32_brgemm`), switched between "
            "calls in one process, the two alternating (A B, B A, ...) after a warm-up of each. Medians of the "
            "wall-clock times; `pairs' middle half`: the quartiles of the per-pair ratios (how much the shared "
            "machine moved them). Each section is one run, labelled by what the kernel's brgemm products "
            "covered then.\n\n" + "\n".join([section, *kept]))
    atomic_write(OUT, lambda f: f.write(text.encode()))


if __name__ == "__main__":
    main()
