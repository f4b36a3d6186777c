"""The banded kernel's report of non-finite inputs (``attnkit.nonfinite.call``'s ``sees_nonfinite`` /
``if_finite``): its statistics mark every row whose scores or output met a NaN or an infinity, so that
an inference call need not read q, k and v once more before the kernel does."""

from __future__ import annotations

import contextlib

import pytest
import torch

import attnkit
from attnkit import masks, nonfinite, scores
from attnkit.backends import _band
from attnkit.call import validate_call
from tests.support.backends import half_products

pytestmark = pytest.mark.skipif(not _band.available(), reason="the banded kernel is not built here")

NAN, INF = float("nan"), float("inf")


def _window(n, left, right):
    return _band._window(n, n, left, right)[2:]


# the half types through their products
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("name", "row", "value"), [
    ("q", 40, NAN), ("q", 40, INF), ("k", 40, NAN), ("k", 40, -INF), ("k", 40, INF), ("v", 40, NAN), ("v", 40, -INF),
    # a key row 40 cannot see but the kernel reads beside those it can (its block of rows spans them)
    ("k", 47, NAN), ("v", 47, INF),
])
def test_the_forward_marks_a_row_whose_scores_or_output_met_a_non_finite_input(dtype, name, row, value):
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(1, 2, 100, 8, generator=g, dtype=dtype) for n in ("q", "k", "v")}
    starts, ends = _window(100, 2, 2)
    mod = _band._module()
    empty = torch.empty(0, 0, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    with _products(dtype):
        _, stats = mod.forward(t["q"], t["k"], t["v"], starts, ends, empty, 0.3, 0.0, 16, 64)
        assert not stats[0].isnan().any()
        t[name][0, 1, row, 3] = value
        out, stats = mod.forward(t["q"], t["k"], t["v"], starts, ends, empty, 0.3, 0.0, 16, 64)
    marked = stats[0].isnan()
    assert marked[0, 1].any() and not marked[0, 0].any()  # the other head read nothing non-finite
    # a row whose output is not finite is always marked: what the caller reads is never less than that
    assert not (out[0, 1].isfinite().all(-1).logical_not() & ~marked[0, 1]).any()


def test_an_inference_call_on_the_kernel_reads_its_statistics_not_the_inputs(monkeypatch):
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    calls = []
    monkeypatch.setattr(nonfinite, "all_finite", lambda req: calls.append(req) or True)
    with torch.no_grad():
        attnkit.attention(q, k, v, window=(4, 4), backend="band")
    assert calls == []
    attnkit.attention(q.requires_grad_(), k, v, window=(4, 4), backend="band")  # a gradient: the check runs
    assert len(calls) == 1


def test_without_the_blas_report_the_check_runs_before_the_kernel(monkeypatch):
    monkeypatch.setattr(_band, "_reports", False)
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
    req = validate_call(q, k, v, window=(4, 4))
    assert not attnkit.backends.get("band").sees_nonfinite(req)
    v[0, 0, 10, 0] = NAN
    with torch.no_grad():
        out = attnkit.attention(q, k, v, window=(4, 4), backend="band")
    rows = out[0, 0].isnan().any(-1).nonzero().flatten().tolist()
    assert rows == list(range(6, 15))  # the rows whose window holds key 10, and no other


def test_the_self_check_finds_the_report_on_this_blas():
    # torch's CPU wheels link MKL or OpenBLAS, whose products carry 0 * inf as NaN
    assert _band.reports_nonfinite() is True


_PATTERNS = {  # name -> attention kwargs at n = 160: one block of rows, many, wide rows, a folded dilation
    "window": lambda n: {"window": (9, 4)},
    "window + global tokens": lambda n: {"mask_mod": masks.global_tokens_mod(6, [0, 77])},
    "dilated": lambda n: {"mask_mod": masks.dilated_window_mod(12, 4)},
    "strided": lambda n: {"mask_mod": masks.strided_mod(16)},
    "causal, ALiBi": lambda n: {"is_causal": True, "score_mod": scores.alibi(scores.alibi_slopes(4))},
    "window, capped": lambda n: {"window": (20, 20), "score_mod": scores.softcap(2.0)},
}


@pytest.mark.parametrize("pattern", list(_PATTERNS))
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_an_inference_call_equals_the_exact_path_whatever_it_holds(pattern, where, value, dtype):
    """Without a gradient the kernel's own pass decides; its answer is the exact path's, bit for bit, for
    a poison anywhere (seeded places across the rows, blocks and heads), on every form of rows (bfloat16:
    through its bfloat16 products where the kernel has them)."""
    n, gen = 160, torch.Generator().manual_seed(len(pattern) * 7 + "qkv".index(where))
    for _ in range(4):
        t = {x: torch.randn(1, 4, n, 16, generator=gen).to(dtype) for x in "qkv"}
        head, row, col = (int(torch.randint(m, (1,), generator=gen)) for m in (4, n, 16))
        t[where][0, head, row, col] = value
        kw = _PATTERNS[pattern](n)
        req = validate_call(t["q"], t["k"], t["v"], **kw)
        band = attnkit.backends.get("band")
        assert band.sees_nonfinite(req)
        with torch.no_grad(), _products(dtype):
            got = attnkit.attention(t["q"], t["k"], t["v"], backend="band", **kw)
            want = nonfinite.exact(band, req)[0]
        assert torch.equal(got.isnan(), want.isnan()), (head, row)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (head, row)


def _products(dtype: torch.dtype):
    """A half type through its own products (where torch has them; skipped elsewhere), others as they are."""
    return half_products(dtype, True) if dtype in (torch.bfloat16, torch.float16) else contextlib.nullcontext()
