"""The banded kernel's native operators against arguments that do not fit together.

Every call of every operator (each function the compiled module exports, each
``torch.ops.attnkit.band_*`` operator) either raises a RuntimeError that names the argument, or
returns what the formula gives for its inputs; none may crash the process. The calls run in a child
process (``python -m tests.backends.test_native_boundary``), so a crash (a signal: a negative return code)
fails the test instead of killing pytest; the child writes down each call before making it, so the
failure names the call that crashed (or hung). The BLAS must never complain of its arguments either
(MKL prints "Parameter N was incorrect" on stdout and carries on with garbage).

The fuzz is seeded: case ``n`` takes random sizes (batch, heads, GQA, lengths, head sizes, intervals
per row and their sharing, bias, soft-cap, dtype, block sizes; some empty) and the ``n % len(MUTATIONS)``-th
mutation of :data:`MUTATIONS`, so every mutation runs on several shapes. A mutation either breaks a
rule the kernel relies on ("bad": every kind of call must refuse it by name) or changes only the
layout ("layout": the module refuses it by name, the operators copy it into place and compute).
Intervals out of order or overlapping break only the caller's side of the contract (wrong sums, the
kernel's documentation says, never a read out of bounds): those calls must merely not crash.
"""

from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SEED, CASES = 29, 300
TIMEOUT_S = 240  # the fuzz takes seconds; a call that hangs is a failure too
#: What the fuzz calls; a new export or operator must be added to it (the test checks these lists).
EXPORTS = ("backward", "bf16_gemm", "bf16_products", "decode", "decode_step", "f16_products", "f32_brgemm",
           "f32_product_times",
           "forward", "half_product", "has_bf16_gemm", "has_blas", "has_f16_gemm", "has_f32_brgemm",
           "set_bf16_products", "set_f16_products", "set_f32_brgemm")
OPERATORS = ("attnkit::band_backward", "attnkit::band_forward")
MAX_BLOCK = 2**20
F64 = torch.float64


# ---- the child: cases, calls and the formula ----------------------------------------------------

def _intervals(rng: random.Random, p: int, lq: int, lk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[p, lq, k]`` sorted, disjoint intervals of ``[0, lk)`` per row, empty ones ``(lk, lk)`` last."""
    starts = torch.full((p, lq, k), lk, dtype=torch.long)
    ends = starts.clone()
    for a in range(p):
        for i in range(lq):
            points = sorted(rng.randint(0, lk) for _ in range(2 * k))
            kept = [(s, e) for s, e in zip(points[::2], points[1::2], strict=True) if s < e]
            for n, (s, e) in enumerate(kept):
                starts[a, i, n], ends[a, i, n] = s, e
    return starts, ends


def _case(rng: random.Random) -> dict:
    """A valid call's arguments (both directions, module and operator) and its sizes."""
    dtype = rng.choice((torch.float32, F64))
    b, hkv = rng.randint(1, 3), rng.randint(1, 2)
    h = hkv * rng.randint(1, 3)
    lq, lk = rng.choice((0, 1, 5, 17, 33)), rng.choice((0, 1, 9, 24, 40))
    e, ev = rng.choice((1, 4, 8)), rng.choice((0, 1, 5, 8))
    p = rng.choice((1, b, b * h))
    starts, ends = _intervals(rng, p, lq, lk, rng.randint(1, 3))

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype)

    biased = rng.random() < 0.4 and lq + lk > 1
    return {
        "q": randn(b, h, lq, e), "k": randn(b, hkv, lk, e), "v": randn(b, hkv, lk, ev), "dout": randn(b, h, lq, ev),
        "starts": starts, "ends": ends,
        "bias": randn(rng.choice((1, h)), lq + lk - 1) if biased else torch.empty(0, 0, dtype=dtype),
        "scale": rng.choice((0.25, 1.0 / math.sqrt(e))), "softcap": rng.choice((0.0, 0.0, 2.5)),
        "q_rows": rng.choice((1, 3, 16, 64)), "kv_chunk": rng.choice((1, 5, 32, 1024)),
        "kv_rows": rng.choice((1, 3, 16, 64)), "q_chunk": rng.choice((1, 7, 24, 1024)),
        "deterministic": rng.random() < 0.5, "bias_grad": rng.random() < 0.5,
        "sizes": (b, h, hkv, lq, lk, e, ev, p),
    }


def _calls(mod) -> dict:
    """Each entry point by name, with the names of the arguments it takes from a case."""
    common = ("starts", "ends", "bias", "scale", "softcap")
    fwd, bwd = ("q", "k", "v", *common), ("dout", "q", "k", "v", "out", "stats", *common)
    return {
        "module.forward": (mod.forward, (*fwd, "q_rows", "kv_chunk")),
        "module.backward": (mod.backward, (*bwd, "kv_rows", "q_chunk", "deterministic", "bias_grad")),
        "torch.ops.attnkit.band_forward": (torch.ops.attnkit.band_forward, fwd),
        "torch.ops.attnkit.band_backward": (torch.ops.attnkit.band_backward, (*bwd, "deterministic", "bias_grad")),
    }


def _formula(a: dict) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv, dbias in float64 by the plain formula, intervals read as the kernel's convention."""
    q, k, v, bias = (a[n].detach().to(F64).requires_grad_() for n in ("q", "k", "v", "bias"))
    b, h, lq, _ = q.shape
    lk, p = k.shape[2], a["starts"].shape[0]
    ke, ve = (t.repeat_interleave(h // k.shape[1], 1) for t in (k, v))
    j = torch.arange(lk)
    seen = ((j >= a["starts"][..., None]) & (j < a["ends"][..., None])).any(-2)  # [P, Lq, Lk]
    seen = seen.view(b, h, lq, lk) if p == b * h else seen[:, None] if p == b else seen[None]
    s = q @ ke.transpose(-1, -2) * a["scale"]
    if bias.numel():
        s = s + bias[:, j[None, :] - torch.arange(lq)[:, None] + lq - 1]
    if a["softcap"] > 0:
        s = a["softcap"] * torch.tanh(s / a["softcap"])
    out = torch.softmax(s.masked_fill(~seen, float("-inf")), -1).nan_to_num(0.0) @ ve
    grads = torch.autograd.grad(out, (q, k, v, bias), a["dout"].detach().to(F64), allow_unused=True)
    return out.detach(), *(torch.zeros_like(x) if g is None else g for g, x in zip(grads, (q, k, v, bias),
                                                                                     strict=True))


def _resized(t: torch.Tensor, dim: int, by: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = max(0, shape[dim] + by)
    return torch.randn(shape, dtype=t.dtype) if t.is_floating_point() else torch.zeros(shape, dtype=t.dtype)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view with stride 2 along the last dim."""
    view = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]
    view.copy_(t)
    return view


def _other_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32 if t.dtype == F64 else F64)


def _set_first(name: str, value):
    """Sets the first interval's start or end (a bad value); only where there is one."""
    def mutate(a):
        if a[name].numel() == 0:
            return None
        a[name] = a[name].clone()
        a[name].view(-1)[0] = value(a)
        return "bad"
    return mutate


def _grow(name: str, dim: int, by: int, *, also: str | None = None):
    def mutate(a):
        if a[name].shape[dim] + by < 0:
            return None
        a[name] = _resized(a[name], dim, by)
        if also is not None:
            a[also] = _resized(a[also], dim, by)
        return "bad"
    return mutate


def _put(name: str, value, verdict: str = "bad"):
    def mutate(a):
        a[name] = value(a) if callable(value) else value
        return verdict
    return mutate


def _not_contiguous(name: str):
    """The same values, not contiguous: refused by the module (a tensor with one element or none is
    contiguous in any layout), made contiguous by the operators."""
    def mutate(a):
        a[name] = _strided(a[name])
        return "fine" if a[name].is_contiguous() else "bad"
    return mutate


def _disorder(a):
    """Each row's intervals shuffled, some moved onto their neighbours (overlapping, empty ones in the
    middle): outside the kernel's contract, so no result is expected, but no crash either."""
    gen = torch.Generator().manual_seed(a["starts"].numel())
    order = torch.rand(a["starts"].shape, generator=gen).argsort(-1)
    shift = torch.randint(-3, 4, a["starts"].shape, generator=gen)
    lk = a["k"].shape[2]
    a["starts"] = (a["starts"].gather(-1, order) + shift).clamp(0, lk)
    a["ends"] = torch.maximum(a["ends"].gather(-1, order), a["starts"])
    return "any"


def _relayout(name: str, make):
    """A view with the same values and another layout: refused by the module where it reads the
    layout (a tensor with elements), copied into place by the operators."""
    def mutate(a):
        made = make(a[name])
        if made is None:
            return None
        a[name] = made
        return "layout"
    return mutate


def _diagonals(a: dict) -> int:
    """Lq + Lk - 1: the bias's length."""
    return a["q"].shape[2] + a["k"].shape[2] - 1


def _rows_overlap(t: torch.Tensor) -> torch.Tensor | None:
    return t[..., :1, :].expand(t.shape) if t.shape[-2] > 1 and t.shape[-1] > 0 and t.numel() else None


#: (what it does, which calls it applies to: "all", "module", "backward" or one call, the argument
#: the error must name, the change).
#: The change returns "bad", "layout", or None where it does not apply to the case.
MUTATIONS = [
    ("nothing", "all", "", lambda a: "fine"),
    ("q's batch one larger", "all", "k", _grow("q", 0, 1)),
    ("k's batch one larger", "all", "k", _grow("k", 0, 1)),
    ("k's batch one smaller", "all", "k", _grow("k", 0, -1)),
    ("v's batch one larger", "all", "v", _grow("v", 0, 1)),
    ("k's heads not dividing q's", "all", "heads", lambda a: _put("k", _resized(a["k"], 1, a["q"].shape[1]))(a)),
    ("v's heads not k's", "all", "v", _grow("v", 1, 1)),
    ("k's head size not q's", "all", "k", _grow("k", 3, 1)),
    ("v shorter than k", "all", "v", _grow("v", 2, -1)),
    ("v longer than k", "all", "v", _grow("v", 2, 1)),
    ("k in another dtype", "all", "k", lambda a: _put("k", _other_dtype(a["k"]))(a)),
    ("v in another dtype", "all", "v", lambda a: _put("v", _other_dtype(a["v"]))(a)),
    ("q in float16", "all", "q", lambda a: _put("q", a["q"].half())(a)),
    ("q in int32", "all", "q", lambda a: _put("q", a["q"].int())(a)),
    ("q 3-D", "all", "q", lambda a: _put("q", a["q"][0])(a)),
    ("k 5-D", "all", "k", lambda a: _put("k", a["k"][None])(a)),
    ("starts and ends for a wrong P", "all", "starts", lambda a: _grow("starts", 0, a["q"].shape[0] * a["q"].shape[1]
                                                                    + 1 - a["starts"].shape[0], also="ends")(a)),
    ("starts and ends one row too many", "all", "starts", _grow("starts", 1, 1, also="ends")),
    ("starts and ends with no interval", "all", "starts", lambda a: _grow("starts", 2, -a["starts"].shape[2],
                                                                          also="ends")(a)),
    ("ends of another shape", "all", "ends", _grow("ends", 2, 1)),
    ("starts in int32", "all", "starts", lambda a: _put("starts", a["starts"].int())(a)),
    ("starts not contiguous", "module", "starts", _not_contiguous("starts")),
    ("a negative start", "all", "intervals", _set_first("starts", lambda a: -1)),
    ("an end past the keys", "all", "intervals", _set_first("ends", lambda a: a["k"].shape[2] + 1)),
    ("a start after its end", "all", "intervals", _set_first("starts", lambda a: int(a["ends"].view(-1)[0]) + 1)),
    ("intervals out of order and overlapping", "all", "", _disorder),
    ("bias for one head too many", "all", "bias",
     lambda a: _put("bias", torch.zeros(a["q"].shape[1] + 1, max(0, _diagonals(a)), dtype=a["q"].dtype))(a)),
    ("bias one diagonal too long", "all", "bias",
     lambda a: _put("bias", torch.zeros(1, _diagonals(a) + 1, dtype=a["q"].dtype))(a)),
    ("bias in another dtype", "all", "bias",
     lambda a: _put("bias", _other_dtype(a["bias"]))(a)),
    ("bias 1-D", "all", "bias", lambda a: _put("bias", torch.zeros(3, dtype=a["q"].dtype))(a)),
    ("bias [1, 0] for none", "all", "bias",  # (a real bias where there is no diagonal: Lq + Lk = 1)
     lambda a: _put("bias", torch.zeros(1, 0, dtype=a["q"].dtype), "fine" if _diagonals(a) == 0 else "bad")(a)),
    ("bias not contiguous", "module", "bias", _not_contiguous("bias")),
    ("scale NaN", "all", "scale", _put("scale", float("nan"))),
    ("scale infinite", "all", "scale", _put("scale", float("-inf"))),
    ("scale past float32", "all", "scale", lambda a: _put("scale", 1e39, "bad" if a["q"].dtype != F64 else None)(a)),
    ("softcap negative", "all", "softcap", _put("softcap", -1.0)),
    ("softcap NaN", "all", "softcap", _put("softcap", float("nan"))),
    ("softcap infinite", "all", "softcap", _put("softcap", float("inf"))),
    ("q_rows 0", "module.forward", "q_rows", _put("q_rows", 0)),
    ("kv_chunk negative", "module.forward", "kv_chunk", _put("kv_chunk", -3)),
    ("kv_rows 0", "module.backward", "kv_rows", _put("kv_rows", 0)),
    ("q_chunk past the most", "module.backward", "q_chunk", _put("q_chunk", MAX_BLOCK + 1)),
    ("q strided along E", "all", "q", _relayout("q", _strided)),
    ("k strided along E", "all", "k", _relayout("k", _strided)),
    ("v's rows overlapping", "all", "v", _relayout("v", _rows_overlap)),
    ("q on the meta device", "module", "q", lambda a: _put("q", a["q"].to("meta"))(a)),
    ("k sparse", "module", "k", lambda a: _put("k", a["k"].to_sparse())(a)),
    ("dout's batch one larger", "backward", "dout", _grow("dout", 0, 1)),
    ("dout's heads one fewer", "backward", "dout", _grow("dout", 1, -1)),
    ("dout's rows one larger", "backward", "dout", _grow("dout", 2, 1)),
    ("dout's rows one fewer", "backward", "dout", _grow("dout", 2, -1)),
    ("dout's Ev one larger", "backward", "dout", _grow("dout", 3, 1)),
    ("dout in another dtype", "backward", "dout", lambda a: _put("dout", _other_dtype(a["dout"]))(a)),
    ("out's rows one fewer", "backward", "out", _grow("out", 2, -1)),
    ("out's Ev one larger", "backward", "out", _grow("out", 3, 1)),
    ("stats one row short", "backward", "stats", _grow("stats", 3, -1)),
    ("stats one batch element larger", "backward", "stats", _grow("stats", 1, 1)),
    ("stats with one statistic", "backward", "stats", _grow("stats", 0, -1)),
    ("stats in another dtype", "backward", "stats", lambda a: _put("stats", _other_dtype(a["stats"]))(a)),
    ("stats not contiguous", "module.backward", "stats", _not_contiguous("stats")),
    ("dout strided along Ev", "backward", "dout", _relayout("dout", _strided)),
    ("out strided along Ev", "backward", "out", _relayout("out", _strided)),
]


def _expected(verdict: str, where: str, call: str, a: dict) -> str | None:
    """"fine", "bad" or "any" for this call, None where the mutation does not apply to it."""
    if where != "all" and not (call.startswith(where) or call.endswith(where)):
        return None
    if verdict == "layout":  # the module reads the layout only of a call with something to compute
        empty = any(a[n].numel() == 0 for n in ("q", "k", "v"))
        return "bad" if call.startswith("module") and not empty else "fine"
    return verdict


def _issue_cases(mod) -> list[tuple[str, str, object, str]]:
    """The calls of issue 29 that crashed or read out of bounds: (what, call, thunk, expected message)."""
    z = torch.zeros
    one = z(1, 64, 1, dtype=torch.long), torch.full((1, 64, 1), 64)
    none = z(0, 0)

    def backward(q, k, v, dout=None, stats=None, out=None):
        dout = z(q.shape[:3] + (v.shape[3],)) if dout is None else dout
        out = z(dout.shape) if out is None else out
        stats = z(2, *q.shape[:3]) if stats is None else stats
        return lambda: torch.ops.attnkit.band_backward(dout, q, k, v, out, stats, *one, none, 0.25, 0.0, False,
                                                       False)

    q = z(4, 2, 64, 16)
    return [
        ("forward: q of batch 20000, k = v of batch 1", "band_forward",
         lambda: torch.ops.attnkit.band_forward(z(20000, 1, 64, 16), z(1, 1, 64, 16), z(1, 1, 64, 16), *one, none,
                                                0.25, 0.0), "k must be"),
        ("backward: q of batch 64, k = v of batch 1", "band_backward", backward(z(64, 1, 64, 16), z(1, 1, 64, 16),
                                                                               z(1, 1, 64, 16)), "k must be"),
        ("backward: k, v one batch element short", "band_backward", backward(q, z(3, 2, 64, 16), z(3, 2, 64, 16)),
         "k must be"),
        ("k's head size not q's", "band_backward", backward(q, z(4, 2, 64, 8), z(4, 2, 64, 16)), "k must be"),
        ("v shorter than k", "band_backward", backward(q, z(4, 2, 64, 16), z(4, 2, 63, 16)), "v must be"),
        ("fewer v heads than k heads", "band_backward", backward(q, z(4, 2, 64, 16), z(4, 1, 64, 16)), "v must be"),
        ("stats smaller than q", "band_backward", backward(q, q, q, stats=z(2, 4, 2, 32)), "stats must be"),
        ("dout smaller than q", "band_backward", backward(q, q, q, dout=z(4, 2, 32, 16)), "dout must be"),
        ("dout larger than q", "band_backward", backward(q, q, q, dout=z(8, 2, 64, 16)), "dout must be"),
        ("the module's forward with q_rows=0", "forward",
         lambda: mod.forward(q[:1, :1], q[:1, :1], q[:1, :1], *one, none, 0.25, 0.0, 0, 1024), "q_rows must be"),
    ]


def _decode_cases(mod) -> list[tuple[str, object, str]]:
    """The decode entry point with arguments that do not fit: (what, thunk, expected message). Each, read as if it
    fit, would read or write out of bounds (``tests/backends/test_decode.py`` has the rest)."""
    z = torch.zeros
    q, k, none = z(2, 4, 1, 16), z(2, 2, 20, 16), z(0, 0, 0, 0, dtype=torch.bool)
    lo, hi = z(2, 1, dtype=torch.long), torch.full((2, 1), 20)
    return [
        ("decode: k of batch 1", lambda: mod.decode(q, k[:1], k[:1], none, lo, hi, 1.0, 0.0), "k must be"),
        ("decode: v shorter than k", lambda: mod.decode(q, k, k[:, :, :10], none, lo, hi, 1.0, 0.0), "v must be"),
        ("decode: hi past Lk", lambda: mod.decode(q, k, k, none, lo, hi + 1, 1.0, 0.0), "key ranges"),
        ("decode: mask one key short", lambda: mod.decode(q, k, k, z(2, 1, 1, 19, dtype=torch.bool), lo, hi, 1.0, 0.0),
         "mask must be"),
        ("decode: mask of 3 batch elements", lambda: mod.decode(q, k, k, z(3, 1, 1, 20, dtype=torch.bool), lo, hi,
                                                                1.0, 0.0), "mask must be"),
        ("decode: lo of 3 rows", lambda: mod.decode(q, k, k, none, z(3, 1, dtype=torch.long), hi, 1.0, 0.0),
         "lo must be"),
        ("decode: 9 queries", lambda: mod.decode(z(2, 4, 9, 16), k, k, none, z(2, 9, dtype=torch.long),
                                                 torch.full((2, 9), 20), 1.0, 0.0), "queries"),
        ("decode: k's columns strided", lambda: mod.decode(q, z(2, 2, 20, 32)[..., ::2], k, none, lo, hi, 1.0, 0.0),
         "unit stride"),
    ]


def _decode_step_cases(rng: random.Random, cases: int):
    """``(label, q, k, v, scale, legal)``: the decode lane's native call on shapes drawn one dimension at a time,
    each of q's, k's and v's sizes sometimes off by one from the others' (batch, heads, length, head size, a
    second query), and a scale sometimes past float32. Legal ones must answer the formula; the rest None (never
    an error, never a read past what was given)."""
    for n in range(cases):
        b, hkv, g, lk, e, ev = (rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 40),
                                rng.choice([1, 8, 16, 24]), rng.choice([1, 8, 16]))
        off = lambda x: x + rng.choice([-1, 1]) if rng.random() < 0.12 else x  # noqa: E731
        q = torch.randn(off(b), off(hkv * g), 1 if rng.random() < 0.9 else 2, off(e))
        k = torch.randn(off(b), off(hkv), off(lk), off(e))
        v = torch.randn(off(b), off(hkv), off(lk), ev)
        scale = rng.choice([float("nan"), 0.5, 2.0, float("inf"), 1e39])
        B, H, Lq, E = q.shape
        legal = (Lq == 1 and k.shape[0] == B == v.shape[0] and k.shape[3] == E and v.shape[1] == k.shape[1] > 0
                 and v.shape[2] == k.shape[2] > 0 and H % k.shape[1] == 0 and (math.isnan(scale) or abs(scale) < 1e38))
        yield (f"decode_step case {n}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, scale {scale}",
               q, k, v, scale, legal)


def _child(seed: int, cases: int, log: str) -> None:
    """Runs the issue's cases and the fuzz, writing each call to ``log`` before it is made; the last
    line is a JSON report: the exports and operators found, and every outcome not the expected one."""
    from attnkit.backends import _band

    log = open(log, "w", buffering=1)  # noqa: SIM115 - open until the process ends, line by line

    torch.manual_seed(seed)
    rng = random.Random(seed)
    mod = _band._module()
    report = {"exports": sorted(n for n in dir(mod) if not n.startswith("_")),
              "operators": sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("attnkit::band")),
              "issue": [], "wrong": [], "refused": 0, "computed": 0}

    def attempt(label, thunk):
        print(label, file=log, flush=True)
        try:
            return thunk(), None
        except Exception as e:  # noqa: BLE001 - every outcome is reported
            return None, f"{type(e).__name__}: {e}"

    for what, call, thunk, message in _issue_cases(mod):
        _, error = attempt(f"issue: {what}", thunk)
        if error is None or not error.startswith("RuntimeError: band kernel: ") or message not in error:
            report["issue"].append(f"{what} ({call}): expected a RuntimeError with {message!r}, got {error}")
    for label, thunk in (("has_blas()", mod.has_blas), ("has_blas(1)", lambda: mod.has_blas(1)),
                         ("has_bf16_gemm()", mod.has_bf16_gemm), ("has_bf16_gemm(1)", lambda: mod.has_bf16_gemm(1)),
                         ("bf16_products()", mod.bf16_products), ("bf16_products(1)", lambda: mod.bf16_products(1)),
                         ("set_bf16_products()", mod.set_bf16_products),
                         ("set_bf16_products('x')", lambda: mod.set_bf16_products("x")),
                         ("has_f16_gemm()", mod.has_f16_gemm), ("has_f16_gemm(1)", lambda: mod.has_f16_gemm(1)),
                         ("f16_products()", mod.f16_products), ("f16_products(1)", lambda: mod.f16_products(1)),
                         ("set_f16_products()", mod.set_f16_products),
                         ("set_f16_products('x')", lambda: mod.set_f16_products("x")),
                         ("bf16_gemm()", mod.bf16_gemm), ("bf16_gemm(1)", lambda: mod.bf16_gemm(1)),
                         ("has_f32_brgemm(1)", lambda: mod.has_f32_brgemm(1)),
                         ("f32_brgemm(1)", lambda: mod.f32_brgemm(1)), ("set_f32_brgemm()", mod.set_f32_brgemm),
                         ("set_f32_brgemm('x')", lambda: mod.set_f32_brgemm("x")),
                         ("f32_product_times()", mod.f32_product_times),
                         ("f32_product_times('x')", lambda: mod.f32_product_times("x"))):
        attempt(label, thunk)
    for reps in (0, -1, 10**12):  # a count that would hang or time nothing is refused by name
        _, error = attempt(f"f32_product_times({reps})", lambda reps=reps: mod.f32_product_times(reps))
        if error is None or "band kernel: reps must be between 1 and 100000" not in error:
            report["issue"].append(f"f32_product_times({reps}): expected a RuntimeError naming reps, got {error}")
    if mod.has_f32_brgemm():  # what the process had (the load's timed choice) stays
        attempt("set_f32_brgemm(on)", lambda: mod.set_f32_brgemm(mod.f32_brgemm()))
    bf, c = torch.ones(8, 4, dtype=torch.bfloat16), torch.zeros(8, 8)
    products = mod.bf16_products()
    if mod.has_bf16_gemm():  # on, so that the checks of the operands are what refuses
        mod.set_bf16_products(True)
    for label, thunk, message in (
            ("half_product()", mod.half_product, "TypeError: half_product(): incompatible function arguments"),
            ("half_product: op(a) [8, 4], op(b) [8, 4]", lambda: mod.half_product(bf, bf, c, False, False, 1.0, 0.0),
             "op(a) is [8, 4] but op(b) is [8, 4]"),
            ("half_product: a 1-D", lambda: mod.half_product(bf[0], bf, c, False, True, 1.0, 0.0), "2-D dense CPU"),
            ("half_product: c [4, 4]", lambda: mod.half_product(bf, bf, c[:4, :4], False, True, 1.0, 0.0),
             "c must be float32 [8, 8]"),
            ("half_product: a float32", lambda: mod.half_product(bf.float(), bf, c, False, True, 1.0, 0.0),
             "must both be bfloat16 or float16"),
            ("half_product: b's rows overlap", lambda: mod.half_product(bf, bf.as_strided((8, 4), (1, 1)), c, False,
                                                                          True, 1.0, 0.0), "must not overlap"),
            ("half_product: a's columns strided", lambda: mod.half_product(bf.repeat(1, 2)[:, ::2], bf, c, False, True,
                                                                            1.0, 0.0), "must have unit stride")):
        if not mod.has_bf16_gemm():
            break
        _, error = attempt(label, thunk)
        if error is None or message not in error:
            report["issue"].append(f"{label}: expected an error with {message!r}, got {error}")
    if mod.has_bf16_gemm():
        mod.set_bf16_products(products)
    if mod.has_bf16_gemm():  # what the process had (the self-check's choice) stays
        attempt("set_bf16_products(on)", lambda: mod.set_bf16_products(mod.bf16_products()))
    if mod.has_f16_gemm():
        attempt("set_f16_products(on)", lambda: mod.set_f16_products(mod.f16_products()))
    for label, thunk, message in _decode_cases(mod):
        _, error = attempt(label, thunk)
        if error is None or not error.startswith("RuntimeError: band kernel: ") or message not in error:
            report["issue"].append(f"{label}: expected a RuntimeError with {message!r}, got {error}")
    _, error = attempt("decode_step()", mod.decode_step)
    if error is None or "incompatible function arguments" not in error:
        report["issue"].append(f"decode_step(): expected pybind's TypeError, got {error}")
    for label, q, k, v, scale, legal in _decode_step_cases(rng, cases):
        got, error = attempt(label, lambda q=q, k=k, v=v, scale=scale: mod.decode_step(q, k, v, scale))
        if error is not None or (got is None) == legal:
            report["wrong"].append(f"{label}: expected {'a result' if legal else 'None'}, got {error or got}")
            continue
        if legal:
            report["computed"] += 1
            g = q.shape[1] // k.shape[1]
            s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * (
                (q.shape[3] ** -0.5 if q.shape[3] else 1.0) if math.isnan(scale) else scale)
            want = torch.softmax(s, -1) @ v.double().repeat_interleave(g, 1)
            if got.shape != want.shape or not torch.allclose(got.double(), want, atol=2e-5, rtol=1e-5):
                report["wrong"].append(f"{label}: differs from the formula")
        else:
            report["refused"] += 1
    calls = _calls(mod)
    forward = calls["torch.ops.attnkit.band_forward"]
    for n in range(cases):
        what, where, name, mutate = MUTATIONS[n % len(MUTATIONS)]
        a = _case(rng)
        a["out"], a["stats"] = forward[0](*(a[x] for x in forward[1]))
        verdict = mutate(a)
        if verdict is None:
            continue
        if verdict in ("fine", "layout"):  # legal inputs: the formula's results (out and stats too, if changed)
            if name in forward[1]:
                a["out"], a["stats"] = forward[0](*(a[x] for x in forward[1]))
            want = _formula(a)
        for call, (fn, names) in calls.items():
            expect = _expected(verdict, where, call, a)
            if expect is None:
                continue
            label = f"case {n} [{what}; sizes (B, H, Hkv, Lq, Lk, E, Ev, P) = {a['sizes']}]: {call}"
            got, error = attempt(label, lambda fn=fn, args=[a[x] for x in names]: tuple(fn(*args)))
            if expect == "any":
                continue
            if expect == "bad":
                report["refused"] += 1
                if error is None or not error.startswith("RuntimeError: band kernel: ") or name not in error:
                    report["wrong"].append(f"{label}: expected a RuntimeError naming {name!r}, got "
                                           f"{error or 'a result'}")
                continue
            report["computed"] += 1
            if error is not None:
                report["wrong"].append(f"{label}: expected a result, got {error}")
                continue
            results = got[:1] if call.endswith("forward") else got[:3] + (got[3:] if a["bias_grad"] else ())
            wanted = want[:1] if call.endswith("forward") else want[1:4] + (want[4:] if a["bias_grad"] else ())
            tol = {"atol": 1e-10, "rtol": 1e-9} if a["q"].dtype == F64 else {"atol": 2e-5, "rtol": 1e-5}
            for x, (r, w) in enumerate(zip(results, wanted, strict=True)):
                if r.shape != w.shape or not torch.allclose(r.to(F64), w, **tol):
                    err = (r.to(F64) - w).abs().max().item() if r.shape == w.shape and r.numel() else r.shape
                    report["wrong"].append(f"{label}: result {x} differs from the formula ({err})")
    print(json.dumps(report), file=log, flush=True)


# ---- the tests ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_report(tmp_path_factory) -> dict:
    from attnkit.backends import _band

    if not _band.available():  # (this process builds the kernel, so the child finds it cached)
        pytest.skip(f"no compiled kernel: {_band.unavailable_reason()}")
    folder = tmp_path_factory.mktemp("fuzz")
    log, out = folder / "calls.log", folder / "stdout.txt"
    hung = False
    with open(out, "wb") as stdout:
        argv = [sys.executable, "-m", "tests.backends.test_native_boundary", str(SEED), str(CASES), str(log)]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=stdout, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            hung = True
            proc.kill()
            _, err = proc.communicate()
    lines = log.read_text().splitlines() if log.exists() else []
    last = lines[-1] if lines else "(before the first call)"
    if hung:
        pytest.fail(f"the child hung (killed after {TIMEOUT_S} s) during: {last}")
    if proc.returncode < 0:
        pytest.fail(f"the child died of {signal.Signals(-proc.returncode).name} during: {last}\n{err[-2000:]}")
    assert proc.returncode == 0, f"the child exited with {proc.returncode} during: {last}\n{err[-3000:]}"
    with open(out, "rb") as f:
        printed = f.read(1 << 20).decode(errors="replace")
    assert "ERROR" not in printed, f"the BLAS complained of its arguments:\n{printed[:2000]}"
    return json.loads(lines[-1])


def test_the_fuzz_calls_every_export_and_every_operator(fuzz_report):
    assert tuple(fuzz_report["exports"]) == EXPORTS
    assert tuple(fuzz_report["operators"]) == OPERATORS


def test_the_calls_that_crashed_in_the_issue_are_refused_by_name(fuzz_report):
    assert fuzz_report["issue"] == []


def test_mismatched_arguments_are_refused_by_name_and_the_rest_match_the_formula(fuzz_report):
    assert fuzz_report["wrong"] == [], "\n".join(fuzz_report["wrong"][:40])
    assert fuzz_report["refused"] >= 2 * CASES and fuzz_report["computed"] >= CASES // 5  # (the fuzz has teeth)


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
