"""Half precision on the CPU: float32, bfloat16 and float16 attention, attnkit against PyTorch's SDPA.

The anchor is this CPU's own matmul in each dtype, measured in the same run: its bf16:float32 and fp16:float32
speed ratios say what half precision can gain here at all (about 1 on a CPU without bf16/fp16 products, 2 or
more with AVX512-BF16 or AMX), MKL's bfloat16 and float16 products (half operands, float32 sums) against
float32, and one tile's product as the banded kernel computes it in each type (bfloat16 through oneDNN's brgemm
where it runs, MKL's product elsewhere; packing included). Each row times the same masked attention in the three
dtypes on one thread (CPU-time medians, every dtype in each round), forward and then forward and backward, for
attnkit and for SDPA (a causal call uses SDPA's own causal kernel, a call with no mask its kernel without one; a
window or documents give SDPA the dense boolean mask), and gives each dtype's time over attnkit's own float32
time; where the banded kernel serves a half type, a row times it with that type's products set the other way
(`bfloat16, float32 products` where they are on, `bfloat16, bfloat16 products` where they are off by default but
available; the same for float16). The CPU's flags that matter are printed first.

A second table times a whole model: a small Mistral-architecture ``MistralForCausalLM`` from transformers
(random weights from a seeded config, nothing downloaded; its sliding window shorter than the sequence), in
bfloat16, one prefill of one sequence without gradient under ``attn_implementation="attnkit"`` and ``"sdpa"`` in
the same rounds, with the backends that served attnkit's calls and the largest difference between the two
implementations' logits. Without transformers the table says so and the rest runs.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

import attnkit

from .. import _cpu, backends, masks, scores
from ..backends import _band
from ._util import interleaved_medians, markdown_table, matmul_gflops, median_time, progress, write_report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HEADER = ["mask", "dtype", "pass", "attnkit backend", "attnkit ms", "SDPA ms", "SDPA / attnkit",
          "attnkit / own float32"]
#: The half types the banded kernel can multiply as they are, with MKL's product for each.
HALF_PRODUCTS = {"bfloat16": "cblas_gemm_bf16bf16f32", "float16": "cblas_gemm_f16f16f32"}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")
MODEL_HEADER = ["model", "n", "dtype", "attnkit backends", "attnkit ms", "SDPA ms", "SDPA / attnkit",
                "max abs logit difference", "max abs logit"]
#: The Mistral-style model of the second table: Mistral's layer (RMSNorm, rotary, GQA, SiLU-gated MLP, a causal
#: sliding window) at a size that one CPU thread prefills at long lengths; the sequence is longer than the window.
MISTRAL = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 512}


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
        peak = _matmul_anchor(size, rounds=5 if quick else 15)
        say("matmul GFLOP/s, one thread: " + ", ".join(f"{k} {v:.1f}" for k, v in peak.items()))
        mkl = {name: _mkl_half_gflops(size, name) for name in HALF_PRODUCTS}
        for name, gflops in mkl.items():
            say(f"MKL's {name} product: " + (f"{gflops:.1f} GFLOP/s" if gflops else "not in this torch"))
        products = {name: _band.half_products(DTYPES[name]) if _band.available() else False for name in HALF_PRODUCTS}
        why_not = {name: _band.half_products_reason(DTYPES[name]) for name in HALF_PRODUCTS}
        for name, on in products.items():
            say(f"banded kernel, {name} products: {'on' if on else 'off'}" + ("" if on else f" ({why_not[name]})"))
        tile = _tile_gflops(products)
        say("a q k^T tile (64 x 1024 x 64), GFLOP/s: " + ", ".join(f"{k} {v:.1f}" for k, v in tile.items()))
        i = torch.arange(n)
        window = (i.view(-1, 1) - i.view(1, -1)).abs() <= 256
        docs = torch.arange(n) * 4 // n  # four documents of n / 4 tokens
        same_doc = (docs.view(-1, 1) == docs.view(1, -1)) & (i.view(-1, 1) >= i.view(1, -1))
        alibi = scores.alibi(scores.alibi_slopes(heads))
        cases = {"window +-256": ({"window": (256, 256)}, {"attn_mask": window}),
                 "causal": ({"is_causal": True}, {"is_causal": True}),
                 "no mask": ({}, {}),
                 "documents (4, causal)": ({"mask_mod": masks.document_mod(docs), "is_causal": True},
                                           {"attn_mask": same_doc}),
                 "causal, ALiBi": ({"is_causal": True, "score_mod": alibi},
                                   {"attn_mask": _alibi_bias(heads, n)})}
        rows = []
        for label, (ours, theirs) in cases.items():
            g = torch.Generator().manual_seed(0)
            base = [torch.randn(1, heads, n, dim, generator=g) for _ in range(4)]
            for backward in (False, True):
                rows += _case_rows(label, ours, theirs, base, backward, products, repeat,
                                   repeat if not backward else 3, say)
        model_n = 1024 if quick else 8192
        model_repeat = 3 if quick else 5
        model = _mistral_prefill(model_n, model_repeat, say)
    finally:
        torch.set_num_threads(threads)
    body = (f"CPU flags: {', '.join(have)}. Matmul anchor, one thread, {size}^2, measured in this run "
            "(float32 and bfloat16 in alternating rounds): "
            + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in peak.items())
            + f" (bf16 : float32 = {peak['bfloat16'] / peak['float32']:.2f}, "
            f"fp16 : float32 = {peak['float16'] / peak['float32']:.2f}); MKL's half products (half operands, float32 "
            "sums; the banded kernel's where oneDNN's brgemm does not run): "
            + ", ".join(f"{name} " + (f"{g:.1f} GFLOP/s ({g / peak['float32']:.2f} of float32)" if g else
                                      "not in this torch") for name, g in mkl.items())
            + ". The banded kernel's half products: "
            + "; ".join(f"{name} " + ("on" if on else f"off ({why_not[name]})") for name, on in products.items())
            + ". " + _tile_text(tile) + "\n\n"
            f"B=1, H={heads}, D={dim}, n = {n}, forward (and forward and backward, with a fixed output gradient), "
            f"one thread; CPU-time medians of {repeat} rounds for attnkit, each running every dtype (the order "
            "reversed every other round, so that a shared machine's load hits all alike), then of SDPA's in "
            f"rounds of their own ({repeat} forward, 3 with the backward: seconds each on a dense mask). `attnkit "
            "/ own float32` is each dtype's attnkit time over attnkit's float32 time for the same mask and pass "
            "(below 1: half precision is faster).\n\n" + markdown_table(HEADER, rows)
            + "\n\n## A Mistral-style model's prefill in bfloat16\n\n" + _model_text(model, model_n, model_repeat))
    return write_report(out_dir, "dtypes", "Half precision on the CPU: float32, bfloat16, float16", body,
                        "attnkit bench dtypes" + (" --quick" if quick else ""), threads=1)


def _case_rows(label: str, ours: dict, theirs: dict, base: list, backward: bool, products: dict[str, bool],
               repeat: int, sdpa_repeat: int, say: Callable[[str], None]) -> list[list]:
    """One mask's rows: attnkit and SDPA in every dtype (and attnkit's half types with their products set the
    other way where the banded kernel serves them; ``products``: each half type's default), forward alone or
    forward and backward. attnkit's calls are timed in rounds of their own (``repeat``), so that SDPA's far
    longer calls on a dense mask, and the memory they take and give back, do not fall between the calls that
    the last column compares; SDPA's then, in rounds of their own (``sdpa_repeat``)."""
    inputs = {name: [t.to(dtype).requires_grad_(backward) for t in base[:3]] for name, dtype in DTYPES.items()}
    douts = {name: base[3].to(dtype) for name, dtype in DTYPES.items()}

    def timed(call, leaves, dout):
        if not backward:
            return call
        return lambda: torch.autograd.grad(call(), leaves, dout)

    fns = {}
    for name, (q, k, v) in inputs.items():  # every dtype on both sides (each side timed in rounds of its own)
        fns["attnkit", name] = timed(lambda q=q, k=k, v=v: attnkit.attention(q, k, v, **ours), (q, k, v), douts[name])
        mask = theirs.get("attn_mask")
        kw = theirs if mask is None or mask.dtype == torch.bool else {"attn_mask": mask.to(q.dtype)}
        fns["sdpa", name] = timed(lambda q=q, k=k, v=v, kw=kw: F.scaled_dot_product_attention(q, k, v, **kw),
                                  (q, k, v), douts[name])
    others = {}  # row name -> the half type it times the other way
    for name, on in products.items():
        x = inputs[name]
        if _band.available() and _band._products_ok.get(DTYPES[name]) and attnkit.which_backend(*x, **ours) == "band":
            other = f"{name}, {'float32' if on else name} products"
            others[other] = name
            step = timed(lambda x=x: attnkit.attention(*x, backend="band", **ours), x, douts[name])
            fns["attnkit", other] = lambda step=step, dtype=DTYPES[name], on=not on: _switched(step, dtype, on)
    with torch.set_grad_enabled(backward):
        t = interleaved_medians({key: fn for key, fn in fns.items() if key[0] == "attnkit"}, repeat=repeat,
                                alternate=True, clock=time.process_time)
        t |= interleaved_medians({key: fn for key, fn in fns.items() if key[0] == "sdpa"}, repeat=sdpa_repeat,
                                 alternate=True, clock=time.process_time)
    rows = []
    for name in [*inputs, *others]:
        q, k, v = inputs.get(name) or inputs[others[name]]
        backend = "band" if name not in inputs else attnkit.which_backend(q, k, v, **ours)
        sdpa = t.get(("sdpa", name))
        row = [label, name, "forward and backward" if backward else "forward", backend, t["attnkit", name] * 1e3,
               "-" if sdpa is None else sdpa * 1e3, "-" if sdpa is None else sdpa / t["attnkit", name],
               t["attnkit", name] / t["attnkit", "float32"]]
        say("  ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in row))
        rows.append(row)
    return rows


def _mistral_prefill(n: int, repeat: int, say: Callable[[str], None]) -> list | str:
    """The second table's row: :data:`MISTRAL` in bfloat16, one prefill of ``n`` tokens without gradient under
    ``"attnkit"`` and ``"sdpa"`` (CPU-time medians of ``repeat`` rounds, both in each round), the backends that
    served attnkit's calls, and the two logits' largest difference; or why it could not run."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import transformers

        from ..integrations import transformers as _registers_attnkit  # noqa: F401
    except ImportError as e:
        return f"Not measured: transformers could not be imported ({e})."
    torch.manual_seed(0)
    config = transformers.MistralConfig(**MISTRAL, max_position_embeddings=n)
    model = transformers.MistralForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, MISTRAL["vocab_size"], (1, n), generator=torch.Generator().manual_seed(0))

    def prefill(impl: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            model.set_attn_implementation(impl)
            return model(input_ids=ids).logits
        return run

    fns = {impl: prefill(impl) for impl in ("attnkit", "sdpa")}
    say(f"Mistral-style prefill, n = {n}, bfloat16")
    with torch.no_grad():
        with backends.served() as served:
            ours = fns["attnkit"]()  # also the warm-up of both
        theirs = fns["sdpa"]()
        t = interleaved_medians(fns, repeat=repeat, warmup=0, alternate=True, clock=time.process_time)
    row = [f"Mistral-style, window {MISTRAL['sliding_window']}", n, "bfloat16", ", ".join(sorted(set(served))),
           t["attnkit"] * 1e3, t["sdpa"] * 1e3, t["sdpa"] / t["attnkit"],
           (ours.double() - theirs.double()).abs().max().item(), theirs.double().abs().max().item()]
    say("  ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in row))
    return row


def _model_text(model: list | str, n: int, repeat: int) -> str:
    """The second table and what it measured, or the line saying why it was not measured."""
    if isinstance(model, str):
        return model
    size = ", ".join(f"{k} {v}" for k, v in MISTRAL.items())
    return (f"transformers' `MistralForCausalLM` with random weights from a seeded config ({size}), in bfloat16; "
            f"one prefill of one sequence of n = {n} tokens without gradient, the sliding window shorter than it, "
            f"under `attn_implementation=\"attnkit\"` and `\"sdpa\"`; one thread, CPU-time medians of {repeat} "
            "rounds, each running both (the order reversed every other round). `attnkit backends`: what served "
            "attnkit's attention calls; the logit columns compare the two implementations' logits over every "
            "position.\n\n" + markdown_table(MODEL_HEADER, [model]))


def _switched(step: Callable[[], object], dtype: torch.dtype, on: bool):
    """``step()`` (a forward, or a forward and its backward, which reads the setting when it runs) with the banded
    kernel's products of half type ``dtype`` ``on`` (or off), then as they were."""
    with _band.half_products_set(dtype, on):
        return step()


def _alibi_bias(heads: int, n: int) -> torch.Tensor:
    """ALiBi and the causal mask as SDPA's float mask ``[H, n, n]``: -slope * distance, -inf above the diagonal."""
    i = torch.arange(n)
    dist = (i.view(-1, 1) - i.view(1, -1)).float()
    bias = -scores.alibi_slopes(heads).view(-1, 1, 1) * dist
    return bias.masked_fill(dist < 0, float("-inf"))


def _matmul_anchor(n: int, rounds: int) -> dict[str, float]:
    """GFLOP/s of an ``n x n`` matmul in each of :data:`DTYPES`, one thread. float32 and bfloat16 are timed in
    alternating rounds, so that a shared machine's drift hits both alike and their ratio (the speed-up
    bfloat16 products offer here, against which the half-precision rows read) holds still from run to run;
    float16 apart, as its product may take seconds where the CPU has no float16 products."""
    fns = {}
    for name in ("float32", "bfloat16"):
        a, b = (torch.randn(n, n, dtype=DTYPES[name]) for _ in range(2))
        fns[name] = lambda a=a, b=b: a @ b
    times = interleaved_medians(fns, repeat=rounds, warmup=2, alternate=True)
    out = {name: 2 * n**3 / t / 1e9 for name, t in times.items()}
    out["float16"] = matmul_gflops(n, torch.float16)
    return {name: out[name] for name in DTYPES}


def _tile_gflops(products: dict[str, bool]) -> dict[str, float]:
    """GFLOP/s of one q k^T tile of the banded kernel's forward (64 query rows, 1024 keys, 64 wide): float32
    through torch's matmul (the BLAS the kernel calls), and each half type whose products are on through the
    kernel's own product (``half_product``: its operands packed as every tile's are, then multiplied: oneDNN's
    brgemm for bfloat16 where it runs, else MKL's)."""
    rows, keys, width = 64, 1024, 64
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(rows, width, generator=g), torch.randn(keys, width, generator=g)
    c = torch.empty(rows, keys)
    flops = 2 * rows * keys * width
    out = {"float32": flops / median_time(lambda: torch.mm(q, k.T), repeat=21, warmup=5) / 1e9}
    if not _band.available():
        return out
    mod = _band._module()
    for name, on in products.items():
        if on:
            a, b = q.to(DTYPES[name]), k.to(DTYPES[name])
            t = median_time(lambda a=a, b=b: mod.half_product(a, b, c, False, True, 1.0, 0.0), repeat=21, warmup=5)
            out[name] = flops / t / 1e9
    return out


def _tile_text(tile: dict[str, float]) -> str:
    """What :func:`_tile_gflops` measured, as a sentence for the table's preamble."""
    base = tile["float32"]
    halves = [f"{name} {g:.1f} GFLOP/s ({g / base:.2f} of float32)" for name, g in tile.items() if name != "float32"]
    product = _band._module().bf16_gemm() if _band.available() else ""
    return (f"The kernel's float32 products: {_band.float32_products()}. "
            f"One q k^T tile of the kernel (64 x 1024 x 64), one thread: float32 {base:.1f} GFLOP/s"
            + (f", {', '.join(halves)} through the kernel's own product (its bfloat16 product here: {product}, "
               "operands packed per tile)" if halves else "") + ".")


def _mkl_half_gflops(n: int, name: str) -> float | None:
    """MKL's product of ``n x n`` matrices of half type ``name`` (``bfloat16``: ``cblas_gemm_bf16bf16f32``,
    ``float16``: ``cblas_gemm_f16f16f32``, as torch exports them) into float32, GFLOP/s, or None where torch has
    no such symbol."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        gemm = getattr(lib, HALF_PRODUCTS[name])
    except (OSError, AttributeError):
        return None
    i32, ptr = ctypes.c_int, ctypes.c_void_p
    gemm.restype = None
    gemm.argtypes = [i32, i32, i32, i32, i32, i32, ctypes.c_float, ptr, i32, ptr, i32, ctypes.c_float, ptr, i32]
    a, b = (torch.randn(n, n).to(DTYPES[name]) for _ in range(2))
    c = torch.empty(n, n)
    row_major, no_trans = 101, 111
    t = median_time(lambda: gemm(row_major, no_trans, no_trans, n, n, n, 1.0, a.data_ptr(), n, b.data_ptr(), n, 0.0,
                                 c.data_ptr(), n), repeat=5, warmup=2)
    return 2 * n**3 / t / 1e9


if __name__ == "__main__":  # pragma: no cover
    start = time.perf_counter()
    print(run(quick=True, out_dir=Path("bench/results")))
    print(f"{time.perf_counter() - start:.0f} s")
