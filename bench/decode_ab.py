"""A/B of one decode step on one thread: ``attnkit.attention`` (the decode backend's lane, what a model's step
runs), the decode backend's checked call, SDPA's folded call (attnkit's "sdpa"), SDPA with ``enable_gqa`` and a
plain read of K and V (``k.sum(); v.sum()``), in the same run.

    PYTHONPATH=. python bench/decode_ab.py [--quick]

Prints two Markdown tables: per shape, each variant's median time and the ratios to the read and to the folded
call, first warm (fresh tensors timed in a loop: a cache that fits stays in the CPU's caches), then cold, as a
model's step sees a cache written in place (attnkit's KVCache, transformers' StaticCache): views into a larger
buffer, with 64 MB written between calls, as the model's other layers pass through the caches between two calls
of one layer. The cold read is the issue's anchor: reading K and V once from memory.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnkit
from attnkit.backends.decode import DecodeBackend
from attnkit.backends.sdpa import SDPABackend
from attnkit.call import validate_call


def _times(fns, reps: int, before=None) -> list[float]:
    """Each function's median time over ``reps`` rounds, the functions run in turn within each round: load from
    other work on the machine then falls on every variant alike, where timing one after the other let a burst
    land on one. ``before`` (untimed) runs before each call."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


_JUNK = None


def _flush() -> None:
    """64 MB written: what a model's other layers do to the CPU's caches between two calls of one layer."""
    global _JUNK
    if _JUNK is None:
        _JUNK = torch.zeros(16 << 20)
    _JUNK.add_(1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one small shape, few repetitions")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    heads = [(32, 8, 128), (12, 12, 64)]
    lengths = [512] if args.quick else [512, 2048, 8192]
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    batches = [1] if args.quick else [1, 8]
    decode, sdpa = DecodeBackend(), SDPABackend()
    print("| dtype | B | H/Hkv, D | Lk | read K,V (ms) | attention (ms) | decode backend (ms) | sdpa folded (ms) | "
          "enable_gqa (ms) | attention / read | folded / attention | enable_gqa / attention |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cells = [(dtype, b, h, hkv, d, lk) for dtype in dtypes for b in batches for h, hkv, d in heads for lk in lengths]
    with torch.no_grad():
        for cell in cells:
            print(_row(decode, sdpa, *cell, args.quick), flush=True)
        print("\nCold: the cache a view into a buffer with room for the next token, 64 MB written before each "
              "call (untimed); the read is of the two buffers (Lk + 1 tokens).\n")
        print("| dtype | B | H/Hkv, D | Lk | read K,V (ms) | attention (ms) | enable_gqa (ms) | attention / read | "
              "enable_gqa / attention |")
        print("|---|---|---|---|---|---|---|---|---|")
        for cell in cells:
            print(_cold_row(*cell, args.quick), flush=True)


def _cold_row(dtype, b, h, hkv, d, lk, quick) -> str:
    q = torch.randn(b, h, 1, d, dtype=dtype)
    kb, vb = (torch.zeros(b, hkv, lk + 1, d, dtype=dtype) for _ in range(2))  # room for the next token
    kb[:, :, :lk], vb[:, :, :lk] = torch.randn(b, hkv, lk, d, dtype=dtype), torch.randn(b, hkv, lk, d, dtype=dtype)
    k, v = kb[:, :, :lk], vb[:, :, :lk]
    reps = 5 if quick else max(7, min(41, int(1e8 / (b * hkv * lk * d * 2 * q.element_size()))))
    read, ours, gqa = _times([  # the read: the buffers, contiguous (a view's sum takes a slow path for bfloat16)
        lambda: (kb.sum(), vb.sum()), lambda: attnkit.attention(q, k, v, is_causal=True),
        lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=h != hkv)], reps, before=_flush)
    return (f"| {str(dtype)[6:]} | {b} | {h}/{hkv}, {d} | {lk} | {read * 1e3:.3f} | {ours * 1e3:.3f}"
            f" | {gqa * 1e3:.3f} | {ours / read:.2f}x | {gqa / ours:.2f}x |")


def _row(decode, sdpa, dtype, b, h, hkv, d, lk, quick) -> str:
    q = torch.randn(b, h, 1, d, dtype=dtype)
    k = torch.randn(b, hkv, lk, d, dtype=dtype)
    v = torch.randn(b, hkv, lk, d, dtype=dtype)
    req = validate_call(q, k, v, is_causal=True)
    reps = 5 if quick else max(7, int(2e8 / (b * hkv * lk * d * 2 * q.element_size())))
    read, ours, backend, folded, gqa = _times([
        lambda: (k.sum(), v.sum()), lambda: attnkit.attention(q, k, v, is_causal=True), lambda: decode.if_finite(req),
        lambda: sdpa.if_finite(req), lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=h != hkv)], reps)
    return (f"| {str(dtype)[6:]} | {b} | {h}/{hkv}, {d} | {lk} | {read * 1e3:.3f} | {ours * 1e3:.3f}"
            f" | {backend * 1e3:.3f} | {folded * 1e3:.3f} | {gqa * 1e3:.3f} | {ours / read:.2f}x"
            f" | {folded / ours:.2f}x | {gqa / ours:.2f}x |")

if __name__ == "__main__":
    main()
