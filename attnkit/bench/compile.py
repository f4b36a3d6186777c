"""Compile suite: attnkit under ``torch.compile``, against eager attnkit and PyTorch's SDPA, in one run.

The questions: does compiling a model built on attnkit cost or buy anything against running it
eagerly; does the compiled code hold the whole model in one graph; does a compiled decode loop
compile once for every token? Target: a compiled ``MultiHeadAttention`` (window 256, n = 8192)
forward+backward no slower than eager attnkit, with 0 graph breaks.

Rows:

* ``MultiHeadAttention`` (512 wide, 8 heads, causal window of 256, n = 8192), forward+backward:
  eager attnkit, compiled attnkit (inductor, ``fullgraph=True``; compile time apart) and the
  anchor, the same projections around PyTorch's SDPA with the window as a dense mask;
* a two-layer encoder of attnkit's ``TransformerEncoderLayer`` (the window as a mask_mod), forward:
  eager against compiled, and its graph break count (``torch._dynamo.explain``);
* greedy decoding through a ``KVCache``: time per token eager and compiled, and how many graphs
  the compiled loop made for all its tokens.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ._util import interleaved_medians, markdown_table, progress, write_report

HEADER = ["case", "n", "path", "ms (median)", "x eager attnkit", "graphs / breaks"]


def _mha_case(n: int, width: int, heads: int, window: int, repeat: int, say) -> list[list]:
    from attnkit import MultiHeadAttention, masks
    from attnkit.modules.attention import merge_heads

    torch.manual_seed(0)
    m = MultiHeadAttention(width, heads)
    x = torch.randn(1, n, width, requires_grad=True)

    def eager():
        m(x, window=(window, 0)).sum().backward()

    dense = masks.sliding_window(n, left=window, right=0)

    def sdpa():  # the same projections around PyTorch's kernel, the window as a dense bool mask
        q, k, v = m.project_qkv(x, x, x)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        m.out_proj(merge_heads(out)).sum().backward()

    fn = torch.compile(lambda x: m(x, window=(window, 0)), fullgraph=True)
    say(f"compiling MultiHeadAttention, n = {n}")
    t0 = time.perf_counter()
    fn(x).sum().backward()
    compile_s = time.perf_counter() - t0
    explained = torch._dynamo.explain(lambda x: m(x, window=(window, 0)))(x)
    say("timing eager, compiled and SDPA with a dense mask")
    t = interleaved_medians({"eager": eager, "compiled": lambda: fn(x).sum().backward(), "sdpa": sdpa},
                            repeat=repeat, alternate=True)
    case = f"MultiHeadAttention {width} wide, {heads} heads, window {window}, fwd+bwd"
    return [[case, n, "attnkit eager", t["eager"] * 1e3, 1.0, "-"],
            [case, n, f"attnkit compiled (compile {compile_s:.0f} s)", t["compiled"] * 1e3,
             t["compiled"] / t["eager"], f"{explained.graph_count} / {explained.graph_break_count}"],
            [case, n, "SDPA, dense window mask", t["sdpa"] * 1e3, t["sdpa"] / t["eager"], "-"]]


def _encoder_case(n: int, width: int, heads: int, window: int, repeat: int, say) -> list[list]:
    from attnkit import masks
    from attnkit.modules.transformer import TransformerEncoderLayer

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(TransformerEncoderLayer(width, heads, ffn_dim=4 * width, dropout=0.0)
                                 for _ in range(2)).eval()

    def encode(x):
        mod = masks.window_mod(window, window)
        for layer in layers:
            x = layer(x, mask_mod=mod)
        return x

    x = torch.randn(1, n, width)
    fn = torch.compile(encode, fullgraph=True)
    say(f"compiling a two-layer encoder, n = {n}")
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(x)
        compile_s = time.perf_counter() - t0
        explained = torch._dynamo.explain(encode)(x)
        say("timing the encoder eager and compiled")
        t = interleaved_medians({"eager": lambda: encode(x), "compiled": lambda: fn(x)}, repeat=repeat,
                                alternate=True)
    case = f"2 x TransformerEncoderLayer {width} wide, window +-{window}, forward"
    return [[case, n, "attnkit eager", t["eager"] * 1e3, 1.0, "-"],
            [case, n, f"attnkit compiled (compile {compile_s:.0f} s)", t["compiled"] * 1e3,
             t["compiled"] / t["eager"], f"{explained.graph_count} / {explained.graph_break_count}"]]


def _decode_case(tokens: int, width: int, heads: int, say) -> list[list]:
    from torch._dynamo.testing import CompileCounterWithBackend

    from attnkit import MultiHeadAttention
    from attnkit.cache import KVCache

    torch.manual_seed(0)
    m = MultiHeadAttention(width, heads, num_kv_heads=heads // 4).eval()
    cache = KVCache(1, tokens + 1, m.num_kv_heads, m.head_dim)
    counter = CompileCounterWithBackend("inductor")
    step = torch.compile(lambda x: m(x, cache=cache, is_causal=True), backend=counter, fullgraph=True)
    xs = torch.randn(1, tokens, width)

    def loop(fn):
        cache.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(tokens):
                fn(xs[:, i:i + 1])
        return (time.perf_counter() - t0) / tokens

    say(f"compiled decode loop, {tokens} tokens")
    first = loop(step)  # compiles
    eager = min(loop(lambda x: m(x, cache=cache, is_causal=True)) for _ in range(3))
    compiled = min(loop(step) for _ in range(3))
    case = f"decode, MultiHeadAttention {width} wide + KVCache, per token"
    return [[case, tokens, "attnkit eager", eager * 1e3, 1.0, "-"],
            [case, tokens, f"attnkit compiled (first loop {first * tokens:.0f} s)", compiled * 1e3,
             compiled / eager, f"{counter.frame_count} for {4 * tokens} steps / 0"]]


def run(quick: bool, out_dir: Path) -> str:
    say = progress("compile")
    n, enc_n, tokens, repeat = (1024, 512, 16, 3) if quick else (8192, 4096, 128, 5)
    rows = []
    for part in (lambda: _mha_case(n, 512, 8, 256, repeat, say),
                 lambda: _encoder_case(enc_n, 256, 4, 128, repeat, say),
                 lambda: _decode_case(tokens, 256, 8, say)):
        rows += part()
        for row in rows[-2:]:
            print("  ", row, flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    body = ("Medians of interleaved runs (decode: the best of 3 loops), times in ms; \"x eager attnkit\" "
            "is the path's time over eager attnkit's in the same run (below 1: faster). Graphs / breaks: "
            "what `torch._dynamo.explain` finds in the compiled function (decode: graphs the compiled loop "
            "made, counted by a compile counter).\n\n"
            + markdown_table(HEADER, rows) + f"\n\nLoad averages after the run: {load}. "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}.\n")
    return write_report(out_dir, "compile", "attnkit under torch.compile", body,
                        f"python -m attnkit.bench compile{' --quick' if quick else ''}")
