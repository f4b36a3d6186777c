"""Half precision through the banded kernel: bfloat16 and float16 go to the kernel as they are. Without products
of their own type they are computed in float32 (queries and outputs converted a row at a time, keys and values
once per call), so such a forward is exactly the float32 kernel on the same values rounded once. With them
(oneDNN's brgemm for bfloat16 where it runs, else MKL's) every product takes operands of that type and the
weights (and the backward's dS) are rounded to it for the products that take them. Either way the errors of
the output and the gradients against the float64 oracle are no larger than SDPA's own half-precision path's
on the same inputs, and gradients come back in the inputs' dtype."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import attnkit
from attnkit import masks, scores
from attnkit.backends import _band
from tests.support import oracle
from tests.support.backends import half_products
from tests.support.tolerances import close

pytestmark = pytest.mark.skipif(not _band.available(), reason="the banded kernel is not built here")

HALF = [torch.bfloat16, torch.float16]
#: name -> (shape (B, H, Hkv, Lq, Lk), attention kwargs): every form of rows the kernel walks.
CASES = {
    "window": ((2, 4, 4, 150, 150), {"window": (20, 5)}),
    "causal, GQA, Lq < Lk": ((1, 4, 2, 70, 150), {"is_causal": True}),
    "documents": ((2, 2, 2, 96, 96), {"mask_mod": masks.document_mod(torch.tensor([0] * 30 + [1] * 50 + [2] * 16))}),
    "global tokens (wide rows)": ((1, 2, 2, 200, 200), {"mask_mod": masks.global_tokens_mod(4, [0, 99])}),
    "dilated (folded)": ((1, 2, 2, 160, 160), {"mask_mod": masks.dilated_window_mod(12, 4)}),
    "ALiBi": ((1, 4, 4, 100, 100), {"is_causal": True, "score_mod": scores.alibi(scores.alibi_slopes(4))}),
    "capped": ((1, 2, 2, 100, 100), {"window": (30, 30), "score_mod": scores.softcap(5.0)}),
    # every run of rows that sees a key block starts on an even row and spans a multiple of 16 rows, and two
    # query heads share each key head: the bfloat16 products under brgemm read their packed copies of v
    # (forward) and of q^T and dout^T (backward, dK and dV summed transposed over both heads)
    "causal, GQA, rows in runs of 16": ((1, 4, 2, 256, 256), {"is_causal": True}),
}


@functools.cache  # the oracle's grid calls the mask_mod cell by cell: seconds for the larger cases, once each
def _allowed(case: str) -> torch.Tensor:
    """The oracle's bool ``[B, H, Lq, Lk]`` for ``CASES[case]``."""
    (b, h, _, lq, lk), kw = CASES[case]
    return oracle.allowed_grid(b, h, lq, lk, is_causal=kw.get("is_causal", False), window=kw.get("window"),
                               mask_mod=kw.get("mask_mod"))


def _inputs(shape, dtype, seed=0, strided=False):
    b, h, hkv, lq, lk = shape
    g = torch.Generator().manual_seed(seed)
    if strided:  # [B, L, H, E] memory seen as [B, H, L, E]: rows H * E apart, as projections give them
        q = torch.randn(b, lq, h, 48, generator=g).to(dtype).transpose(1, 2)
        k, v = (torch.randn(b, lk, hkv, 48, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
        return q, k, v
    return tuple(torch.randn(b, n, length, 48, generator=g).to(dtype) for n, length in ((h, lq), (hkv, lk), (hkv, lk)))


@pytest.mark.parametrize("lq, heads, lk", [(1, 2, 300), (64, 2, 300), (128, 2, 300), (1, 4, 300), (130, 2, 300),
                                           (1, 8, 2000)],
                         ids=["decode", "one block", "two blocks", "decode, GQA", "three blocks",
                              "decode, 4 heads per key head, a window over a long cache"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_short_half_query_reads_keys_a_chunk_at_a_time_with_the_same_result(dtype, lq, heads, lk):
    """Where few blocks of rows read each key (a decode step, a short chunk), or the keys they read are few
    beside the cache (a window over a long one, even with several query heads per key head), the forward
    widens keys and values a chunk at a time as it reads them, not as a whole copy first; the result is the
    same either way: the float32 kernel's on the same values, rounded once."""
    q, k, v = _inputs((1, heads, 2, lq, lk), dtype, seed=3, strided=True)
    kw = {"is_causal": True} if lq > 1 else {"window": (100, 0)}
    with torch.no_grad(), half_products(dtype, False):
        got = attnkit.attention(q, k, v, backend="band", **kw)
        want = attnkit.attention(q.float(), k.float(), v.float(), backend="band", **kw).to(dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("scale", "d"), [(1 / 8, 64), (1 / 4, 16), (2.0, 64)], ids=["1/8", "1/4", "2"])
def test_a_power_of_two_scale_taken_into_the_packed_keys_is_exact(scale, d):
    """Under bfloat16 products, where the keys are packed once for the call, a score scale that is a power of
    two is taken into them as they are packed (each exponent moved, exactly) and the queries are read in
    place: the scores are then those of queries scaled beforehand with a scale of 1, so the kernel's outputs
    and statistics are equal bit for bit. A scale taken in twice, or not at all, changes every output. Some
    keys are zero, some subnormal, some subnormal once scaled: those go through float one by one and may
    lose bits there (as queries scaled beforehand would), far too small to change a score here."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 512, d, generator=g).to(torch.bfloat16) for _ in range(3))
    k[0, 0, 7] = 0
    k[0, 0, 9, : d // 2] = 3e-39  # subnormal in bfloat16
    k[0, 1, 11, : d // 2] = 2e-38  # subnormal once scaled by 1/8 or 1/4
    scaled = (q.float() * scale).to(torch.bfloat16)
    assert torch.equal(scaled.float(), q.float() * scale)  # the premise: q * scale exact in bfloat16
    starts, ends = _band._window(512, 512, 100, 100)[2:]
    with torch.no_grad(), half_products(torch.bfloat16, True):
        got = _band._run(q, k, v, starts, ends, None, scale)
        want = _band._run(scaled, k, v, starts, ends, None, 1.0)
        halved = _band._run(q, k, v, starts, ends, None, scale / 2)[0]
    assert not torch.isnan(got[1]).any()  # the kernel's own result, not a non-finite one's
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not torch.equal(got[0], halved)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_rows_whose_maximum_the_row_before_finds_give_what_they_give_alone(dtype):
    """Under half products, with scores as the product leaves them (no bias, no cap), a row of one range finds
    the next row's maximum in the loop of its own exponentials, and that row skips its own pass for it. A bias
    of zeros gives the same scores but takes every row through its own pass: outputs and statistics are equal
    bit for bit, also beside a NaN query (its row's statistics NaN), rows of two ranges and an empty row."""
    n = 256
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g).to(dtype) for _ in range(3))
    q[0, 1, 70, 5] = float("nan")
    none = torch.full((1, n, 1), n)  # a second, empty range per row
    starts, ends = (torch.cat([x, none], -1) for x in _band._window(n, n, 40, 40)[2:])
    starts[0, 50:60], ends[0, 50:60] = torch.tensor([0, 10]), torch.tensor([4, 101])  # two ranges
    starts[0, 100], ends[0, 100] = n, n  # nothing to see
    with torch.no_grad(), half_products(dtype, True):
        piped = _band._run(q, k, v, starts, ends, None, 1 / 8)
        alone = _band._run(q, k, v, starts, ends, torch.zeros(2, 2 * n - 1), 1 / 8)
    assert torch.isnan(piped[1][:, 0, 1, 70]).all() and not torch.isnan(piped[1][:, 0, 0]).any()
    assert torch.equal(piped[0].nan_to_num(), alone[0].nan_to_num())
    assert torch.equal(piped[1].nan_to_num(), alone[1].nan_to_num())


@pytest.mark.parametrize("bias", [False, True], ids=["scale", "scale and bias"])
def test_equal_huge_bfloat16_scores_under_a_scale_that_rounds_weigh_every_key_alike(bias):
    """Every score 1.5e9 (ulps of 128) under bfloat16 products, times a scale that is not a power of two (each
    score rounded once), with or without a bias: the weights are exp(t - m) of the stored, rounded t and of
    their maximum, so every weight is 1 and each row is its keys' mean value. A score recomputed unrounded
    (s * scale - m in one fused multiply-add) is a rounding off m, up to 64 here, and exp of that 0 or inf."""
    n = 128
    q = torch.full((1, 2, n, 64), 6144.0, dtype=torch.bfloat16)  # 6144^2 * 64 * 0.6 = 1.45e9
    k = q.clone()
    v = torch.randn(1, 2, n, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    starts, ends = _band._window(n, n, 40, 40)[2:]
    table = torch.zeros(2, 2 * n - 1) if bias else None  # a bias of zeros: the biased path, the same scores
    with torch.no_grad(), half_products(torch.bfloat16, True):
        out, _ = _band._run(q, k, v, starts, ends, table, 0.6)
    want = torch.stack([v[:, :, a:e].double().mean(2) for a, e in zip(starts.flatten(), ends.flatten(),
                                                                        strict=True)], 2)
    close(out, want.to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_forward_without_its_products_is_the_float32_kernel_rounded_once(dtype, case, strided):
    shape, kw = CASES[case]
    q, k, v = _inputs(shape, dtype, strided=strided)
    with torch.no_grad(), half_products(dtype, False):
        got = attnkit.attention(q, k, v, backend="band", **kw)
        want = attnkit.attention(q.float(), k.float(), v.float(), backend="band", **kw).to(dtype)
    assert got.dtype == dtype
    assert torch.equal(got, want)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_forward_with_its_products_is_the_formula_within_the_rounding_of_weights_and_output(dtype, case,
                                                                                                 strided):
    """Every form of rows the kernel walks, with products of the inputs' half type: against the float64 oracle
    on the same (rounded) values, within the table's row for the type; and not the float32 path (the switch
    works)."""
    shape, kw = CASES[case]
    b, h, hkv, lq, lk = shape
    q, k, v = _inputs(shape, dtype, strided=strided)
    with torch.no_grad(), half_products(dtype, True):
        got = attnkit.attention(q, k, v, backend="band", **kw)
    with torch.no_grad(), half_products(dtype, False):
        widened = attnkit.attention(q, k, v, backend="band", **kw)
    ref = attnkit.attention(*(t.double() for t in (q, k, v)), backend="reference", **kw)
    assert got.dtype == dtype
    close(got, ref, dtype)
    assert not torch.equal(got, widened)  # the weights rounded to the half type move some outputs by an ulp


@pytest.mark.parametrize("case", ["window", "causal, GQA, Lq < Lk", "documents"])
@pytest.mark.parametrize(("dtype", "products"), [(torch.bfloat16, True), (torch.bfloat16, False),
                                                 (torch.float16, True), (torch.float16, False)],
                         ids=["bf16 products", "bf16 in float32", "fp16 products", "fp16 in float32"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_half_error_is_within_sdpas_own_half_path(dtype, case, products, seed):
    """Widened to float32, the output is rounded once, as SDPA's: its error at most SDPA's (measured 0.80-1.00
    of it). With products of the half type the weights are rounded to it before ``p v`` too (FlashAttention's
    choice): measured up to 1.23x SDPA's error in bfloat16 and 1.16x in float16 (10 seeds of these three
    cases), held to 1.5x."""
    shape, kw = CASES[case]
    b, h, hkv, lq, lk = shape
    q, k, v = _inputs(shape, dtype, seed=seed)
    allowed = _allowed(case)
    want, _ = oracle.attention(q.double(), k.double(), v.double(), allowed=allowed)
    with half_products(dtype, products):
        ours = (attnkit.attention(q, k, v, backend="band", **kw).double() - want).abs().max()
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1),
                                          attn_mask=allowed)
    theirs = (sdpa.double() - want).abs().max()
    assert ours <= theirs * (1.5 if products else 1.05), (ours.item(), theirs.item())
    close(ours, torch.zeros(()), dtype)  # and within the table's row for the type


@pytest.mark.parametrize("case", ["window", "causal, GQA, Lq < Lk", "ALiBi"])
@pytest.mark.parametrize(("dtype", "products"), [(torch.bfloat16, True), (torch.bfloat16, False),
                                                 (torch.float16, True), (torch.float16, False)],
                         ids=["bf16 products", "bf16 in float32", "fp16 products", "fp16 in float32"])
def test_half_gradients_come_back_in_the_inputs_dtype_within_the_table(dtype, case, products):
    shape, kw = CASES[case]
    b, h, hkv, lq, lk = shape
    q, k, v = (t.requires_grad_() for t in _inputs(shape, dtype, seed=2))
    dout = torch.randn(b, h, lq, 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    with half_products(dtype, products):
        out = attnkit.attention(q, k, v, backend="band", **kw)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    # the formula in float64 on the same (rounded) inputs: the reference backend, which the grids hold to the oracle
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = attnkit.attention(q64, k64, v64, backend="reference", **kw)
    wants = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    for got, expected in zip(grads, wants, strict=True):
        assert got.dtype == dtype
        close(got, expected, dtype)


def assert_the_float32_kernels(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """``got`` (a half type) is the float32 kernel's ``want`` on the same values, rounded once, up to the order of
    float32 sums: equal where that order is the same, else within one unit in the last place of the half type
    and float32's order noise on the row's scale. The order differs (1) when dQ is added under locks by more
    than one thread, in the order they come, and (2) where MKL's float32 product picks its code by its operands'
    alignment and leading dimension, which differ between a tile widened into a buffer and the float32 tensor:
    on AVX-512 CPUs it does (a few elements of a gradient, by a unit or so), on AVX2 ones it did not."""
    if torch.equal(got, want.to(got.dtype)):
        return
    tiny = torch.finfo(got.dtype).tiny
    ulp = torch.finfo(got.dtype).eps * torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(tiny))))
    assert bool(((got.float() - want).abs() <= ulp + 1e-5 * want.abs().amax(-1, keepdim=True)).all()), name


#: The rows the backward walks in its own ways: key blocks with their runs of rows, lone rows gathered (a
#: global token's), wide keys apart, and under deterministic algorithms dQ from its own pass over query blocks.
GRAD_CASES = ["window", "causal, GQA, Lq < Lk", "documents", "global tokens (wide rows)"]


@pytest.mark.parametrize("deterministic", [False, True], ids=["dQ under locks", "dQ by query blocks"])
@pytest.mark.parametrize("case", GRAD_CASES)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_backward_without_its_products_is_the_float32_kernels_on_the_same_values(dtype, case, deterministic):
    """Without its products a half type's backward reads its inputs as they are stored, a tile at a time, and
    widens them in the kernel (no float32 copy of a whole tensor): every pass the case takes gives what the
    float32 kernel gives on the same values widened first, rounded once. Rows as projections lay them out."""
    shape, kw = CASES[case]
    b, h, _, lq, lk = shape
    q, k, v = _inputs(shape, dtype, seed=7, strided=True)
    plan = attnkit.mask_plan(kw.get("mask_mod"), q_len=lq, kv_len=lk, batch=b, heads=h,
                             is_causal=kw.get("is_causal", False), window=kw.get("window"))
    args = (plan.starts, plan.ends, torch.zeros(0, 0), 48 ** -0.5, 0.0)
    out, stats = torch.ops.attnkit.band_forward(q, k, v, *args)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(dtype)
    with half_products(dtype, False):
        got = torch.ops.attnkit.band_backward(dout, q, k, v, out, stats, *args, deterministic, False)
    want = torch.ops.attnkit.band_backward(*(t.float() for t in (dout, q, k, v, out)), stats, *args, deterministic,
                                           False)
    for name, a, c in zip("qkv", got[:3], want[:3], strict=True):
        assert a.dtype == dtype, name
        assert_the_float32_kernels(a, c, name)


@pytest.mark.parametrize("deterministic", [False, True], ids=["dQ under locks", "dQ by query blocks"])
@pytest.mark.parametrize("case", [*GRAD_CASES, "causal, GQA, rows in runs of 16"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_gradients_with_half_products_err_no_more_than_sdpas_half_backward(dtype, case, deterministic):
    """The backward's products take operands of the inputs' half type (P and dS rounded, as FlashAttention does):
    each gradient's error against the float64 formula on the same values is within twice SDPA's own backward's
    in that type, which computes in float32 and rounds once (measured up to 1.52x in bfloat16 and 1.46x in
    float16, 5 seeds of these cases both ways of dQ; often equal, the final rounding), and within the table's
    row for the type; and the path is not the widened one."""
    shape, kw = CASES[case]
    b, h, hkv, lq, lk = shape
    q, k, v = _inputs(shape, dtype, seed=7)
    dout = torch.randn(b, h, lq, 48, generator=torch.Generator().manual_seed(8)).to(dtype)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    wants = torch.autograd.grad(attnkit.attention(q64, k64, v64, backend="reference", **kw), (q64, k64, v64),
                                dout.double())

    def grads(fn, products=False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.use_deterministic_algorithms(deterministic)
        try:
            with half_products(dtype, products):
                return torch.autograd.grad(fn(*leaves), leaves, dout)
        finally:
            torch.use_deterministic_algorithms(False)

    ours = grads(lambda a, c, e: attnkit.attention(a, c, e, backend="band", **kw), products=True)
    widened = grads(lambda a, c, e: attnkit.attention(a, c, e, backend="band", **kw))
    allowed = _allowed(case)
    theirs = grads(lambda a, c, e: F.scaled_dot_product_attention(a, c.repeat_interleave(h // hkv, 1),
                                                                  e.repeat_interleave(h // hkv, 1), attn_mask=allowed))
    for name, got, sdpa, want in zip("qkv", ours, theirs, wants, strict=True):
        assert got.dtype == dtype
        err, sdpa_err = ((x.double() - want).abs().max().item() for x in (got, sdpa))
        assert err <= sdpa_err * 2, (name, err, sdpa_err)
        close(got, want, dtype)
    assert not all(torch.equal(a, c) for a, c in zip(ours, widened, strict=True))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_operator_takes_half_inputs_with_a_float32_bias_and_its_backward_with_or_without_their_products(dtype):
    q, k, v = _inputs((1, 2, 2, 20, 20), dtype)
    starts, ends = _band._window(20, 20, 3, 3)[2:]
    with pytest.raises(RuntimeError, match=r"bias .*float32 for half types"):
        torch.ops.attnkit.band_forward(q, k, v, starts, ends, torch.zeros(2, 39, dtype=dtype), 0.3, 0.0)
    out, stats = torch.ops.attnkit.band_forward(q, k, v, starts, ends, torch.zeros(2, 39), 0.3, 0.0)
    assert out.dtype == dtype and stats.dtype == torch.float32
    no_bias = torch.zeros(0, 0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with half_products(dtype, False):  # widened in the kernel: the float32 backward of the widened tensors, rounded
        grads = torch.ops.attnkit.band_backward(dout, q, k, v, out, stats, starts, ends, no_bias, 0.3, 0.0, False,
                                                False)
        wide = torch.ops.attnkit.band_backward(*(t.float() for t in (dout, q, k, v, out)), stats, starts, ends,
                                               no_bias, 0.3, 0.0, False, False)
    assert [g.dtype for g in grads[:3]] == [dtype] * 3
    for name, got, want in zip("qkv", grads[:3], wide[:3], strict=True):
        assert_the_float32_kernels(got, want, name)
    if _band._products_ok.get(dtype):
        with half_products(dtype, True):
            with pytest.raises(RuntimeError, match=r"stats must be a dense float32"):
                torch.ops.attnkit.band_backward(out, q, k, v, out, stats.to(dtype), starts, ends, no_bias, 0.3, 0.0,
                                                False, False)
            grads = torch.ops.attnkit.band_backward(out, q, k, v, out, stats, starts, ends, no_bias, 0.3, 0.0, False,
                                                    False)
        assert [g.dtype for g in grads[:3]] == [dtype] * 3


#: Per half type: the environment variable, the CPU check and the flags its default names.
SWITCHES = {torch.bfloat16: ("ATTNKIT_BF16_PRODUCTS", "has_bf16_products", "has_bf16_gemm", "AVX512-BF16 or AMX-BF16"),
            torch.float16: ("ATTNKIT_FP16_PRODUCTS", "has_fp16_products", "has_f16_gemm", "AVX512-FP16 or AMX-FP16")}


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_products_are_on_where_the_cpu_has_them_unless_asked_otherwise_and_the_switch_checks_its_arguments(
        dtype):
    from attnkit import _cpu

    variable, native, gemm, flags = SWITCHES[dtype]
    mod = _band._module()  # torch's x86 wheels link MKL, which has both products on every x86 CPU
    asked = os.environ.get(variable)
    want = getattr(mod, gemm)() and (asked == "1" or asked != "0" and getattr(_cpu, native)())
    assert _band.half_products(dtype) is want
    assert (_band.half_products_reason(dtype) is None) is want
    if getattr(mod, gemm)() and asked is None and not want:
        assert f"no {flags}" in _band.half_products_reason(dtype)
    with pytest.raises(TypeError, match="on must be a bool, got int"):
        _band.set_half_products(dtype, 1)
    with pytest.raises(TypeError, match=r"dtype must be torch.bfloat16 or torch.float16 .*got torch.float32"):
        _band.set_half_products(torch.float32, True)
    with half_products(dtype, False):
        assert not _band.half_products(dtype)
        assert f"set_half_products({_band.dtype_name(dtype)}, False)" in _band.half_products_reason(dtype)


@functools.cache
def _fresh_process_says(asked: str) -> dict[torch.dtype, str]:
    """What a fresh process prints for each half type (``half_products`` and its reason, one line per type) with
    every half type's variable set to ``asked``. Each type reads only its own variable, so one process (an
    import of torch and both self-checks) answers for both types."""
    names = [_band.dtype_name(dtype) for dtype in HALF]
    code = ("import torch; from attnkit.backends import _band; assert _band.available(), _band.unavailable_reason(); "
            + "; ".join(f"print(_band.half_products(torch.{n}), _band.half_products_reason(torch.{n}))" for n in names))
    env = {**os.environ, **{SWITCHES[dtype][0]: asked for dtype in HALF}, "ATTNKIT_BUILD": "0"}  # this build
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == len(HALF), done.stdout
    return dict(zip(HALF, lines, strict=True))


@pytest.mark.parametrize(("asked", "printed"), [("0", "False turned off by {}=0"), ("1", "True None")])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_environment_turns_half_products_off_or_on_whatever_the_cpu(dtype, asked, printed):
    variable = SWITCHES[dtype][0]
    if asked == "1" and not _band._products_ok.get(dtype):
        pytest.skip(f"no {dtype} products here: {_band.half_products_reason(dtype)}")
    assert _fresh_process_says(asked)[dtype] == printed.format(variable)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, *HALF], ids=str)
def test_auto_serves_plain_causal_calls_on_the_kernel(dtype):
    """The measured preference (attnkit bench core, attnkit bench dtypes): plain causal calls with more than one
    query go to the kernel ahead of SDPA in every dtype, with or without a gradient; one query (a decode step) goes
    to the decode kernel without a gradient (but in float64, which it does not take), a dense mask or dropout stay
    with SDPA, and so does no mask, but for bfloat16 where the kernel runs the CPU's
    own bfloat16 products (_band.native_bf16_products). The kernel's answer is the oracle's within the table, and a
    NaN query poisons its own row only."""
    q, k, v = _inputs((1, 4, 2, 90, 90), dtype, seed=4)
    with torch.no_grad():
        assert attnkit.which_backend(q, k, v, is_causal=True) == "band"
        assert attnkit.which_backend(q[..., :1, :], k, v, is_causal=True) == ("sdpa" if dtype == torch.float64
                                                                               else "decode")
        native = dtype == torch.bfloat16 and _band.native_bf16_products()
        assert attnkit.which_backend(q, k, v) == ("band" if native else "sdpa")
        assert attnkit.which_backend(q, k, v, is_causal=True, mask=torch.ones(90, 90, dtype=torch.bool)) == "sdpa"
        out = attnkit.attention(q, k, v, is_causal=True)
        bad = q.clone()
        bad[0, 1, 30, 5] = float("nan")
        poisoned = attnkit.attention(bad, k, v, is_causal=True)
    assert attnkit.which_backend(q.requires_grad_(), k, v, is_causal=True) == "band"
    assert attnkit.which_backend(q, k, v, is_causal=True, dropout_p=0.1) == "sdpa"
    ref = attnkit.attention(*(t.detach().double() for t in (q, k, v)), is_causal=True, backend="reference")
    close(out, ref, dtype)
    rows = poisoned.isnan().all(-1)
    assert rows[0, 1, 30] and rows.sum() == 1 and not (poisoned.isnan() & ~rows[..., None]).any()
    assert torch.equal(poisoned.masked_fill(rows[..., None], 0), out.masked_fill(rows[..., None], 0))


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_learned_alibi_slopes_and_a_relative_table_get_their_gradients_in_their_own_dtype(param_dtype):
    """bfloat16 inputs through the kernel with learned score_mod tensors (a model kept in float32, or cast to
    bfloat16 whole): the gradients reach the slopes and the table in the tensors' own dtype, and equal the
    float64 formula's within the bfloat16 row."""
    q, k, v = (t.requires_grad_() for t in _inputs((1, 4, 4, 60, 60), torch.bfloat16, seed=5))
    g = torch.Generator().manual_seed(6)
    slopes = scores.alibi_slopes(4).to(param_dtype).requires_grad_()
    table = (0.3 * torch.randn(4, 13, generator=g)).to(param_dtype).requires_grad_()
    dout = torch.randn(1, 4, 60, 48, generator=g).to(torch.bfloat16)

    def mod(s, t):
        return scores.compose(scores.alibi(s), scores.relative_position_bias(t, 6))

    with attnkit.backends.served() as ran:
        out = attnkit.attention(q, k, v, is_causal=True, score_mod=mod(slopes, table), backend="band")
    assert ran == ["band"]
    grads = torch.autograd.grad(out, (slopes, table), dout)
    s64, t64 = (p.detach().double().requires_grad_() for p in (slopes, table))
    want = attnkit.attention(*(t.detach().double() for t in (q, k, v)), is_causal=True, score_mod=mod(s64, t64),
                             backend="reference")
    wants = torch.autograd.grad(want, (s64, t64), dout.double())
    for got, expected in zip(grads, wants, strict=True):
        assert got.dtype == param_dtype
        close(got, expected, torch.bfloat16)


#: The product's operand layouts as the kernel's tiles give them: (rows m, columns n, depth k). n and k are packed
#: rounded up to 16 with zeros and m >= 8 takes oneDNN's brgemm where it runs: odd, below and above those.
PRODUCT_SHAPES = [(1, 5, 7), (8, 16, 16), (9, 5, 7), (64, 256, 64), (64, 64, 256), (33, 100, 63), (16, 3, 1),
                  (0, 5, 7), (9, 0, 7), (9, 5, 0)]


@pytest.mark.parametrize("alpha, beta", [(1.0, 0.0), (1.0, 1.0), (0.125, 1.0), (0.3, 0.7)])
@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False), (True, True)])
def test_the_kernels_bfloat16_product_is_exact_products_with_float32_sums_for_every_operand_layout(ta, tb, alpha,
                                                                                                    beta):
    """alpha * op(a) op(b) + beta * c, as every tile's product packs its operands (transposed or not, sizes that
    are not multiples of the packing's 16, a single row), against float64 on the same bfloat16 values: within
    float32 summation error of the terms' magnitudes (the products are exact). With beta 0, c is not read (NaN
    there stays out), as in BLAS."""
    mod = _band._module()
    g = torch.Generator().manual_seed(3)
    with half_products(torch.bfloat16, True):
        for m, n, k in PRODUCT_SHAPES:
            a = torch.randn(*((k, m) if ta else (m, k)), generator=g).bfloat16()
            b = torch.randn(*((n, k) if tb else (k, n)), generator=g).bfloat16()
            c = torch.full((m, n), float("nan")) if beta == 0 else torch.randn(m, n, generator=g)
            got = mod.half_product(a, b, c, ta, tb, alpha, beta)
            A, B = (a.double().T if ta else a.double()), (b.double().T if tb else b.double())
            want = alpha * (A @ B) + (beta * c.double() if beta else 0)
            scale = abs(alpha) * (A.abs() @ B.abs()) + abs(beta) * (c.double().abs() if beta else 0)
            bound = 2 * (k + 2) * torch.finfo(torch.float32).eps * scale
            assert bool(((got.double() - want).abs() <= bound).all()), (m, n, k)


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's, on switching oneDNN off
def test_the_bfloat16_product_falls_back_to_mkls_where_onednn_is_turned_off():
    """``torch.backends.mkldnn.enabled = False`` turns oneDNN's brgemm off between calls: the product is then MKL's
    (where torch exports it), with the same result up to float32 summation order, and the kernel says which."""
    mod = _band._module()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(64, 48, generator=g).bfloat16(), torch.randn(100, 48, generator=g).bfloat16()
    c = torch.zeros(64, 100)
    with half_products(torch.bfloat16, True):
        first = mod.half_product(a, b, c, False, True, 1.0, 0.0)
        with torch.backends.mkldnn.flags(enabled=False):
            if not mod.has_bf16_gemm():
                pytest.skip("no MKL bfloat16 product to fall back to")
            assert mod.bf16_gemm() == "MKL"
            second = mod.half_product(a, b, c, False, True, 1.0, 0.0)
    want = a.double() @ b.double().T
    bound = 2 * 50 * torch.finfo(torch.float32).eps * (a.double().abs() @ b.double().abs().T)
    for got in (first, second):
        assert bool(((got.double() - want).abs() <= bound).all())


def test_the_product_checks_its_arguments_before_touching_memory():
    mod = _band._module()
    a, b, c = torch.zeros(8, 4, dtype=torch.bfloat16), torch.zeros(4, 6, dtype=torch.bfloat16), torch.zeros(8, 6)
    with half_products(torch.bfloat16, True):
        with pytest.raises(RuntimeError, match="op\\(a\\) is \\[8, 4\\] but op\\(b\\) is \\[6, 4\\]"):
            mod.half_product(a, b, c, False, True, 1.0, 0.0)
        with pytest.raises(RuntimeError, match="c must be float32 \\[8, 6\\]"):
            mod.half_product(a, b, torch.zeros(6, 8), False, False, 1.0, 0.0)
        with pytest.raises(RuntimeError, match="a and b must both be bfloat16 or float16"):
            mod.half_product(a.float(), b, c, False, False, 1.0, 0.0)
        with pytest.raises(RuntimeError, match="unit stride along its rows"):
            mod.half_product(torch.zeros(4, 8, dtype=torch.bfloat16).T, b, c, False, False, 1.0, 0.0)
        with pytest.raises(RuntimeError, match="2-D dense CPU tensor"):
            mod.half_product(a[None], b, c, False, False, 1.0, 0.0)
    with half_products(torch.bfloat16, False), pytest.raises(RuntimeError, match="bfloat16 products are off"):
        mod.half_product(a, b, c, False, False, 1.0, 0.0)


@pytest.mark.parametrize("lq", [1, 7])
def test_a_bfloat16_call_of_fewer_rows_than_brgemm_takes_is_computed_with_float32_products(lq):
    """A decode step (fewer than 8 query rows) would send every tile to MKL's bfloat16 product, slower than
    widening to float32 where oneDNN's brgemm serves the larger calls: with the products on, such a call gives
    exactly what it gives with them off."""
    mod = _band._module()
    if not (_band.half_products(torch.bfloat16) and mod.bf16_gemm() == "oneDNN brgemm"):
        pytest.skip("bfloat16 products through oneDNN's brgemm are not on here")
    q, k, v = _inputs((1, 4, 2, lq, 300), torch.bfloat16, seed=5)
    starts, ends = _band._window(lq, 300, 100, 0)[2:]
    args = (starts, ends, torch.zeros(0, 0), 48 ** -0.5, 0.0)
    on = torch.ops.attnkit.band_forward(q, k, v, *args)
    with half_products(torch.bfloat16, False):
        off = torch.ops.attnkit.band_forward(q, k, v, *args)
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_bfloat16_products_from_several_python_threads_at_once_give_each_threads_own_answer():
    """The products' packing buffers are per thread and torch builds brgemm's micro-kernels per thread: four
    Python threads running bfloat16 forwards and backwards of different shapes at once (each shape a micro-kernel
    of its own) get exactly what each call gives alone, forward and gradients (under deterministic algorithms,
    whose dQ pass repeats bit for bit)."""
    from concurrent.futures import ThreadPoolExecutor

    shapes = [(1, 4, 2, 70, 70), (2, 2, 2, 96, 130), (1, 4, 4, 150, 150), (1, 2, 1, 33, 90)]

    def run(shape):
        q, k, v = (t.requires_grad_() for t in _inputs(shape, torch.bfloat16, seed=shape[3]))
        out = attnkit.attention(q, k, v, backend="band", window=(20, 5))
        out.backward(torch.ones_like(out))
        return out.detach(), q.grad, k.grad, v.grad

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # dQ from its own pass: repeatable at any thread count
    try:
        with half_products(torch.bfloat16, True):
            alone = [run(s) for s in shapes]
            with ThreadPoolExecutor(4) as pool:
                together = list(pool.map(run, shapes * 3))
    finally:
        torch.use_deterministic_algorithms(before)
    for i, got in enumerate(together):
        want = alone[i % len(shapes)]
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), shapes[i % len(shapes)]
