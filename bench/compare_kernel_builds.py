"""Two builds of the banded kernel, loaded in one process, on a grid of calls: every output bit for bit.

For a change to the kernel's sources that must not change its numbers (a reorganisation, new flags):
build the old sources and the new ones (each build's module, e.g. from ``$ATTNKIT_CACHE``), then

    python bench/compare_kernel_builds.py OLD.so NEW.so

It calls both modules' ``forward`` and ``backward`` with the same arguments over float32, float64, bfloat16
and float16 (the half types with their products on and off), windows, causal rows with ``Lq != Lk``, packed
documents per batch element, several intervals per row, GQA, a diagonal table, soft-capping, the operator's
block sizes and small ones; the backward deterministic at two threads and under locks at one thread (under
locks with several threads dQ's sums may come in any order, in either build). It prints one line per build
difference and exits 1 if there is any.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from attnkit.backends import _band


def _load(path: str, tag: str):
    folder = Path(tempfile.mkdtemp(prefix="attnkit-compare-"))
    name = re.search(rb"PyInit_(\w+)", Path(path).read_bytes()).group(1).decode()  # (not always the file's name)
    copy = folder / Path(path).name
    shutil.copyfile(path, copy)
    spec = importlib.util.spec_from_file_location(name, copy)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32 if t.element_size() == 4
                               else torch.int64)


def _cases():
    """(name, lq, lk, starts, ends) over the masks the kernel takes."""
    yield ("window", *_band._window(300, 300, 40, 7))
    yield ("causal Lq<Lk", *_band._window(200, 333, 400, 0))
    yield ("documents", *_band._documents((0, 70, 150, 151, 260), (0, 40, 40, 190, 241)))
    yield ("several intervals", *_band._scattered(75, 80))


def main(old_path: str, new_path: str) -> int:
    old, new = _load(old_path, "old"), _load(new_path, "new")
    gen = torch.Generator().manual_seed(0)
    differences = calls = 0
    dtypes = [(torch.float32, None), (torch.float64, None), (torch.bfloat16, False), (torch.float16, False)]
    for tag, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
        if getattr(old, f"has_{tag}_gemm")() and getattr(new, f"has_{tag}_gemm")():
            dtypes.append((dtype, True))
    for (dtype, products), (name, lq, lk, starts, ends), (heads, table_heads, cap), blocks in itertools.product(
            dtypes, _cases(), ((4, 0, 0.0), (4, 4, 0.0), (2, 1, 5.0)), ((64, 1024, 64, 1024), (16, 32, 16, 24))):
        for mod in (old, new):
            for tag, half in (("bf16", torch.bfloat16), ("f16", torch.float16)):
                getattr(mod, f"set_{tag}_products")(bool(products) and half == dtype)
        kv_heads = 2 if heads == 4 else heads
        b = starts.shape[0] if starts.shape[0] > 1 else 2
        e, ev = 64, 48
        q = torch.randn(b, heads, lq, e, generator=gen).to(dtype)
        k = torch.randn(b, kv_heads, lk, e, generator=gen).to(dtype)
        v = torch.randn(b, kv_heads, lk, ev, generator=gen).to(dtype)
        dout = torch.randn(b, heads, lq, ev, generator=gen).to(dtype)
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        table = torch.randn(table_heads, lq + lk - 1 if table_heads else 0, generator=gen).to(compute)
        scale = e ** -0.5
        q_rows, kv_chunk, kv_rows, q_chunk = blocks
        runs = []
        for mod in (old, new):
            out, stats = mod.forward(q, k, v, starts, ends, table, scale, cap, q_rows, kv_chunk)
            results = {"out": out, "stats": stats}
            for deterministic, threads in ((True, torch.get_num_threads()), (False, 1)):
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    grads = mod.backward(dout, q, k, v, out, stats, starts, ends, table, scale, cap, kv_rows,
                                         q_chunk, deterministic, table_heads > 0)
                finally:
                    torch.set_num_threads(before)
                for gname, g in zip(("dq", "dk", "dv", "dtable"), grads, strict=True):
                    results[f"{gname} (deterministic={deterministic})"] = g
            runs.append(results)
        for key in runs[0]:
            calls += 1
            a, c = runs[0][key], runs[1][key]
            if a.shape != c.shape or not torch.equal(_bits(a), _bits(c)):
                differences += 1
                print(f"DIFFERENT {key}: {dtype} products={products} {name} heads={heads} table={table_heads} "
                      f"softcap={cap} blocks={blocks}")
    print(f"{calls} results compared, {differences} differ ({torch.get_num_threads()} threads; "
          f"bf16 products: {new.bf16_gemm() or 'none'})")
    return 1 if differences else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python bench/compare_kernel_builds.py OLD.so NEW.so")
    sys.exit(main(sys.argv[1], sys.argv[2]))
