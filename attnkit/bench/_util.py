"""Shared measuring tools for the benchmark suites: timing, anchors, peak memory, tables."""

from __future__ import annotations

import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .._io import atomic_write


class CannotMeasure(Exception):
    """This machine lacks what a suite measures (a CUDA device for ``gpu``): the command says so in one line."""


def progress(suite: str) -> Callable[[str], None]:
    """``say(step)`` prints ``attnkit bench SUITE: step (N s)`` on stderr: a suite runs for minutes."""
    t0 = time.perf_counter()

    def say(step: str) -> None:
        print(f"attnkit bench {suite}: {step} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    return say


def median_time(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """Median time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` runs.

    ``clock`` is the wall clock by default; ``time.process_time`` measures CPU time instead.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], *, repeat: int = 7, warmup: int = 1,
                        clock: Callable[[], float] = time.perf_counter, alternate: bool = False) -> dict[str, float]:
    """Median time of each function, measured round-robin so that drift on a shared machine
    (other processes, frequency changes) hits every candidate alike; ``clock`` as in ``median_time``.
    ``alternate`` reverses the order every other round (A B, B A, ...), so a slow drift does not
    favour whichever runs first."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(repeat):
        for name, fn in (items[::-1] if alternate and r % 2 else items):
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def matmul_gflops(n: int = 2048, dtype: torch.dtype = torch.float32, repeat: int = 5) -> float:
    """This machine's measured dense matmul throughput (GFLOP/s): the physical anchor."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    t = median_time(lambda: a @ b, repeat=repeat, warmup=2)
    return 2 * n**3 / t / 1e9


def attention_flops(q_len: int, kv_len: int, head_dim: int, heads: int, batch: int = 1,
                    density: float = 1.0, backward: bool = False) -> float:
    """Forward FLOPs ``4 * Lq * Lk * D * H * B * density``; backward counts 2.5x the forward."""
    f = 4.0 * q_len * kv_len * head_dim * heads * batch * density
    return f * 3.5 if backward else f


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_line(threads: int) -> str:
    """The machine, the ``threads`` the measurement ran on, torch and python, for a table's header."""
    return (f"{platform.machine()}, {threads} thread{'' if threads == 1 else 's'}, torch {torch.__version__}, "
            f"python {platform.python_version()}")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(x: object) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(out_dir: Path, suite: str, title: str, body: str, command: str, *, threads: int | None = None) -> str:
    """Write ``out_dir/<suite>.md`` with a header naming the machine, the threads the measurement ran on and the
    command (whole or not at all, never through a link: :func:`attnkit._io.atomic_write`); return it.

    ``threads``: what the suite timed with; ``None`` for the process's count, right only for a suite that times
    on it (one that sets one thread restores the count before it writes, so it must say ``threads=1``)."""
    threads = torch.get_num_threads() if threads is None else threads
    text = (f"# {title}\n\nMeasured on {machine_line(threads)}, {time.strftime('%Y-%m-%d')}.\n"
            f"Command: `{command}`\n\n{body}\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    data = text.encode()
    atomic_write(out_dir / f"{suite}.md", lambda f: f.write(data))
    return text
