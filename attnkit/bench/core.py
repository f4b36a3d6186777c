"""Core suite: ``attnkit.attention`` (auto) against raw PyTorch SDPA and the naive textbook formula.

The question it answers: what does attnkit's validation and dispatch cost on top of the fused
kernel it calls, and how far is the textbook formula from both? Target: at most 3% over raw SDPA
at n >= 1024.
"""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit
from attnkit import backends, nonfinite
from attnkit.cache import KVCache
from attnkit.call import validate_call
from attnkit.modules import MultiHeadAttention

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


CHECK_HEADER = ["mask", "backend", "with check ms", "without ms", "overhead %", "check in the call ms",
                "in the call % of fwd", "check alone ms", "alone % of fwd"]


def _finiteness_check(n: int, heads: int, dim: int, repeat: int) -> str:
    """What the NaN/inf rule's one check per call (:func:`attnkit.nonfinite.all_finite`) costs a finite
    forward: ``attnkit.attention`` against the same request served by the same backend without it, in the same
    rounds, on one thread by CPU time (a shared machine's load moves wall-clock medians by more than the budget),
    and the check's own time, where the call runs it and alone right after a forward (every cache cold).
    The decode step runs ten times the rounds (its forward is small, its check a fixed cost that a few rounds
    cannot tell from the noise), and times a bare read of its query's sum in the call besides: the least any
    check that reads the query can cost there."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, heads, n, dim, generator=g) for _ in range(3))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # A decode step as MultiHeadAttention makes it eagerly: one query over the written part of a KV cache's
    # buffers (a view), half of them; the cache vouches for them.
    cache = KVCache(1, n, heads, dim)
    cache.update(k[:, :, : n // 2], v[:, :, : n // 2])
    cached = cache.update(k[:, :, n // 2:n // 2 + 1], v[:, :, n // 2:n // 2 + 1])
    step = (q[:, :, :1], cached.k[:, :, :cached.seq_len], cached.v[:, :, :cached.seq_len])
    rows, notes = [], []
    try:
        trained = tuple(t.clone().requires_grad_() for t in (q, k, v))
        for label, (a, b, c), kw, decode in (
                ("window (256, 256)", (q, k, v), {"window": (256, 256)}, False),
                ("window (256, 256), forward and backward", trained, {"window": (256, 256)}, False),
                ("causal", (q, k, v), {"is_causal": True}, False),
                (f"decode step, KV cache {n // 2 + 1} of {n}", step, {"is_causal": True}, True)):
            train = a.requires_grad
            req = validate_call(a, b, c, **kw)
            backend = backends.select(req)
            with torch.set_grad_enabled(train):
                own = getattr(backend, "sees_nonfinite", None)
                own = own is not None and own(req)  # the kernel's own pass answers: no check before it
            # Every entry ends with a forward, so that each timing follows one, whatever the order: as a call
            # follows the previous call (a check timed right before would warm what the next entry times).
            entries = {"with": _timed(lambda a=a, b=b, c=c, kw=kw: _step(attnkit.attention(a, b, c, **kw))),
                       "without": _timed(lambda a=a, b=b, c=c, kw=kw: _step(_unchecked(a, b, c, kw)))}
            if not own:
                entries["alone"] = lambda req=req, backend=backend: _alone(req, backend)
                entries["in the call"] = lambda a=a, b=b, c=c, kw=kw: _in_the_call(a, b, c, kw, nonfinite.all_finite)
            if decode:
                entries["query read"] = lambda a=a, b=b, c=c, kw=kw: _in_the_call(a, b, c, kw,
                                                                                 lambda r: r.query.sum().item())
            with torch.set_grad_enabled(train):
                t = _rounds(entries, 10 * repeat if decode else repeat)
            m = {name: statistics.median(ts) for name, ts in t.items()}
            fwd = m["without"]
            overhead = statistics.median(w - wo for w, wo in zip(t["with"], t["without"], strict=True)) / fwd
            if own:
                checks = ["none: the kernel's own pass"] + ["-"] * 3
            else:
                checks = [m["in the call"] * 1e3, f"{100 * m['in the call'] / fwd:.2f}", m["alone"] * 1e3,
                          f"{100 * m['alone'] / fwd:.2f}"]
            row = [label, backend.name, m["with"] * 1e3, fwd * 1e3, f"{100 * overhead:+.1f}", *checks]
            print(_progress_check(row))
            rows.append(row)
            if decode:
                notes.append(f"{label}: {m['query read'] * 1e3:.3g} ms ({100 * m['query read'] / fwd:.2f}% of "
                             "the forward)")
        rows.append(_module_decode_row(n, heads, dim, 10 * repeat))
    finally:
        torch.set_num_threads(threads)
    return (f"### The NaN/inf rule's finiteness check, n = {n}, forward, one thread\n\n"
            f"B=1, H={heads}, D={dim}, float32; CPU time on one thread, medians of {repeat} rounds (round-robin, the "
            f"order reversed every other round; {10 * repeat} for the decode step, whose forward is small). `with "
            "check` is `attnkit.attention`; `without` builds the same request and calls the same backend directly; "
            "`overhead %` is the median over rounds of `with` minus `without` (run next to each other in each round), "
            "as a share of `without`: what the check costs a call. The check (a sum of q, and of k and v unless a "
            "KV cache vouches for them: the cache keeps a flag of what it wrote, so a decode step reads its one "
            "query token and that flag, not the buffers) is also timed on its own: `in the call` where "
            "`attnkit.attention` runs it, after validating the call and choosing the backend, before the backend; "
            "`alone` right after a forward. Both pay cold caches, in the call also misses the backend would "
            "otherwise take, so they exceed what the check adds to a call. The banded kernel, in a call that records "
            "no gradient, answers for q, k and v itself: it marks in its statistics the rows whose scores or output "
            "met a non-finite value as it passes over them, so no check runs before it and `overhead %` is the look "
            "at those statistics (its checks' cost inside the kernel is within `without`). A call that records a "
            "gradient keeps the check (the backward reads keys the forward did not): the row `forward and backward` "
            "times a training step, the forward and its backward, and its `% of fwd` columns are of that step. "
            "The last row is a decode step as a model runs it: `MultiHeadAttention` (its four projections, the cache "
            "write, the attention over the written keys) on one token with the cache cut back to the same length "
            "before each round (`KVCache.crop`, untimed); `without` is the same step with the check replaced by "
            "`True`, and `check in the call` times the check inside that step. "
            "Budget: 2% of the forward.\n\n"
            + markdown_table(CHECK_HEADER, rows)
            + "\n\nThe least any check that reads the query costs in the call (its sum read to the host, nothing "
            "else, timed like `in the call` in the same rounds): " + "; ".join(notes) + ".")


def _module_decode_row(n: int, heads: int, dim: int, rounds: int) -> list:
    """The check's cost in a decode step as a model runs it (see the table's text): one token through
    ``MultiHeadAttention`` over a KV cache holding ``n // 2`` tokens of ``n``, with and without the check."""
    g = torch.Generator().manual_seed(2)
    embed = heads * dim
    torch.manual_seed(2)
    mha = MultiHeadAttention(embed, heads).eval()
    x = torch.randn(1, n // 2 + 1, embed, generator=g)
    cache = KVCache(1, n, heads, dim)
    keep = n // 2
    spent = []
    real = nonfinite.all_finite

    def timed_check(req) -> bool:
        t0 = time.process_time()
        ok = real(req)
        spent.append(time.process_time() - t0)
        return ok

    def step(check) -> float:
        cache.crop(keep)
        nonfinite.all_finite = check
        try:
            t0 = time.process_time()
            mha(x[:, keep:], cache=cache, is_causal=True)
            return time.process_time() - t0
        finally:
            nonfinite.all_finite = real

    with torch.no_grad():
        mha(x[:, :keep], cache=cache, is_causal=True)
        t = _rounds({"with": lambda: step(real), "without": lambda: step(lambda req: True),
                     "in the call": lambda: step(timed_check)}, rounds)
    backend = attnkit.which_backend(torch.randn(1, heads, 1, dim), cache.k[:, :, :keep + 1], cache.v[:, :, :keep + 1],
                                    is_causal=True)
    m = {name: statistics.median(ts) for name, ts in t.items()}
    fwd = m["without"]
    overhead = statistics.median(w - wo for w, wo in zip(t["with"], t["without"], strict=True)) / fwd
    if spent:
        check = statistics.median(spent[1:] if len(spent) > 1 else spent)
        checks = [check * 1e3, f"{100 * check / fwd:.2f}"]
    else:  # the backend's own pass answered (attnkit.nonfinite.call): the check never ran
        checks = ["none: the kernel's own pass", "-"]
    row = [f"decode step, MultiHeadAttention E={embed}, KV cache {keep + 1} of {n}", backend, m["with"] * 1e3,
           fwd * 1e3, f"{100 * overhead:+.1f}", *checks, "-", "-"]
    print(_progress_check(row))
    return row


def _timed(fn):
    """``fn`` made to return its own CPU time."""
    def run() -> float:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    return run


def _unchecked(a, b, c, kw) -> torch.Tensor:
    """``attnkit.attention`` without the check: validation, the backend's choice, the backend."""
    req = validate_call(a, b, c, **kw)
    return backends.select(req)(req)[0]


def _step(out: torch.Tensor) -> None:
    """A training step's backward after a forward that records one (nothing after one that does not)."""
    if out.requires_grad:
        out.backward(torch.ones_like(out))


def _in_the_call(a, b, c, kw, check) -> float:
    """One call as ``attnkit.attention`` makes it, with ``check`` in the check's place: validation, the
    backend's choice, the check, the backend. Returns the check's CPU time."""
    req = validate_call(a, b, c, **kw)
    backend = backends.select(req)
    t0 = time.process_time()
    check(req)
    spent = time.process_time() - t0
    backend(req)
    return spent


def _alone(req, backend) -> float:
    """The check's CPU time right after whatever ran last, then ``backend`` on ``req``, untimed, so that what
    runs next follows a forward."""
    t0 = time.process_time()
    nonfinite.all_finite(req)
    spent = time.process_time() - t0
    backend(req)
    return spent


def _rounds(entries: dict, rounds: int) -> dict[str, list[float]]:
    """The times each entry (a function returning the time it measured) gives over ``rounds`` round-robin
    rounds, the order reversed every other round, so that drift on a shared machine hits all alike; one more
    round first warms up and is dropped."""
    times = {name: [] for name in entries}
    items = list(entries.items())
    for r in range(rounds + 1):
        for name, run in items[::-1] if r % 2 else items:
            times[name].append(run())
    return {name: ts[1:] for name, ts in times.items()}


def _progress_check(cells) -> str:
    # Three significant digits: the check's cells are hundredths of a millisecond.
    return "  " + "  ".join((f"{c:.3g}" if isinstance(c, float) else str(c)).rjust(max(len(h), 7))
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
